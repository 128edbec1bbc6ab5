// SPDX-License-Identifier: MIT
// The kernels of kernels/lowrank_tf32x3.cu (its comment has the method and
// the figures), shared with bench/micro/lowrank_3xtf32.cu, which times them
// and compares promotion intervals, and bench/micro/lowrank_wgmma.cu (the
// wgmma and tensor-map primitives): the 3xTF32 product kernel, the split
// pass, and the packed parts' tensor maps; and gemm_field's form of the
// product (field_tf32x3_kernel, A from registers) with its transposing
// split pass. Device code for sm_90a (the
// bodies are empty in other images); no dependency on the rest of the
// library.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dion::kernels::x3 {


constexpr int kX3Threads = 256;   // two warpgroups
constexpr int kX3Tile = 128;      // output tile rows and columns
constexpr int kX3RowBytes = 128;  // k bytes per row and stage: one 128-byte swizzle row (32 fp32)
constexpr int kX3Stages = 3;
constexpr int kX3PartBytes = kX3Tile * kX3RowBytes;  // 16 KiB: one part's tile of a stage
constexpr int kX3StageBytes = 4 * kX3PartBytes;      // Ah, Al, Bh, Bl
// + alignment, barriers, the slots' release counters (lowrank_tf32x3_kernel)
constexpr size_t kX3SmemBytes = kX3Stages * kX3StageBytes + 1024 + 8 * kX3Stages + 4 * kX3Stages;
constexpr int kX3Promote = 2;  // k-steps of 8 accumulated in the tensor cores before each promotion

// Whether output tile (tile_row, tile_col), of kX3Tile rows and bn columns,
// holds an element on or below the diagonal: the tiles a symmetric result
// forms (field_tf32x3_kernel's `lower`, counted by its launcher).
__host__ __device__ constexpr bool x3_tile_lower(int64_t tile_row, int64_t tile_col, int bn) {
  return tile_row * kX3Tile + kX3Tile - 1 >= tile_col * bn;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DION_X3_REGS \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DION_X3_OPS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
  "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
  "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
  "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), \
  "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), \
  "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
  "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
  "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

__device__ __forceinline__ uint32_t x3_smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The descriptor of a K-major operand in the 128-byte swizzle: start address
// (>> 4), leading offset 1 (unused with this swizzle), 1024 bytes between
// groups of 8 rows, swizzle mode 1 (128 bytes).
__device__ __forceinline__ uint64_t x3_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// D (64 x 128) = (acc ? D : 0) + A (64 x 8) B^T (128 x 8), TF32, both from shared memory.
__device__ __forceinline__ void x3_mma(float (&d)[64], uint64_t a, uint64_t b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" DION_X3_REGS "}, %64, %65, p, 1, 1;\n}\n"
      : DION_X3_OPS(d)
      : "l"(a), "l"(b), "r"(acc));
}

// Keeps the compiler from moving accesses of the accumulators across the
// asynchronous MMAs.
template <int N>
__device__ __forceinline__ void x3_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Keeps A's registers (read by the MMAs in flight, field_tf32x3_kernel's)
// live and unchanged until the MMAs are waited for.
__device__ __forceinline__ void x3_fence_a(uint32_t (&a)[2][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[j][i])::"memory");
}

// A promotion: once at most kPending of this warpgroup's MMA groups are in
// flight (those before have written t and, with A from registers, read
// their fragments ah, al), d += t; add false: only the wait.
template <int kPending, int N>
__device__ __forceinline__ void x3_promote(float (&d)[N], float (&t)[N], uint32_t (*ah)[2][4] = nullptr,
                                           uint32_t (*al)[2][4] = nullptr, bool add = true) {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
  x3_fence(t);
  if (ah) x3_fence_a(*ah);
  if (al) x3_fence_a(*al);
  if (!add) return;
#pragma unroll
  for (int i = 0; i < N; ++i) d[i] += t[i];
}

__device__ __forceinline__ void x3_bar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void x3_bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nX3_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra X3_DONE;\nbra X3_WAIT;\nX3_DONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// A named barrier over warpgroup wg's 128 threads (ids 1 and 2; constant ids, so that
// ptxas counts 3 barriers, not 16).
__device__ __forceinline__ void x3_wg_sync(int wg) {
  if (wg)
    asm volatile("bar.sync 2, 128;\n" ::: "memory");
  else
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
}

// The slots' release counters, one per slot after the slots' barriers
// (bars) in the dynamic shared memory that starts at smem (shared address
// raw): each warpgroup adds one when it is done with the slot's item.
__device__ __forceinline__ uint32_t* x3_release_counters(uint8_t* smem, uint32_t raw, uint32_t bars, int stages) {
  return reinterpret_cast<uint32_t*>(smem + (bars + 8 * stages - raw));
}
// Warpgroup's release of slot st (its first thread): whether it is the
// second to release the slot's item (an odd old count), which then loads
// the item the slot takes next.
__device__ __forceinline__ bool x3_release(uint32_t* rel, uint32_t st) { return (atomicAdd(&rel[st], 1u) & 1u) != 0; }

// One stage: the k columns kcol.. of Ah, Al (rows row0..) and Bh, Bl (rows
// col0..) of matrix g, completing on the stage's barrier.
__device__ __forceinline__ void x3_issue(const CUtensorMap* const (&maps)[4], uint32_t sa, uint32_t bar, int kcol,
                                         int row0, int col0, int g) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "n"(kX3StageBytes) : "memory");
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(sa + i * kX3PartBytes),
        "l"(reinterpret_cast<uint64_t>(maps[i])), "r"(kcol), "r"(i < 2 ? row0 : col0), "r"(g), "r"(bar)
        : "memory");
}

// The epilogue of one 64 x 8 NJ block (NJ = 16: half of a 128 x 128 tile):
// thread (warp w, lane l) holds, for j = 0..NJ-1 and h = 0, 1, the elements
// (row0 + 16 w + l / 4 + 8 h, col0 + 8 j + 2 (l % 4) + {0, 1}) in d[4 j + 2
// h + {0, 1}]. All of C's loads are issued before the first store. kInside:
// the whole block lies inside C and pairs of elements are 8-byte aligned, so
// no element is checked.
template <bool kInside, int NJ = 16>
__device__ __forceinline__ void x3_store(const float (&d)[4 * NJ], float* C, int64_t ldc, int64_t m, int64_t n,
                                         int64_t row0, int64_t col0, float alpha, float beta, bool pairs, int tid) {
  const int w = tid >> 5, l = tid & 31;
  const int64_t r0 = row0 + 16 * w + (l >> 2), c0 = col0 + 2 * (l & 3);
  float* const p0 = C + r0 * ldc + c0;
  float* const p1 = p0 + 8 * ldc;
  float cv[4 * NJ];
  if (beta != 0.f) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * j + 2 * h;
        const float* p = (h ? p1 : p0) + 8 * j;
        if (kInside) {
          const float2 v = *reinterpret_cast<const float2*>(p);
          cv[i] = v.x;
          cv[i + 1] = v.y;
          continue;
        }
        const int64_t r = r0 + 8 * h, c = c0 + 8 * j;
        cv[i] = cv[i + 1] = 0.f;
        if (r < m && c < n) {
          cv[i] = p[0];
          if (c + 1 < n) cv[i + 1] = p[1];
        }
      }
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 4 * j + 2 * h;
      const float x = beta != 0.f ? alpha * d[i] + beta * cv[i] : alpha * d[i];
      const float y = beta != 0.f ? alpha * d[i + 1] + beta * cv[i + 1] : alpha * d[i + 1];
      float* p = (h ? p1 : p0) + 8 * j;
      if (kInside) {
        *reinterpret_cast<float2*>(p) = make_float2(x, y);
        continue;
      }
      const int64_t r = r0 + 8 * h, c = c0 + 8 * j;
      if (r >= m || c >= n) continue;
      if (pairs && c + 1 < n) {
        *reinterpret_cast<float2*>(p) = make_float2(x, y);
      } else {
        p[0] = x;
        if (c + 1 < n) p[1] = y;
      }
    }
}

// A warpgroup's 64 x 2 N block of C at (row0, col0) from its N
// accumulators: x3_store without element checks where the block lies
// inside C and C's pairs of elements are 8-byte aligned.
template <int N>
__device__ __forceinline__ void x3_store_block(const float (&d)[N], float* C, int64_t ldc, int64_t m, int64_t n,
                                               int row0, int col0, float alpha, float beta, int tid) {
  const bool pairs = reinterpret_cast<uintptr_t>(C) % 8 == 0 && ldc % 2 == 0;
  if (pairs && row0 + 64 <= m && col0 + 2 * N <= n)
    x3_store<true, N / 4>(d, C, ldc, m, n, row0, col0, alpha, beta, pairs, tid);
  else
    x3_store<false, N / 4>(d, C, ldc, m, n, row0, col0, alpha, beta, pairs, tid);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The tiles of count products m x n, kX3Tile x kX3Tile each, numbered
// matrix by matrix, row tile by row tile, column tiles fastest.
__host__ __device__ inline int64_t x3_lowrank_tiles(int64_t count, int64_t m, int64_t n) {
  return count * ((m + kX3Tile - 1) / kX3Tile) * ((n + kX3Tile - 1) / kX3Tile);
}
// lowrank_tf32x3_kernel's grid: a CTA per multiprocessor, at most one per tile.
inline unsigned x3_lowrank_grid(int64_t count, int64_t m, int64_t n, int sms) {
  const int64_t tiles = x3_lowrank_tiles(count, m, n), ctas = sms > 0 ? sms : 1;
  return static_cast<unsigned>(ctas < tiles ? ctas : tiles);
}

// Grid: x3_lowrank_grid's CTAs of kX3Threads, each taking the tiles
// blockIdx.x, + gridDim.x, ... (x3_lowrank_tiles' order); shared memory
// kX3SmemBytes. Maps: Ah, Al as (k, m, count), Bh, Bl as (k, n, count).
// kP: k-steps of 8 whose three products accumulate in the tensor cores
// before each promotion (the library takes kX3Promote); 0 accumulates all
// of k there (the form the promotion corrects, for
// bench/micro/lowrank_3xtf32.cu's comparison).
//
// A CTA's loads are one stream over its tiles: item i = (its (i / kt_count)-th
// tile, stage i % kt_count of k), in slot i % kX3Stages, whose barrier
// completes its phase i / kX3Stages then. Every slot is refilled as soon as
// both warpgroups are done with it (all of a stage's MMAs are waited for
// within the stage), so kX3Stages - 1 items are in flight while one is
// multiplied, and the next tile's first stages load during a tile's last
// stages and its epilogue (the twenty-fifth session: this kernel 212 -> 202
// us for gpt-160m's fc2 class, 5.20 -> 5.11 ms for gpt-1.3b's fc1 class,
// against a CTA per tile that kept kX3Stages - 2 items in flight; two stages
// and each tile's C copied into shared memory while its products run was no
// faster, 209 us and 5.09 ms).
template <int kP>
__global__ void __launch_bounds__(kX3Threads, 1)
    lowrank_tf32x3_kernel(const __grid_constant__ CUtensorMap tah, const __grid_constant__ CUtensorMap tal,
                          const __grid_constant__ CUtensorMap tbh, const __grid_constant__ CUtensorMap tbl,
                          void* const* cptr, const float* coef, int64_t count, int64_t m, int64_t n, int64_t k,
                          int64_t ldc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const float alpha = coef[0], beta = coef[1];
  if (alpha == 0.f && beta == 1.f) return;  // a skipped step: C keeps its bits
  extern __shared__ __align__(1024) uint8_t x3_smem[];
  const uint32_t raw = x3_smem_addr(x3_smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t bars = base + kX3Stages * kX3StageBytes;
  uint32_t* const rel = x3_release_counters(x3_smem, raw, bars, kX3Stages);
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  constexpr int kBk = kX3RowBytes / 4;  // k per stage
  const uint32_t kt_count = static_cast<uint32_t>((k + kBk - 1) / kBk);
  const int64_t tiles_n = (n + kX3Tile - 1) / kX3Tile, per_matrix = tiles_n * ((m + kX3Tile - 1) / kX3Tile);
  const int64_t tiles = count * per_matrix;
  const CUtensorMap* const maps[4] = {&tah, &tal, &tbh, &tbl};
  const auto origin = [&](int64_t tile, int64_t& g, int& row0, int& col0) {
    g = tile / per_matrix;
    const int64_t r = tile - g * per_matrix;
    row0 = static_cast<int>(r / tiles_n) * kX3Tile;
    col0 = static_cast<int>(r % tiles_n) * kX3Tile;
  };
  // Each warpgroup's first thread keeps a cursor over the stream: the next
  // item's tile (its origin found once per tile, not by divisions per
  // stage) and stage of k, and the items passed. Both cursors pass every
  // item; the item is loaded by the thread whose warpgroup releases its
  // slot second (thread 0 the first kX3Stages).
  int64_t ld_tile = blockIdx.x, ld_g = 0;
  int ld_row0 = 0, ld_col0 = 0;
  uint32_t ld_kt = 0, loaded = 0;
  const auto next_item = [&](bool issue) {
    if (ld_tile >= tiles) return;
    const uint32_t st = loaded++ % kX3Stages;
    if (issue)
      x3_issue(maps, base + st * kX3StageBytes, bars + 8 * st, static_cast<int>(ld_kt) * kBk, ld_row0, ld_col0,
               static_cast<int>(ld_g));
    if (++ld_kt == kt_count) {
      ld_kt = 0;
      ld_tile += gridDim.x;
      if (ld_tile < tiles) origin(ld_tile, ld_g, ld_row0, ld_col0);
    }
  };
  if (tid == 0) {
    for (int s = 0; s < kX3Stages; ++s) {
      x3_bar_init(bars + 8 * s);
      rel[s] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (wtid == 0) {
    if (ld_tile < tiles) origin(ld_tile, ld_g, ld_row0, ld_col0);
    for (int s = 0; s < kX3Stages; ++s) next_item(tid == 0);
  }
  __syncthreads();
  uint32_t used = 0;  // items multiplied so far
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int64_t g;
    int row0, col0;
    origin(tile, g, row0, col0);
    float* const C = static_cast<float*>(cptr[g]);
    // kP k-steps' products go into a scratch accumulator (zeroed by the
    // first), which is then added into d; with kP = 0 all of the stage's
    // straight into d. kPairs (an even count of chunks per stage): the
    // chunks go by pairs, the first into t and the second into u, whose
    // MMAs are issued before t's sum is waited for: t is added into d while
    // u's run (wait_group 1), so the tensor cores drain once per pair, not
    // per chunk. (Keeping u's MMAs in flight across the stage's barrier
    // made ptxas serialize every wgmma.) The same additions into d in the
    // same order either way: the same bits.
    constexpr int kChunk = kP > 0 ? kP : kBk / 8, kChunks = kBk / 8 / kChunk;
    constexpr bool kPairs = kP > 0 && kChunks % 2 == 0;
    float d[64], t[64], u[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = t[i] = u[i] = 0.f;
    for (uint32_t kt = 0; kt < kt_count; ++kt, ++used) {
      const uint32_t st = used % kX3Stages;
      x3_bar_wait(bars + 8 * st, (used / kX3Stages) & 1u);
      // this warpgroup's 64 rows of A's parts; all 128 rows of B's
      const uint32_t sah = base + st * kX3StageBytes + wg * 64 * kX3RowBytes, sal = sah + kX3PartBytes;
      const uint32_t sbh = base + st * kX3StageBytes + 2 * kX3PartBytes, sbl = sbh + kX3PartBytes;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        float(&acc)[64] = *(kP == 0 ? &d : kPairs && c % 2 ? &u : &t);
        x3_fence(acc);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          const int kk = c * kChunk + j;  // the k-step of 8: 32 bytes into each row
          x3_mma(acc, x3_desc(sal + 32 * kk), x3_desc(sbh + 32 * kk), kP == 0 || j > 0);
          x3_mma(acc, x3_desc(sah + 32 * kk), x3_desc(sbl + 32 * kk), 1);
          x3_mma(acc, x3_desc(sah + 32 * kk), x3_desc(sbh + 32 * kk), 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if constexpr (kPairs) {
          if (c % 2 == 0) continue;  // u's MMAs first
          x3_promote<1>(d, t);
        }
        x3_promote<0>(d, acc, nullptr, nullptr, kP > 0);  // kP = 0: acc is d
      }
      // This warpgroup is done with the slot (its four warps' MMAs waited
      // for); the warpgroup that releases it second loads the item
      // kX3Stages on into it. No CTA-wide barrier: the warpgroups drift
      // apart, so that one's MMAs run while the other drains its tensor
      // cores, promotes and waits for a stage.
      x3_wg_sync(wg);
      if (wtid == 0) next_item(x3_release(rel, st));  // item used + kX3Stages
    }
    x3_store_block(d, C, ldc, m, n, row0 + 64 * wg, col0, alpha, beta, wtid);
  }
#endif
}

__device__ __forceinline__ void x3_split1(float v, float& hi, float& lo) {
  uint32_t h, l;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(h) : "f"(v));
  const float r = v - __uint_as_float(h);  // exact: v and hi agree in their leading 11 bits
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(l) : "f"(r));
  hi = __uint_as_float(h);
  lo = __uint_as_float(l);
}

// hi, lo (count x rows x kpad, packed) <- the split of a (count rows x k
// matrices, ld, stride): a warp per row, four elements per lane and access
// where a's rows are 16-byte aligned (vec4); the padding columns k..kpad-1
// are not written.
template <bool kVec4>
__global__ void split_tf32_kernel(const float* a, int64_t rows, int64_t k, int64_t ld, int64_t stride,
                                  int64_t count, int64_t kpad, float* hi, float* lo) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t R = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; R < count * rows;
       R += warps) {
    const int64_t g = R / rows, r = R - g * rows;
    const float* src = a + g * stride + r * ld;
    float* const h = hi + R * kpad;
    float* const l = lo + R * kpad;
    if constexpr (kVec4) {
      for (int64_t c = 4 * lane; c < k; c += 128) {
        const float4 v = *reinterpret_cast<const float4*>(src + c);
        float4 vh, vl;
        x3_split1(v.x, vh.x, vl.x);
        x3_split1(v.y, vh.y, vl.y);
        x3_split1(v.z, vh.z, vl.z);
        x3_split1(v.w, vh.w, vl.w);
        *reinterpret_cast<float4*>(h + c) = vh;
        *reinterpret_cast<float4*>(l + c) = vl;
      }
    } else {
      for (int64_t c = lane; c < k; c += 32) x3_split1(src[c], h[c], l[c]);
    }
  }
}


// ---- C_g = op(X_g) B_g at FP32 (gemm_field's path): X read in place ----
//
// X_g is a tensor's own buffer (a pointer per matrix: Dion's momentum), so
// no tensor map covers the batch; and at R = X^T P the inner dimension runs
// down X's columns, where wgmma's TF32 operands in shared memory must be
// K-major. So X is the A operand from registers: each stage's X tile (fp32,
// 128 rows of C by 32 of the inner dimension, either orientation) is copied
// to shared memory by cp.async in X's own layout, and every thread loads its
// fragment elements from there and splits them into the TF32 parts itself.
// B (k x n, small: Q or P) is split, transposed, into packed scratch by a
// pass, and loaded by the tensor memory accelerator as in the kernel above.
// Tiles of 128 x BN, BN = 128 or 96 (gpt-160m's rank 192 in two tiles, not
// two of 128 with a quarter of the second's MMAs wasted).

constexpr int kFxStages = 4;
// Bh, Bl (BN x 128 bytes each, tensor maps), X (cp.async, 16 KiB)
template <int BN>
__host__ __device__ constexpr int fx_stage_bytes() {
  return 2 * BN * kX3RowBytes + kX3PartBytes;
}
template <int BN>
__host__ __device__ constexpr size_t fx_smem_bytes() {
  return kFxStages * fx_stage_bytes<BN>() + 1024 + 8 * kFxStages + 4 * kFxStages;  // + barriers, release counters
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DION_X3_REGS48 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
  "%46, %47"
#define DION_X3_OPS48(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
  "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
  "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
  "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), \
  "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), \
  "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])

// D (64 x BN) = (acc ? D : 0) + A (64 x 8, registers) B^T (BN x 8, shared
// memory), TF32, BN = 128 or 96. Thread (warp w, lane l) holds A's elements
// (16 w + l / 4 + 8 (i % 2), l % 4 + 4 (i / 2)) in a[i].
__device__ __forceinline__ void x3_mma_r(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" DION_X3_REGS "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : DION_X3_OPS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
__device__ __forceinline__ void x3_mma_r(float (&d)[48], const uint32_t (&a)[4], uint64_t b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k8.f32.tf32.tf32 {" DION_X3_REGS48 "}, {%48, %49, %50, %51}, %52, p, 1, 1;\n}\n"
      : DION_X3_OPS48(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}

__device__ __forceinline__ void x3_cp16(uint32_t dst, const float* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void x3_cp4(uint32_t dst, const float* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}

// Warpgroup wg's half of the X tile of one stage at sx (the 64 rows of A
// its MMAs take, 64 wg.. of the tile), copied by its 128 threads (wtid): A
// (m x k: X, or X^T with X k x m, ld ldx) rows row0..row0 + 127, columns
// kk0..kk0 + 31, zeros outside (and from kend on). Row-major A (X): rows of
// 32 floats, their 16-byte chunks swizzled by the row (chunk c of row i at c
// ^ (i % 8)); X^T: X's 32 rows of 128 floats, element i of row q at i ^ (8
// (q % 4)) (which keeps each half's elements in its half). Either way a
// warp's fragment loads meet 32 banks. vec: 16-byte copies (X 16-byte
// aligned, ldx and A's extent along the copies multiples of 4), else 4-byte
// ones.
template <bool kTransX>
__device__ __forceinline__ void x3_load_x(uint32_t sx, const float* X, int64_t m, int64_t kend, int64_t ldx,
                                          int64_t row0, int64_t kk0, bool vec, int wg, int wtid) {
  if (vec) {
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int idx = wtid + it * 128;
      if constexpr (kTransX) {
        const int q = idx >> 4, c = 16 * wg + (idx & 15);
        const bool ok = kk0 + q < kend && row0 + 4 * c < m;
        x3_cp16(sx + 4 * (q * 128 + ((c ^ ((q & 3) << 1)) << 2)), ok ? X + (kk0 + q) * ldx + row0 + 4 * c : X, ok);
      } else {
        const int i = 64 * wg + (idx >> 3), c = idx & 7;
        const bool ok = row0 + i < m && kk0 + 4 * c < kend;
        x3_cp16(sx + 4 * (i * 32 + ((c ^ (i & 7)) << 2)), ok ? X + (row0 + i) * ldx + kk0 + 4 * c : X, ok);
      }
    }
  } else {
#pragma unroll 4
    for (int it = 0; it < 16; ++it) {
      const int idx = wtid + it * 128;
      if constexpr (kTransX) {
        const int q = idx >> 6, i = 64 * wg + (idx & 63);
        const bool ok = kk0 + q < kend && row0 + i < m;
        x3_cp4(sx + 4 * (q * 128 + (i ^ ((q & 3) << 3))), ok ? X + (kk0 + q) * ldx + row0 + i : X, ok);
      } else {
        const int i = 64 * wg + (idx >> 5), q = idx & 31;
        const bool ok = row0 + i < m && kk0 + q < kend;
        x3_cp4(sx + 4 * (i * 32 + (((q >> 2) ^ (i & 7)) << 2) + (q & 3)), ok ? X + (row0 + i) * ldx + kk0 + q : X,
               ok);
      }
    }
  }
}

// The TF32 parts of this thread's A fragments for k-steps kk and kk + 1 of
// the stage's X tile xs (layouts as x3_load_x writes them); i0 = the
// thread's first row in the tile (64 wg + 16 w + l / 4), t = l % 4.
template <bool kTransX>
__device__ __forceinline__ void x3_frag(const float* xs, int i0, int t, int kk, uint32_t (&hi)[2][4],
                                        uint32_t (&lo)[2][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float v[4];
    if constexpr (kTransX) {
      const int q = 8 * (kk + j) + t, sw = t << 3;
      v[0] = xs[q * 128 + (i0 ^ sw)];
      v[1] = xs[q * 128 + ((i0 + 8) ^ sw)];
      v[2] = xs[(q + 4) * 128 + (i0 ^ sw)];
      v[3] = xs[(q + 4) * 128 + ((i0 + 8) ^ sw)];
    } else {
      const int g = i0 & 7, c0 = ((2 * (kk + j)) ^ g) << 2, c1 = ((2 * (kk + j) + 1) ^ g) << 2;
      const float* p = xs + i0 * 32 + t;
      v[0] = p[c0];
      v[1] = p[256 + c0];
      v[2] = p[c1];
      v[3] = p[256 + c1];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi[j][i]) : "f"(v[i]));
      const float r = v[i] - __uint_as_float(hi[j][i]);
      asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo[j][i]) : "f"(r));
    }
  }
}

// One stage's B parts (tensor maps), completing on the stage's barrier.
template <int BN>
__device__ __forceinline__ void x3_issue_fx(const CUtensorMap* tbh, const CUtensorMap* tbl, uint32_t sb, uint32_t bar,
                                            int col0, int kcol, int g) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "n"(2 * BN * kX3RowBytes)
               : "memory");
#pragma unroll
  for (int i = 0; i < 2; ++i)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(sb + i * BN * kX3RowBytes),
        "l"(reinterpret_cast<uint64_t>(i ? tbl : tbh)), "r"(kcol), "r"(col0), "r"(g), "r"(bar)
        : "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// C_g (m x n fp32, row-major) = op(X_g) B_g: op(X) = X (X m x k) or X^T (X
// k x m), ld ldx, at xptr[g] (xptr null: xbase + g xstride); B's parts Bh,
// Bl as the maps (k, n, count), boxes of 32 x BN, of the packed split of
// B^T. Grid: x the column tiles, y the row tiles, z the batch times
// `splits`, grid-stride: z = g splits + s sums the inner dimension's part s
// (ksplit of it, a multiple of 32) into C + g cstride_g + s cstride_s (ldc):
// with splits > 1 (or a symmetric result), partial sums for
// kernels::sum_parts. vec_ok: ldx and the extent X's rows are copied along
// (k, or m for X^T) are multiples of 4 (each X's alignment is checked here).
// lower: only the tiles holding an element on or below the diagonal. Each
// result (or partial sum) is stored times alpha.
template <bool kTransX, int BN>
__global__ void __launch_bounds__(kX3Threads, 1)
    field_tf32x3_kernel(const __grid_constant__ CUtensorMap tbh, const __grid_constant__ CUtensorMap tbl,
                        const void* const* xptr, const float* xbase, int64_t xstride, float* cbase,
                        int64_t cstride_g, int64_t cstride_s, int64_t count,
                        int splits, int64_t ksplit, int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldc,
                        bool vec_ok, bool lower, float alpha) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // lower: only C's lower triangle is read (a symmetric result mirrored by
  // sum_parts), so a tile wholly above the diagonal is not formed.
  if (lower && !x3_tile_lower(blockIdx.y, blockIdx.x, BN)) return;
  constexpr int kStage = fx_stage_bytes<BN>(), kPart = BN * kX3RowBytes, kAcc = BN / 2;
  extern __shared__ __align__(1024) uint8_t x3_smem[];
  const uint32_t raw = x3_smem_addr(x3_smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const float* const xsm = reinterpret_cast<const float*>(x3_smem + (base - raw));
  const uint32_t bars = base + kFxStages * kStage;
  // the slots' release counters; the second to release a slot loads B's
  // parts of the item kFxStages on
  uint32_t* const rel = x3_release_counters(x3_smem, raw, bars, kFxStages);
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, lane = tid & 31;
  const int i0 = 64 * wg + 16 * ((tid >> 5) & 3) + (lane >> 2), t4 = lane & 3;
  const int col0 = static_cast<int>(blockIdx.x) * BN, row0 = static_cast<int>(blockIdx.y) * kX3Tile;
  if (tid == 0) {
    for (int s = 0; s < kFxStages; ++s) {
      x3_bar_init(bars + 8 * s);
      rel[s] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Stages loaded and used so far (all matrices): stage t in slot t %
  // kFxStages, whose barrier completes its phase t / kFxStages then (B's
  // parts; X's tile in the same slot, each warpgroup copying the half its
  // MMAs read). One cp.async group is committed per stage slot, loaded or
  // not, so the wait for stage kt leaves kFxStages - 1 groups pending. The
  // warpgroups share only B's parts: no CTA-wide barrier per stage, so that
  // they drift apart and one's MMAs run while the other splits its
  // fragments, drains its tensor cores or waits for a stage.
  uint32_t loaded = 0, used = 0;
  for (int64_t z = blockIdx.z; z < count * splits; z += gridDim.z) {
    const int64_t g = z / splits, s = z - g * splits;
    const int64_t kbeg = s * ksplit, kend = kbeg + ksplit < k ? kbeg + ksplit : k;
    const int kt_count = kend > kbeg ? static_cast<int>((kend - kbeg + 31) / 32) : 0;
    const float* X = xptr ? static_cast<const float*>(xptr[g]) : xbase + g * xstride;
    float* C = cbase + g * cstride_g + s * cstride_s;
    const bool vec = vec_ok && reinterpret_cast<uintptr_t>(X) % 16 == 0;
    // stage q's B parts (thread 0) and this warpgroup's half of its X tile
    const auto load = [&](int q, uint32_t st, bool b) {
      if (b) x3_issue_fx<BN>(&tbh, &tbl, base + st * kStage, bars + 8 * st, col0, static_cast<int>(kbeg) + 32 * q,
                             static_cast<int>(g));
      x3_load_x<kTransX>(base + st * kStage + 2 * kPart, X, m, kend, ldx, row0, kbeg + 32 * q, vec, wg, wtid);
    };
    for (int q = 0; q < kFxStages; ++q) {
      if (q < kt_count) load(q, loaded++ % kFxStages, tid == 0);
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    float d[kAcc], t[kAcc], u[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) d[i] = t[i] = u[i] = 0.f;
    for (int kt = 0; kt < kt_count; ++kt, ++used) {
      const uint32_t st = used % kFxStages;
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kFxStages - 1) : "memory");
      x3_wg_sync(wg);  // every copy of this warpgroup's half has landed
      x3_bar_wait(bars + 8 * st, (used / kFxStages) & 1u);
      const float* xs = xsm + st * (kStage / 4) + 2 * (kPart / 4);
      const uint32_t sbh = base + st * kStage, sbl = sbh + kPart;
      // Two k-steps of 8 per promotion (kX3Promote), two promotions per
      // stage, by pairs as in lowrank_tf32x3_kernel: the first's products
      // into t, the second's into u (its fragments loaded and split while
      // the first's MMAs run), then t added into d while u's MMAs run.
      uint32_t ah[2][2][4], al[2][2][4];
      x3_frag<kTransX>(xs, i0, t4, 0, ah[0], al[0]);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float(&acc)[kAcc] = *(c ? &u : &t);
        x3_fence(acc);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int kk = 2 * c + j;
          x3_mma_r(acc, al[c][j], x3_desc(sbh + 32 * kk), j > 0);
          x3_mma_r(acc, ah[c][j], x3_desc(sbl + 32 * kk), 1);
          x3_mma_r(acc, ah[c][j], x3_desc(sbh + 32 * kk), 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (c == 0) x3_frag<kTransX>(xs, i0, t4, 2, ah[1], al[1]);
      }
      x3_promote<1>(d, t, &ah[0], &al[0]);  // u's MMAs run on
      x3_promote<0>(d, u, &ah[1], &al[1]);
      // This warpgroup is done with the slot (its MMAs waited for, its
      // fragments read): its half of X takes the stage kFxStages on, and
      // the warpgroup that releases the slot second loads B's parts.
      x3_wg_sync(wg);
      const int nk = kt + kFxStages;
      if (nk < kt_count) {
        const uint32_t ns = loaded++ % kFxStages;  // = st
        load(nk, ns, wtid == 0 && x3_release(rel, ns));
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    x3_store_block(d, C, ldc, m, n, row0 + 64 * wg, col0, alpha, 0.f, wtid);
    __syncthreads();  // both warpgroups are done with the slots before the next matrix's loads
  }
#endif
}

// hi, lo (count x n x kpad, packed) <- the split of B_g^T, B_g k x n
// (row-major, ld) at bptr[g] (bptr null: bbase + g bstride; bstride 0: one
// B for all): 32 x 32 tiles transposed through shared
// memory (blocks of 32 x 8 threads); the padding columns are not written.
__global__ void split_tf32_t_kernel(const void* const* bptr, const float* bbase, int64_t bstride, int64_t k,
                                    int64_t n, int64_t ld, int64_t count, int64_t kpad, float* hi, float* lo) {
  __shared__ float tile[32][33];
  const int64_t tk = (k + 31) / 32, tn = (n + 31) / 32, tiles = count * tk * tn;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t T = blockIdx.x; T < tiles; T += gridDim.x) {
    const int64_t g = T / (tk * tn), rem = T - g * tk * tn, k0 = rem / tn * 32, n0 = rem % tn * 32;
    const float* B = bptr ? static_cast<const float*>(bptr[g]) : bbase + g * bstride;
#pragma unroll
    for (int j = ty; j < 32; j += 8)
      tile[j][tx] = k0 + j < k && n0 + tx < n ? B[(k0 + j) * ld + n0 + tx] : 0.f;
    __syncthreads();
#pragma unroll
    for (int j = ty; j < 32; j += 8)
      if (n0 + j < n && k0 + tx < k) {
        const int64_t e = (g * n + n0 + j) * kpad + k0 + tx;
        x3_split1(tile[tx][j], hi[e], lo[e]);
      }
    __syncthreads();
  }
}

inline int64_t x3_kpad(int64_t k) { return (k + 3) / 4 * 4; }

// cuTensorMapEncodeTiled from the driver (through the runtime: no link to
// libcuda), looked up once; null where the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 x3_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// count packed rows x k matrices (row length kpad) at p as the 3-D tensor
// (k, rows, count), boxes of 32 x box_rows with the 128-byte swizzle.
inline bool x3_map(CUtensorMap* map, const float* p, int64_t rows, int64_t k, int64_t kpad, int64_t count,
                   int box_rows = kX3Tile) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = x3_encoder();
  if (!encode) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(count)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kpad * 4), static_cast<cuuint64_t>(rows * kpad * 4)};
  const cuuint32_t box[3] = {kX3RowBytes / 4, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<float*>(p), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace dion::kernels::x3

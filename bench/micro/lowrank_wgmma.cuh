// SPDX-License-Identifier: MIT
// An experiment, not part of the library (bench/micro/lowrank_wgmma.cu runs
// it; docs/benchmarks.md, fifteenth session, has the figures): Dion's error
// feedback and update product on Hopper's warpgroup MMA (wgmma), as a kernel
// of our own in place of cuBLASLt's: for each g of a batch,
//
//   C_g (m x n, row-major, ldc) = alpha A_g B_g^T + beta C_g,
//   A_g m x k row-major (lda), B_g n x k row-major (ldb), strided batches,
//
// with fp32 factors at TF32 or bf16 factors (fp32 accumulation both), C fp32
// or bf16 at cptr[g], alpha = coef[0] and beta = coef[1] read on the device.
// alpha == 0 and beta == 1 (a skipped step) leaves every C untouched.
//
// The idea: k is Dion's rank (512 at gpt-1.3b), short, while every output
// element is read and written once, so each 128 x 128 tile is a short burst
// of MMAs and an epilogue that moves 128 KiB (fp32 C); cuBLASLt's TF32 kernel
// runs one CTA per multiprocessor (231 KiB of shared memory) and does not
// overlap the two (72 % of SM throughput under Nsight Compute). Here a CTA
// takes 97 KiB (three stages of 128 x 128-byte tiles of A and B, loaded by the
// tensor memory accelerator with the 128-byte swizzle wgmma's descriptors
// expect, zeros outside the matrices), so two run on each multiprocessor and
// one's epilogue can overlap the other's MMAs. One warpgroup per CTA; the
// tile's two m64n128 halves are two accumulators of 64 registers.
//
// The outcome (an H200): correct everywhere, but slower than cuBLASLt at TF32
// on gpt-1.3b's shapes (the tensor pipe 54 % active against cuBLASLt's 72 %,
// the warps stalled on the epilogue's loads of C and on the barriers) and
// with bf16 C; faster than cuBLAS's default with bf16 factors into fp32 C
// and on gpt-160m's TF32 shapes, which no target row uses. Build for sm_90a
// only.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels/lowrank_tf32x3.cuh"  // the wgmma and tensor-map primitives

namespace wgmma_micro {

struct Ctx {
  cudaStream_t stream;
  int sms;
};
struct ConstMatBatch {  // a strided batch of row-major matrices, strides in elements
  const float* p;
  int64_t rows, cols, ld, stride, batch;
};
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    printf("CUDA error %s in %s\n", cudaGetErrorString(e), what);
    exit(1);
  }
}

namespace {

using namespace dion::kernels::x3;

constexpr int kWgThreads = 128;                    // one warpgroup
constexpr int kWgTile = 128;                       // output tile rows and columns
constexpr int kWgRowBytes = 128;                   // k bytes per row and stage: one 128-byte swizzle row
constexpr int kWgStages = 3;
constexpr int kWgTileBytes = kWgTile * kWgRowBytes;  // 16 KiB, A's or B's part of a stage
constexpr int kWgStageBytes = 2 * kWgTileBytes;
// + the alignment to 1024 bytes and the stages' barriers
constexpr size_t kWgSmemBytes = kWgStages * kWgStageBytes + 1024 + 8 * kWgStages;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// D (64 x 128, fp32) += A (64 x kstep) B^T (128 x kstep), both from shared
// memory: kstep 8 for TF32, 16 for bf16 (32 bytes of k either way).
__device__ __forceinline__ void wg_mma(float (&d)[64], uint64_t a, uint64_t b, float) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
      DION_X3_REGS
      "}, %64, %65, p, 1, 1;\n}\n"
      : DION_X3_OPS(d)
      : "l"(a), "l"(b));
}
__device__ __forceinline__ void wg_mma(float (&d)[64], uint64_t a, uint64_t b, __nv_bfloat16) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      DION_X3_REGS
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : DION_X3_OPS(d)
      : "l"(a), "l"(b));
}

// Stage `stage` of tile kt: A's rows row0.. and B's rows col0.. of matrix g,
// by the tensor memory accelerator (128 x 128-byte boxes, the 128-byte
// swizzle, zeros outside the matrices), completing on the stage's barrier.
__device__ __forceinline__ void wg_issue(const CUtensorMap* ta, const CUtensorMap* tb, uint32_t sa, uint32_t bar,
                                         int kcol, int row0, int col0, int g) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "n"(2 * kWgTileBytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(sa),
      "l"(reinterpret_cast<uint64_t>(ta)), "r"(kcol), "r"(row0), "r"(g), "r"(bar)
      : "memory");
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(sa + kWgTileBytes),
      "l"(reinterpret_cast<uint64_t>(tb)), "r"(kcol), "r"(col0), "r"(g), "r"(bar)
      : "memory");
}

__device__ __forceinline__ float2 wg_ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 wg_ld2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ void wg_st2(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
__device__ __forceinline__ void wg_st2(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ float wg_ld1(const float* p) { return *p; }
__device__ __forceinline__ float wg_ld1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void wg_st1(float* p, float x) { *p = x; }
__device__ __forceinline__ void wg_st1(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// The epilogue of one 64 x 128 half: thread (warp w, lane l) holds, for j =
// 0..15 and h = 0, 1, the elements (row0 + 16 w + l / 4 + 8 h, col0 + 8 j + 2
// (l % 4) + {0, 1}) in d[4 j + 2 h + {0, 1}]. All of C's loads are issued
// before the first store. kInside: the whole half lies inside C and pairs of
// elements are aligned, so no element is checked.
template <bool kInside, class TC>
__device__ __forceinline__ void wg_store(float (&d)[64], TC* C, int64_t ldc, int64_t m, int64_t n, int64_t row0,
                                         int64_t col0, float alpha, float beta, bool pairs, int tid) {
  const int w = tid >> 5, l = tid & 31;
  const int64_t r0 = row0 + 16 * w + (l >> 2), c0 = col0 + 2 * (l & 3);
  TC* const p0 = C + r0 * ldc + c0;
  TC* const p1 = p0 + 8 * ldc;
  float cv[64];
  if (beta != 0.f) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * j + 2 * h;
        const TC* p = (h ? p1 : p0) + 8 * j;
        if (kInside) {
          const float2 v = wg_ld2(p);
          cv[i] = v.x;
          cv[i + 1] = v.y;
          continue;
        }
        const int64_t r = r0 + 8 * h, c = c0 + 8 * j;
        cv[i] = cv[i + 1] = 0.f;
        if (r < m && c < n) {
          if (pairs && c + 1 < n) {
            const float2 v = wg_ld2(p);
            cv[i] = v.x;
            cv[i + 1] = v.y;
          } else {
            cv[i] = wg_ld1(p);
            if (c + 1 < n) cv[i + 1] = wg_ld1(p + 1);
          }
        }
      }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 4 * j + 2 * h;
      const float x = beta != 0.f ? alpha * d[i] + beta * cv[i] : alpha * d[i];
      const float y = beta != 0.f ? alpha * d[i + 1] + beta * cv[i + 1] : alpha * d[i + 1];
      TC* p = (h ? p1 : p0) + 8 * j;
      if (kInside) {
        wg_st2(p, x, y);
        continue;
      }
      const int64_t r = r0 + 8 * h, c = c0 + 8 * j;
      if (r >= m || c >= n) continue;
      if (pairs && c + 1 < n) {
        wg_st2(p, x, y);
      } else {
        wg_st1(p, x);
        if (c + 1 < n) wg_st1(p + 1, y);
      }
    }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Grid: x the column tiles of C, y its row tiles, z the batch (grid-stride).
// ta, tb: A's and B's batches as 3-D tensors (k, rows, batch).
template <class T, class TC>
__global__ void __launch_bounds__(kWgThreads, 2)
    lowrank_sm90a_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                         void* const* cptr, const float* coef, int64_t count, int64_t m, int64_t n, int64_t k,
                         int64_t ldc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const float alpha = coef[0], beta = coef[1];
  if (alpha == 0.f && beta == 1.f) return;  // a skipped step: C keeps its bits
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  const uint32_t base = (x3_smem_addr(wg_smem) + 1023u) & ~1023u;
  const uint32_t bars = base + kWgStages * kWgStageBytes;
  const int tid = threadIdx.x;
  const int col0 = static_cast<int>(blockIdx.x) * kWgTile, row0 = static_cast<int>(blockIdx.y) * kWgTile;
  constexpr int kBk = kWgRowBytes / sizeof(T);  // k per stage
  const int kt_count = static_cast<int>((k + kBk - 1) / kBk);
  if (tid == 0) {
    for (int s = 0; s < kWgStages; ++s) x3_bar_init(bars + 8 * s);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Tiles loaded and used so far, over all of this CTA's matrices: tile t
  // goes to stage t % kWgStages, whose barrier completes its phase t /
  // kWgStages then.
  uint32_t loaded = 0, used = 0;
  for (int64_t g = blockIdx.z; g < count; g += gridDim.z) {
    TC* C = static_cast<TC*>(cptr[g]);
    if (tid == 0)
      for (int s = 0; s < kWgStages - 1 && s < kt_count; ++s, ++loaded) {
        const uint32_t st = loaded % kWgStages;
        wg_issue(&ta, &tb, base + st * kWgStageBytes, bars + 8 * st, s * kBk, row0, col0, static_cast<int>(g));
      }
    float d0[64], d1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d0[i] = d1[i] = 0.f;
    for (int kt = 0; kt < kt_count; ++kt, ++used) {
      const uint32_t st = used % kWgStages;
      x3_bar_wait(bars + 8 * st, (used / kWgStages) & 1u);
      const uint32_t sa = base + st * kWgStageBytes, sb = sa + kWgTileBytes;
      x3_fence(d0);
      x3_fence(d1);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kWgRowBytes / 32; ++kk) {
        const uint64_t db = x3_desc(sb + 32 * kk);
        wg_mma(d0, x3_desc(sa + 32 * kk), db, T{});
        wg_mma(d1, x3_desc(sa + 64 * kWgRowBytes + 32 * kk), db, T{});
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // the previous tile's MMAs are done
      x3_fence(d0);
      x3_fence(d1);
      __syncthreads();  // in every warp: the previous tile's stage may be refilled
      const int nk = kt + kWgStages - 1;
      if (tid == 0 && nk < kt_count) {
        const uint32_t ns = loaded % kWgStages;
        wg_issue(&ta, &tb, base + ns * kWgStageBytes, bars + 8 * ns, nk * kBk, row0, col0, static_cast<int>(g));
        ++loaded;
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    x3_fence(d0);
    x3_fence(d1);
    const bool pairs = reinterpret_cast<uintptr_t>(C) % (2 * sizeof(TC)) == 0 && ldc % 2 == 0;
    if (pairs && row0 + kWgTile <= m && col0 + kWgTile <= n) {
      wg_store<true>(d0, C, ldc, m, n, row0, col0, alpha, beta, pairs, tid);
      wg_store<true>(d1, C, ldc, m, n, row0 + 64, col0, alpha, beta, pairs, tid);
    } else {
      wg_store<false>(d0, C, ldc, m, n, row0, col0, alpha, beta, pairs, tid);
      wg_store<false>(d1, C, ldc, m, n, row0 + 64, col0, alpha, beta, pairs, tid);
    }
    __syncthreads();  // every warp's MMAs are done before the next matrix's loads
  }
#endif
}

template <class T, class TC>
void wg_set_smem() {
  check(cudaFuncSetAttribute(lowrank_sm90a_kernel<T, TC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(kWgSmemBytes)),
              "cudaFuncSetAttribute (lowrank_sm90a)");
  check(cudaFuncSetAttribute(lowrank_sm90a_kernel<T, TC>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   cudaSharedmemCarveoutMaxShared),
              "cudaFuncSetAttribute (lowrank_sm90a carveout)");
}

// A batch of count rows x k row-major matrices (ld elements apart, stride
// elements from one to the next) as the 3-D tensor (k, rows, count), boxes
// of 128 bytes of k by 128 rows.
bool wg_map(CUtensorMap* map, const void* p, int64_t stride, int64_t ld, int64_t rows, int64_t k, int64_t count,
            bool bf16) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = x3_encoder();
  if (!encode) return false;
  const int64_t es = bf16 ? 2 : 4;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(count)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld * es),
                                 static_cast<cuuint64_t>(count > 1 ? stride * es : rows * ld * es)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kWgRowBytes / es), kWgTile, 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3,
                const_cast<void*>(p), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

inline bool lowrank_sm90a_ok(int cc_major, int cc_minor) {
  return cc_major == 9 && cc_minor == 0 && x3_encoder() != nullptr;
}

inline void lowrank_sm90a_init() {
  wg_set_smem<float, float>();
  wg_set_smem<__nv_bfloat16, float>();
  wg_set_smem<__nv_bfloat16, __nv_bfloat16>();
}

// False (nothing launched) where the driver refuses a tensor map (rows of A
// or B not 16-byte aligned, say) or C has more than 65535 row tiles.
inline bool lowrank_sm90a(const Ctx& c, ConstMatBatch a, ConstMatBatch b, void* const* cptr, const float* coef,
                          int64_t count, int64_t ldc, bool bf16_ab, bool bf16_c) {
  const int64_t m = a.rows, n = b.rows, k = a.cols;
  if (count <= 0 || m <= 0 || n <= 0) return true;
  const int64_t tiles_m = (m + kWgTile - 1) / kWgTile, tiles_n = (n + kWgTile - 1) / kWgTile;
  CUtensorMap ta, tb;
  if (tiles_m > 65535 || !wg_map(&ta, a.p, a.stride, a.ld, m, k, count, bf16_ab) ||
      !wg_map(&tb, b.p, b.stride, b.ld, n, k, count, bf16_ab))
    return false;
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m),
                  static_cast<unsigned>(count < 65535 ? count : 65535));
  if (!bf16_ab)
    lowrank_sm90a_kernel<float, float>
        <<<grid, kWgThreads, kWgSmemBytes, c.stream>>>(ta, tb, cptr, coef, count, m, n, k, ldc);
  else if (!bf16_c)
    lowrank_sm90a_kernel<__nv_bfloat16, float>
        <<<grid, kWgThreads, kWgSmemBytes, c.stream>>>(ta, tb, cptr, coef, count, m, n, k, ldc);
  else
    lowrank_sm90a_kernel<__nv_bfloat16, __nv_bfloat16>
        <<<grid, kWgThreads, kWgSmemBytes, c.stream>>>(ta, tb, cptr, coef, count, m, n, k, ldc);
  check(cudaGetLastError(), "lowrank_sm90a_kernel");
  return true;
}

}  // namespace wgmma_micro

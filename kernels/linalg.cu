// SPDX-License-Identifier: MIT
// Helpers around the cuBLAS/cuSOLVER calls of the CUDA backend (pointer
// arrays, layout changes, Cholesky post-processing) and the Gram-Schmidt
// fallback used when a Cholesky factorisation failed.
#include "core/error.hpp"
#include "kernels/common.cuh"

namespace dion::kernels {

namespace {

__global__ void fill_pointers_kernel(float** ptrs, const float* base, int64_t stride, int64_t batch) {
  for (int64_t b = global_thread(); b < batch; b += grid_threads()) ptrs[b] = const_cast<float*>(base) + b * stride;
}

struct BlockPointerSpecs {
  BlockPointers s[kMaxBlockPointerArrays];
};
__global__ void fill_block_pointers_kernel(float** out, BlockPointerSpecs specs, int arrays, int64_t per,
                                           int64_t count) {
  for (int64_t i = global_thread(); i < arrays * count; i += grid_threads()) {
    const BlockPointers& s = specs.s[i / count];
    const int64_t j = i % count;
    out[i] = const_cast<float*>(s.base) + (j / per) * s.outer + (j % per) * s.inner;
  }
}

// Tiled transpose through shared memory so both the reads and the writes are
// coalesced (the +1 column avoids bank conflicts).
// Matrix b's source: in + b * stride_in, or with list the field `field` of list[b].
__global__ void transpose_kernel(const float* in, int64_t rows, int64_t cols, int64_t ld_in, int64_t stride_in,
                                 float* out, int64_t ld_out, int64_t stride_out, int64_t batch,
                                 const TensorEntry* list = nullptr, int field = 0) {
  __shared__ float tile[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const float* src = list ? static_cast<const float*>(list[b].ptr[field]) : in + b * stride_in;
    float* dst = out + b * stride_out;
    for (int64_t r0 = blockIdx.y * 32LL; r0 < rows; r0 += gridDim.y * 32LL)
      for (int64_t c0 = blockIdx.x * 32LL; c0 < cols; c0 += gridDim.x * 32LL) {
        for (int k = ty; k < 32; k += kTileY) {
          const int64_t r = r0 + k, c = c0 + tx;
          if (r < rows && c < cols) tile[k][tx] = src[r * ld_in + c];
        }
        __syncthreads();
        for (int k = ty; k < 32; k += kTileY) {
          const int64_t orow = c0 + k, ocol = r0 + tx;
          if (orow < cols && ocol < rows) dst[orow * ld_out + ocol] = tile[tx][k];
        }
        __syncthreads();
      }
  }
}

struct ExtractR {
  const float* cm;
  int64_t p;
  MatBatch r;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    const float* a = cm + b * p * r.cols;
    mat_at(r, b)[i * r.ld + j] = j >= i ? a[i + j * p] : 0.0f;
  }
};

// c[b](i, j) = sum over q < S of parts[b S + q](i, j), in order q = 0, 1, ...
// (parts dense: rows x cols per matrix, every element formed).
struct SumParts {
  const float* parts;
  int64_t S;
  MatBatch c;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    const int64_t per = c.rows * c.cols;
    const float* x = parts + b * S * per + i * c.cols + j;
    float s = 0.0f;
    for (int64_t q = 0; q < S; ++q) s += x[q * per];
    mat_at(c, b)[i * c.ld + j] = s;
  }
};

// The sum of parts where only the blocks (bs x bs) on and below the block
// diagonal were formed (bs > 0), by 32 x 32 tiles: an element on or below
// the block diagonal is the sum of its parts, read where it lies (a warp
// reads a row of the tile: coalesced), and one strictly below it is also
// written, through shared memory, at its transposed place (reading the parts
// column-wise there instead, 32 scattered reads per warp and part, took
// about twice the bytes' time at the copy bandwidth). Every element is
// written once: a tile wholly above the block diagonal only by its mirror
// tile's transposed pass.
constexpr int kSymTile = 32;
__global__ void sum_parts_sym_kernel(const float* parts, int64_t S, int64_t bs64, MatBatch c) {
  __shared__ float tile[kSymTile][kSymTile + 1];
  // Block indices in 32-bit arithmetic (r x r Gram matrices: r < 2^31).
  const int n = static_cast<int>(c.cols), rows = static_cast<int>(c.rows), bs = static_cast<int>(bs64);
  const int64_t per = c.rows * c.cols;
  const int i0 = static_cast<int>(blockIdx.y) * kSymTile, j0 = static_cast<int>(blockIdx.x) * kSymTile;
  if ((min(i0 + kSymTile, rows) - 1) / bs < j0 / bs) return;  // wholly above the block diagonal (uniform)
  const int tx = static_cast<int>(threadIdx.x);
  for (int64_t b = blockIdx.z; b < c.batch; b += gridDim.z) {
    const float* x = parts + b * S * per;
    float* out = mat_at(c, b);
    for (int k = static_cast<int>(threadIdx.y); k < kSymTile; k += kTileY) {
      const int i = i0 + k, j = j0 + tx;
      float sum = 0.0f;
      if (i < rows && j < n && i / bs >= j / bs) {
        const float* xp = x + static_cast<int64_t>(i) * n + j;
        for (int64_t q = 0; q < S; ++q) sum += xp[q * per];
        out[static_cast<int64_t>(i) * c.ld + j] = sum;
      }
      tile[k][tx] = sum;  // read back only where (i, j) is strictly below
    }
    __syncthreads();
    // (row, col) = (j, i) of the tile's elements: above exactly where (i, j) is strictly below.
    for (int k = static_cast<int>(threadIdx.y); k < kSymTile; k += kTileY) {
      const int row = j0 + k, col = i0 + tx;
      if (row < rows && col < n && row / bs < col / bs) out[static_cast<int64_t>(row) * c.ld + col] = tile[tx][k];
    }
    __syncthreads();  // the tile is reused by the next matrix
  }
}

struct ToDouble {
  ConstMatBatch m;
  double* out;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    out[(b * m.rows + i) * m.cols + j] = static_cast<double>(mat_at(m, b)[i * m.ld + j]);
  }
};

struct ExtractRDouble {
  const double* l;
  MatBatch r;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    const int64_t n = r.cols;
    mat_at(r, b)[i * r.ld + j] = j >= i ? static_cast<float>(l[b * n * n + i * n + j]) : 0.0f;
  }
};

__global__ void cholesky_fixup_kernel(MatBatch a, int32_t* info) {
  __shared__ int first_bad;
  const int64_t n = a.rows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int64_t b = blockIdx.x; b < a.batch; b += gridDim.x) {
    float* p = mat_at(a, b);
    if (threadIdx.x == 0) first_bad = static_cast<int>(n);
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float d = p[i * a.ld + i];
      if (!isfinite(d) || !(d > 0.0f)) atomicMin(&first_bad, static_cast<int>(i));  // min: order-independent
    }
    for (int64_t i = warp; i < n; i += nwarps)
      for (int64_t j = lane; j < i; j += 32) p[i * a.ld + j] = 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
      // potrf's own failure index wins; otherwise a bad pivot is a failure too.
      int32_t v = info[b];
      if (v == 0 && first_bad < n) v = first_bad + 1;
      info[b] = v;
    }
    __syncthreads();
  }
}

// ---- Gram-Schmidt fallback ----

constexpr int kOrthThreads = 1024;  // 32 warps

// Removes from column j of p (rows x ld, row-major) its components along
// columns 0..j-1 (orthonormal), twice: classical Gram-Schmidt with one
// reorthogonalisation, which leaves the column orthogonal to working
// precision ("twice is enough"). Returns the column's norm afterwards.
// Sums in double, in a fixed order. `d` holds j doubles of scratch.
__device__ double project_out(float* p, int64_t ld, int64_t rows, int64_t j, double* d, double (*part)[33],
                              double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int pass = 0; pass < 2 && j > 0; ++pass) {
    // d = P[:, :j]^T v, 32 columns at a time: lane = column, warps split the rows.
    for (int64_t q0 = 0; q0 < j; q0 += 32) {
      const int64_t q = q0 + lane;
      double acc = 0.0;
      if (q < j)
        for (int64_t i = warp; i < rows; i += nwarps) acc += static_cast<double>(p[i * ld + q]) * p[i * ld + j];
      part[warp][lane] = acc;
      __syncthreads();
      if (warp == 0) {
        double t = 0.0;
        for (int w = 0; w < nwarps; ++w) t += part[w][lane];
        if (q < j) d[q] = t;
      }
      __syncthreads();
    }
    // v -= P[:, :j] d: one warp per row.
    for (int64_t i = warp; i < rows; i += nwarps) {
      double acc = 0.0;
      for (int64_t q = lane; q < j; q += 32) acc += static_cast<double>(p[i * ld + q]) * d[q];
      acc = warp_sum(acc);
      if (lane == 0) p[i * ld + j] = static_cast<float>(p[i * ld + j] - acc);
    }
    __syncthreads();
  }
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
    const double x = p[i * ld + j];
    s += x * x;
  }
  return sqrt(block_sum(s, red));
}

// P0's elements are floats, or bf16 where p0_bf16 is given (dense, P0's shape).
__global__ void __launch_bounds__(kOrthThreads)
    orth_fallback_kernel(MatBatch P, ConstMatBatch P0, const uint16_t* p0_bf16, const int32_t* info, double* scratch) {
  __shared__ double red[33];
  __shared__ double part[32][33];
  const int64_t rows = P.rows, cols = P.cols;
  for (int64_t b = blockIdx.x; b < P.batch; b += gridDim.x) {
    if (info[b] == 0) continue;  // the Cholesky path succeeded: nothing to do
    float* p = mat_at(P, b);
    const float* p0 = p0_bf16 ? nullptr : mat_at(P0, b);
    const uint16_t* p16 = p0_bf16 ? p0_bf16 + b * P0.stride : nullptr;
    double* d = scratch + b * cols;
    int64_t next_unit = 0;  // unit vectors are tried in order e_0, e_1, ...
    for (int64_t j = 0; j < cols; ++j) {
      // Column j of P0 (read and written by the same thread: P may alias P0).
      double s0 = 0.0;
      for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
        const float x = p16 ? bf16_to_float(p16[i * P0.ld + j]) : p0[i * P0.ld + j];
        p[i * P.ld + j] = x;
        s0 += static_cast<double>(x) * x;
      }
      const double n0 = sqrt(block_sum(s0, red));
      double nrm = project_out(p, P.ld, rows, j, d, part, red);
      // A column (numerically) in the span of the previous ones, zero, or
      // non-finite is replaced by a unit vector orthogonalised the same way:
      // one with a residual above 1/2 is taken, else the best of all tried.
      // (The residuals' squares over all e_t add up to rows - j > 0.)
      if (!(nrm > 1e-4 * n0) || !(nrm > 0.0)) {
        int64_t best_t = -1;
        double best = -1.0;
        bool found = false;
        for (int64_t tries = 0; tries < rows && !found; ++tries) {
          const int64_t t = (next_unit + tries) % rows;
          for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) p[i * P.ld + j] = i == t ? 1.0f : 0.0f;
          __syncthreads();
          nrm = project_out(p, P.ld, rows, j, d, part, red);
          if (nrm > 0.5) {
            found = true;
            next_unit = t + 1;
          } else if (nrm > best) {
            best = nrm;
            best_t = t;
          }
        }
        if (!found) {
          for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) p[i * P.ld + j] = i == best_t ? 1.0f : 0.0f;
          __syncthreads();
          nrm = project_out(p, P.ld, rows, j, d, part, red);
          next_unit = best_t + 1;
        }
      }
      const double inv = 1.0 / nrm;
      for (int64_t i = threadIdx.x; i < rows; i += blockDim.x)
        p[i * P.ld + j] = static_cast<float>(p[i * P.ld + j] * inv);
      __syncthreads();
    }
  }
}

}  // namespace

void fill_pointers(const Ctx& c, float** ptrs, const float* base, int64_t stride, int64_t batch) {
  if (batch <= 0) return;
  fill_pointers_kernel<<<blocks_1d(c, batch), kThreads, 0, c.stream>>>(ptrs, base, stride, batch);
  cuda::check_launch("pointer-array kernel");
}

void fill_block_pointers(const Ctx& c, float** out, const BlockPointers* specs, int count_arrays, int64_t per,
                         int64_t count) {
  DION_REQUIRE(count_arrays <= kMaxBlockPointerArrays, DION_ERROR_INTERNAL,
               "fill_block_pointers: %d arrays, at most %d", count_arrays, kMaxBlockPointerArrays);
  if (count <= 0 || count_arrays <= 0) return;
  BlockPointerSpecs s{};
  for (int a = 0; a < count_arrays; ++a) s.s[a] = specs[a];
  fill_block_pointers_kernel<<<blocks_1d(c, count_arrays * count), kThreads, 0, c.stream>>>(out, s, count_arrays, per,
                                                                                           count);
  cuda::check_launch("block pointer-array kernel");
}

void transpose(const Ctx& c, const float* in, int64_t rows, int64_t cols, int64_t ld_in, int64_t stride_in, float* out,
               int64_t ld_out, int64_t stride_out, int64_t batch, const TensorEntry* list, int field) {
  if (rows <= 0 || cols <= 0 || batch <= 0) return;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ceil_div(cols, 32), 65535)),
                  static_cast<unsigned>(std::min<int64_t>(ceil_div(rows, 32), 65535)),
                  static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  transpose_kernel<<<grid, dim3(32, kTileY), 0, c.stream>>>(in, rows, cols, ld_in, stride_in, out, ld_out, stride_out,
                                                            batch, list, field);
  cuda::check_launch("transpose kernel");
}

void sum_parts(const Ctx& c, const float* parts, int64_t S, MatBatch out, int64_t bs) {
  if (out.batch <= 0 || out.rows <= 0 || out.cols <= 0) return;
  if (bs <= 0) {
    for_each_2d(c, out.batch, out.rows, out.cols, SumParts{parts, S, out}, "sum_parts kernel");
    return;
  }
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ceil_div(out.cols, kSymTile), 65535)),
                  static_cast<unsigned>(std::min<int64_t>(ceil_div(out.rows, kSymTile), 65535)),
                  static_cast<unsigned>(std::min<int64_t>(out.batch, 65535)));
  sum_parts_sym_kernel<<<grid, dim3(kSymTile, kTileY), 0, c.stream>>>(parts, S, bs, out);
  cuda::check_launch("sum_parts (blocks) kernel");
}

namespace {
constexpr int kLeaf = 64, kLeafThreads = 256;
// Block (blockIdx.x: leaf j of matrix b = blockIdx.x / blocks). The leaf of
// u, padded to 64 x 64 with the identity, in shared memory; thread t < 64
// forms column t of its inverse X by back substitution, U X = I from the
// last row up: x_i = acc_i / u_ii, then acc_k -= u_ki x_i for k < i, acc
// (column t of the identity at the start) in registers (every index
// static). Then the whole CTA zeroes the blocks below the leaf.
__global__ void __launch_bounds__(kLeafThreads) tri_inverse_leaves_kernel(ConstMatBatch u, MatBatch inv, int L,
                                                                          int blocks) {
  __shared__ float us[kLeaf][kLeaf + 1];
  const int t = static_cast<int>(threadIdx.x);
  const int64_t b = blockIdx.x / blocks, j = blockIdx.x % blocks, o = j * L;
  const float* U = u.p + b * u.stride + o * u.ld + o;
  float* X = inv.p + b * inv.stride + o * inv.ld + o;
  for (int e = t; e < kLeaf * kLeaf; e += kLeafThreads) {
    const int r = e / kLeaf, c = e % kLeaf;
    us[r][c] = r < L && c < L ? U[static_cast<int64_t>(r) * u.ld + c] : (r == c ? 1.0f : 0.0f);
  }
  __syncthreads();
  if (t < kLeaf) {
    float acc[kLeaf];
#pragma unroll
    for (int k = 0; k < kLeaf; ++k) acc[k] = k == t ? 1.0f : 0.0f;
#pragma unroll
    for (int i = kLeaf - 1; i >= 0; --i) {
      const float x = acc[i] / us[i][i];
      acc[i] = x;
#pragma unroll
      for (int k = 0; k < i; ++k) acc[k] = __fmaf_rn(-us[k][i], x, acc[k]);
    }
    if (t < L)
#pragma unroll
      for (int i = 0; i < kLeaf; ++i)
        if (i < L) X[static_cast<int64_t>(i) * inv.ld + t] = acc[i];
  }
  // rows o + L .. n - 1 of the leaf's columns
  const int below = (blocks - 1 - static_cast<int>(j)) * L;
  for (int e = t; e < below * L; e += kLeafThreads) X[static_cast<int64_t>(L + e / L) * inv.ld + e % L] = 0.0f;
}
}  // namespace

void tri_inverse_leaves(const Ctx& c, ConstMatBatch u, MatBatch inv, int64_t L, int64_t blocks) {
  if (inv.batch <= 0 || blocks <= 0) return;
  DION_REQUIRE(L >= 1 && L <= kLeaf && inv.batch * blocks <= 0x7fffffff && L * L * blocks <= 0x7fffffff,
               DION_ERROR_INTERNAL,
               "tri_inverse_leaves: blocks of %lld (at most %d), %lld of them", static_cast<long long>(L), kLeaf,
               static_cast<long long>(inv.batch * blocks));
  tri_inverse_leaves_kernel<<<static_cast<unsigned>(inv.batch * blocks), kLeafThreads, 0, c.stream>>>(
      u, inv, static_cast<int>(L), static_cast<int>(blocks));
  cuda::check_launch("triangular inverse leaves kernel");
}

namespace {
__global__ void add_diag_bf16_kernel(MatBatch m, int64_t n, float v) {
  uint16_t* base = reinterpret_cast<uint16_t*>(m.p);
  for (int64_t b = blockIdx.y; b < m.batch; b += gridDim.y)
    for (int64_t i = global_thread(); i < n; i += grid_threads()) {
      uint16_t* e = base + b * m.stride + i * m.ld + i;
      *e = float_to_bf16(bf16_to_float(*e) + v);
    }
}
}  // namespace

namespace {
// gemm_bf16_lower's blocks: e = t * nblk + q, q walking the blocks (i, j), j <= i
// < nb, column j by column j (j = 0: i = 0 .. nb - 1, then j = 1: i = 1 .. ).
// upper: the blocks (j, i) instead, on and above the block diagonal.
__global__ void sym_block_pointers_kernel(ConstMatBatch a, bool ta, ConstMatBatch b, bool tb, MatBatch c, int64_t nb,
                                          int64_t bs, int64_t nblk, int64_t cnt, int64_t es, bool upper,
                                          const void** out) {
  for (int64_t e = global_thread(); e < cnt; e += grid_threads()) {
    const int64_t t = e / nblk;
    int64_t q = e % nblk, j = 0;
    while (q >= nb - j) q -= nb - j++;
    int64_t i = j + q;
    if (upper) {
      const int64_t k = i;
      i = j;
      j = k;
    }
    // elements of es bytes: ld and stride count elements
    const char* pa = reinterpret_cast<const char*>(a.p) + es * (t * a.stride + (ta ? i * bs : i * bs * a.ld));
    const char* pb = reinterpret_cast<const char*>(b.p) + es * (t * b.stride + (tb ? j * bs * b.ld : j * bs));
    const char* pc = reinterpret_cast<const char*>(c.p) + es * (t * c.stride + i * bs * c.ld + j * bs);
    out[e] = pb;
    out[cnt + e] = pa;
    out[2 * cnt + e] = pc;
  }
}

// mirror_bf16 by 64 x 64 tiles of the lower triangle, one tile and matrix
// per CTA of 256 threads, each thread two chunks of 8 bf16 (16 bytes: Vec,
// where every row start is 16-byte aligned; else 8 scalar accesses). bs is
// a multiple of 32 dividing n, so a chunk lies in one block row and one
// block column (the conditions below hold for its 8 elements alike), while
// a tile may straddle blocks (bs = 288). Element (i, j) of tile (R, C), R >=
// C, with block indices bi = i / bs and bj = j / bs:
//  - bi > bj (below the block diagonal): copied as read, and written to its
//    transposed place (j, i), which lies above the block diagonal;
//  - bi == bj (a diagonal block, formed whole by gemm_bf16_lower): copied,
//    and when R > C its transpose (j, i), in the same diagonal block but in
//    a tile nothing else visits, copied too; diag added where i == j;
//  - bi < bj (only in the upper part of a straddling diagonal tile): left.
// Phase 1 loads the tile (row chunks), copies and shifts from registers and
// puts it in shared memory; phase 2 writes its transposed chunks. Writes go
// only to places above the block diagonal, which no CTA reads (those of a
// diagonal tile are read by its own CTA in phase 1, before the barrier),
// to the copy, and to diagonal elements only their own thread reads.
// An (R, C) entirely inside one diagonal block has nothing to do without
// a copy, a scale or, on the diagonal, a shift (most of them for 4 x 4
// blocks).
// With a scale (power 1 or 2: frob_scale_bf16's sc from the partial sums
// `parts`, computed by frob_inv as there), every element on and below the
// block diagonal (i / bs >= j / bs) becomes bf16(sc (x + diag [i == j])),
// the operations and roundings of frob_scale_bf16, and is written back in
// place, to the copy and, below the block diagonal, to its transposed place:
// the matrix frob_scale_bf16 gives after (or, diag 0, before) the plain
// mirror, in the mirror's one pass. Phase 2 also rewrites the transposed
// tile of an off-diagonal tile inside a diagonal block (only its CTA visits
// it).
// Against one 32 x 32 tile per CTA of every matrix's whole grid: 380 -> 140
// us per call for 24 matrices of 2048 (ncu, H100; docs/benchmarks.md).
constexpr int kMirTile = 64, kMirPitch = kMirTile + 2, kMirThreads = 256;
constexpr int kMirChunks = kMirTile * kMirTile / 8;  // 512 chunks of 8

template <bool Vec>
__device__ inline void mir_load8(const uint16_t* p, uint16_t (&v)[8]) {
  if constexpr (Vec) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      v[2 * q] = static_cast<uint16_t>(u[q] & 0xffffu);
      v[2 * q + 1] = static_cast<uint16_t>(u[q] >> 16);
    }
  } else {
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = p[q];
  }
}
template <bool Vec>
__device__ inline void mir_store8(uint16_t* p, const uint16_t (&v)[8]) {
  if constexpr (Vec) {
    uint32_t u[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) u[q] = static_cast<uint32_t>(v[2 * q]) | (static_cast<uint32_t>(v[2 * q + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(u[0], u[1], u[2], u[3]);
  } else {
#pragma unroll
    for (int q = 0; q < 8; ++q) p[q] = v[q];
  }
}

__device__ inline void mir_scale8(uint16_t (&v)[8], int64_t i, int64_t j, float diag, float sc) {
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    float x = bf16_to_float(v[q]);
    if (i == j + q) x += diag;
    v[q] = float_to_bf16(x * sc);
  }
}

template <bool Vec>
__global__ void __launch_bounds__(kMirThreads)
    mirror_bf16_kernel(MatBatch m, int64_t bs, float diag, MatBatch copy, const double* parts, int64_t nparts,
                       float factor, float eps, int power) {
  __shared__ uint16_t tile[kMirTile][kMirPitch];
  __shared__ double sh[33];
  const int64_t n = m.rows, k = blockIdx.x;
  // Tile k of the lower triangle in row order: (R, C), k = R (R + 1) / 2 + C.
  int64_t R = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(k) + 1.0) - 1.0) / 2.0);
  while (R * (R + 1) / 2 > k) --R;
  while ((R + 1) * (R + 2) / 2 <= k) ++R;
  const int64_t C = k - R * (R + 1) / 2;
  const int64_t r0 = R * kMirTile, c0 = C * kMirTile;
  const int64_t r1 = min(r0 + kMirTile, n) - 1, c1 = min(c0 + kMirTile, n) - 1;
  const bool on_diag = R == C;
  const bool inside = r0 / bs == r1 / bs && c0 / bs == c1 / bs && r0 / bs == c0 / bs;
  const bool scaled = power != 0;
  if (inside && !copy.p && !scaled && !(on_diag && diag != 0.0f)) return;
  const int t = static_cast<int>(threadIdx.x);
  for (int64_t b = blockIdx.y; b < m.batch; b += gridDim.y) {
    float sc = 1.0f;
    if (scaled) {
      const float inv = frob_inv(parts, b, nparts, factor, eps, sh);
      sc = power == 2 ? inv * inv : inv;
    }
    uint16_t* base = reinterpret_cast<uint16_t*>(m.p) + b * m.stride;
    uint16_t* dst = copy.p ? reinterpret_cast<uint16_t*>(copy.p) + b * copy.stride : nullptr;
    for (int e = t; e < kMirChunks; e += kMirThreads) {
      const int li = e / 8, lj = (e % 8) * 8;
      const int64_t i = r0 + li, j = c0 + lj;
      uint16_t v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (i < n && j < n) {
        mir_load8<Vec>(base + i * m.ld + j, v);
        const int64_t bi = i / bs, bj = j / bs;
        if (scaled && bi >= bj) {
          mir_scale8(v, i, j, diag, sc);
          mir_store8<Vec>(base + i * m.ld + j, v);
        }
        if (dst && bi >= bj) mir_store8<Vec>(dst + i * copy.ld + j, v);
        if (!scaled && on_diag && diag != 0.0f && i >= j && i < j + 8)
          base[i * m.ld + i] = float_to_bf16(bf16_to_float(v[i - j]) + diag);
      }
#pragma unroll
      for (int q = 0; q < 8; ++q) tile[li][lj + q] = v[q];
    }
    __syncthreads();
    for (int e = t; e < kMirChunks; e += kMirThreads) {
      const int lj = e / 8, li = (e % 8) * 8;
      const int64_t j = c0 + lj, i = r0 + li;  // the chunk (j, i .. i + 7): column j's rows i .. i + 7, transposed
      if (i >= n || j >= n) continue;
      const int64_t bi = i / bs, bj = j / bs;
      uint16_t v[8];
      if (bi > bj) {
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = tile[li + q][lj];
        mir_store8<Vec>(base + j * m.ld + i, v);
      } else if (bi == bj && !on_diag && (dst || scaled)) {
        mir_load8<Vec>(base + j * m.ld + i, v);
        if (scaled) {  // j < i: no diagonal element here
          mir_scale8(v, j, i, 0.0f, sc);
          mir_store8<Vec>(base + j * m.ld + i, v);
        }
        if (dst) mir_store8<Vec>(dst + j * copy.ld + i, v);
      }
    }
    __syncthreads();  // the tile is reused for the next matrix
  }
}
}  // namespace

namespace {
// Backend::ns_shift_bf16: y walks the matrices, x the chunks of 8 elements
// of a row (cpr per row, the last one short where n % 8 != 0: Vec, 16-byte
// accesses, only where n % 8 == 0 and every row start is aligned).
template <bool Vec>
__global__ void ns_shift_bf16_kernel(MatBatch a, MatBatch b, float coef, float diag, const double* parts,
                                     int64_t nparts, float factor, float eps, uint16_t* a3) {
  __shared__ double sh[33];
  const int64_t n = a.rows, cpr = (n + 7) / 8, chunks = n * cpr;
  for (int64_t q = blockIdx.y; q < a.batch; q += gridDim.y) {
    float s2 = 1.0f, s3 = 1.0f, sc = 1.0f;
    if (parts) {
      const float inv = frob_inv(parts, q, nparts, factor, eps, sh);
      s2 = inv * inv;
      s3 = s2 * inv;
      sc = inv;
    }
    uint16_t* pa = reinterpret_cast<uint16_t*>(a.p) + q * a.stride;
    uint16_t* pb = reinterpret_cast<uint16_t*>(b.p) + q * b.stride;
    uint16_t* p3 = parts ? a3 + q * n * n : nullptr;
    for (int64_t e = global_thread(); e < chunks; e += grid_threads()) {
      const int64_t i = e / cpr, j0 = (e - i * cpr) * 8;
      const int w = static_cast<int>(n - j0 < 8 ? n - j0 : 8);
      uint16_t v[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v3[8], vb[8];
      if constexpr (Vec) {
        mir_load8<true>(pa + i * a.ld + j0, v);
      } else {
        for (int k = 0; k < w; ++k) v[k] = pa[i * a.ld + j0 + k];
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float x = bf16_to_float(v[k]);
        if (parts) {
          v3[k] = float_to_bf16(x * s3);
          v[k] = float_to_bf16(x * s2);
          x = bf16_to_float(v[k]);
        }
        float t = coef * x;
        if (i == j0 + k) t += diag;
        vb[k] = float_to_bf16(t * sc);
      }
      if constexpr (Vec) {
        mir_store8<true>(pb + i * b.ld + j0, vb);
        if (parts) {
          mir_store8<true>(pa + i * a.ld + j0, v);
          mir_store8<true>(p3 + i * n + j0, v3);
        }
      } else {
        for (int k = 0; k < w; ++k) {
          pb[i * b.ld + j0 + k] = vb[k];
          if (parts) {
            pa[i * a.ld + j0 + k] = v[k];
            p3[i * n + j0 + k] = v3[k];
          }
        }
      }
    }
  }
}
}  // namespace

void ns_shift_bf16(const Ctx& c, MatBatch a, MatBatch b, float coef, float diag, const double* parts, int64_t nparts,
                   float factor, float eps, void* a3) {
  const int64_t n = a.rows;
  if (n <= 0 || a.batch <= 0) return;
  DION_REQUIRE(a.cols == n && b.rows == n && b.cols == n && b.batch == a.batch && (!parts || (a3 && nparts > 0)),
               DION_ERROR_INTERNAL, "ns_shift_bf16: needs square matrices of one shape, and a3 with a scale");
  const auto aligned = [](const void* p, int64_t ld, int64_t stride) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld % 8 == 0 && stride % 8 == 0;
  };
  const bool vec = n % 8 == 0 && aligned(a.p, a.ld, a.stride) && aligned(b.p, b.ld, b.stride) &&
                   (!parts || aligned(a3, n, n * n));
  const dim3 grid = grid_multi(c, a.batch, n * ((n + 7) / 8));
  uint16_t* p3 = static_cast<uint16_t*>(a3);
  if (vec)
    ns_shift_bf16_kernel<true><<<grid, kThreads, 0, c.stream>>>(a, b, coef, diag, parts, nparts, factor, eps, p3);
  else
    ns_shift_bf16_kernel<false><<<grid, kThreads, 0, c.stream>>>(a, b, coef, diag, parts, nparts, factor, eps, p3);
  cuda::check_launch("ns_shift_bf16 kernel");
}

void sym_block_pointers(const Ctx& c, ConstMatBatch a, bool ta, ConstMatBatch b, bool tb, MatBatch m, int64_t nb,
                        int64_t bs, int64_t es, const void** out, bool upper) {
  const int64_t nblk = nb * (nb + 1) / 2, cnt = m.batch * nblk;
  if (cnt <= 0) return;
  sym_block_pointers_kernel<<<blocks_1d(c, cnt), kThreads, 0, c.stream>>>(a, ta, b, tb, m, nb, bs, nblk, cnt, es,
                                                                          upper, out);
  cuda::check_launch("symmetric block pointer kernel");
}

void mirror_bf16(const Ctx& c, MatBatch m, int64_t bs, float diag, MatBatch copy, const double* parts, int64_t nparts,
                 float factor, float eps, int power) {
  const int64_t n = m.rows;
  if (n <= 0 || m.batch <= 0) return;
  DION_REQUIRE(m.cols == n && bs > 0 && bs % 32 == 0 && n % bs == 0 && (!copy.p || (copy.rows == n && copy.cols == n)),
               DION_ERROR_INTERNAL, "mirror_bf16: needs square matrices and blocks of a multiple of 32 dividing them");
  DION_REQUIRE(power == 0 || ((power == 1 || power == 2) && parts && nparts > 0), DION_ERROR_INTERNAL,
               "mirror_bf16: a scale needs power 1 or 2 and partial sums");
  // 16-byte chunks where every row of m (and of the copy) starts 16-byte aligned.
  const auto aligned = [](const MatBatch& x) {
    return !x.p || (reinterpret_cast<uintptr_t>(x.p) % 16 == 0 && x.ld % 8 == 0 && x.stride % 8 == 0);
  };
  const int64_t nt = (n + kMirTile - 1) / kMirTile;
  const dim3 grid(static_cast<unsigned>(nt * (nt + 1) / 2), static_cast<unsigned>(std::min<int64_t>(m.batch, 65535)));
  if (aligned(m) && aligned(copy))
    mirror_bf16_kernel<true>
        <<<grid, kMirThreads, 0, c.stream>>>(m, bs, diag, copy, parts, nparts, factor, eps, power);
  else
    mirror_bf16_kernel<false>
        <<<grid, kMirThreads, 0, c.stream>>>(m, bs, diag, copy, parts, nparts, factor, eps, power);
  cuda::check_launch("mirror_bf16 kernel");
}

void add_diag_bf16(const Ctx& c, MatBatch m, float v) {
  const int64_t n = m.rows < m.cols ? m.rows : m.cols;
  if (n <= 0 || m.batch <= 0) return;
  add_diag_bf16_kernel<<<grid_multi(c, m.batch, n), kThreads, 0, c.stream>>>(m, n, v);
  cuda::check_launch("add_diag_bf16 kernel");
}

void to_double(const Ctx& c, ConstMatBatch m, double* out) {
  for_each_2d(c, m.batch, m.rows, m.cols, ToDouble{m, out}, "to_double kernel");
}

void extract_r_double(const Ctx& c, const double* l, MatBatch r_out) {
  for_each_2d(c, r_out.batch, r_out.rows, r_out.cols, ExtractRDouble{l, r_out}, "qr_r (fp64) extract kernel");
}

void extract_r(const Ctx& c, const float* cm, int64_t p, MatBatch r_out) {
  for_each_2d(c, r_out.batch, r_out.rows, r_out.cols, ExtractR{cm, p, r_out}, "qr_r extract kernel");
}

// ---- the blocked Cholesky's diagonal blocks (chol_block) ----

namespace {

constexpr int kCholThreads = 256;
constexpr int kCholWarps = kCholThreads / 32;      // 8
constexpr int kCholCols = kCholBlock / kCholWarps;  // 8 columns per warp: w + 8 c
constexpr int kCholHalves = kCholBlock / 32;        // 2 rows per lane: l + 32 h
constexpr int kCholLd = kCholBlock + 1;             // shared-memory column stride
static_assert(kCholBlock == 64 && kCholWarps == kCholCols, "one group of steps per column of a warp");

__device__ inline float chol_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ inline double chol_fma(double a, double b, double c) { return __fma_rn(a, b, c); }

// Step k's pivot, by the warp that keeps column k (its column G, rows
// below k of its halves from G / 4 on): a_kk broadcast by a shuffle, and
// the multipliers -a_ik / a_kk and factors a_ik of the rows below k (zero
// for the others) put in mb and fb.
template <class T, int G>
__device__ __forceinline__ void chol_pivot(T (&a)[kCholHalves][kCholCols], T* mb, T* fb, T* piv, int k, int l) {
  constexpr int H = G * kCholCols / 32;
  const T d = __shfl_sync(0xffffffffu, a[H][G], k % 32);
  if (l == 0) piv[k] = d;
  const T rd = T(1) / d;
#pragma unroll
  for (int h = H; h < kCholHalves; ++h) {
    const int i = l + 32 * h;
    mb[i] = i > k ? -(a[h][G] * rd) : T(0);
    fb[i] = i > k ? a[h][G] : T(0);
  }
}

// Steps k = 8 G .. 8 G + 7 of cta_chol64 (see there). Column k is the
// owning warp's (k % 8) column G, and with G fixed a thread's columns c < G
// are left of k and its rows l + 32 h for h < G / 4 above it: their factors
// and multipliers are zero, and those fused multiply-adds, which change
// nothing for finite values, are not issued (nor Y's for columns right of
// k: y_kc = 0 there). (Only after a failed pivot, where the result is
// replaced anyway, can a skipped one differ: 0 times an infinite
// multiplier.)
template <class T, bool Inv, int G>
__device__ __forceinline__ void chol_steps(T (&a)[kCholHalves][kCholCols], T (&y)[kCholHalves][kCholCols], T* mbuf,
                                           T* fbuf, T* piv, int w, int l) {
  constexpr int H = G * kCholCols / 32;  // the pivots' half: rows l + 32 h for h < H are done
#pragma unroll 1
  for (int kk = 0; kk < kCholCols; ++kk) {
    const int k = G * kCholCols + kk;
    T* mb = mbuf + (k & 1) * kCholBlock;  // by step parity: one barrier per step
    T* fb = fbuf + (k & 1) * kCholBlock;
    if (w == kk) chol_pivot<T, G>(a, mb, fb, piv, k, l);
    __syncthreads();
    T m[kCholHalves];
#pragma unroll
    for (int h = H; h < kCholHalves; ++h) m[h] = mb[l + 32 * h];
#pragma unroll
    for (int c = G; c < kCholCols; ++c) {
      const T f = fb[w + kCholCols * c];
#pragma unroll
      for (int h = H; h < kCholHalves; ++h) a[h][c] = chol_fma(m[h], f, a[h][c]);
    }
    if (Inv) {  // row k of Y is lane k % 32's half H, in every warp
#pragma unroll
      for (int c = 0; c <= G; ++c) {
        const T e = __shfl_sync(0xffffffffu, y[H][c], k % 32);
#pragma unroll
        for (int h = H; h < kCholHalves; ++h) y[h][c] = chol_fma(m[h], e, y[h][c]);
      }
    }
  }
}

// The CTA factors the 64 x 64 block of s (column-major, ld kCholLd; the
// whole symmetric square) in place into its lower Cholesky factor and,
// with Inv, writes the factor's inverse to x (zeros above the diagonal).
// Warp w keeps columns w + 8 c of the block and of Y, the inverse's rows
// before their scaling, in registers, lane l their rows l and l + 32. Step
// k (a rolled loop: unrolled steps are fetched from memory once each, and
// that, not the arithmetic, bounded earlier versions): the warp that keeps
// column k (chol_pivot) broadcasts its pivot a_kk by a shuffle and puts the
// multipliers -a_ik / a_kk and the factors a_jk (= a_kj: the square stays
// symmetric) of rows below k, zero elsewhere, in shared memory (two buffers
// by step parity, so one barrier per step); then every thread applies the unscaled
// right-looking recurrence a_ij -= a_ik a_kj / a_kk to its columns right of
// k and the forward elimination y_ic -= a_ik y_kc / a_kk, row k of Y taken
// from the lane that keeps it by a shuffle. Every update is one fused
// multiply-add. At the end L_ij = a_ij / sqrt(a_jj) (a_ij as it was at step
// j) and L^-1 = diag(L)^-1 Y. Returns 1 + the first pivot that is not
// positive (NaN included), 0 if none, on every thread.
template <class T, bool Inv>
__device__ int cta_chol64(T* s, T* x, T* mbuf, T* fbuf, T* piv) {
  const int t = static_cast<int>(threadIdx.x), w = t / 32, l = t % 32;
  T a[kCholHalves][kCholCols], y[kCholHalves][kCholCols];
#pragma unroll
  for (int h = 0; h < kCholHalves; ++h)
#pragma unroll
    for (int c = 0; c < kCholCols; ++c) {
      const int i = l + 32 * h, j = w + kCholCols * c;
      a[h][c] = s[j * kCholLd + i];
      y[h][c] = i == j ? T(1) : T(0);
    }
  chol_steps<T, Inv, 0>(a, y, mbuf, fbuf, piv, w, l);
  chol_steps<T, Inv, 1>(a, y, mbuf, fbuf, piv, w, l);
  chol_steps<T, Inv, 2>(a, y, mbuf, fbuf, piv, w, l);
  chol_steps<T, Inv, 3>(a, y, mbuf, fbuf, piv, w, l);
  chol_steps<T, Inv, 4>(a, y, mbuf, fbuf, piv, w, l);
  chol_steps<T, Inv, 5>(a, y, mbuf, fbuf, piv, w, l);
  chol_steps<T, Inv, 6>(a, y, mbuf, fbuf, piv, w, l);
  chol_steps<T, Inv, 7>(a, y, mbuf, fbuf, piv, w, l);
  __syncthreads();  // piv complete
  // The first pivot that is not positive: lanes l and l + 32 vote.
  const unsigned lo = __ballot_sync(0xffffffffu, !(piv[l] > T(0)));
  const unsigned hi = __ballot_sync(0xffffffffu, !(piv[l + 32] > T(0)));
  const int fail = lo ? __ffs(lo) : hi ? 32 + __ffs(hi) : 0;
#pragma unroll
  for (int h = 0; h < kCholHalves; ++h) {
    const int i = l + 32 * h;
    const T ri = T(1) / sqrt(piv[i]);
#pragma unroll
    for (int c = 0; c < kCholCols; ++c) {
      const int j = w + kCholCols * c;
      if (i > j) s[j * kCholLd + i] = a[h][c] / sqrt(piv[j]);
      if (i == j) s[j * kCholLd + i] = sqrt(piv[i]);
      if (Inv) x[j * kCholLd + i] = i >= j ? y[h][c] * ri : T(0);
    }
  }
  return fail;
}

// The diagonal block (CholBlock): the block loaded (a block of nb < 64
// padded with the identity), factored and inverted by cta_chol64, and
// written back.
template <class T>
__global__ void __launch_bounds__(kCholThreads, 1) chol_block_kernel(CholBlock<T> g) {
  extern __shared__ __align__(16) unsigned char chol_smem[];
  T* s = reinterpret_cast<T*>(chol_smem);  // the block, column-major, ld kCholLd
  T* x = s + kCholBlock * kCholLd;         // its inverse
  T* mbuf = x + kCholBlock * kCholLd;      // 2 x 64: step k's multipliers, by step parity
  T* fbuf = mbuf + 2 * kCholBlock;         // 2 x 64: its factors
  T* piv = fbuf + 2 * kCholBlock;          // 64 pivots
  const int t = static_cast<int>(threadIdx.x);
  const int nb = g.nb;
  const bool inv = g.inv != nullptr;
  for (int64_t b = blockIdx.x; b < g.batch; b += gridDim.x) {
    T* A = g.a + b * g.stride + g.o * g.ld + g.o;  // the block's (0, 0)
    for (int e = t; e < kCholBlock * kCholBlock; e += kCholThreads) {
      const int i = e % kCholBlock, j = e / kCholBlock;
      s[j * kCholLd + i] = i < nb && j < nb ? A[static_cast<int64_t>(j) * g.ld + i] : (i == j ? T(1) : T(0));
    }
    __syncthreads();
    const int fail = inv ? cta_chol64<T, true>(s, x, mbuf, fbuf, piv) : cta_chol64<T, false>(s, x, mbuf, fbuf, piv);
    __syncthreads();
    for (int e = t; e < kCholBlock * kCholBlock; e += kCholThreads) {
      const int i = e % kCholBlock, j = e / kCholBlock;
      if (i >= j && i < nb) A[static_cast<int64_t>(j) * g.ld + i] = s[j * kCholLd + i];
      if (inv) g.inv[b * kCholBlock * kCholBlock + e] = x[j * kCholLd + i];
    }
    if (t == 0) {
      const int32_t at = fail ? static_cast<int32_t>(g.o) + fail : 0;
      if (g.first)
        g.info[b] = at;
      else if (at && g.info[b] == 0)
        g.info[b] = at;
    }
    __syncthreads();  // the shared arrays are reused by the next matrix
  }
}

constexpr size_t chol_smem_bytes(size_t elem) { return elem * (2 * kCholBlock * kCholLd + 5 * kCholBlock); }

}  // namespace

void chol_block_init() {
  // fp64: the block, its inverse and the broadcast buffers, above the 48 KiB
  // a launch gets by default.
  cuda::check(cudaFuncSetAttribute(chol_block_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(chol_smem_bytes(sizeof(float)))),
              "cudaFuncSetAttribute (cholesky block, fp32)");
  cuda::check(cudaFuncSetAttribute(chol_block_kernel<double>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(chol_smem_bytes(sizeof(double)))),
              "cudaFuncSetAttribute (cholesky block, fp64)");
}

template <class T>
void chol_block(const Ctx& c, const CholBlock<T>& g) {
  if (g.batch <= 0 || g.nb <= 0) return;
  DION_REQUIRE(g.nb <= kCholBlock && (!g.inv || g.nb == kCholBlock), DION_ERROR_INTERNAL,
               "chol_block: blocks of at most %d columns, and of %d where the inverse is formed", kCholBlock,
               kCholBlock);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(g.batch, 65535));
  chol_block_kernel<T><<<blocks, kCholThreads, chol_smem_bytes(sizeof(T)), c.stream>>>(g);
  cuda::check_launch("cholesky block kernel");
}
template void chol_block<float>(const Ctx&, const CholBlock<float>&);
template void chol_block<double>(const Ctx&, const CholBlock<double>&);

namespace {
constexpr int kMirrorTile = 32, kMirrorRows = 8;
static_assert(kCholBlock % kMirrorTile == 0, "a tile lies within one block row and one block column");
// Block (blockIdx.x: tile column tj, blockIdx.y: tile row ti of a tile grid
// over the matrix, blockIdx.z + k gridDim.z: matrix): for a tile below the
// diagonal blocks, its mirror read by its rows (contiguous columns of the
// upper part) into shared memory, written transposed by the rows of the
// tile; every other block returns at once.
template <class T>
__global__ void chol_mirror_kernel(T* a, int64_t n, int64_t ld, int64_t stride, int64_t batch) {
  __shared__ T tile[kMirrorTile][kMirrorTile + 1];
  // Tile (ti, tj) = (blockIdx.y, blockIdx.x); only tiles below the diagonal
  // blocks (tile rows of a later block row) hold a panel.
  const int ti = static_cast<int>(blockIdx.y), tj = static_cast<int>(blockIdx.x);
  if ((ti * kMirrorTile) / kCholBlock <= (tj * kMirrorTile) / kCholBlock) return;
  const int64_t i0 = static_cast<int64_t>(ti) * kMirrorTile, j0 = static_cast<int64_t>(tj) * kMirrorTile;
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    T* m = a + b * stride;
    // read (j, i) for j in [j0, j0 + 32), i in [i0, i0 + 32): column i, rows j0 + tx
    for (int r = ty; r < kMirrorTile; r += kMirrorRows) {
      const int64_t i = i0 + r, j = j0 + tx;
      if (i < n && j < n) tile[r][tx] = m[i * ld + j];
    }
    __syncthreads();
    // write (i, j): column j, rows i0 + tx
    for (int r = ty; r < kMirrorTile; r += kMirrorRows) {
      const int64_t j = j0 + r, i = i0 + tx;
      if (i < n && j < n) m[j * ld + i] = tile[tx][r];
    }
    __syncthreads();
  }
}
}  // namespace

template <class T>
void chol_mirror_panels(const Ctx& c, T* a, int64_t n, int64_t ld, int64_t stride, int64_t batch) {
  if (n <= kCholBlock || batch <= 0) return;
  const int64_t t = (n + kMirrorTile - 1) / kMirrorTile;
  DION_REQUIRE(t <= 65535, DION_ERROR_INTERNAL, "chol_mirror_panels: n = %lld too large", static_cast<long long>(n));
  const dim3 grid(static_cast<unsigned>(t), static_cast<unsigned>(t),
                  static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  chol_mirror_kernel<T><<<grid, dim3(kMirrorTile, kMirrorRows), 0, c.stream>>>(a, n, ld, stride, batch);
  cuda::check_launch("cholesky mirror kernel");
}
template void chol_mirror_panels<float>(const Ctx&, float*, int64_t, int64_t, int64_t, int64_t);
template void chol_mirror_panels<double>(const Ctx&, double*, int64_t, int64_t, int64_t, int64_t);

void cholesky_fixup(const Ctx& c, MatBatch a, int32_t* info) {
  if (a.batch <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(a.batch, 65535));
  cholesky_fixup_kernel<<<blocks, kThreads, 0, c.stream>>>(a, info);
  cuda::check_launch("cholesky fix-up kernel");
}

size_t orth_fallback_scratch(const Ctx& c, const MatBatch& p) {
  (void)c;
  return sizeof(double) * static_cast<size_t>(std::max<int64_t>(p.batch * p.cols, 1));
}

void orth_fallback(const Ctx& c, MatBatch p, ConstMatBatch p0, const uint16_t* p0_bf16, const int32_t* info,
                   void* scratch) {
  if (p.batch <= 0 || p.rows <= 0 || p.cols <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(p.batch, 65535));
  orth_fallback_kernel<<<blocks, kOrthThreads, 0, c.stream>>>(p, p0, p0_bf16, info, static_cast<double*>(scratch));
  cuda::check_launch("orth_fallback kernel");
}

}  // namespace dion::kernels

// SPDX-License-Identifier: MIT
// Device-side helpers shared by the kernels: launch sizing, grid-stride
// loops, deterministic block reductions and row-major matrix addressing.
//
// Determinism: every reduction here sums in a fixed order that depends only
// on the launch shape (a fixed shuffle tree inside each warp, then the warps
// in index order), never on timing; no floating-point atomics are used
// anywhere in the backend, so each op gives the same bits on every run.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.hpp"
#include "core/backend.hpp"
#include "core/dtype.hpp"
#include "kernels/launch.hpp"

namespace dion::kernels {

constexpr int kThreads = 256;  // default block size of 1-D kernels

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride 1-D kernel over n items: enough to fill the
// device several times over, never more than the items need.
inline unsigned blocks_1d(const Ctx& c, int64_t n, int threads = kThreads) {
  const int64_t want = std::max<int64_t>(1, ceil_div(n, threads));
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(c.sms) * 16);
  return static_cast<unsigned>(std::min(want, cap));
}

// Grid of a multi-tensor kernel: y walks the tensors (grid-stride beyond
// 65535), x the elements of each, sized so the whole grid is a few waves.
inline dim3 grid_multi(const Ctx& c, int64_t count, int64_t max_n, int threads = kThreads) {
  const int64_t gy = std::min<int64_t>(std::max<int64_t>(count, 1), 65535);
  const int64_t want_x = std::max<int64_t>(1, ceil_div(max_n, threads));
  const int64_t fill_x = std::max<int64_t>(1, ceil_div(static_cast<int64_t>(c.sms) * 16, gy));
  return dim3(static_cast<unsigned>(std::min<int64_t>(want_x, fill_x)), static_cast<unsigned>(gy), 1);
}

// 2-D tiles of (32 x 8) threads over a batch of rows x cols items: x walks
// columns, y rows, z matrices; each is grid-stride so any size fits.
constexpr int kTileX = 32, kTileY = 8;
inline dim3 grid_2d(const Ctx& c, int64_t rows, int64_t cols, int64_t batch) {
  const int64_t gz = std::min<int64_t>(std::max<int64_t>(batch, 1), 65535);
  const int64_t gx = std::min<int64_t>(std::max<int64_t>(1, ceil_div(cols, kTileX)), 65535);
  const int64_t fill = std::max<int64_t>(1, ceil_div(static_cast<int64_t>(c.sms) * 32, gx * gz));
  const int64_t gy = std::min<int64_t>({std::max<int64_t>(1, ceil_div(rows, kTileY)), fill, 65535});
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(gz));
}

// Runs f(b, i, j) for every element of a batch of rows x cols items, launched
// with grid_2d and (kTileX, kTileY) threads.
template <class F>
__global__ void for_each_2d_kernel(int64_t batch, int64_t rows, int64_t cols, F f) {
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z)
    for (int64_t i = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; i < rows;
         i += static_cast<int64_t>(gridDim.y) * blockDim.y)
      for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < cols;
           j += static_cast<int64_t>(gridDim.x) * blockDim.x)
        f(b, i, j);
}

template <class F>
void for_each_2d(const Ctx& c, int64_t batch, int64_t rows, int64_t cols, const F& f, const char* name) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return;
  for_each_2d_kernel<<<grid_2d(c, rows, cols, batch), dim3(kTileX, kTileY), 0, c.stream>>>(batch, rows, cols, f);
  cuda::check_launch(name);
}

__device__ __forceinline__ int64_t global_thread() {
  return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Sum over a warp, the same shuffle tree every time.
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;  // valid in lane 0
}

// Sum of one value per thread of a 1-D block (blockDim.x a multiple of 32, at
// most 1024); every thread gets the result. `smem` holds 33 doubles. Contains
// __syncthreads: call it from all threads of the block.
__device__ __forceinline__ double block_sum(double v, double* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double w = lane < nwarps ? smem[lane] : 0.0;
    w = warp_sum(w);
    if (lane == 0) smem[32] = w;
  }
  __syncthreads();
  const double r = smem[32];
  __syncthreads();  // smem may be reused right after
  return r;
}

// 1 / (factor ||m[b]||_F + eps) from the partial sums of matrix b. Every
// block that calls it (with kThreads threads) adds the same partials in the
// same order, so frob_normalize and frob_normalize_bf16 get the same float.
// Contains __syncthreads: call it from all threads of the block.
__device__ __forceinline__ float frob_inv(const double* partial, int64_t b, int64_t nchunks, float factor, float eps,
                                          double* sh) {
  double s = 0.0;
  for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) s += partial[b * nchunks + c];
  s = block_sum(s, sh);
  return static_cast<float>(1.0 / (factor * sqrt(s) + eps));
}

// Walks the flat element range [e0, e1) of a rows x cols row-major matrix
// (leading dimension ld) with a fixed step, keeping (row, col) up to date
// without a division per element.
struct FlatWalk {
  int64_t e, row, col, dr, dc;
  __device__ FlatWalk(int64_t start, int64_t step, int64_t cols)
      : e(start), row(start / cols), col(start % cols), dr(step / cols), dc(step % cols) {}
  __device__ __forceinline__ int64_t offset(int64_t ld) const { return row * ld + col; }
  __device__ __forceinline__ void next(int64_t step, int64_t cols) {
    e += step;
    row += dr;
    col += dc;
    if (col >= cols) {
      col -= cols;
      ++row;
    }
  }
};

// Eight consecutive elements of a typed buffer, chunk j = elements
// [8j, 8j + 8), with 16-byte loads and stores: the buffer's address must be
// 16-byte aligned. The conversions are load_elem's and store_elem's, so a
// kernel gives the same bits on its vector and its element path.
__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ float half_bits_to_float(uint32_t h, dion_dtype_t dt) {
  return dt == DION_DTYPE_BF16 ? bf16_to_float(static_cast<uint16_t>(h)) : fp16_to_float(static_cast<uint16_t>(h));
}
__device__ __forceinline__ uint32_t float_to_half_bits(float v, dion_dtype_t dt) {
  return dt == DION_DTYPE_BF16 ? float_to_bf16(v) : float_to_fp16(v);
}

// Eight elements' bytes as loaded, before their conversion (load_raw8):
// two 16-byte words for fp32, one (a) for a 16-bit dtype. A pass that reads
// several buffers loads them all first and converts after (cvt8), so that
// its loads are issued together. With each buffer's conversion between the
// loads (load8 after load8) a thread could wait on one load before issuing
// the next: AdamW's pass over four bf16 buffers ran at 70% of the copy
// bandwidth on an H200 that way, and at about 85% loading first
// (docs/benchmarks.md, eighteenth session).
struct Raw8 {
  uint4 a, b;
};

__device__ __forceinline__ Raw8 load_raw8(const void* p, dion_dtype_t dt, int64_t j) {
  Raw8 r;
  if (dt == DION_DTYPE_FP32) {
    const uint4* q = static_cast<const uint4*>(p) + 2 * j;
    r.a = q[0];
    r.b = q[1];
  } else {
    r.a = static_cast<const uint4*>(p)[j];
    r.b = make_uint4(0, 0, 0, 0);
  }
  return r;
}

__device__ __forceinline__ void cvt8(const Raw8& r, dion_dtype_t dt, float (&v)[8]) {
  if (dt == DION_DTYPE_FP32) {
    const uint32_t w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __uint_as_float(w[k]);
  } else {
    const uint32_t w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = half_bits_to_float(w[k] & 0xffffu, dt);
      v[2 * k + 1] = half_bits_to_float(w[k] >> 16, dt);
    }
  }
}

__device__ __forceinline__ void load8(const void* p, dion_dtype_t dt, int64_t j, float (&v)[8]) {
  cvt8(load_raw8(p, dt, j), dt, v);
}

// Two floats rounded to bf16 or fp16 (round to nearest even, subnormals
// kept, fp16 overflow to inf) and packed, lo in the low half: on sm_80 and
// later one paired conversion instruction for both, where the bit
// arithmetic of float_to_bf16 / float_to_fp16 takes about eight per value
// (the streaming passes over bf16 tensors convert every element they
// store). The hardware writes its canonical NaN; a NaN gets the host's bits
// instead (a quiet NaN with the input's sign and upper payload), so the
// device stores what the host backend stores.
__device__ __forceinline__ uint32_t half2_bits(float lo, float hi, dion_dtype_t dt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  if (dt == DION_DTYPE_BF16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  if (isnan(lo) || isnan(hi)) r = float_to_half_bits(lo, dt) | (float_to_half_bits(hi, dt) << 16);
  return r;
#else
  return float_to_half_bits(lo, dt) | (float_to_half_bits(hi, dt) << 16);
#endif
}

__device__ __forceinline__ void store8(void* p, dion_dtype_t dt, int64_t j, const float (&v)[8]) {
  if (dt == DION_DTYPE_FP32) {
    float4* q = static_cast<float4*>(p) + 2 * j;
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = half2_bits(v[2 * k], v[2 * k + 1], dt);
    static_cast<uint4*>(p)[j] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

__device__ __forceinline__ float* mat_at(const MatBatch& m, int64_t b) { return m.p + b * m.stride; }
__device__ __forceinline__ const float* mat_at(const ConstMatBatch& m, int64_t b) { return m.p + b * m.stride; }

}  // namespace dion::kernels

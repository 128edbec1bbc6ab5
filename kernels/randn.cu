// SPDX-License-Identifier: MIT
// Normal random matrices from the counter-based generator of core/rng.hpp,
// whose philox_normal is shared with the host backend so both draw the same
// numbers for the same key and global index. This file depends on nothing
// else of the backend: tests/gpu/test_rng_device.cu compiles it alone.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/backend.hpp"
#include "core/dtype.hpp"
#include "core/rng.hpp"
#include "kernels/launch.hpp"

namespace dion {

namespace {

// The Philox blocks (four elements each) that cover `cols` consecutive
// elements starting anywhere: at most (cols + 2) / 4 + 1.
__host__ __device__ inline int64_t blocks_per_row(int64_t cols) { return (cols + 2) / 4 + 1; }

// grid.y walks the matrices, x their Philox blocks (both grid-stride): row r
// of a matrix is the global elements [s, s + cols), s = (row0 + r) *
// global_cols + col0, covered by at most gpr = (cols + 2) / 4 + 1 blocks
// from s / 4 on (philox_normal4: block g holds elements 4 g .. 4 g + 3);
// each thread draws one block and writes those of its four normals that lie
// in the row. The key's tensor and step may come from device memory, so a
// captured graph replayed at a later step draws that step's numbers. T:
// float, or uint16_t for bf16 (the float value rounded as store rounds it).
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(uint16_t* p, float v) { *p = float_to_bf16(v); }

template <class T>
__global__ void randn_kernel(T* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                             int64_t global_cols, PhiloxKey key, const TensorEntry* tensors, const int64_t* step,
                             float scale) {
  const int64_t gpr = blocks_per_row(cols), work = rows * gpr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // (row, block) of work item i advance by (stride / gpr, stride % gpr) per
  // iteration: one division per thread instead of one per item.
  const int64_t sr = stride / gpr, sj = stride % gpr;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    PhiloxKey k = key;
    if (tensors) k.tensor = tensors[b].tensor_id;
    if (step) k.step = static_cast<uint64_t>(*step);
    T* o = out + b * rows * cols;
    int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    int64_t r = i / gpr, j = i % gpr;
    for (; i < work; i += stride) {
      const int64_t s = (row0 + r) * global_cols + col0, e = s + cols, g = (s >> 2) + j;
      if (4 * g < e) {
        float z[4];
        philox_normal4(k, static_cast<uint64_t>(g), z);
        T* row = o + r * cols - s;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int64_t idx = 4 * g + q;
          if (idx >= s && idx < e) put(row + idx, scale * z[q]);
        }
      }
      r += sr;
      j += sj;
      if (j >= gpr) {
        j -= gpr;
        ++r;
      }
    }
  }
}

}  // namespace

namespace kernels {

template <class T>
cudaError_t randn_t(cudaStream_t stream, T* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0,
                    int64_t col0, int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors,
                    const int64_t* step, float scale) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t work = rows * blocks_per_row(cols);  // Philox blocks per matrix (randn_kernel)
  // About 4096 blocks in all (enough to fill any current GPU several times
  // over), each thread then stepping through its Philox blocks of the matrices.
  const int64_t gy = std::min<int64_t>(batch, 65535);
  const int64_t gx = std::min<int64_t>((work + threads - 1) / threads, std::max<int64_t>(1, 4096 / gy));
  randn_kernel<T><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), threads, 0, stream>>>(
      out, batch, rows, cols, row0, col0, global_cols, key, tensors, step, scale);
  return cudaGetLastError();
}

cudaError_t randn(cudaStream_t stream, float* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0,
                  int64_t col0, int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors,
                  const int64_t* step, float scale) {
  return randn_t(stream, out, batch, rows, cols, row0, col0, global_cols, key, tensors, step, scale);
}

cudaError_t randn_bf16(cudaStream_t stream, void* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0,
                       int64_t col0, int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors,
                       const int64_t* step, float scale) {
  return randn_t(stream, static_cast<uint16_t*>(out), batch, rows, cols, row0, col0, global_cols, key, tensors, step,
                 scale);
}

}  // namespace kernels

// The single-matrix form used by tests/gpu/test_rng_device.cu.
cudaError_t launch_randn(float* out, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t global_cols,
                         const PhiloxKey& key, float scale, cudaStream_t stream) {
  return kernels::randn(stream, out, 1, rows, cols, row0, col0, global_cols, key, nullptr, nullptr, scale);
}

}  // namespace dion

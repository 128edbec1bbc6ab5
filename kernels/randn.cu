// SPDX-License-Identifier: MIT
// Normal random matrices from the counter-based generator of core/rng.hpp,
// whose philox_normal is shared with the host backend so both draw the same
// numbers for the same key and global index. This file depends on nothing
// else of the backend: tests/gpu/test_rng_device.cu compiles it alone.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/backend.hpp"
#include "core/rng.hpp"
#include "kernels/launch.hpp"

namespace dion {

namespace {

// grid.y walks the matrices, x their elements (both grid-stride). The key's
// tensor and step may come from device memory, so a captured graph replayed
// at a later step draws that step's numbers.
__global__ void randn_kernel(float* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                             int64_t global_cols, PhiloxKey key, const TensorEntry* tensors, const int64_t* step,
                             float scale) {
  const int64_t per = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // (row, col) of element i advance by (stride / cols, stride % cols) per
  // iteration: one division per thread instead of one per element.
  const int64_t sr = stride / cols, sc = stride % cols;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    PhiloxKey k = key;
    if (tensors) k.tensor = tensors[b].tensor_id;
    if (step) k.step = static_cast<uint64_t>(*step);
    float* o = out + b * per;
    int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    int64_t r = i / cols, c = i % cols;
    for (; i < per; i += stride) {
      o[i] = scale * philox_normal(k, static_cast<uint64_t>((row0 + r) * global_cols + col0 + c));
      r += sr;
      c += sc;
      if (c >= cols) {
        c -= cols;
        ++r;
      }
    }
  }
}

}  // namespace

namespace kernels {

cudaError_t randn(cudaStream_t stream, float* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0,
                  int64_t col0, int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors,
                  const int64_t* step, float scale) {
  const int64_t per = rows * cols;
  if (batch <= 0 || per <= 0) return cudaSuccess;
  const int threads = 256;
  // About 4096 blocks in all (enough to fill any current GPU several times
  // over), each thread then stepping through its elements of the matrices.
  const int64_t gy = std::min<int64_t>(batch, 65535);
  const int64_t gx = std::min<int64_t>((per + threads - 1) / threads, std::max<int64_t>(1, 4096 / gy));
  randn_kernel<<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), threads, 0, stream>>>(
      out, batch, rows, cols, row0, col0, global_cols, key, tensors, step, scale);
  return cudaGetLastError();
}

}  // namespace kernels

// The single-matrix form used by tests/gpu/test_rng_device.cu.
cudaError_t launch_randn(float* out, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t global_cols,
                         const PhiloxKey& key, float scale, cudaStream_t stream) {
  return kernels::randn(stream, out, 1, rows, cols, row0, col0, global_cols, key, nullptr, nullptr, scale);
}

}  // namespace dion

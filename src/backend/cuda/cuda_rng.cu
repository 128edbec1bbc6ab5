// SPDX-License-Identifier: MIT
// The CUDA side of the counter-based generator (src/core/rng.hpp). The CUDA
// backend proper (cuBLAS/cuSOLVER drivers, fused kernels) is not implemented
// yet; this file keeps the shared host/device code compiling with nvcc so the
// two backends cannot drift apart.
#include <cuda_runtime.h>

#include "core/rng.hpp"

namespace dion {

__global__ void randn_kernel(float* out, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t global_cols,
                             PhiloxKey key, float scale) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * cols) return;
  int64_t r = i / cols, c = i % cols;
  out[i] = scale * philox_normal(key, static_cast<uint64_t>((row0 + r) * global_cols + col0 + c));
}

cudaError_t launch_randn(float* out, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t global_cols,
                         const PhiloxKey& key, float scale, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>((n + threads - 1) / threads);
  randn_kernel<<<blocks, threads, 0, stream>>>(out, rows, cols, row0, col0, global_cols, key, scale);
  return cudaGetLastError();
}

}  // namespace dion

// SPDX-License-Identifier: MIT
// The counter-based generator must give the same numbers on the host and on
// the GPU (DESIGN.md §4): Dion's initial Q and RCQR sketches are drawn by
// whichever backend runs, and sharded runs are compared with single-device
// runs. Needs a CUDA device (label gpu); skipped without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/rng.hpp"

namespace dion {
cudaError_t launch_randn(float* out, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t global_cols,
                         const PhiloxKey& key, float scale, cudaStream_t stream);
}

namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

TEST(Rng_Device, MatchesHostBitForBit) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  // The second shape has more elements than the kernel has threads (4096
  // blocks of 256), so each thread steps through several (row, col).
  struct Window {
    int64_t rows, cols, row0, col0, gcols;
  };
  const dion::PhiloxKey keys[] = {{0, dion::kRngInitQ, 0, 0}, {12345678901ull, dion::kRngSketch, 17, 42},
                                  {~0ull, dion::kRngSketch | (2u << 8), 4000000000u, 1ull << 40}};
  for (const Window& w : {Window{777, 513, 5, 9, 1031}, Window{1201, 1297, 3, 0, 1300}})
  for (const auto& key : keys) {
    const int64_t rows = w.rows, cols = w.cols, row0 = w.row0, col0 = w.col0, gcols = w.gcols;
    float* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, sizeof(float) * rows * cols), cudaSuccess);
    ASSERT_EQ(dion::launch_randn(d, rows, cols, row0, col0, gcols, key, 0.5f, nullptr), cudaSuccess);
    std::vector<float> dev(rows * cols), host(rows * cols);
    ASSERT_EQ(cudaMemcpy(dev.data(), d, sizeof(float) * rows * cols, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(d);
    int64_t mismatches = 0, bits_off = 0;
    double sum = 0, sum2 = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float h = 0.5f * dion::philox_normal(key, static_cast<uint64_t>((row0 + i) * gcols + col0 + j));
        host[i * cols + j] = h;
        const float g = dev[i * cols + j];
        if (std::memcmp(&h, &g, 4) != 0) {
          ++mismatches;
          uint32_t a, b;
          std::memcpy(&a, &h, 4);
          std::memcpy(&b, &g, 4);
          bits_off = std::max<int64_t>(bits_off, a > b ? a - b : b - a);
        }
        sum += g;
        sum2 += static_cast<double>(g) * g;
      }
    // The normals are IEEE float operations only (no libm; the device code is
    // built with -fmad=false): the same bits on both sides.
    EXPECT_EQ(mismatches, 0) << mismatches << " of " << rows * cols << " differ, by up to " << bits_off << " ulp";
    // And they are N(0, 0.25): mean ~ 0, variance ~ 0.25 (n = 4e5: 5-sigma bounds).
    const double n = static_cast<double>(rows * cols);
    EXPECT_NEAR(sum / n, 0.0, 5 * 0.5 / std::sqrt(n));
    EXPECT_NEAR(sum2 / n, 0.25, 5 * 0.25 * std::sqrt(2.0 / n));
    std::printf("key stream %u: %lld of %lld elements differ (max %lld ulp)\n", key.stream,
                static_cast<long long>(mismatches), static_cast<long long>(rows * cols), static_cast<long long>(bits_off));
  }
}

}  // namespace

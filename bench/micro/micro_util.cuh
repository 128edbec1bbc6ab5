// SPDX-License-Identifier: MIT
// What the single-file micro-benchmarks of bench/micro share: a checked-call
// macro, a cuBLAS handle on its own stream with a workspace, a median timer
// (CUDA events, warm-up first) and a deterministic bf16 fill.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                   \
  do {                                                          \
    auto e_ = (x);                                              \
    if ((int)e_) {                                              \
      printf("err %d at %s:%d\n", (int)e_, __FILE__, __LINE__); \
      exit(1);                                                  \
    }                                                           \
  } while (0)

// Uniform values in [-0.05, 0.05) from a hash of the index: the same on every run.
__device__ __forceinline__ float micro_uniform(long i, uint32_t seed) {
  uint32_t h = (uint32_t)i * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return ((h & 0xffff) / 65536.0f - 0.5f) * 0.1f;
}
__global__ void fill_bf16(__nv_bfloat16* p, long n, uint32_t seed) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(micro_uniform(i, seed));
}
__global__ void fill_f32(float* p, long n, uint32_t seed) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    p[i] = micro_uniform(i, seed);
}

struct MicroRig {
  cublasHandle_t h;
  cudaStream_t st;
  void* ws;
  size_t wsz;
  cudaEvent_t e0, e1;
  explicit MicroRig(size_t workspace_bytes) : wsz(workspace_bytes) {
    CK(cublasCreate(&h));
    CK(cudaStreamCreate(&st));
    CK(cublasSetStream(h, st));
    CK(cudaMalloc(&ws, wsz));
    CK(cublasSetWorkspace(h, ws, wsz));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
  }
  // One timing (ms) of fn() on st, no warm-up: a quick screen before median_ms.
  template <class F>
  float once_ms(F&& fn) {
    CK(cudaEventRecord(e0, st));
    fn();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  }
  // The median of `reps` timings (ms) of fn() on st, after 3 untimed calls.
  template <class F>
  float median_ms(F&& fn, int reps) {
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) t.push_back(once_ms(fn));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures): time the P = B Q GEMMs of gpt-1.3b Dion bf16.
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o dion_products bench/micro/dion_products.cu -lcublas && ./dion_products
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#define CK(x) do { auto e = (x); if ((int)e) { printf("err %d at %s:%d\n", (int)e, __FILE__, __LINE__); return 1; } } while (0)
int main() {
  cublasHandle_t h; CK(cublasCreate(&h));
  cudaStream_t st; cudaStreamCreate(&st); cublasSetStream(h, st);
  const int r = 512, batch = 24;
  size_t maxab = 8192L * 2048;
  float *M, *Q, *P; CK(cudaMalloc(&M, 4 * maxab * batch)); CK(cudaMalloc(&Q, 4L * 8192 * r * batch)); CK(cudaMalloc(&P, 4L * 8192 * r * batch));
  __nv_bfloat16 *Mb, *Qb; CK(cudaMalloc(&Mb, 2 * maxab * batch)); CK(cudaMalloc(&Qb, 2L * 8192 * r * batch));
  cudaMemset(M, 0, 4 * maxab * batch); cudaMemset(Q, 0, 4L * 8192 * r * batch); cudaMemset(Mb, 0, 2 * maxab * batch); cudaMemset(Qb, 0, 2L*8192*r*batch);
  void* ws; size_t wsz = 256u << 20; CK(cudaMalloc(&ws, wsz));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  int shapes[][2] = {{6144, 2048}, {8192, 2048}, {2048, 2048}, {2048, 8192}, {4096, 2048}, {6144, 1024}};
  for (auto& sh : shapes) {
    const int a = sh[0], b = sh[1];
    for (int variant = 0; variant < 6; ++variant) {
      size_t wsb = variant == 1 ? (256u << 20) : (32u << 20);
      CK(cublasSetWorkspace(h, ws, wsb));
      int chunks = variant == 2 ? 3 : variant == 3 ? 24 : 1;
      int per = batch / chunks;
      auto run = [&]() {
        for (int c = 0; c < chunks; ++c) {
          float one = 1, zero = 0;
          if (variant == 4)
            cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, r, a, b, &one, Qb + (size_t)c * per * b * r, CUDA_R_16BF, r, (long long)b * r,
                                       Mb + (size_t)c * per * a * b, CUDA_R_16BF, b, (long long)a * b, &zero, P + (size_t)c * per * a * r, CUDA_R_32F, r, (long long)a * r, per,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          else
            cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, r, a, b, &one, Q + (size_t)c * per * b * r, CUDA_R_32F, r, (long long)b * r,
                                       M + (size_t)c * per * a * b, CUDA_R_32F, b, (long long)a * b, &zero, P + (size_t)c * per * a * r, CUDA_R_32F, r, (long long)a * r, per,
                                       variant == 5 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT);
        }
      };
      for (int i = 0; i < 3; ++i) run();
      std::vector<float> t;
      for (int i = 0; i < 15; ++i) { cudaEventRecord(e0, st); run(); cudaEventRecord(e1, st); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms); }
      std::sort(t.begin(), t.end());
      double tf = 2.0 * a * b * r * batch / (t[7] * 1e-3) / 1e12;
      const char* names[] = {"fast16bf ws32", "fast16bf ws256", "fast16bf 3 chunks", "fast16bf per matrix", "bf16 inputs", "tf32"};
      printf("a=%5d b=%5d %-20s %7.3f ms  %6.1f TFLOP/s\n", a, b, names[variant], t[7], tf);
    }
  }
  return 0;
}

// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures): per-call cost of the small batched factorizations of Dion's RCQR.
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o factorizations bench/micro/factorizations.cu -lcublas -lcusolver && ./factorizations
#include <cublas_v2.h>
#include <cusolverDn.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <functional>
#define CK(x) do { auto e = (x); if ((int)e) { printf("err %d at %s:%d\n", (int)e, __FILE__, __LINE__); exit(1); } } while (0)
__global__ void spd(float* a, int n, int batch) {  // a = I*n + small symmetric
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x; if (i >= (long)n * n * batch) return;
  int e = i % (n * n), r = e / n, c = e % n;
  a[i] = (r == c ? n : 0) + 0.5f * __sinf((float)(r + c) + (float)(i / (n * n)));
}
__global__ void spdd(double* a, int n, int batch) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x; if (i >= (long)n * n * batch) return;
  int e = i % (n * n), r = e / n, c = e % n;
  a[i] = (r == c ? n : 0) + 0.5 * sin((double)(r + c) + (double)(i / (n * n)));
}
__global__ void fillp(void** p, char* base, long stride, int b) { int i = threadIdx.x + blockIdx.x * blockDim.x; if (i < b) p[i] = base + stride * i; }
cudaStream_t st; cudaEvent_t e0, e1;
float timeit(std::function<void()> f, std::function<void()> reset = nullptr) {
  for (int i = 0; i < 3; ++i) { if (reset) reset(); f(); }
  std::vector<float> t;
  for (int i = 0; i < 15; ++i) { if (reset) reset(); cudaEventRecord(e0, st); f(); cudaEventRecord(e1, st); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms); }
  std::sort(t.begin(), t.end()); return t[7];
}
int main() {
  cublasHandle_t h; CK(cublasCreate(&h)); cusolverDnHandle_t s; CK(cusolverDnCreate(&s));
  cudaStreamCreate(&st); cublasSetStream(h, st); cusolverDnSetStream(s, st);
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  const int n = 512, B = 96;
  float *A, *A0, *X, *Y; double *D, *D0;
  CK(cudaMalloc(&A, 4L * n * n * B)); CK(cudaMalloc(&A0, 4L * n * n * B)); CK(cudaMalloc(&X, 4L * 8192 * n * 24)); CK(cudaMalloc(&Y, 4L * 8192 * n * 24));
  CK(cudaMalloc(&D, 8L * n * n * B)); CK(cudaMalloc(&D0, 8L * n * n * B));
  cudaMemset(X, 0, 4L * 8192 * n * 24);
  spd<<<(n * n * B + 255) / 256, 256, 0, st>>>(A0, n, B); spdd<<<(n * n * B + 255) / 256, 256, 0, st>>>(D0, n, B);
  void** pa; void** pb; int* info; CK(cudaMalloc(&pa, 8 * 4096)); CK(cudaMalloc(&pb, 8 * 4096)); CK(cudaMalloc(&info, 4 * 4096));
  for (int b : {24, 48, 96}) {
    auto rs = [&] { cudaMemcpyAsync(A, A0, 4L * n * n * b, cudaMemcpyDeviceToDevice, st); };
    auto rd = [&] { cudaMemcpyAsync(D, D0, 8L * n * n * b, cudaMemcpyDeviceToDevice, st); };
    float tr = timeit(rs), tdr = timeit(rd);
    fillp<<<1, 128, 0, st>>>(pa, (char*)A, 4L * n * n, b);
    float ts = timeit([&] { cusolverDnSpotrfBatched(s, CUBLAS_FILL_MODE_LOWER, n, (float**)pa, n, info, b); }, rs) - tr;
    fillp<<<1, 128, 0, st>>>(pb, (char*)D, 8L * n * n, b);
    float td = timeit([&] { cusolverDnDpotrfBatched(s, CUBLAS_FILL_MODE_LOWER, n, (double**)pb, n, info, b); }, rd) - tdr;
    printf("n=%d batch=%d: SpotrfBatched %.3f ms  DpotrfBatched %.3f ms\n", n, b, ts, td);
    // inverse of a lower-triangular (the factor) by trsmBatched against I: solve L X = I (X in Y)
    fillp<<<1, 128, 0, st>>>(pb, (char*)Y, 4L * n * n, b);
    float one = 1;
    float ti = timeit([&] { cublasStrsmBatched(h, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, n, n, &one, (float**)pa, n, (float**)pb, n, b); });
    printf("  StrsmBatched n=%d nrhs=%d (inverse) %.3f ms\n", n, n, ti);
  }
  // loop of single blocked potrf (fp64, fp32)
  {
    int lw; size_t dws, hws; cusolverDnParams_t prm; cusolverDnCreateParams(&prm);
    CK(cusolverDnXpotrf_bufferSize(s, prm, CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, D, n, CUDA_R_64F, &dws, &hws));
    void* dw; CK(cudaMalloc(&dw, dws + 1)); std::vector<char> hw(hws + 1);
    auto rd = [&] { cudaMemcpyAsync(D, D0, 8L * n * n * 24, cudaMemcpyDeviceToDevice, st); };
    float tdr = timeit(rd);
    float t1 = timeit([&] { cusolverDnXpotrf(s, prm, CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, D, n, CUDA_R_64F, dw, dws, hw.data(), hws, info); }, rd) - tdr;
    float t24 = timeit([&] { for (int i = 0; i < 24; ++i) cusolverDnXpotrf(s, prm, CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, D + (long)i * n * n, n, CUDA_R_64F, dw, dws, hw.data(), hws, info + i); }, rd) - tdr;
    printf("Xpotrf fp64 n=%d one: %.3f ms, loop of 24: %.3f ms\n", n, t1, t24);
    (void)lw;
  }
  // GEMM latencies of the recursion (fp32) and the Gram (fp64)
  for (int m : {64, 128, 256, 512}) {
    float one = 1, zero = 0;
    float t = timeit([&] { cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &one, A, n, n * n, A0, n, n * n, &zero, Y, n, n * n, 24); });
    printf("SgemmStridedBatched %dx%dx%d batch 24 (ld 512): %.3f ms\n", m, m, m, t);
  }
  { double one = 1, zero = 0;
    float t = timeit([&] { cublasDgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, n, n, 640, &one, D0, n, 640L * n, D0, n, 640L * n, &zero, D, n, n * n, 24); });
    printf("Dgemm Gram 512x512x640 batch 24: %.3f ms\n", t); }
  // strsmBatched leaf 64
  { float one = 1; fillp<<<1, 128, 0, st>>>(pa, (char*)A, 4L * n * n, 24); fillp<<<1, 128, 0, st>>>(pb, (char*)Y, 4L * n * n, 24);
    float t = timeit([&] { cublasStrsmBatched(h, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, 64, 64, &one, (float**)pa, n, (float**)pb, n, 24); });
    printf("StrsmBatched 64x64 batch 24: %.3f ms\n", t); }
  // tall products with the inverse at TF32 and fp32
  for (int rows : {2048, 6144, 8192}) {
    float one = 1, zero = 0;
    for (int tf : {0, 1}) {
      cublasSetMathMode(h, tf ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH);
      float t = timeit([&] { cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, n, rows, n, &one, A, n, n * n, X, n, (long)rows * n, &zero, Y, n, (long)rows * n, 24); });
      float tc = timeit([&] { cudaMemcpyAsync(X, Y, 4L * rows * n * 24, cudaMemcpyDeviceToDevice, st); });
      printf("tall %d x 512 x 512 batch 24 %s: %.3f ms (copy back %.3f ms)\n", rows, tf ? "tf32" : "fp32", t, tc);
    }
    cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
  }
  // Householder QR of RCQR's sketch S P (k x r = 640 x 512, fp32) by cuBLAS's
  // batched geqrf, a candidate for qr_r (whose R comes from an fp64 Gram
  // matrix, DGEMM, and DpotrfBatched): Householder QR needs no fp64 for an
  // ill-conditioned sketch. Measured on an H100 (docs/benchmarks.md): 358 ms
  // for 24 and 551 ms for 96 (cuBLAS's batched QR is meant for small
  // matrices), against about 0.85 ms for qr_r's path: not a candidate.
  {
    const int k = 640;
    float *Q, *Q0, *tau;
    CK(cudaMalloc(&Q, 4L * k * n * B)); CK(cudaMalloc(&Q0, 4L * k * n * B)); CK(cudaMalloc(&tau, 4L * n * B));
    spd<<<(k * n * B + 255) / 256, 256, 0, st>>>(Q0, n, (k * B) / n);  // any full-rank fill
    for (int b : {24, 96}) {
      auto rq = [&] { cudaMemcpyAsync(Q, Q0, 4L * k * n * b, cudaMemcpyDeviceToDevice, st); };
      const float tq = timeit(rq);
      fillp<<<1, 128, 0, st>>>(pa, (char*)Q, 4L * k * n, b);
      fillp<<<1, 128, 0, st>>>(pb, (char*)tau, 4L * n, b);
      int hinfo = 0;
      const float t = timeit([&] { cublasSgeqrfBatched(h, k, n, (float**)pa, k, (float**)pb, &hinfo, b); }, rq) - tq;
      printf("SgeqrfBatched %d x %d batch %d: %.3f ms (info %d)\n", k, n, b, t, hinfo);
    }
  }
  return 0;
}

// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// the TF32 products of Dion's step (gpt-1.3b, rank 512, 24 matrices) under
// every storage order. The math is C (M x N) = A (M x K) B (K x N) (+ C);
// each of A, B, C may be stored row- or column-major, 8 variants, the same
// FLOPs and bytes. For each: cublasGemmStridedBatchedEx (CUBLAS_GEMM_DEFAULT,
// CUBLAS_COMPUTE_32F_FAST_TF32) and the fastest of cuBLASLt's first 16
// heuristic algorithms. TF/s of the faster. A square 8192^3 product gives the
// device's TF32 rate for scale.
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o tf32_layouts bench/micro/tf32_layouts.cu -lcublasLt -lcublas && ./tf32_layouts
#include "micro_lt.cuh"

struct Case {
  const char* name;
  int m, n, k, batch;
  float beta;
};

int main(int argc, char** argv) {
  const cublasComputeType_t compute = argc > 1 && argv[1][0] == 's' ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
  MicroRig rig(64u << 20);
  cublasHandle_t h = rig.h;
  cudaStream_t st = rig.st;
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  const Case cases[] = {
      {"square 8192^3", 8192, 8192, 8192, 1, 0.0f},
      {"P = B Q, B 8192x2048", 8192, 512, 2048, 24, 0.0f},
      {"R = B^T P, B 8192x2048", 2048, 512, 8192, 24, 0.0f},
      {"P = B Q, B 6144x2048", 6144, 512, 2048, 24, 0.0f},
      {"ef C 8192x2048 r512", 8192, 2048, 512, 24, 1.0f},
      {"ef C 2048x8192 r512", 2048, 8192, 512, 24, 1.0f},
      {"solve 8192x512 r512", 8192, 512, 512, 24, 0.0f},
      {"sketch 640x512 k8192", 640, 512, 8192, 24, 0.0f},
  };
  printf("%s\n", compute == CUBLAS_COMPUTE_32F ? "SGEMM (CUBLAS_COMPUTE_32F)" : "TF32 (CUBLAS_COMPUTE_32F_FAST_TF32)");
  printf("%-26s %-5s %9s %9s %8s\n", "case", "A B C", "default", "lt best", "TF/s");
  for (const Case& c : cases) {
    const long sa = (long)c.m * c.k, sb = (long)c.k * c.n, sc = (long)c.m * c.n;
    float *A, *B, *C;
    CK(cudaMalloc(&A, 4 * sa * c.batch));
    CK(cudaMalloc(&B, 4 * sb * c.batch));
    CK(cudaMalloc(&C, 4 * sc * c.batch));
    CK(cudaMemsetAsync(A, 0, 4 * sa * c.batch, st));
    CK(cudaMemsetAsync(B, 0, 4 * sb * c.batch, st));
    CK(cudaMemsetAsync(C, 0, 4 * sc * c.batch, st));
    const float one = 1.f;
    for (int v = 0; v < 8; ++v) {
      const bool a_rm = v & 4, b_rm = v & 2, c_rm = v & 1;
      // column-major call: X (MM x NN) = op(P1) op(P2)
      int MM, NN;
      const float *P1, *P2;
      cublasOperation_t o1, o2;
      int ld1, ld2;
      long s1, s2;
      if (!c_rm) {  // C col-major: C = A B
        MM = c.m, NN = c.n, P1 = A, P2 = B, s1 = sa, s2 = sb;
        o1 = a_rm ? CUBLAS_OP_T : CUBLAS_OP_N, ld1 = a_rm ? c.k : c.m;
        o2 = b_rm ? CUBLAS_OP_T : CUBLAS_OP_N, ld2 = b_rm ? c.n : c.k;
      } else {  // C row-major: C^T = B^T A^T
        MM = c.n, NN = c.m, P1 = B, P2 = A, s1 = sb, s2 = sa;
        o1 = b_rm ? CUBLAS_OP_N : CUBLAS_OP_T, ld1 = b_rm ? c.n : c.k;
        o2 = a_rm ? CUBLAS_OP_N : CUBLAS_OP_T, ld2 = a_rm ? c.k : c.m;
      }
      auto time_it = [&](auto&& fn) { return rig.median_ms(fn, 9); };
      const float t_def = time_it([&] {
        CK(cublasGemmStridedBatchedEx(h, o1, o2, MM, NN, c.k, &one, P1, CUDA_R_32F, ld1, s1, P2, CUDA_R_32F, ld2, s2,
                                      &c.beta, C, CUDA_R_32F, MM, sc, c.batch, compute, CUBLAS_GEMM_DEFAULT));
      });
      cublasLtMatmulDesc_t desc = lt_desc(compute, o1, o2);
      cublasLtMatrixLayout_t l1 = lt_layout(CUDA_R_32F, o1 == CUBLAS_OP_N ? MM : c.k, o1 == CUBLAS_OP_N ? c.k : MM, ld1,
                                            c.batch, s1);
      cublasLtMatrixLayout_t l2 = lt_layout(CUDA_R_32F, o2 == CUBLAS_OP_N ? c.k : NN, o2 == CUBLAS_OP_N ? NN : c.k, ld2,
                                            c.batch, s2);
      cublasLtMatrixLayout_t lc = lt_layout(CUDA_R_32F, MM, NN, MM, c.batch, sc);
      const float best = lt_time_algos(rig, lt, desc, l1, l2, lc, 16, 9, [&](const cublasLtMatmulAlgo_t* algo) {
                           return cublasLtMatmul(lt, desc, &one, P1, l1, P2, l2, &c.beta, C, lc, C, lc, algo, rig.ws,
                                                 rig.wsz, st);
                         }).best;
      const double tf = 2.0 * c.m * c.n * (double)c.k * c.batch / (std::min(best, t_def) * 1e-3) / 1e12;
      printf("%-26s %c %c %c %9.3f %9.3f %8.1f\n", c.name, a_rm ? 'r' : 'c', b_rm ? 'r' : 'c', c_rm ? 'r' : 'c', t_def,
             best, tf);
      cublasLtMatrixLayoutDestroy(l1);
      cublasLtMatrixLayoutDestroy(l2);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(desc);
      if (c.batch == 1 && v == 0) break;  // the square: one layout
    }
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(C));
  }
  printf("ms, median of 9, whole batch; r/c: row-/column-major storage of A, B, C\n");
  return 0;
}

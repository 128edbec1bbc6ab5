// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// would choosing among cuBLASLt's algorithms beat cuBLAS's default choice for
// the bf16 products of Dion's and Muon's steps? For each shape: the time of
// cublasGemmStridedBatchedEx (CUBLAS_GEMM_DEFAULT), of cublasLtMatmul with
// the heuristic's first algorithm, and of the fastest of its first 32.
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o lt_algos bench/micro/lt_algos.cu -lcublasLt -lcublas && ./lt_algos
#include "micro_lt.cuh"

struct Case {
  const char* name;
  int m, n, k, batch;
  bool ta, tb;
  bool c_bf16;
  float beta;
};

int main() {
  MicroRig rig(32u << 20);
  cublasHandle_t h = rig.h;
  cudaStream_t st = rig.st;
  void* ws = rig.ws;
  const size_t wsz = rig.wsz;
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  const Case cases[] = {
      {"dion ef bf16 C 8192x2048 r512", 2048, 8192, 512, 24, false, true, true, 1.0f},
      {"dion ef bf16 C 6144x2048 r512", 2048, 6144, 512, 24, false, true, true, 1.0f},
      {"dion ef bf16 C 2048x2048 r512", 2048, 2048, 512, 24, false, true, true, 1.0f},
      {"dion P=BQ f32 C 8192x2048", 512, 8192, 2048, 24, false, false, false, 0.0f},
      {"dion R=B^TP f32 C 8192x2048", 512, 2048, 8192, 24, false, true, false, 0.0f},
      {"muon160 gram 768 k3072", 768, 768, 3072, 12, true, false, true, 0.0f},
      {"muon160 A^2 768", 768, 768, 768, 12, false, false, true, 1.0f},
      {"muon160 BX 3072x768", 3072, 768, 768, 12, false, false, true, 1.0f},
      {"muon160 gram 768 k2304", 768, 768, 2304, 12, true, false, true, 0.0f},
      {"muon1.3b gram 2048 k8192", 2048, 2048, 8192, 24, true, false, true, 0.0f},
      {"muon1.3b BX 8192x2048", 8192, 2048, 2048, 24, false, false, true, 1.0f},
      {"muon1.3b A^2 2048", 2048, 2048, 2048, 24, false, false, true, 1.0f},
  };
  printf("%-32s %9s %9s %9s %5s %8s\n", "case", "default", "lt #0", "lt best", "idx", "TF/s");
  for (const Case& c : cases) {
    const long sa = (long)c.m * c.k, sb = (long)c.k * c.n, sc = (long)c.m * c.n;
    __nv_bfloat16 *A, *B;
    void* C;
    CK(cudaMalloc(&A, 2 * sa * c.batch));
    CK(cudaMalloc(&B, 2 * sb * c.batch));
    CK(cudaMalloc(&C, (c.c_bf16 ? 2 : 4) * sc * c.batch));
    fill_bf16<<<1024, 256, 0, st>>>(A, sa * c.batch, 1);
    fill_bf16<<<1024, 256, 0, st>>>(B, sb * c.batch, 2);
    CK(cudaMemsetAsync(C, 0, (c.c_bf16 ? 2 : 4) * sc * c.batch, st));
    const int lda = c.ta ? c.k : c.m, ldb = c.tb ? c.n : c.k;
    const cudaDataType_t ct = c.c_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const float one = 1.f;
    auto time_it = [&](auto&& fn) { return rig.median_ms(fn, 11); };
    const float t_def = time_it([&] {
      CK(cublasGemmStridedBatchedEx(h, c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, c.m, c.n,
                                    c.k, &one, A, CUDA_R_16BF, lda, sa, B, CUDA_R_16BF, ldb, sb, &c.beta, C, ct, c.m,
                                    sc, c.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    cublasLtMatmulDesc_t desc =
        lt_desc(CUBLAS_COMPUTE_32F, c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, c.tb ? CUBLAS_OP_T : CUBLAS_OP_N);
    cublasLtMatrixLayout_t la = lt_layout(CUDA_R_16BF, c.ta ? c.k : c.m, c.ta ? c.m : c.k, lda, c.batch, sa);
    cublasLtMatrixLayout_t lb = lt_layout(CUDA_R_16BF, c.tb ? c.n : c.k, c.tb ? c.k : c.n, ldb, c.batch, sb);
    cublasLtMatrixLayout_t lc = lt_layout(ct, c.m, c.n, c.m, c.batch, sc);
    const LtTiming lt_t = lt_time_algos(rig, lt, desc, la, lb, lc, 32, 11, [&](const cublasLtMatmulAlgo_t* algo) {
      return cublasLtMatmul(lt, desc, &one, A, la, B, lb, &c.beta, C, lc, C, lc, algo, ws, wsz, st);
    });
    const float t0 = lt_t.first, best = lt_t.best;
    const int bi = lt_t.best_index, nres = lt_t.count;
    const double tf = 2.0 * c.m * c.n * (double)c.k * c.batch / (std::min(best, t_def) * 1e-3) / 1e12;
    printf("%-32s %9.3f %9.3f %9.3f %2d/%-2d %8.1f\n", c.name, t_def, t0, best, bi, nres, tf);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
  }
  printf("ms, median of 11, whole batch\n");
  return 0;
}

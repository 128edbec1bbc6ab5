// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// Dion's large products at every matmul precision (fp32 SIMT, TF32, bf16),
// at the gpt-1.3b (rank 512, 24 matrices) and gpt-160m (rank 192, 12)
// shapes, as strided batches:
//   ef    C += P R^T (C row-major a x b, the error feedback / update)
//   P=BQ  P = B Q   (B row-major a x b, Q b x r)
//   R=BtP R = B^T P
// For each: cuBLAS's default algorithm, cuBLASLt's heuristic first and the
// fastest of its first 32 (ms for the batch); for ef also beta = 0 (no C
// read) and two products into two C's on one stream against two streams
// (the error feedback and the update are independent once Q is separate).
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o lowrank_algos bench/micro/lowrank_algos.cu -lcublasLt -lcublas && ./lowrank_algos
#include "micro_lt.cuh"

struct Shape {
  int a, b, r, batch;
};

int main() {
  MicroRig rig(32u << 20);
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  cudaStream_t st2;
  CK(cudaStreamCreateWithFlags(&st2, cudaStreamNonBlocking));
  cublasHandle_t h2;
  CK(cublasCreate(&h2));
  CK(cublasSetStream(h2, st2));
  void* ws2;
  CK(cudaMalloc(&ws2, rig.wsz));
  CK(cublasSetWorkspace(h2, ws2, rig.wsz));
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  const Shape shapes[] = {{8192, 2048, 512, 24}, {2048, 8192, 512, 24}, {6144, 2048, 512, 24}, {2048, 2048, 512, 24},
                          {3072, 768, 192, 12},  {768, 3072, 192, 12},  {2304, 768, 192, 12},  {768, 768, 192, 12}};
  const char* prec_name[] = {"fp32", "tf32", "bf16"};
  printf("%-5s %-6s %-16s %8s %8s %8s %5s %7s | %8s %8s %8s\n", "prec", "kind", "a x b r", "default", "lt#0",
         "lt best", "idx", "TF/s", "beta0", "2 seq", "2 strm");
  for (int prec = 0; prec < 3; ++prec) {
    const bool bf = prec == 2;
    const size_t es = bf ? 2 : 4;
    const cudaDataType_t t = bf ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute = prec == 0 ? CUBLAS_COMPUTE_32F
                                        : prec == 1 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                    : CUBLAS_COMPUTE_32F;
    for (const Shape& s : shapes) {
      const long sB = (long)s.a * s.b, sP = (long)s.a * s.r, sR = (long)s.b * s.r;
      void *B, *B2, *P, *R;
      CK(cudaMalloc(&B, es * sB * s.batch));
      CK(cudaMalloc(&B2, es * sB * s.batch));
      CK(cudaMalloc(&P, es * sP * s.batch));
      CK(cudaMalloc(&R, es * sR * s.batch));
      CK(cudaMemset(B, 0, es * sB * s.batch));
      CK(cudaMemset(B2, 0, es * sB * s.batch));
      CK(cudaMemset(P, 0, es * sP * s.batch));
      CK(cudaMemset(R, 0, es * sR * s.batch));
      for (int kind = 0; kind < 3; ++kind) {
        // column-major m x n x k, operands, lds, strides, beta, output
        int m, n, k, lda, ldb, ldc;
        cublasOperation_t oa, ob;
        const void *A_, *B_;
        void* C_;
        long sa, sb, sc;
        float beta;
        const char* kn;
        if (kind == 0) {  // C^T (b x a) = R P^T
          kn = "ef";
          m = s.b, n = s.a, k = s.r, oa = CUBLAS_OP_T, ob = CUBLAS_OP_N, A_ = R, lda = s.r, sa = sR, B_ = P, ldb = s.r,
          sb = sP, C_ = B, ldc = s.b, sc = sB, beta = 1.f;
        } else if (kind == 1) {  // P^T (r x a) = Q^T B^T
          kn = "P=BQ";
          m = s.r, n = s.a, k = s.b, oa = CUBLAS_OP_N, ob = CUBLAS_OP_N, A_ = R, lda = s.r, sa = sR, B_ = B, ldb = s.b,
          sb = sB, C_ = P, ldc = s.r, sc = sP, beta = 0.f;
        } else {  // R^T (r x b) = P^T B
          kn = "R=BtP";
          m = s.r, n = s.b, k = s.a, oa = CUBLAS_OP_N, ob = CUBLAS_OP_T, A_ = P, lda = s.r, sa = sP, B_ = B, ldb = s.b,
          sb = sB, C_ = R, ldc = s.r, sc = sR, beta = 0.f;
        }
        const cudaDataType_t ct = t;
        const float one = 1.f, zero = 0.f;
        auto call = [&](cublasHandle_t hh, void* C, const float* bt) {
          CK(cublasGemmStridedBatchedEx(hh, oa, ob, m, n, k, &one, A_, t, lda, sa, B_, t, ldb, sb, bt, C, ct, ldc, sc,
                                        s.batch, compute, CUBLAS_GEMM_DEFAULT));
        };
        const float t_def = rig.median_ms([&] { call(rig.h, C_, &beta); }, 9);
        cublasLtMatmulDesc_t desc = lt_desc(compute, oa, ob);
        cublasLtMatrixLayout_t la = lt_layout(t, oa == CUBLAS_OP_N ? m : k, oa == CUBLAS_OP_N ? k : m, lda, s.batch, sa);
        cublasLtMatrixLayout_t lb = lt_layout(t, ob == CUBLAS_OP_N ? k : n, ob == CUBLAS_OP_N ? n : k, ldb, s.batch, sb);
        cublasLtMatrixLayout_t lc = lt_layout(ct, m, n, ldc, s.batch, sc);
        const LtTiming lt_t = lt_time_algos(rig, lt, desc, la, lb, lc, 32, 9, [&](const cublasLtMatmulAlgo_t* algo) {
          return cublasLtMatmul(lt, desc, &one, A_, la, B_, lb, &beta, C_, lc, C_, lc, algo, rig.ws, rig.wsz, rig.st);
        });
        const double tf = 2.0 * m * n * (double)k * s.batch / (std::min(lt_t.best, t_def) * 1e-3) / 1e12;
        printf("%-5s %-6s %5dx%-5d r%-4d %8.3f %8.3f %8.3f %2d/%-2d %7.1f", prec_name[prec], kn, s.a, s.b, s.r, t_def,
               lt_t.first, lt_t.best, lt_t.best_index, lt_t.count, tf);
        if (kind == 0) {
          const float t_b0 = rig.median_ms([&] { call(rig.h, C_, &zero); }, 9);
          const float t_seq = rig.median_ms(
              [&] {
                call(rig.h, B, &one);
                call(rig.h, B2, &one);
              },
              9);
          const float t_two = rig.median_ms(
              [&] {
                CK(cudaEventRecord(fork, rig.st));
                CK(cudaStreamWaitEvent(st2, fork, 0));
                call(rig.h, B, &one);
                call(h2, B2, &one);
                CK(cudaEventRecord(join, st2));
                CK(cudaStreamWaitEvent(rig.st, join, 0));
              },
              9);
          printf(" | %8.3f %8.3f %8.3f", t_b0, t_seq, t_two);
        }
        printf("\n");
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(desc);
      }
      CK(cudaFree(B));
      CK(cudaFree(B2));
      CK(cudaFree(P));
      CK(cudaFree(R));
    }
  }
  printf("ms, median of 9, whole batch; TF/s at the faster of default and lt best\n");
  return 0;
}

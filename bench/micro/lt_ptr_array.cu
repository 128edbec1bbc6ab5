// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// Dion's error feedback / update products (C += P R^T on 24 matrices, C row-
// major a x b, P a x r, R b x r, both row-major, as the library's
// lowrank_gemm passes them) as pointer-array batches: cublasGemmBatchedEx
// (CUBLAS_GEMM_DEFAULT) against cublasLtMatmul with
// CUBLASLT_BATCH_MODE_POINTER_ARRAY, its heuristic's first algorithm and the
// fastest of its first 16. TF32 (fp32 operands) and bf16 (bf16 operands and C).
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o lt_ptr_array bench/micro/lt_ptr_array.cu -lcublasLt -lcublas && ./lt_ptr_array
#include "micro_lt.cuh"

int main() {
  MicroRig rig(64u << 20);
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  const int shapes[][3] = {{8192, 2048, 512}, {2048, 8192, 512}, {6144, 2048, 512}, {2048, 2048, 512}};
  const int batch = 24;
  printf("%-24s %-5s %9s %9s %9s %6s\n", "C a x b, rank", "type", "cublas", "lt #0", "lt best", "idx");
  for (int bf = 0; bf < 2; ++bf)
    for (const auto& sh : shapes) {
      const int a = sh[0], b = sh[1], r = sh[2];
      const cudaDataType_t t = bf ? CUDA_R_16BF : CUDA_R_32F;
      LowrankPointers lp(a, b, r, batch, t, bf ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32);
      const float t_def = lp.cublas_ms(rig);
      const LtTiming lt_t = lt_time_algos(rig, lt, lp.desc, lp.l1, lp.l2, lp.lc, 16, 9,
                                          [&](const cublasLtMatmulAlgo_t* algo) { return lp.lt_matmul(lt, algo, rig); });
      const float t0 = lt_t.first, best = lt_t.best;
      const int bi = lt_t.best_index, nres = lt_t.count;
      printf("%5d x %-5d r %-8d %-5s %9.3f %9.3f %9.3f %2d/%-2d\n", a, b, r, bf ? "bf16" : "tf32", t_def, t0, best, bi,
             nres);
      lp.free();
    }
  printf("ms, median of 9, whole batch\n");
  return 0;
}

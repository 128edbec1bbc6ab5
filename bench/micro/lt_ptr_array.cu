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
#include <cublasLt.h>

#include "micro_util.cuh"

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
      const size_t es = bf ? 2 : 4;
      const cudaDataType_t t = bf ? CUDA_R_16BF : CUDA_R_32F;
      const cublasComputeType_t compute = bf ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
      std::vector<void*> hp(3 * batch);
      for (int i = 0; i < batch; ++i) {
        CK(cudaMalloc(&hp[i], es * b * r));              // R (first operand: C^T = R P^T)
        CK(cudaMalloc(&hp[batch + i], es * a * r));      // P
        CK(cudaMalloc(&hp[2 * batch + i], es * a * b));  // C
        CK(cudaMemset(hp[i], 0, es * b * r));
        CK(cudaMemset(hp[batch + i], 0, es * a * r));
        CK(cudaMemset(hp[2 * batch + i], 0, es * a * b));
      }
      void** dp;
      CK(cudaMalloc(&dp, sizeof(void*) * 3 * batch));
      CK(cudaMemcpy(dp, hp.data(), sizeof(void*) * 3 * batch, cudaMemcpyHostToDevice));
      const float one = 1.f;
      // column-major C^T (b x a) = R (b x r, stored r x b col-major: OP_T, ld r) P^T (r x a, OP_N, ld r)
      const float t_def = rig.median_ms(
          [&] {
            CK(cublasGemmBatchedEx(rig.h, CUBLAS_OP_T, CUBLAS_OP_N, b, a, r, &one, (const void* const*)dp, t, r,
                                   (const void* const*)(dp + batch), t, r, &one, dp + 2 * batch, t, b, batch, compute,
                                   CUBLAS_GEMM_DEFAULT));
          },
          9);
      cublasLtMatmulDesc_t desc;
      CK(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F));
      cublasOperation_t o1 = CUBLAS_OP_T, o2 = CUBLAS_OP_N;
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &o1, sizeof(o1)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &o2, sizeof(o2)));
      auto layout = [&](int rows, int cols, int ld) {
        cublasLtMatrixLayout_t l;
        CK(cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld));
        int32_t bc = batch;
        uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
        CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof(bc)));
        CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof(mode)));
        return l;
      };
      cublasLtMatrixLayout_t l1 = layout(r, b, r), l2 = layout(r, a, r), lc = layout(b, a, b);
      cublasLtMatmulPreference_t pref;
      CK(cublasLtMatmulPreferenceCreate(&pref));
      uint64_t wsb = rig.wsz;
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
      cublasLtMatmulHeuristicResult_t res[16];
      int nres = 0;
      float t0 = -1, best = 1e30f;
      int bi = -1;
      const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, l1, l2, lc, lc, pref, 16, res, &nres);
      if (hs != CUBLAS_STATUS_SUCCESS) printf("heuristic: status %d\n", (int)hs);
      for (int i = 0; hs == CUBLAS_STATUS_SUCCESS && i < nres; ++i) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        bool ok = true;
        const float tt = rig.median_ms(
            [&] {
              if (cublasLtMatmul(lt, desc, &one, dp, l1, dp + batch, l2, &one, dp + 2 * batch, lc, dp + 2 * batch, lc,
                                 &res[i].algo, rig.ws, rig.wsz, rig.st) != CUBLAS_STATUS_SUCCESS)
                ok = false;
            },
            9);
        if (!ok) continue;
        if (i == 0) t0 = tt;
        if (tt < best) best = tt, bi = i;
      }
      CK(cudaStreamSynchronize(rig.st));
      CK(cudaGetLastError());
      printf("%5d x %-5d r %-8d %-5s %9.3f %9.3f %9.3f %2d/%-2d\n", a, b, r, bf ? "bf16" : "tf32", t_def, t0, best, bi,
             nres);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(l1);
      cublasLtMatrixLayoutDestroy(l2);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(desc);
      for (void* p : hp) CK(cudaFree(p));
      CK(cudaFree(dp));
    }
  printf("ms, median of 9, whole batch\n");
  return 0;
}

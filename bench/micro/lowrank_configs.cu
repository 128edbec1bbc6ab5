// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// what distinguishes the fastest of cuBLASLt's heuristic algorithms for
// Dion's error feedback / update product (C += P R^T, C row-major a x b, as
// lowrank_gemm passes it: a pointer-array batch, C^T = R P^T column-major)
// at TF32 and bf16: for each of the heuristic's first 16 algorithms its time
// (ms for the batch, median of 9) and its configuration (algorithm id, tile,
// split-K, reduction scheme, swizzle, custom option, stages, cluster shape).
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o lowrank_configs bench/micro/lowrank_configs.cu -lcublasLt -lcublas && ./lowrank_configs
#include "micro_lt.cuh"

int main() {
  MicroRig rig(32u << 20);
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  const int shapes[][4] = {{8192, 2048, 512, 24}, {2048, 8192, 512, 24}, {6144, 2048, 512, 24},
                           {2048, 2048, 512, 24}, {3072, 768, 192, 12},  {768, 3072, 192, 12},
                           {2304, 768, 192, 12},  {768, 768, 192, 12}};
  for (int bf = 0; bf < 2; ++bf)
    for (const auto& sh : shapes) {
      const int a = sh[0], b = sh[1], r = sh[2], batch = sh[3];
      LowrankPointers lp(a, b, r, batch, bf ? CUDA_R_16BF : CUDA_R_32F,
                         bf ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32);
      const float t_def = lp.cublas_ms(rig);
      printf("%s C %dx%d r%d b%d: cublas default %.3f ms\n", bf ? "bf16" : "tf32", a, b, r, batch, t_def);
      cublasLtMatmulHeuristicResult_t res[16];
      int cnt = 0;
      CK(lt_heuristic(lt, lp.desc, lp.l1, lp.l2, lp.lc, rig.wsz, 16, res, &cnt));
      for (int i = 0; i < cnt; ++i) {
        const cublasLtMatmulAlgo_t& al = res[i].algo;
        bool ok = true;
        const float ms = rig.median_ms(
            [&] {
              if (lp.lt_matmul(lt, &al, rig) != CUBLAS_STATUS_SUCCESS) ok = false;
            },
            9);
        printf("  #%-2d %8.3f %s id %d tile %u splitk %d red %u swz %u cust %u stages %u cluster %u inner %u ws %zu waves %.2f\n",
               i, ok ? ms : -1.f, ok ? "" : "FAIL", lt_cfg<int32_t>(al, CUBLASLT_ALGO_CONFIG_ID),
               lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_TILE_ID), lt_cfg<int32_t>(al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
               lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
               lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
               lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_STAGES_ID),
               (unsigned)lt_cfg<uint16_t>(al, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
               (unsigned)lt_cfg<uint16_t>(al, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID), res[i].workspaceSize,
               res[i].wavesCount);
      }
      CK(cudaStreamSynchronize(rig.st));
      lp.free();
    }
  return 0;
}

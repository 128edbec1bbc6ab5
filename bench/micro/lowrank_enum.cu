// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// every cuBLASLt configuration for Dion's error feedback / update product
// (C += P R^T, C row-major a x b, as lowrank_gemm passes it: a pointer-array
// batch, C^T = R P^T column-major), not only the heuristic's first ones
// (lowrank_configs.cu): for each algorithm id cuBLASLt lists for the types,
// each tile, stage count and custom option it supports and the cluster
// shapes AUTO, 1x1, 2x1, 1x2, 2x2, 4x1, 1x4 (ENUM_BUDGET_S seconds per
// shape at most, default 40). Operands hold random values (power and clocks
// depend on the data). Prints cuBLAS's default, the heuristic's first 8 (the
// library's choice among them marked: TF32, the first with a 128 x 128 tile,
// else the first), the fastest five of its list of up to 128, and the five fastest configurations overall, ms for the
// batch (median of 7; a configuration whose first timed call takes over 1.5
// times the default's is left out).
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o lowrank_enum bench/micro/lowrank_enum.cu -lcublasLt -lcublas
//   ./lowrank_enum [bf16|tf32|fp32|fp32big]...
// (tf32, bf16: gpt-1.3b's shapes; fp32: gpt-160m's; fp32big: fp32 at gpt-1.3b's)
#include <chrono>
#include <cstring>
#include <string>

#include "micro_lt.cuh"

namespace {

template <class T>
void set(cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr, T v) {
  CK(cublasLtMatmulAlgoConfigSetAttribute(&a, attr, &v, sizeof(v)));
}
template <class T>
std::vector<T> cap_list(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t need = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&a, attr, nullptr, 0, &need) != CUBLAS_STATUS_SUCCESS || need == 0) return {};
  std::vector<T> v(need / sizeof(T));
  size_t w = 0;
  CK(cublasLtMatmulAlgoCapGetAttribute(&a, attr, v.data(), need, &w));
  return v;
}

std::string describe(const cublasLtMatmulAlgo_t& al) {
  char buf[200];
  snprintf(buf, sizeof buf, "id %d tile %u stages %u cust %u cluster %u inner %u splitk %d swz %u",
           lt_cfg<int32_t>(al, CUBLASLT_ALGO_CONFIG_ID), lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_TILE_ID),
           lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_STAGES_ID), lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
           (unsigned)lt_cfg<uint16_t>(al, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
           (unsigned)lt_cfg<uint16_t>(al, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
           lt_cfg<int32_t>(al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), lt_cfg<uint32_t>(al, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
  return buf;
}

struct Timed {
  float ms;
  cublasLtMatmulAlgo_t algo;
};

}  // namespace

int main(int argc, char** argv) {
  MicroRig rig(64u << 20);
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  std::vector<std::string> kinds;
  const int budget_s = getenv("ENUM_BUDGET_S") ? atoi(getenv("ENUM_BUDGET_S")) : 40;
  for (int i = 1; i < argc; ++i) kinds.push_back(argv[i]);
  if (kinds.empty()) kinds = {"tf32", "bf16", "fp32"};
  const int big[][4] = {{8192, 2048, 512, 24}, {2048, 8192, 512, 24}, {6144, 2048, 512, 24}, {2048, 2048, 512, 24}};
  const int small[][4] = {{3072, 768, 192, 12}, {768, 3072, 192, 12}, {2304, 768, 192, 12}, {768, 768, 192, 12}};
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO,  CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x2x1, CUBLASLT_CLUSTER_SHAPE_2x2x1, CUBLASLT_CLUSTER_SHAPE_4x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x4x1};
  for (const std::string& kind : kinds) {
    const bool bf = kind == "bf16";
    const cudaDataType_t t = bf ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute = kind == "tf32" ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const auto& shapes = kind == "fp32" ? small : big;
    for (int si = 0; si < 4; ++si) {
      const int a = shapes[si][0], b = shapes[si][1], r = shapes[si][2], batch = shapes[si][3];
      LowrankPointers lp(a, b, r, batch, t, compute);
      for (int i = 0; i < 3 * batch; ++i) {
        const long n = i < batch ? (long)b * r : i < 2 * batch ? (long)a * r : (long)a * b;
        if (bf)
          fill_bf16<<<1024, 256, 0, rig.st>>>(static_cast<__nv_bfloat16*>(lp.hp[i]), n, 17u + i);
        else
          fill_f32<<<1024, 256, 0, rig.st>>>(static_cast<float*>(lp.hp[i]), n, 17u + i);
      }
      CK(cudaStreamSynchronize(rig.st));
      const double flop = 2.0 * a * b * r * batch;
      const float t_def = lp.cublas_ms(rig);
      printf("%s C %dx%d r%d b%d: cublas default %.3f ms (%.0f TFLOP/s)\n", kind.c_str(), a, b, r, batch, t_def,
             flop / t_def * 1e-9);
      // The heuristic's first 8 and the library's choice among them.
      cublasLtMatmulHeuristicResult_t res[8];
      int cnt = 0;
      CK(lt_heuristic(lt, lp.desc, lp.l1, lp.l2, lp.lc, rig.wsz, 8, res, &cnt));
      int lib = cnt > 0 ? 0 : -1;
      if (kind == "tf32")
        for (int i = 0; i < cnt; ++i)
          if (lt_cfg<uint32_t>(res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID) == CUBLASLT_MATMUL_TILE_128x128) {
            lib = i;
            break;
          }
      for (int i = 0; i < cnt; ++i) {
        const float ms = rig.median_ms([&] { CK(lp.lt_matmul(lt, &res[i].algo, rig)); }, 7);
        printf("  heur #%d%s %8.3f  %s\n", i, i == lib ? "*" : " ", ms, describe(res[i].algo).c_str());
      }
      // The heuristic's longer list (up to 128): the fastest of it.
      {
        std::vector<cublasLtMatmulHeuristicResult_t> ext(128);
        int ne = 0;
        CK(lt_heuristic(lt, lp.desc, lp.l1, lp.l2, lp.lc, rig.wsz, 128, ext.data(), &ne));
        std::vector<std::pair<float, int>> tl;
        for (int i = 0; i < ne; ++i) {
          if (ext[i].state != CUBLAS_STATUS_SUCCESS) continue;
          if (lp.lt_matmul(lt, &ext[i].algo, rig) != CUBLAS_STATUS_SUCCESS) continue;
          if (rig.once_ms([&] { lp.lt_matmul(lt, &ext[i].algo, rig); }) > 1.5f * t_def) continue;
          tl.push_back({rig.median_ms([&] { lp.lt_matmul(lt, &ext[i].algo, rig); }, 7), i});
        }
        std::sort(tl.begin(), tl.end());
        printf("  heuristic's list of %d, %zu timed; the fastest:\n", ne, tl.size());
        for (size_t i = 0; i < std::min<size_t>(5, tl.size()); ++i)
          printf("  ext #%-3d %8.3f  %s\n", tl[i].second, tl[i].first, describe(ext[tl[i].second].algo).c_str());
      }
      // Every configuration of every algorithm id (AlgoInit), within the budget.
      int ids[256];
      int nid = 0;
      CK(cublasLtMatmulAlgoGetIds(lt, compute, CUDA_R_32F, t, t, t, t, 256, ids, &nid));
      // The heuristic's algorithm ids first (the budget may not reach the rest).
      std::stable_partition(ids, ids + nid, [&](int id) {
        for (int i = 0; i < cnt; ++i)
          if (lt_cfg<int32_t>(res[i].algo, CUBLASLT_ALGO_CONFIG_ID) == id) return true;
        return false;
      });
      std::vector<Timed> all;
      int tried = 0;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(budget_s);
      auto try_algo = [&](cublasLtMatmulAlgo_t al) {
        cublasLtMatmulHeuristicResult_t chk{};
        if (cublasLtMatmulAlgoCheck(lt, lp.desc, lp.l1, lp.l2, lp.lc, lp.lc, &al, &chk) != CUBLAS_STATUS_SUCCESS)
          return;
        if (chk.workspaceSize > rig.wsz) return;
        if (lp.lt_matmul(lt, &al, rig) != CUBLAS_STATUS_SUCCESS) {
          cudaGetLastError();
          return;
        }
        ++tried;
        // One timed call first: a configuration over 1.5 times cuBLAS's
        // default is not timed further (some run tens of times slower).
        if (rig.once_ms([&] { lp.lt_matmul(lt, &al, rig); }) > 1.5f * t_def) return;
        const float ms = rig.median_ms([&] { lp.lt_matmul(lt, &al, rig); }, 7);
        all.push_back({ms, al});
      };
      for (int k = 0; k < nid; ++k) {
        cublasLtMatmulAlgo_t base;
        if (cublasLtMatmulAlgoInit(lt, compute, CUDA_R_32F, t, t, t, t, ids[k], &base) != CUBLAS_STATUS_SUCCESS)
          continue;
        size_t w = 0;
        std::vector<uint32_t> tiles = cap_list<uint32_t>(base, CUBLASLT_ALGO_CAP_TILE_IDS);
        if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
        int32_t cmax = 0;
        cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &cmax, sizeof(cmax), &w);
        std::vector<uint32_t> stages = cap_list<uint32_t>(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
        if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
        for (uint32_t tile : tiles)
          for (uint32_t st : stages)
            for (int32_t c = 0; c <= std::min(cmax, 15); ++c)
              for (uint16_t cl : clusters) {
                if (std::chrono::steady_clock::now() > deadline) continue;
                cublasLtMatmulAlgo_t al = base;
                set<uint32_t>(al, CUBLASLT_ALGO_CONFIG_TILE_ID, tile);
                set<uint32_t>(al, CUBLASLT_ALGO_CONFIG_STAGES_ID, st);
                set<uint32_t>(al, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, (uint32_t)c);
                set<int32_t>(al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 1);
                if (cublasLtMatmulAlgoConfigSetAttribute(&al, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl,
                                                         sizeof(cl)) != CUBLAS_STATUS_SUCCESS)
                  continue;
                try_algo(al);
              }
      }
      std::sort(all.begin(), all.end(), [](const Timed& x, const Timed& y) { return x.ms < y.ms; });
      printf("  %d algorithm ids, %d configurations ran%s; the fastest:\n", nid, tried,
             std::chrono::steady_clock::now() > deadline ? " (budget reached)" : "");
      for (size_t i = 0; i < std::min<size_t>(6, all.size()); ++i)
        printf("  best %zu %8.3f (%.0f TFLOP/s)  %s\n", i, all[i].ms, flop / all[i].ms * 1e-9,
               describe(all[i].algo).c_str());
      fflush(stdout);
      lp.free();
    }
  }
  return 0;
}

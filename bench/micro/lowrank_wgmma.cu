// SPDX-License-Identifier: MIT
// Micro-benchmark and check (not built by CMake) of lowrank_wgmma.cuh, the
// error feedback / update product on wgmma, against cuBLAS's pointer-array
// batched GEMM (what lowrank_gemm calls where cuBLASLt has no plan) and a
// float64 host product:
//   1. small and ragged shapes (m, n, k not multiples of the tile, padded
//      rows), every operand/output type: max |C - C64| / (|alpha| |A| |B| +
//      |beta| |C|) per element, against the bound of the factors' rounding
//      (TF32 truncation: 2^-9 of the product; bf16 factors are exact, so
//      fp32 accumulation: 1e-5; a bf16 output adds its rounding, 2^-8);
//      alpha = 0, beta = 1 leaves C's bits; beta = 0 never reads C (NaN there);
//   2. gpt-1.3b's and gpt-160m's classes (24 / 12 products of rank 512 / 192),
//      ms per batch (median of 20), and the largest difference from cuBLAS's
//      result relative to the operands' scale;
//   `ncu`: one launch of each kernel at C 8192 x 2048, for Nsight Compute.
// Build and run on the GPU machine (from the repository root):
//   nvcc -std=c++17 -O3 -arch=sm_90a -I. -o lowrank_wgmma bench/micro/lowrank_wgmma.cu -lcublas && ./lowrank_wgmma
#include <cmath>
#include <cstring>
#include <random>

#include "lowrank_wgmma.cuh"
#include "micro_util.cuh"

namespace {

float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

struct Case {
  int64_t m, n, k, count, lda, ldb;
  bool bf16_ab, bf16_c;
};

// Device buffers of one batch: A, B (element size es), C (es_c), pointer array, coefficients.
struct Batch {
  Case c;
  void *a = nullptr, *b = nullptr, *cm = nullptr;
  void** ptr = nullptr;
  float* coef = nullptr;
  size_t es, esc;
  explicit Batch(const Case& cs) : c(cs) {
    es = c.bf16_ab ? 2 : 4;
    esc = c.bf16_c ? 2 : 4;
    CK(cudaMalloc(&a, es * c.m * c.lda * c.count + 16));
    CK(cudaMalloc(&b, es * c.n * c.ldb * c.count + 16));
    CK(cudaMalloc(&cm, esc * c.m * c.n * c.count + 16));
    CK(cudaMalloc(&ptr, sizeof(void*) * 3 * c.count));
    CK(cudaMalloc(&coef, 8));
    std::vector<void*> p(3 * c.count);
    for (int64_t g = 0; g < c.count; ++g) {
      p[g] = (char*)b + es * c.n * c.ldb * g;
      p[c.count + g] = (char*)a + es * c.m * c.lda * g;
      p[2 * c.count + g] = (char*)cm + esc * c.m * c.n * g;
    }
    CK(cudaMemcpy(ptr, p.data(), sizeof(void*) * p.size(), cudaMemcpyHostToDevice));
  }
  ~Batch() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(cm);
    cudaFree(ptr);
    cudaFree(coef);
  }
  void set_coef(float alpha, float beta) {
    float h[2] = {alpha, beta};
    CK(cudaMemcpy(coef, h, 8, cudaMemcpyHostToDevice));
  }
  // host values -> device, in the element types
  void put(void* dst, const std::vector<float>& v, bool bf16) {
    if (bf16) {
      std::vector<__nv_bfloat16> t(v.size());
      for (size_t i = 0; i < v.size(); ++i) t[i] = __float2bfloat16(v[i]);
      CK(cudaMemcpy(dst, t.data(), t.size() * 2, cudaMemcpyHostToDevice));
    } else {
      CK(cudaMemcpy(dst, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    }
  }
  std::vector<float> get_c() {
    const size_t n = c.m * c.n * c.count;
    std::vector<float> v(n);
    if (c.bf16_c) {
      std::vector<__nv_bfloat16> t(n);
      CK(cudaMemcpy(t.data(), cm, n * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < n; ++i) v[i] = __bfloat162float(t[i]);
    } else {
      CK(cudaMemcpy(v.data(), cm, n * 4, cudaMemcpyDeviceToHost));
    }
    return v;
  }
  void own(cudaStream_t st) {
    const wgmma_micro::ConstMatBatch ma{(const float*)a, c.m, c.k, c.lda, c.m * c.lda, c.count};
    const wgmma_micro::ConstMatBatch mb{(const float*)b, c.n, c.k, c.ldb, c.n * c.ldb, c.count};
    if (!wgmma_micro::lowrank_sm90a(wgmma_micro::Ctx{st, 132}, ma, mb, ptr + 2 * c.count, coef, c.count, c.n,
                                      c.bf16_ab, c.bf16_c)) {
      printf("lowrank_sm90a: no tensor maps\n");
      exit(1);
    }
  }
  // what lowrank_gemm calls without the kernel: column-major C^T = B A^T
  void cublas(cublasHandle_t h) {
    CK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE));
    CK(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)c.n, (int)c.m, (int)c.k, coef, (const void**)ptr,
                           c.bf16_ab ? CUDA_R_16BF : CUDA_R_32F, (int)c.ldb, (const void**)(ptr + c.count),
                           c.bf16_ab ? CUDA_R_16BF : CUDA_R_32F, (int)c.lda, coef + 1, ptr + 2 * c.count,
                           c.bf16_c ? CUDA_R_16BF : CUDA_R_32F, (int)c.n, (int)c.count,
                           c.bf16_ab ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
    CK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  }
};

int failures = 0;

void check_case(MicroRig& rig, const Case& cs, float alpha, float beta, bool nan_c) {
  Batch bt(cs);
  std::mt19937 gen(42);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> a(cs.m * cs.lda * cs.count), b(cs.n * cs.ldb * cs.count), c(cs.m * cs.n * cs.count);
  for (auto& x : a) x = u(gen);
  for (auto& x : b) x = u(gen);
  for (auto& x : c) x = nan_c ? NAN : u(gen);
  if (cs.bf16_ab) {
    for (auto& x : a) x = bf16_round(x);
    for (auto& x : b) x = bf16_round(x);
  }
  if (cs.bf16_c)
    for (auto& x : c) x = bf16_round(x);
  bt.put(bt.a, a, cs.bf16_ab);
  bt.put(bt.b, b, cs.bf16_ab);
  bt.put(bt.cm, c, cs.bf16_c);
  bt.set_coef(alpha, beta);
  std::vector<float> before = bt.get_c();
  bt.own(rig.st);
  CK(cudaStreamSynchronize(rig.st));
  std::vector<float> got = bt.get_c();
  const char* what = cs.bf16_ab ? (cs.bf16_c ? "bf16 -> bf16" : "bf16 -> fp32") : "tf32 -> fp32";
  if (alpha == 0.f && beta == 1.f) {
    const bool same = memcmp(got.data(), before.data(), got.size() * 4) == 0;
    printf("check %s %ldx%ldx%ld skip: C %s\n", what, cs.m, cs.n, cs.k, same ? "unchanged" : "CHANGED");
    failures += !same;
    return;
  }
  double worst = 0;
  bool finite = true;
  for (int64_t g = 0; g < cs.count; ++g)
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = 0; j < cs.n; ++j) {
        double s = 0, mag = 0;
        for (int64_t l = 0; l < cs.k; ++l) {
          const double x = a[(g * cs.m + i) * cs.lda + l], y = b[(g * cs.n + j) * cs.ldb + l];
          s += x * y;
          mag += std::fabs(x * y);
        }
        const size_t o = (g * cs.m + i) * cs.n + j;
        const double cv = beta != 0.f ? c[o] : 0.0;
        const double ref = alpha * s + beta * cv;
        const double scale = std::fabs(alpha) * mag + std::fabs(beta * cv) + 1e-30;
        if (!std::isfinite(got[o])) finite = false;
        worst = std::max(worst, std::fabs(got[o] - ref) / scale);
      }
  const double bound = (cs.bf16_ab ? 1e-5 : std::ldexp(1.0, -9)) + (cs.bf16_c ? std::ldexp(1.0, -8) : 0.0);
  const bool ok = finite && worst <= bound;
  printf("check %s %ldx%ldx%ld (lda %ld, ldb %ld) x%ld alpha %g beta %g%s: max rel err %.3g (bound %.3g) %s\n",
         what, cs.m, cs.n, cs.k, cs.lda, cs.ldb, cs.count, alpha, beta, nan_c ? " (C NaN)" : "", worst, bound,
         ok ? "ok" : "FAIL");
  failures += !ok;
}

void time_case(MicroRig& rig, const char* name, const Case& cs) {
  Batch bt(cs);
  const long na = cs.m * cs.lda * cs.count, nb = cs.n * cs.ldb * cs.count, nc = cs.m * cs.n * cs.count;
  if (cs.bf16_ab) {
    fill_bf16<<<1024, 256, 0, rig.st>>>((__nv_bfloat16*)bt.a, na, 1);
    fill_bf16<<<1024, 256, 0, rig.st>>>((__nv_bfloat16*)bt.b, nb, 2);
  } else {
    fill_f32<<<1024, 256, 0, rig.st>>>((float*)bt.a, na, 1);
    fill_f32<<<1024, 256, 0, rig.st>>>((float*)bt.b, nb, 2);
  }
  if (cs.bf16_c)
    fill_bf16<<<1024, 256, 0, rig.st>>>((__nv_bfloat16*)bt.cm, nc, 3);
  else
    fill_f32<<<1024, 256, 0, rig.st>>>((float*)bt.cm, nc, 3);
  bt.set_coef(-0.5f, 0.999f);
  CK(cudaStreamSynchronize(rig.st));
  const float t_own = rig.median_ms([&] { bt.own(rig.st); }, 20);
  const float t_blas = rig.median_ms([&] { bt.cublas(rig.h); }, 20);
  // one product each from the same C: the largest difference relative to |C| + |alpha| k max|a||b|
  std::vector<float> c0 = bt.get_c();
  bt.set_coef(-0.5f, 1.f);
  bt.own(rig.st);
  CK(cudaStreamSynchronize(rig.st));
  std::vector<float> c1 = bt.get_c();
  bt.put(bt.cm, c0, cs.bf16_c);
  bt.cublas(rig.h);
  CK(cudaStreamSynchronize(rig.st));
  std::vector<float> c2 = bt.get_c();
  double worst = 0;
  const double scale = 0.5 * cs.k * 0.05 * 0.05 + 0.05;
  for (size_t i = 0; i < c1.size(); ++i) worst = std::max(worst, std::fabs((double)c1[i] - c2[i]) / scale);
  const double gflop = 2.0 * cs.m * cs.n * cs.k * cs.count * 1e-9;
  printf("time %-28s %s own %.3f ms (%.0f TFLOP/s)  cuBLAS %.3f ms (%.0f TFLOP/s)  ratio %.3f  max diff %.2g\n", name,
         cs.bf16_ab ? (cs.bf16_c ? "bf16>bf16" : "bf16>fp32") : "tf32>fp32", t_own, gflop / t_own, t_blas,
         gflop / t_blas, t_own / t_blas, worst);
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0;
  cudaDeviceProp prop{};
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  if (!wgmma_micro::lowrank_sm90a_ok(prop.major, prop.minor)) {
    printf("needs a device of compute capability 9.0 and a driver with tensor maps (this one: %d.%d)\n", prop.major,
           prop.minor);
    return 1;
  }
  MicroRig rig(32 << 20);
  wgmma_micro::lowrank_sm90a_init();
  const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  if (argc > 1 && strcmp(argv[1], "ncu") == 0) {  // one launch of each kernel, for Nsight Compute
    for (int t = 0; t < 3; ++t) {
      Batch bt({8192, 2048, 512, 24, 512, 512, t > 0, t > 1});
      bt.set_coef(-0.5f, 1.f);
      bt.own(rig.st);
      bt.cublas(rig.h);
    }
    CK(cudaStreamSynchronize(rig.st));
    return 0;
  }
  for (bool bab : {false, true})
    for (bool bc : {false, true}) {
      if (!bab && bc) continue;
      check_case(rig, {128, 128, 32, 1, 32, 32, bab, bc}, 1.f, 0.f, false);
      check_case(rig, {300, 264, 68, 3, 72, 80, bab, bc}, -0.7f, 0.9f, false);
      check_case(rig, {257, 129, 33, 2, 40, 48, bab, bc}, 1.3f, 1.f, false);
      check_case(rig, {1, 1, 1, 1, 8, 8, bab, bc}, 2.f, -1.f, false);
      check_case(rig, {130, 300, 512, 2, 512, 520, bab, bc}, -0.25f, 0.f, true);
      check_case(rig, {200, 136, 96, 2, 96, 96, bab, bc}, 0.f, 1.f, false);
      check_case(rig, {256, 258, 64, 2, 64, 64, bab, bc}, 0.5f, 1.f, false);
      check_case(rig, {384, 256, 512, 3, 512, 512, bab, bc}, -0.5f, 0.999f, false);
    }
  if (!quick) {
    const struct {
      const char* name;
      int64_t m, n, k, count;
    } shapes[] = {{"gpt-1.3b fc1 8192x2048 r512", 8192, 2048, 512, 24},
                  {"gpt-1.3b fc2 2048x8192 r512", 2048, 8192, 512, 24},
                  {"gpt-1.3b qkv 6144x2048 r512", 6144, 2048, 512, 24},
                  {"gpt-1.3b out 2048x2048 r512", 2048, 2048, 512, 24},
                  {"gpt-160m fc1 3072x768 r192", 3072, 768, 192, 12},
                  {"gpt-160m fc2 768x3072 r192", 768, 3072, 192, 12},
                  {"gpt-160m qkv 2304x768 r192", 2304, 768, 192, 12},
                  {"gpt-160m out 768x768 r192", 768, 768, 192, 12}};
    for (int t = 0; t < 3; ++t)
      for (const auto& s : shapes)
        time_case(rig, s.name, {s.m, s.n, s.k, s.count, s.k, s.k, t > 0, t > 1});
  }
  printf("%s\n", failures ? "FAILURES" : "all checks passed");
  return failures ? 1 : 0;
}

// SPDX-License-Identifier: MIT
// Micro-benchmark and check (not built by CMake; docs/benchmarks.md,
// nineteenth session, has the figures) of the library's kernel
// (kernels/lowrank_tf32x3.cuh, wgmma on the fifteenth session's TMA pipeline
// of lowrank_wgmma.cuh): Dion's error feedback and update product at
// exact-fp32 accuracy on Hopper's tensor cores,
//
//   C_g (m x n fp32, row-major) = alpha A_g B_g^T + beta C_g,  A m x k, B n x k fp32,
//
// with each factor split into two TF32 parts, x = hi + lo (hi = x rounded to
// TF32's 11 significant bits, to nearest; lo = the rest, rounded the same
// way, so hi + lo is x to about 2^-22), and A B^T = Ah Bh + Ah Bl + Al Bh
// (Al Bl, about 2^-22 of the product, is left out): three TF32 MMAs where
// the SIMT SGEMM does one fp32 FMA per term. cuBLAS's TF32 kernels on a
// tripled inner dimension gave 5 to 30 times SGEMM's error (sixteenth
// session, fp32_split.cu), growing with k: the tensor cores' accumulation
// does not round to nearest. Here the three products of `kP` k-steps of 8
// go into a scratch accumulator T (zeroed by the first MMA), which the
// threads then add into the running sum D with fp32 adds (round to nearest)
// -- the promotion of Ootomo and Yokota (2022), "Recovering single precision
// accuracy from Tensor Cores while surpassing the FP32 theoretical peak
// performance". kP = 0 accumulates everything in the tensor cores (the
// cuBLAS-like form, for comparison).
//
// Checked: max |C - C64| / (|alpha| sum |a b| + |beta c|) per element against
// a float64 host product, for this kernel and for cuBLAS's SGEMM on the same
// inputs (signed and positive data, ragged shapes, padded rows); a skipped
// step (alpha 0, beta 1) leaves C's bits; beta = 0 never reads C (NaN there).
// Timed: gpt-1.3b's and gpt-160m's classes, the split passes included,
// against cuBLAS's pointer-array SGEMM (what the library calls for
// DION_MATMUL_FP32) and its TF32 product.
// Build and run on the GPU machine (from the repository root):
//   nvcc -std=c++17 -O3 -arch=sm_90a -I. -o lowrank_3xtf32 bench/micro/lowrank_3xtf32.cu -lcublas && ./lowrank_3xtf32
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "kernels/lowrank_tf32x3.cuh"
#include "micro_util.cuh"

namespace {

using namespace dion::kernels::x3;

void split(cudaStream_t st, const float* x, float* hi, float* lo, int64_t rows, int64_t k, int64_t ld, int64_t count,
           int64_t kpad) {
  split_tf32_kernel<false><<<1024, 256, 0, st>>>(x, rows, k, ld, rows * ld, count, kpad, hi, lo);
  CK(cudaGetLastError());
}

// The parts (packed, rows of kpad) and the product at promotion interval kP.
bool product3(cudaStream_t st, const float* ah, const float* al, const float* bh, const float* bl, int64_t m,
              int64_t n, int64_t k, int64_t count, void* const* cptr, const float* coef, int promote) {
  const int64_t kpad = x3_kpad(k);
  CUtensorMap t[4];
  if (!x3_map(&t[0], ah, m, k, kpad, count) || !x3_map(&t[1], al, m, k, kpad, count) ||
      !x3_map(&t[2], bh, n, k, kpad, count) || !x3_map(&t[3], bl, n, k, kpad, count))
    return false;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const unsigned grid = x3_lowrank_grid(count, m, n, sms);
#define X_LAUNCH(P)                                                                                                 \
  lowrank_tf32x3_kernel<P><<<grid, kX3Threads, kX3SmemBytes, st>>>(t[0], t[1], t[2], t[3], cptr, coef, count, m, n, \
                                                                    k, n)
  switch (promote) {
    case 0: X_LAUNCH(0); break;
    case 1: X_LAUNCH(1); break;
    case 2: X_LAUNCH(2); break;
    default: X_LAUNCH(4); break;
  }
#undef X_LAUNCH
  CK(cudaGetLastError());
  return true;
}

template <int P>
void set_smem() {
  CK(cudaFuncSetAttribute(lowrank_tf32x3_kernel<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kX3SmemBytes));
}

}  // namespace

namespace {

struct Case {
  int64_t m, n, k, count, lda, ldb;
};

// Device buffers of one batch: A, B and their parts, C, pointer array, coefficients.
struct Batch {
  Case c;
  float *a, *b, *ah, *al, *bh, *bl, *cm;
  void** ptr = nullptr;
  float* coef = nullptr;
  int64_t na, nb, nc;
  explicit Batch(const Case& cs) : c(cs) {
    na = c.m * c.lda * c.count;
    nb = c.n * c.ldb * c.count;
    nc = c.m * c.n * c.count;
    const int64_t kpad = x3_kpad(c.k);
    CK(cudaMalloc(&a, 4 * na + 16));
    CK(cudaMalloc(&b, 4 * nb + 16));
    for (float** p : {&ah, &al}) CK(cudaMalloc(p, 4 * c.m * kpad * c.count + 16));
    for (float** p : {&bh, &bl}) CK(cudaMalloc(p, 4 * c.n * kpad * c.count + 16));
    CK(cudaMalloc(&cm, 4 * nc + 16));
    CK(cudaMalloc(&ptr, sizeof(void*) * 3 * c.count));
    CK(cudaMalloc(&coef, 8));
    std::vector<void*> p(3 * c.count);
    for (int64_t g = 0; g < c.count; ++g) {
      p[g] = b + c.n * c.ldb * g;
      p[c.count + g] = a + c.m * c.lda * g;
      p[2 * c.count + g] = cm + c.m * c.n * g;
    }
    CK(cudaMemcpy(ptr, p.data(), sizeof(void*) * p.size(), cudaMemcpyHostToDevice));
  }
  ~Batch() {
    for (float* p : {a, b, ah, al, bh, bl, cm}) cudaFree(p);
    cudaFree(ptr);
    cudaFree(coef);
  }
  void set_coef(float alpha, float beta) {
    float h[2] = {alpha, beta};
    CK(cudaMemcpy(coef, h, 8, cudaMemcpyHostToDevice));
  }
  std::vector<float> get_c() {
    std::vector<float> v(nc);
    CK(cudaMemcpy(v.data(), cm, nc * 4, cudaMemcpyDeviceToHost));
    return v;
  }
  void put_c(const std::vector<float>& v) { CK(cudaMemcpy(cm, v.data(), nc * 4, cudaMemcpyHostToDevice)); }
  // the split passes and the product
  void own(cudaStream_t st, int promote) {
    split(st, a, ah, al, c.m, c.k, c.lda, c.count, x3_kpad(c.k));
    split(st, b, bh, bl, c.n, c.k, c.ldb, c.count, x3_kpad(c.k));
    product(st, promote);
  }
  void product(cudaStream_t st, int promote) {
    if (!product3(st, ah, al, bh, bl, c.m, c.n, c.k, c.count, ptr + 2 * c.count, coef, promote)) {
      printf("lowrank_tf32x3: no tensor maps\n");
      exit(1);
    }
  }
  // what lowrank_gemm calls: column-major C^T = B A^T, fp32 (SIMT) or TF32
  void cublas(cublasHandle_t h, bool tf32) {
    CK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE));
    CK(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)c.n, (int)c.m, (int)c.k, coef, (const void**)ptr,
                           CUDA_R_32F, (int)c.ldb, (const void**)(ptr + c.count), CUDA_R_32F, (int)c.lda, coef + 1,
                           ptr + 2 * c.count, CUDA_R_32F, (int)c.n, (int)c.count,
                           tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  }
};

int failures = 0;

// max |C - C64| / (|alpha| sum_l |a b| + |beta c|) over every element
double max_err(const Case& cs, const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& c,
               const std::vector<float>& got, float alpha, float beta) {
  double worst = 0;
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
        const double e = std::isfinite(got[o]) ? std::fabs(got[o] - ref) / scale : INFINITY;
        worst = std::max(worst, e);
      }
  return worst;
}

// lo: the data's lower end (-1: signed, 0: positive)
void check_case(MicroRig& rig, const Case& cs, float alpha, float beta, bool nan_c, float lo) {
  Batch bt(cs);
  std::mt19937 gen(42);
  std::uniform_real_distribution<float> u(lo, 1.f);
  std::vector<float> a(bt.na), b(bt.nb), c(bt.nc);
  for (auto& x : a) x = u(gen);
  for (auto& x : b) x = u(gen);
  for (auto& x : c) x = nan_c ? NAN : u(gen);
  CK(cudaMemcpy(bt.a, a.data(), 4 * bt.na, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(bt.b, b.data(), 4 * bt.nb, cudaMemcpyHostToDevice));
  bt.set_coef(alpha, beta);
  if (alpha == 0.f && beta == 1.f) {
    bt.put_c(c);
    bt.own(rig.st, 1);
    CK(cudaStreamSynchronize(rig.st));
    const std::vector<float> got = bt.get_c();
    const bool same = memcmp(got.data(), c.data(), got.size() * 4) == 0;
    printf("check %ldx%ldx%ld skip: C %s\n", cs.m, cs.n, cs.k, same ? "unchanged" : "CHANGED");
    failures += !same;
    return;
  }
  bt.put_c(c);
  bt.cublas(rig.h, false);
  CK(cudaStreamSynchronize(rig.st));
  const double e_sgemm = max_err(cs, a, b, c, bt.get_c(), alpha, beta);
  printf("check %ldx%ldx%ld (lda %ld, ldb %ld) x%ld alpha %g beta %g data [%g, 1)%s: SGEMM %.3g", cs.m, cs.n, cs.k,
         cs.lda, cs.ldb, cs.count, alpha, beta, lo, nan_c ? " (C NaN)" : "", e_sgemm);
  bool ok = true;
  for (int p : {1, 2, 4, 0}) {
    bt.put_c(c);
    bt.own(rig.st, p);
    CK(cudaStreamSynchronize(rig.st));
    const double e = max_err(cs, a, b, c, bt.get_c(), alpha, beta);
    printf("  kP=%d %.3g (x%.2f)", p, e, e / e_sgemm);
    // the promoted forms must be as exact as SGEMM: within twice its error, or 2^-22 where SGEMM's is near 0
    if (p > 0 && !(e <= std::max(2 * e_sgemm, std::ldexp(1.0, -22)))) ok = false;
  }
  printf("  %s\n", ok ? "ok" : "FAIL");
  failures += !ok;
}

void time_case(MicroRig& rig, const char* name, const Case& cs) {
  Batch bt(cs);
  fill_f32<<<1024, 256, 0, rig.st>>>(bt.a, bt.na, 1);
  fill_f32<<<1024, 256, 0, rig.st>>>(bt.b, bt.nb, 2);
  fill_f32<<<1024, 256, 0, rig.st>>>(bt.cm, bt.nc, 3);
  bt.set_coef(-0.5f, 0.999f);
  CK(cudaStreamSynchronize(rig.st));
  const double gflop = 2.0 * cs.m * cs.n * cs.k * cs.count * 1e-9;
  const float t_sgemm = rig.median_ms([&] { bt.cublas(rig.h, false); }, 20);
  const float t_tf32 = rig.median_ms([&] { bt.cublas(rig.h, true); }, 20);
  printf("time %-28s SGEMM %.3f ms (%.1f TFLOP/s)  TF32 %.3f", name, t_sgemm, gflop / t_sgemm, t_tf32);
  for (int p : {1, 2, 4}) {
    const float t_own = rig.median_ms([&] { bt.own(rig.st, p); }, 20);
    const float t_prod = rig.median_ms([&] { bt.product(rig.st, p); }, 20);
    printf("  kP=%d %.3f (product %.3f, %.1f TFLOP/s; x%.2f of SGEMM)", p, t_own, t_prod, gflop / t_prod,
           t_own / t_sgemm);
  }
  // one product each from the same C: the largest difference relative to |C| + |alpha| k max|a||b|
  std::vector<float> c0 = bt.get_c();
  bt.set_coef(-0.5f, 1.f);
  bt.own(rig.st, 1);
  CK(cudaStreamSynchronize(rig.st));
  const std::vector<float> c1 = bt.get_c();
  bt.put_c(c0);
  bt.cublas(rig.h, false);
  CK(cudaStreamSynchronize(rig.st));
  const std::vector<float> c2 = bt.get_c();
  double worst = 0;
  const double scale = 0.5 * cs.k * 0.05 * 0.05 + 0.05;
  for (size_t i = 0; i < c1.size(); ++i) worst = std::max(worst, std::fabs((double)c1[i] - c2[i]) / scale);
  printf("  max diff from SGEMM %.2g\n", worst);
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0;
  cudaDeviceProp prop{};
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  if (prop.major != 9 || prop.minor != 0 || !x3_encoder()) {
    printf("needs a device of compute capability 9.0 and a driver with tensor maps (this one: %d.%d)\n", prop.major,
           prop.minor);
    return 1;
  }
  MicroRig rig(32 << 20);
  set_smem<0>();
  set_smem<1>();
  set_smem<2>();
  set_smem<4>();
  const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  for (float lo : {-1.f, 0.f}) {
    check_case(rig, {128, 128, 32, 1, 32, 32}, 1.f, 0.f, false, lo);
    check_case(rig, {300, 264, 68, 3, 72, 80}, -0.7f, 0.9f, false, lo);
    check_case(rig, {257, 129, 33, 2, 40, 48}, 1.3f, 1.f, false, lo);
    check_case(rig, {1, 1, 1, 1, 8, 8}, 2.f, -1.f, false, lo);
    check_case(rig, {130, 300, 512, 2, 512, 520}, -0.25f, 0.f, true, lo);
    check_case(rig, {256, 258, 64, 2, 64, 64}, 0.5f, 1.f, false, lo);
    check_case(rig, {384, 256, 512, 2, 512, 512}, -0.5f, 0.999f, false, lo);
    check_case(rig, {256, 384, 192, 2, 192, 192}, -1.f, 1.f, false, lo);
    check_case(rig, {128, 256, 2048, 1, 2048, 2048}, 1.f, 0.f, false, lo);
  }
  check_case(rig, {200, 136, 96, 2, 96, 96}, 0.f, 1.f, false, -1.f);
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
    for (const auto& s : shapes) time_case(rig, s.name, {s.m, s.n, s.k, s.count, s.k, s.k});
  }
  printf("%s\n", failures ? "FAILURES" : "all checks passed");
  return failures ? 1 : 0;
}

// SPDX-License-Identifier: MIT
// Micro-benchmark and check (not built by CMake; docs/benchmarks.md,
// nineteenth session, has the figures): Dion's error feedback and update
// product at exact-fp32 accuracy on Hopper's tensor cores, as a kernel of our
// own (wgmma, the fifteenth session's TMA pipeline of lowrank_wgmma.cuh):
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
//   nvcc -std=c++17 -O3 -arch=sm_90a -o lowrank_3xtf32 bench/micro/lowrank_3xtf32.cu -lcublas && ./lowrank_3xtf32
#include <cmath>
#include <cstring>
#include <random>

#include "lowrank_wgmma.cuh"
#include "micro_util.cuh"

namespace wgmma_micro {
namespace {

constexpr int kXThreads = 256;  // two warpgroups: rows 0..63 and 64..127 of the tile
constexpr int kXStages = 3;
constexpr int kXStageBytes = 4 * kWgTileBytes;  // Ah, Al, Bh, Bl: 64 KiB
constexpr size_t kXSmemBytes = kXStages * kXStageBytes + 1024 + 8 * kXStages;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// D (64 x 128) = (acc ? D : 0) + A B^T over one k-step of 8.
__device__ __forceinline__ void mma_tf32(float (&d)[64], uint64_t a, uint64_t b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
      DION_WG_REGS
      "}, %64, %65, p, 1, 1;\n}\n"
      : DION_WG_OPS(d)
      : "l"(a), "l"(b), "r"(acc));
}

__device__ __forceinline__ void x_issue(const CUtensorMap* const (&maps)[4], uint32_t sa, uint32_t bar, int kcol,
                                        int row0, int col0, int g) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "n"(kXStageBytes) : "memory");
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(sa + i * kWgTileBytes),
        "l"(reinterpret_cast<uint64_t>(maps[i])), "r"(kcol), "r"(i < 2 ? row0 : col0), "r"(g), "r"(bar)
        : "memory");
}
#endif

// Grid: x the column tiles of C, y its row tiles, z the batch (grid-stride).
// Maps: Ah, Al (k, m, batch), Bh, Bl (k, n, batch).
template <int kP>
__global__ void __launch_bounds__(kXThreads, 1)
    lowrank_3xtf32_kernel(const __grid_constant__ CUtensorMap tah, const __grid_constant__ CUtensorMap tal,
                          const __grid_constant__ CUtensorMap tbh, const __grid_constant__ CUtensorMap tbl,
                          void* const* cptr, const float* coef, int64_t count, int64_t m, int64_t n, int64_t k,
                          int64_t ldc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const float alpha = coef[0], beta = coef[1];
  if (alpha == 0.f && beta == 1.f) return;  // a skipped step: C keeps its bits
  extern __shared__ __align__(1024) uint8_t x_smem[];
  const uint32_t base = (smem_addr(x_smem) + 1023u) & ~1023u;
  const uint32_t bars = base + kXStages * kXStageBytes;
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int col0 = static_cast<int>(blockIdx.x) * kWgTile, row0 = static_cast<int>(blockIdx.y) * kWgTile;
  constexpr int kBk = kWgRowBytes / 4;  // k per stage: 32
  const int kt_count = static_cast<int>((k + kBk - 1) / kBk);
  const CUtensorMap* const maps[4] = {&tah, &tal, &tbh, &tbl};
  if (tid == 0) {
    for (int s = 0; s < kXStages; ++s) wg_bar_init(bars + 8 * s);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  uint32_t loaded = 0, used = 0;
  for (int64_t g = blockIdx.z; g < count; g += gridDim.z) {
    float* C = static_cast<float*>(cptr[g]);
    if (tid == 0)
      for (int s = 0; s < kXStages - 1 && s < kt_count; ++s, ++loaded) {
        const uint32_t st = loaded % kXStages;
        x_issue(maps, base + st * kXStageBytes, bars + 8 * st, s * kBk, row0, col0, static_cast<int>(g));
      }
    float d[64], t[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = t[i] = 0.f;
    for (int kt = 0; kt < kt_count; ++kt, ++used) {
      const uint32_t st = used % kXStages;
      wg_bar_wait(bars + 8 * st, (used / kXStages) & 1u);
      const uint32_t sah = base + st * kXStageBytes + wg * 64 * kWgRowBytes, sal = sah + kWgTileBytes;
      const uint32_t sbh = base + st * kXStageBytes + 2 * kWgTileBytes, sbl = sbh + kWgTileBytes;
      if constexpr (kP == 0) {  // everything accumulated in the tensor cores
        wg_fence_regs(d);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          mma_tf32(d, wg_desc(sal + 32 * kk), wg_desc(sbh + 32 * kk), 1);
          mma_tf32(d, wg_desc(sah + 32 * kk), wg_desc(sbl + 32 * kk), 1);
          mma_tf32(d, wg_desc(sah + 32 * kk), wg_desc(sbh + 32 * kk), 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_fence_regs(d);
      } else {
#pragma unroll
        for (int c = 0; c < 4 / kP; ++c) {
          wg_fence_regs(t);
          asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
          for (int j = 0; j < kP; ++j) {
            const int kk = c * kP + j;
            mma_tf32(t, wg_desc(sal + 32 * kk), wg_desc(sbh + 32 * kk), j > 0);
            mma_tf32(t, wg_desc(sah + 32 * kk), wg_desc(sbl + 32 * kk), 1);
            mma_tf32(t, wg_desc(sah + 32 * kk), wg_desc(sbh + 32 * kk), 1);
          }
          asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
          wg_fence_regs(t);
#pragma unroll
          for (int i = 0; i < 64; ++i) d[i] += t[i];
        }
      }
      __syncthreads();  // both warpgroups are done with this stage: the previous one may be refilled
      const int nk = kt + kXStages - 1;
      if (tid == 0 && nk < kt_count) {
        const uint32_t ns = loaded % kXStages;
        x_issue(maps, base + ns * kXStageBytes, bars + 8 * ns, nk * kBk, row0, col0, static_cast<int>(g));
        ++loaded;
      }
    }
    const bool pairs = reinterpret_cast<uintptr_t>(C) % 8 == 0 && ldc % 2 == 0;
    const int r0 = row0 + 64 * wg;
    if (pairs && r0 + 64 <= m && col0 + kWgTile <= n)
      wg_store<true>(d, C, ldc, m, n, r0, col0, alpha, beta, pairs, wtid);
    else
      wg_store<false>(d, C, ldc, m, n, r0, col0, alpha, beta, pairs, wtid);
    __syncthreads();
  }
#endif
}

// hi = x rounded to TF32 (to nearest, ties away), lo = (x - hi) rounded the same way.
__global__ void split_tf32_kernel(const float* x, float* hi, float* lo, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float v = x[i];
    uint32_t h, l;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(h) : "f"(v));
    const float r = v - __uint_as_float(h);
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(l) : "f"(r));
    hi[i] = __uint_as_float(h);
    lo[i] = __uint_as_float(l);
  }
}

template <int kP>
void x_set_smem() {
  check(cudaFuncSetAttribute(lowrank_3xtf32_kernel<kP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kXSmemBytes)),
        "cudaFuncSetAttribute (lowrank_3xtf32)");
}

}  // namespace

inline void lowrank_3xtf32_init() {
  x_set_smem<0>();
  x_set_smem<1>();
  x_set_smem<2>();
  x_set_smem<4>();
}

// The split parts of A and B (the same layout as A and B) and the product.
inline bool lowrank_3xtf32(const Ctx& c, ConstMatBatch ah, ConstMatBatch al, ConstMatBatch bh, ConstMatBatch bl,
                           void* const* cptr, const float* coef, int64_t count, int64_t ldc, int promote) {
  const int64_t m = ah.rows, n = bh.rows, k = ah.cols;
  if (count <= 0 || m <= 0 || n <= 0) return true;
  const int64_t tiles_m = (m + kWgTile - 1) / kWgTile, tiles_n = (n + kWgTile - 1) / kWgTile;
  CUtensorMap t[4];
  if (tiles_m > 65535 || !wg_map(&t[0], ah.p, ah.stride, ah.ld, m, k, count, false) ||
      !wg_map(&t[1], al.p, al.stride, al.ld, m, k, count, false) ||
      !wg_map(&t[2], bh.p, bh.stride, bh.ld, n, k, count, false) ||
      !wg_map(&t[3], bl.p, bl.stride, bl.ld, n, k, count, false))
    return false;
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m),
                  static_cast<unsigned>(count < 65535 ? count : 65535));
#define X_LAUNCH(P)                                                                                        \
  lowrank_3xtf32_kernel<P><<<grid, kXThreads, kXSmemBytes, c.stream>>>(t[0], t[1], t[2], t[3], cptr, coef, \
                                                                        count, m, n, k, ldc)
  switch (promote) {
    case 0: X_LAUNCH(0); break;
    case 1: X_LAUNCH(1); break;
    case 2: X_LAUNCH(2); break;
    default: X_LAUNCH(4); break;
  }
#undef X_LAUNCH
  check(cudaGetLastError(), "lowrank_3xtf32_kernel");
  return true;
}

inline void split_tf32(const Ctx& c, const float* x, float* hi, float* lo, int64_t n) {
  split_tf32_kernel<<<4 * c.sms, 256, 0, c.stream>>>(x, hi, lo, n);
  check(cudaGetLastError(), "split_tf32_kernel");
}

}  // namespace wgmma_micro

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
    for (float** p : {&a, &ah, &al}) CK(cudaMalloc(p, 4 * na + 16));
    for (float** p : {&b, &bh, &bl}) CK(cudaMalloc(p, 4 * nb + 16));
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
    const wgmma_micro::Ctx x{st, 132};
    wgmma_micro::split_tf32(x, a, ah, al, na);
    wgmma_micro::split_tf32(x, b, bh, bl, nb);
    product(st, promote);
  }
  void product(cudaStream_t st, int promote) {
    const wgmma_micro::Ctx x{st, 132};
    auto mat = [&](const float* p, int64_t rows, int64_t ld) {
      return wgmma_micro::ConstMatBatch{p, rows, c.k, ld, rows * ld, c.count};
    };
    if (!wgmma_micro::lowrank_3xtf32(x, mat(ah, c.m, c.lda), mat(al, c.m, c.lda), mat(bh, c.n, c.ldb),
                                     mat(bl, c.n, c.ldb), ptr + 2 * c.count, coef, c.count, c.n, promote)) {
      printf("lowrank_3xtf32: no tensor maps\n");
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
  if (!wgmma_micro::lowrank_sm90a_ok(prop.major, prop.minor)) {
    printf("needs a device of compute capability 9.0 and a driver with tensor maps (this one: %d.%d)\n", prop.major,
           prop.minor);
    return 1;
  }
  MicroRig rig(32 << 20);
  wgmma_micro::lowrank_3xtf32_init();
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

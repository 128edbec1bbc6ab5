// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// fp32-accurate products on tensor cores. For the shapes of Dion's fp32 step,
// times and checks against a float64 product
//   sgemm   cuBLAS CUBLAS_COMPUTE_32F (SIMT fp32)
//   tf32    CUBLAS_COMPUTE_32F_FAST_TF32 (one tf32 product: not fp32-accurate)
//   bf16x9  CUBLAS_COMPUTE_32F_EMULATED_16BFX9 with the EAGER emulation strategy
//   3xtf32  A = Ah + Al, B = Bh + Bl (Ah, Bh rounded to tf32, the rest exact
//           in fp32), C = Ah Bh + Ah Bl + Al Bh as ONE tf32 product with the
//           inner dim tripled: [Ah Ah Al] [Bh; Bl; Bh]; the split passes timed in.
// The error is max_ij |C - C64|_ij / (|A| |B|)_ij (the componentwise bound's
// scale), over the first matrix of the batch.
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o fp32_split bench/micro/fp32_split.cu -lcublas && ./fp32_split
#include <cmath>
#include <random>

#include "micro_util.cuh"

__device__ __forceinline__ float tf32_round(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;  // Inf/NaN
  u += 0x1000u;                                     // round half away in magnitude
  u &= 0xffffe000u;
  return __uint_as_float(u);
}

// src: rows x cols column-major (ld = rows), batch stride rows*cols. The K dim
// is `cols` (k_cols) or `rows`. Output: the K dim tripled, dense, blocks in
// pattern p (0: h h l, 1: h l h).
__global__ void split3(const float* __restrict__ src, float* __restrict__ dst, int rows, int cols, long batch,
                       bool k_cols, int pattern) {
  const long per = (long)rows * cols;
  const long total = per * batch;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
    const long bidx = i / per, e = i % per;
    const int r = (int)(e % rows), c = (int)(e / rows);
    const float x = src[i], h = tf32_round(x), l = x - h;
    const float v0 = h, v1 = pattern == 0 ? h : l, v2 = pattern == 0 ? l : h;
    float* out = dst + bidx * per * 3;
    if (k_cols) {  // out: rows x 3cols, ld rows
      out[(long)c * rows + r] = v0;
      out[(long)(c + cols) * rows + r] = v1;
      out[(long)(c + 2 * cols) * rows + r] = v2;
    } else {  // out: 3rows x cols, ld 3rows
      out[(long)c * 3 * rows + r] = v0;
      out[(long)c * 3 * rows + r + rows] = v1;
      out[(long)c * 3 * rows + r + 2 * rows] = v2;
    }
  }
}

__global__ void to_double(const float* s, double* d, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) d[i] = s[i];
}
__global__ void abs_double(const float* s, double* d, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) d[i] = fabs((double)s[i]);
}

struct Case {
  const char* name;
  int m, n, k, batch;
  bool ta, tb;  // op(A) = A^T (A stored k x m), op(B) = B^T (B stored n x k)
  float beta;
};

int main() {
  MicroRig rig(64u << 20);
  cublasHandle_t h = rig.h;
  cudaStream_t st = rig.st;
  // Column-major views of Dion's row-major products (gpt-1.3b r = 512, k = 640; gpt-160m r = 192).
  const Case cases[] = {
      {"ef/update 8192x2048 r512", 2048, 8192, 512, 24, false, true, 1.0f},
      {"ef/update 6144x2048 r512", 2048, 6144, 512, 24, false, true, 1.0f},
      {"solve P R^-1 8192x512", 512, 8192, 512, 24, false, false, 0.0f},
      {"gram P^T P 8192x512", 512, 512, 8192, 24, false, true, 0.0f},
      {"sketch S P 640x8192x512", 512, 640, 8192, 24, false, false, 0.0f},
      {"P = B Q 8192x2048 r512", 512, 8192, 2048, 24, false, false, 0.0f},
      {"160m ef 3072x768 r192", 768, 3072, 192, 12, false, true, 1.0f},
      {"160m P = B Q 3072x768", 192, 3072, 768, 12, false, false, 0.0f},
  };
  std::mt19937 gen(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  printf("%-28s %9s %9s %9s %9s %9s | %9s %9s %9s %9s\n", "case", "sgemm", "tf32", "bf16x9", "3xtf32", "(gemm)",
         "err sg", "err tf32", "err bx9", "err 3x");
  for (const Case& c : cases) {
    const long sa = (long)c.m * c.k, sb = (long)c.k * c.n, sc = (long)c.m * c.n;
    std::vector<float> ha(sa * c.batch), hb(sb * c.batch), hc(sc * c.batch);
    for (auto& x : ha) x = nd(gen);
    for (auto& x : hb) x = nd(gen) * 1e-2f;
    for (auto& x : hc) x = nd(gen);
    float *A, *B, *C0, *C, *A3, *B3;
    CK(cudaMalloc(&A, 4 * sa * c.batch));
    CK(cudaMalloc(&B, 4 * sb * c.batch));
    CK(cudaMalloc(&C0, 4 * sc * c.batch));
    CK(cudaMalloc(&C, 4 * sc * c.batch));
    CK(cudaMalloc(&A3, 12 * sa * c.batch));
    CK(cudaMalloc(&B3, 12 * sb * c.batch));
    CK(cudaMemcpy(A, ha.data(), 4 * sa * c.batch, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hb.data(), 4 * sb * c.batch, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(C0, hc.data(), 4 * sc * c.batch, cudaMemcpyHostToDevice));
    const int lda = c.ta ? c.k : c.m, ldb = c.tb ? c.n : c.k;
    const float one = 1.f;
    auto gemm = [&](cublasComputeType_t ct) {
      CK(cublasGemmStridedBatchedEx(h, c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, c.m, c.n,
                                    c.k, &one, A, CUDA_R_32F, lda, sa, B, CUDA_R_32F, ldb, sb, &c.beta, C, CUDA_R_32F,
                                    c.m, sc, c.batch, ct, CUBLAS_GEMM_DEFAULT));
    };
    // 3xtf32: A's K dim is its cols (no trans) or rows (trans); B's K dim is its rows (no trans) or cols (trans).
    auto split_gemm = [&](bool with_split) {
      if (with_split) {
        split3<<<1024, 256, 0, st>>>(A, A3, c.ta ? c.k : c.m, c.ta ? c.m : c.k, c.batch, !c.ta, 0);
        split3<<<1024, 256, 0, st>>>(B, B3, c.tb ? c.n : c.k, c.tb ? c.k : c.n, c.batch, c.tb, 1);
      }
      const int lda3 = c.ta ? 3 * c.k : c.m, ldb3 = c.tb ? c.n : 3 * c.k;
      CK(cublasGemmStridedBatchedEx(h, c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, c.m, c.n,
                                    3 * c.k, &one, A3, CUDA_R_32F, lda3, 3 * sa, B3, CUDA_R_32F, ldb3, 3 * sb,
                                    &c.beta, C, CUDA_R_32F, c.m, sc, c.batch, CUBLAS_COMPUTE_32F_FAST_TF32,
                                    CUBLAS_GEMM_DEFAULT));
    };
    auto time_it = [&](auto&& fn) { return rig.median_ms(fn, 15); };
    // float64 reference of the first matrix: C64 = op(A) op(B) + beta C0, and the scale |A| |B|.
    double *Ad, *Bd, *Cd, *Aa, *Ba, *Sd;
    CK(cudaMalloc(&Ad, 8 * sa));
    CK(cudaMalloc(&Bd, 8 * sb));
    CK(cudaMalloc(&Cd, 8 * sc));
    CK(cudaMalloc(&Aa, 8 * sa));
    CK(cudaMalloc(&Ba, 8 * sb));
    CK(cudaMalloc(&Sd, 8 * sc));
    to_double<<<256, 256, 0, st>>>(A, Ad, sa);
    to_double<<<256, 256, 0, st>>>(B, Bd, sb);
    to_double<<<256, 256, 0, st>>>(C0, Cd, sc);
    abs_double<<<256, 256, 0, st>>>(A, Aa, sa);
    abs_double<<<256, 256, 0, st>>>(B, Ba, sb);
    const double oned = 1.0, betad = c.beta, zerod = 0.0;
    CK(cublasDgemm(h, c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, c.m, c.n, c.k, &oned, Ad,
                   lda, Bd, ldb, &betad, Cd, c.m));
    CK(cublasDgemm(h, c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, c.m, c.n, c.k, &oned, Aa,
                   lda, Ba, ldb, &zerod, Sd, c.m));
    std::vector<double> c64(sc), s64(sc);
    CK(cudaMemcpy(c64.data(), Cd, 8 * sc, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(s64.data(), Sd, 8 * sc, cudaMemcpyDeviceToHost));
    auto err = [&]() {
      std::vector<float> out(sc);
      CK(cudaMemcpy(out.data(), C, 4 * sc, cudaMemcpyDeviceToHost));
      double e = 0;
      for (long i = 0; i < sc; ++i) {
        if (!std::isfinite(out[i])) return (double)INFINITY;
        e = std::max(e, std::fabs(out[i] - c64[i]) / (s64[i] + 1e-300));
      }
      return e;
    };
    auto fresh = [&]() { CK(cudaMemcpyAsync(C, C0, 4 * sc * c.batch, cudaMemcpyDeviceToDevice, st)); };
    float t_sg, t_tf, t_bx = NAN, t_3, t_3g;
    double e_sg, e_tf, e_bx = NAN, e_3;
    t_sg = time_it([&] { gemm(CUBLAS_COMPUTE_32F); });
    fresh(); gemm(CUBLAS_COMPUTE_32F); e_sg = err();
    t_tf = time_it([&] { gemm(CUBLAS_COMPUTE_32F_FAST_TF32); });
    fresh(); gemm(CUBLAS_COMPUTE_32F_FAST_TF32); e_tf = err();
    if (cublasSetEmulationStrategy(h, CUBLAS_EMULATION_STRATEGY_EAGER) == CUBLAS_STATUS_SUCCESS) {
      fresh();
      if (cublasGemmStridedBatchedEx(h, c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, c.m, c.n,
                                     c.k, &one, A, CUDA_R_32F, lda, sa, B, CUDA_R_32F, ldb, sb, &c.beta, C, CUDA_R_32F,
                                     c.m, sc, c.batch, CUBLAS_COMPUTE_32F_EMULATED_16BFX9,
                                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS) {
        e_bx = err();
        t_bx = time_it([&] { gemm(CUBLAS_COMPUTE_32F_EMULATED_16BFX9); });
      }
      cublasSetEmulationStrategy(h, CUBLAS_EMULATION_STRATEGY_DEFAULT);
    }
    t_3 = time_it([&] { split_gemm(true); });
    t_3g = time_it([&] { split_gemm(false); });
    fresh(); split_gemm(true); e_3 = err();
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    printf("%-28s %9.3f %9.3f %9.3f %9.3f %9.3f | %9.2e %9.2e %9.2e %9.2e\n", c.name, t_sg, t_tf, t_bx, t_3, t_3g,
           e_sg, e_tf, e_bx, e_3);
    for (void* p : {(void*)A, (void*)B, (void*)C0, (void*)C, (void*)A3, (void*)B3, (void*)Ad, (void*)Bd, (void*)Cd,
                    (void*)Aa, (void*)Ba, (void*)Sd})
      cudaFree(p);
  }
  printf("times: median of 15, ms, whole batch; errors: max |C - C64| / (|A||B|), first matrix; 2^-24 = %.2e\n",
         std::ldexp(1.0, -24));
  return 0;
}

// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// how much of RCQR's latency-bound chain of small products could hide behind
// a bandwidth-bound pass on another stream. The chain stands in for the
// factorizations of gpt-1.3b's 96 slots at r = 512: the fp64 Gram matrix of
// the sketches (96 x 512 x 512 x 640, the whole square), 8 steps of a
// blocked fp64 Cholesky's two GEMMs (panel m x 64 x 64, trailing m x m x 64),
// the same in fp32 for the second Cholesky, and two triangular inverses by
// levels (a batched trsm of the 64 x 64 diagonal blocks, then 2 fp32 GEMMs
// per level of 64, 128 and 256, over every node). The operands' values and
// places are not the library's (zeros and identities, dense batches); the
// calls' shapes and batch counts are. The pass stands in for Dion's momentum pass
// over gpt-1.3b in bf16 (M += G over 1.2e9 elements: read 2, write 1, 2 bytes
// each), by a grid-stride loop over 8, 4 or 2 blocks per SM or by one block
// per 2048 elements. Timed: each alone, then both started together on two
// streams (the time until both are done), medians of 20; the chain's stream
// at the default or (argument "hi") the highest priority.
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o overlap_chain bench/micro/overlap_chain.cu -lcublas && ./overlap_chain && ./overlap_chain hi
#include "micro_util.cuh"

namespace {
constexpr int kB = 96, kR = 512, kK = 640, kNb = 64;

__global__ void axpy_bf16(__nv_bfloat16* y, const __nv_bfloat16* x, long n) {
  const long n8 = n / 8;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n8; i += (long)gridDim.x * blockDim.x) {
    uint4 a = reinterpret_cast<const uint4*>(y)[i], b = reinterpret_cast<const uint4*>(x)[i];
    __nv_bfloat162* pa = reinterpret_cast<__nv_bfloat162*>(&a);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int k = 0; k < 4; ++k) pa[k] = __hadd2(pa[k], pb[k]);
    reinterpret_cast<uint4*>(y)[i] = a;
  }
}

struct Chain {
  cublasHandle_t h;
  double *x, *g, *pd;
  float *gf, *pf, *inv, *tmp, *u;
  const float** tp;  // trsm pointers (device)
  float** tpo;
  void run() const {
    const double one = 1.0, zero = 0.0, m1 = -1.0;
    const float onef = 1.0f, zerof = 0.0f, m1f = -1.0f;
    CK(cublasDgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, kR, kR, kK, &one, x, kR, (long)kK * kR, x, kR,
                                 (long)kK * kR, &zero, g, kR, (long)kR * kR, kB));
    for (int o = 0; o + kNb < kR; o += kNb) {  // fp64 Cholesky's panels and trailing updates
      const int m = kR - o - kNb;
      CK(cublasDgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, m, kNb, kNb, &one, g + (long)o * kR + o + kNb, kR,
                                   (long)kR * kR, pd, kNb, kNb * kNb, &zero, pd + kB * kNb * kNb, m, (long)m * kNb,
                                   kB));
      CK(cublasDgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, m, m, kNb, &m1, pd + kB * kNb * kNb, m, (long)m * kNb,
                                   pd + kB * kNb * kNb, m, (long)m * kNb, &one, g + (long)(o + kNb) * kR + o + kNb, kR,
                                   (long)kR * kR, kB));
    }
    for (int o = 0; o + kNb < kR; o += kNb) {  // fp32 Cholesky's
      const int m = kR - o - kNb;
      CK(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, m, kNb, kNb, &onef, gf + (long)o * kR + o + kNb, kR,
                                   (long)kR * kR, pf, kNb, kNb * kNb, &zerof, pf + kB * kNb * kNb, m, (long)m * kNb,
                                   kB));
      CK(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, m, m, kNb, &m1f, pf + kB * kNb * kNb, m, (long)m * kNb,
                                   pf + kB * kNb * kNb, m, (long)m * kNb, &onef, gf + (long)(o + kNb) * kR + o + kNb,
                                   kR, (long)kR * kR, kB));
    }
    for (int rep = 0; rep < 2; ++rep) {  // two inverses by levels
      CK(cublasStrsmBatched(h, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, kNb, kNb,
                            &onef, tp, kR, tpo, kR, kB * (kR / kNb)));
      for (int hh = kNb; hh < kR; hh *= 2) {  // per level: T = A^-1 B, then -T C^-1, over every node
        const int cnt = kB * (kR / (2 * hh));
        const long st = (long)hh * hh;
        CK(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, hh, hh, hh, &onef, u, hh, st, inv, hh, st, &zerof,
                                     tmp, hh, st, cnt));
        CK(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, hh, hh, hh, &m1f, inv, hh, st, tmp, hh, st, &zerof,
                                     tmp + (long)kB * kR * kR / 2, hh, st, cnt));
      }
    }
  }
};
}  // namespace

int main(int argc, char** argv) {
  MicroRig rig(64u << 20);
  // The chain's stream at the lowest or the highest priority (argv[1] = "hi").
  int lo_p = 0, hi_p = 0;
  CK(cudaDeviceGetStreamPriorityRange(&lo_p, &hi_p));
  cudaStream_t s2;
  CK(cudaStreamCreateWithPriority(&s2, cudaStreamNonBlocking, argc > 1 ? hi_p : lo_p));
  cublasHandle_t h2;
  CK(cublasCreate(&h2));
  CK(cublasSetStream(h2, s2));
  void* ws2;
  CK(cudaMalloc(&ws2, 64u << 20));
  CK(cublasSetWorkspace(h2, ws2, 64u << 20));
  Chain c{h2};
  CK(cudaMalloc(&c.x, sizeof(double) * kB * kK * kR));
  CK(cudaMalloc(&c.g, sizeof(double) * kB * kR * kR));
  CK(cudaMalloc(&c.pd, sizeof(double) * 2 * kB * kR * kNb));
  CK(cudaMalloc(&c.gf, sizeof(float) * kB * kR * kR));
  CK(cudaMalloc(&c.pf, sizeof(float) * 2 * kB * kR * kNb));
  CK(cudaMalloc(&c.inv, sizeof(float) * kB * kR * kR));
  CK(cudaMalloc(&c.tmp, sizeof(float) * kB * kR * kR));
  CK(cudaMalloc(&c.u, sizeof(float) * kB * kR * kR));
  CK(cudaMemset(c.x, 0, sizeof(double) * kB * kK * kR));
  CK(cudaMemset(c.g, 0, sizeof(double) * kB * kR * kR));
  CK(cudaMemset(c.pd, 0, sizeof(double) * 2 * kB * kR * kNb));
  CK(cudaMemset(c.gf, 0, sizeof(float) * kB * kR * kR));
  CK(cudaMemset(c.pf, 0, sizeof(float) * 2 * kB * kR * kNb));
  CK(cudaMemset(c.inv, 0, sizeof(float) * kB * kR * kR));
  CK(cudaMemset(c.u, 0, sizeof(float) * kB * kR * kR));
  {  // trsm pointers: the 64 x 64 diagonal blocks of every matrix; unit diagonal so the solve is finite
    std::vector<float> one(kB * (long)kR * kR, 0.0f);
    for (long b = 0; b < kB; ++b)
      for (int i = 0; i < kR; ++i) one[b * kR * kR + (long)i * kR + i] = 1.0f;
    CK(cudaMemcpy(c.u, one.data(), one.size() * sizeof(float), cudaMemcpyHostToDevice));
    std::vector<const float*> a;
    std::vector<float*> o;
    for (long b = 0; b < kB; ++b)
      for (int j = 0; j < kR / kNb; ++j) {
        a.push_back(c.u + b * kR * kR + (long)j * kNb * (kR + 1));
        o.push_back(c.inv + b * kR * kR + (long)j * kNb * (kR + 1));
      }
    CK(cudaMalloc(&c.tp, a.size() * sizeof(void*)));
    CK(cudaMalloc(&c.tpo, o.size() * sizeof(void*)));
    CK(cudaMemcpy(c.tp, a.data(), a.size() * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(c.tpo, o.data(), o.size() * sizeof(void*), cudaMemcpyHostToDevice));
  }
  const long n = 1207959552L;  // gpt-1.3b's matrix parameters
  __nv_bfloat16 *y, *x;
  CK(cudaMalloc(&y, n * 2));
  CK(cudaMalloc(&x, n * 2));
  fill_bf16<<<1024, 256, 0, rig.st>>>(y, n, 1);
  fill_bf16<<<1024, 256, 0, rig.st>>>(x, n, 2);
  CK(cudaDeviceSynchronize());
  // The pass's grid: blocks per SM (a grid-stride loop: its blocks hold their SMs to the end), or 0: one
  // chunk of 8 per thread, blocks that finish and free their SM at once.
  int per_sm = 8;
  auto pass = [&](cudaStream_t s) {
    const long blocks = per_sm > 0 ? 132L * per_sm : (n / 8 + 255) / 256;
    axpy_bf16<<<(unsigned)blocks, 256, 0, s>>>(y, x, n);
  };
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&e2));
  auto timed = [&](int mode) {  // 0: chain, 1: pass, 2: both
    std::vector<float> t;
    for (int r = 0; r < 23; ++r) {
      CK(cudaDeviceSynchronize());
      CK(cudaEventRecord(e0, rig.st));
      CK(cudaStreamWaitEvent(s2, e0, 0));
      if (mode != 0) pass(rig.st);  // first: the chain's host-side enqueueing must not delay it
      if (mode != 1) c.run();
      CK(cudaEventRecord(e1, s2));
      CK(cudaStreamWaitEvent(rig.st, e1, 0));
      CK(cudaEventRecord(e2, rig.st));
      CK(cudaEventSynchronize(e2));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e2));
      if (r >= 3) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  printf("chain's stream priority: %s\n", argc > 1 ? "highest" : "default");
  for (int round = 0; round < 2; ++round)
    for (int ps : {8, 4, 2, 0}) {
      per_sm = ps;
      const float chain = timed(0), p = timed(1), both = timed(2);
      printf("round %d, pass grid %s%d: chain %.3f ms, pass %.3f ms, sum %.3f, both on two streams %.3f (hidden %.3f)\n",
             round + 1, ps ? "blocks per SM " : "one chunk per thread", ps, chain, p, chain + p, both,
             chain + p - both);
    }
  return 0;
}

// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// whether Dion's momentum pass of one bucket (bandwidth-bound) hides behind
// the product P = B Q of the bucket before it (arithmetic-bound) when the two
// run on two streams. Shapes of gpt-1.3b's fc1 class at r = 512: B is 24
// matrices of 8192 x 2048, Q 24 of 2048 x 512; the pass is M += G over 24
// such B (read 2, write 1), a grid-stride loop over 16 blocks of 256 per SM
// as the library's passes are, or one block per 2048 elements ("short").
// Precisions: fp32 (SIMT SGEMM, fp32 pass), tf32 (fp32 operands, TF32
// tensor cores, fp32 pass), bf16 (bf16 operands and pass). Timed (medians of
// 20, CUDA events): each alone, both in sequence on one stream, and both
// started together on two streams (the time until both are done), the GEMM's
// stream at the default or the highest priority.
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o overlap_pass_gemm bench/micro/overlap_pass_gemm.cu -lcublas && ./overlap_pass_gemm
#include "micro_util.cuh"

namespace {
constexpr int kBatch = 24, kA = 8192, kB = 2048, kR = 512;

__global__ void pass_f32(float* m, const float* g, long n) {
  const long n4 = n / 4;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n4; i += (long)gridDim.x * blockDim.x) {
    float4 a = reinterpret_cast<const float4*>(m)[i];
    const float4 b = reinterpret_cast<const float4*>(g)[i];
    a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
    reinterpret_cast<float4*>(m)[i] = a;
  }
}
__global__ void pass_bf16(__nv_bfloat16* m, const __nv_bfloat16* g, long n) {
  const long n8 = n / 8;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n8; i += (long)gridDim.x * blockDim.x) {
    uint4 a = reinterpret_cast<const uint4*>(m)[i];
    const uint4 b = reinterpret_cast<const uint4*>(g)[i];
    __nv_bfloat162* pa = reinterpret_cast<__nv_bfloat162*>(&a);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int k = 0; k < 4; ++k) pa[k] = __hadd2(pa[k], pb[k]);
    reinterpret_cast<uint4*>(m)[i] = a;
  }
}

enum Prec { kF32, kTF32, kBF16 };
const char* name(Prec p) { return p == kF32 ? "fp32" : p == kTF32 ? "tf32" : "bf16"; }
}  // namespace

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const long nb = (long)kBatch * kA * kB, nq = (long)kBatch * kB * kR, np = (long)kBatch * kA * kR;
  void *A, *Q, *P, *M, *G;
  CK(cudaMalloc(&A, nb * 4));
  CK(cudaMalloc(&Q, nq * 4));
  CK(cudaMalloc(&P, np * 4));
  CK(cudaMalloc(&M, nb * 4));
  CK(cudaMalloc(&G, nb * 4));
  int lo = 0, hi = 0;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t s1, s1hi, s2;
  CK(cudaStreamCreateWithPriority(&s1, cudaStreamNonBlocking, 0));
  CK(cudaStreamCreateWithPriority(&s1hi, cudaStreamNonBlocking, hi));
  CK(cudaStreamCreateWithPriority(&s2, cudaStreamNonBlocking, 0));
  MicroRig rig(64 << 20);
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  for (Prec p : {kF32, kTF32, kBF16}) {
    const bool b16 = p == kBF16;
    if (b16) {
      fill_bf16<<<sms * 8, 256>>>(static_cast<__nv_bfloat16*>(A), nb, 1);
      fill_bf16<<<sms * 8, 256>>>(static_cast<__nv_bfloat16*>(Q), nq, 2);
      fill_bf16<<<sms * 8, 256>>>(static_cast<__nv_bfloat16*>(M), nb, 3);
      fill_bf16<<<sms * 8, 256>>>(static_cast<__nv_bfloat16*>(G), nb, 4);
    } else {
      fill_f32<<<sms * 8, 256>>>(static_cast<float*>(A), nb, 1);
      fill_f32<<<sms * 8, 256>>>(static_cast<float*>(Q), nq, 2);
      fill_f32<<<sms * 8, 256>>>(static_cast<float*>(M), nb, 3);
      fill_f32<<<sms * 8, 256>>>(static_cast<float*>(G), nb, 4);
    }
    CK(cudaDeviceSynchronize());
    const cudaDataType dt = b16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t ct = p == kTF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    auto gemm = [&](cudaStream_t s) {
      const float one = 1.0f, zero = 0.0f;
      CK(cublasSetStream(rig.h, s));
      // P (r x a, column-major) = Q^T (r x b) B (b x a): P = B Q in row-major terms.
      CK(cublasGemmStridedBatchedEx(rig.h, CUBLAS_OP_N, CUBLAS_OP_N, kR, kA, kB, &one, Q, dt, kR, (long)kB * kR, A,
                                    dt, kB, (long)kA * kB, &zero, P, dt, kR, (long)kA * kR, kBatch, ct,
                                    CUBLAS_GEMM_DEFAULT));
    };
    auto pass = [&](cudaStream_t s, bool shrt) {
      const long per = b16 ? 8 : 4;
      const unsigned blocks = shrt ? (unsigned)((nb / per + 255) / 256) : (unsigned)(sms * 16);
      if (b16)
        pass_bf16<<<blocks, 256, 0, s>>>(static_cast<__nv_bfloat16*>(M), static_cast<const __nv_bfloat16*>(G), nb);
      else
        pass_f32<<<blocks, 256, 0, s>>>(static_cast<float*>(M), static_cast<const float*>(G), nb);
    };
    // Both on two streams, forked from and joined into rig.st.
    auto both = [&](cudaStream_t sg, bool shrt, bool pass_first) {
      CK(cudaEventRecord(fork, rig.st));
      CK(cudaStreamWaitEvent(sg, fork));
      CK(cudaStreamWaitEvent(s2, fork));
      if (pass_first) pass(s2, shrt);
      gemm(sg);
      if (!pass_first) pass(s2, shrt);
      CK(cudaEventRecord(join, sg));
      CK(cudaStreamWaitEvent(rig.st, join));
      CK(cudaEventRecord(join, s2));
      CK(cudaStreamWaitEvent(rig.st, join));
    };
    const float tg = rig.median_ms([&] { gemm(rig.st); }, 20);
    const float tp = rig.median_ms([&] { pass(rig.st, false); }, 20);
    const float tps = rig.median_ms([&] { pass(rig.st, true); }, 20);
    const float ts = rig.median_ms([&] { gemm(rig.st); pass(rig.st, false); }, 20);
    printf("%s: gemm %.3f ms (%.1f TFLOP/s), pass %.3f (short blocks %.3f), in sequence %.3f\n", name(p), tg,
           2.0 * kBatch * kA * kB * kR / tg / 1e9, tp, tps, ts);
    for (int prio = 0; prio < 2; ++prio)
      for (int shrt = 0; shrt < 2; ++shrt)
        for (int pf = 0; pf < 2; ++pf) {
          const float t = rig.median_ms([&] { both(prio ? s1hi : s1, shrt, pf); }, 20);
          printf("  two streams, gemm priority %s, pass %s, %s first: %.3f ms (saves %.3f)\n",
                 prio ? "high" : "default", shrt ? "short blocks" : "grid-stride", pf ? "pass" : "gemm", t, ts - t);
        }
  }
  return 0;
}

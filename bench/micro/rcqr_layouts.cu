// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// the TF32 products of RCQR's two passes over P1 (gpt-1.3b's fc1 bucket: 24
// matrices of a = 8192 rows, rank r = 512) with P1 stored as the library
// stores it (row-major a x r: the Gram matrix P1^T P1 reads both operands
// along M/N, not along K) and stored transposed (row-major r x a: the Gram
// matrix reads both along K, which Hopper's TF32 kernels prefer), which the
// first solve could write at no cost (C^T = B^T A^T). Timed per layout:
//   first solve   P1 = P X1 (X1 = R1^-1, r x r; P row-major a x r), P1 written
//                 in the layout;
//   Gram          P1^T P1 in row chunks of 2048 (S = 4, as gram_splits), the
//                 whole r x r product per chunk, and the 10 lower 128 x 128
//                 blocks per chunk in one pointer-array call (as gram);
//   second solve  Y = P1 X2, Y row-major a x r as the library needs it.
// Every call is cuBLAS with CUBLAS_COMPUTE_32F_FAST_TF32; where the operand
// order of the small matrix is free (X stored either way), the faster. Then
// a sweep of the library layout's Gram over the chunk count S and the block
// grid nb (a = 8192 and 2048).
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o rcqr_layouts bench/micro/rcqr_layouts.cu -lcublas && ./rcqr_layouts
#include "micro_util.cuh"

namespace {
constexpr int kT = 24, kA = 8192, kR = 512, kS = 4, kChunk = kA / kS, kNb = 4, kBs = kR / kNb;
constexpr cublasComputeType_t kTf32 = CUBLAS_COMPUTE_32F_FAST_TF32;

// Device copy of a host pointer list.
const void** device_ptrs(const std::vector<const void*>& v) {
  const void** d;
  CK(cudaMalloc(&d, v.size() * sizeof(void*)));
  CK(cudaMemcpy(d, v.data(), v.size() * sizeof(void*), cudaMemcpyHostToDevice));
  return d;
}
}  // namespace

int main() {
  MicroRig rig(64u << 20);
  cublasHandle_t h = rig.h;
  const long per = (long)kA * kR, n = kT * per;
  float *P, *P1, *P1t, *Y, *X, *parts;
  CK(cudaMalloc(&P, n * sizeof(float)));
  CK(cudaMalloc(&P1, n * sizeof(float)));
  CK(cudaMalloc(&P1t, n * sizeof(float)));
  CK(cudaMalloc(&Y, n * sizeof(float)));
  CK(cudaMalloc(&X, (long)kT * kR * kR * sizeof(float)));
  CK(cudaMalloc(&parts, (long)kT * 16 * kR * kR * sizeof(float)));  // up to S = 16 (the sweep)
  fill_f32<<<1024, 256, 0, rig.st>>>(P, n, 1);
  fill_f32<<<1024, 256, 0, rig.st>>>(X, (long)kT * kR * kR, 2);
  const float one = 1.0f, zero = 0.0f;
  const double gemm_flop = 2.0 * kT * kA * (double)kR * kR;  // one a x r x r product per matrix
  auto report = [&](const char* what, float ms, double flop) {
    printf("%-58s %8.3f ms  %6.1f TFLOP/s\n", what, ms, flop / (ms * 1e9));
  };
  const int reps = 20;

  // ---- first solve: P1 = P X1 (row-major P a x r, X r x r) ----
  // Column-major: P is Pc = P^T (r x a, ld r). Library layout: P1^T = X^T P^T,
  // C (r x a, ld r); X's order either way (opA N or T).
  for (cublasOperation_t ox : {CUBLAS_OP_N, CUBLAS_OP_T}) {
    const float ms = rig.median_ms(
        [&] {
          CK(cublasGemmStridedBatchedEx(h, ox, CUBLAS_OP_N, kR, kA, kR, &one, X, CUDA_R_32F, kR, (long)kR * kR, P,
                                        CUDA_R_32F, kR, per, &zero, P1, CUDA_R_32F, kR, per, kT, kTf32,
                                        CUBLAS_GEMM_DEFAULT));
        },
        reps);
    report(ox == CUBLAS_OP_N ? "first solve, P1 row-major a x r (X as is)" : "first solve, P1 row-major a x r (X^T)",
           ms, gemm_flop);
  }
  // Transposed layout: P1 column-major a x r (ld a) = P (a x r: op T on Pc) X.
  for (cublasOperation_t ox : {CUBLAS_OP_N, CUBLAS_OP_T}) {
    const float ms = rig.median_ms(
        [&] {
          CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, ox, kA, kR, kR, &one, P, CUDA_R_32F, kR, per, X, CUDA_R_32F,
                                        kR, (long)kR * kR, &zero, P1t, CUDA_R_32F, kA, per, kT, kTf32,
                                        CUBLAS_GEMM_DEFAULT));
        },
        reps);
    report(ox == CUBLAS_OP_N ? "first solve, P1 stored r x a (X as is)" : "first solve, P1 stored r x a (X^T)", ms,
           gemm_flop);
  }

  // ---- Gram P1^T P1 by chunks of kChunk rows ----
  const double gram_flop = 2.0 * kT * kA * (double)kR * kR, block_flop = gram_flop * (kNb + 1) / (2.0 * kNb);
  // Library layout, whole product per chunk: G = Pc Pc^T (N, T), k = kChunk, one strided batch of T S.
  report("Gram, P1 row-major, whole r x r per chunk",
         rig.median_ms(
             [&] {
               CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, kR, kR, kChunk, &one, P1, CUDA_R_32F, kR,
                                             (long)kChunk * kR, P1, CUDA_R_32F, kR, (long)kChunk * kR, &zero, parts,
                                             CUDA_R_32F, kR, (long)kR * kR, kT * kS, kTf32, CUBLAS_GEMM_DEFAULT));
             },
             reps),
         gram_flop);
  // Transposed layout, whole product per chunk: G = Pk^T Pk (T, N) with Pk (a x r, ld a);
  // chunk c of matrix t starts at t per + c kChunk: pointer arrays.
  {
    std::vector<const void*> a, c;
    for (int t = 0; t < kT; ++t)
      for (int q = 0; q < kS; ++q) {
        a.push_back(P1t + t * per + (long)q * kChunk);
        c.push_back(parts + ((long)t * kS + q) * kR * kR);
      }
    const void** da = device_ptrs(a);
    const void** dc = device_ptrs(c);
    report("Gram, P1 stored r x a, whole r x r per chunk",
           rig.median_ms(
               [&] {
                 CK(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, kR, kR, kChunk, &one, da, CUDA_R_32F, kA, da,
                                        CUDA_R_32F, kA, &zero, (void* const*)dc, CUDA_R_32F, kR, kT * kS, kTf32,
                                        CUBLAS_GEMM_DEFAULT));
               },
               reps),
           gram_flop);
  }
  // The lower blocks (row-major block (i, j), i >= j, as gram's sym_block_pointers), both layouts.
  for (bool kmajor : {false, true}) {
    std::vector<const void*> a, b, c;
    for (int t = 0; t < kT; ++t)
      for (int q = 0; q < kS; ++q)
        for (int j = 0; j < kNb; ++j)
          for (int i = j; i < kNb; ++i) {
            float* cb = parts + ((long)t * kS + q) * kR * kR;
            if (!kmajor) {  // as the library: (N, T), first operand B's columns j, second A's rows i
              const float* base = P1 + t * per + (long)q * kChunk * kR;
              a.push_back(base + j * kBs);
              b.push_back(base + i * kBs);
              c.push_back(cb + (long)i * kBs * kR + j * kBs);
            } else {  // (T, N) on Pk: op(A) rows = Pk's columns
              const float* base = P1t + t * per + (long)q * kChunk;
              a.push_back(base + (long)j * kBs * kA);
              b.push_back(base + (long)i * kBs * kA);
              c.push_back(cb + (long)i * kBs * kR + j * kBs);
            }
          }
    const void** da = device_ptrs(a);
    const void** db = device_ptrs(b);
    const void** dc = device_ptrs(c);
    const int cnt = (int)a.size();
    report(kmajor ? "Gram, P1 stored r x a, 10 lower blocks per chunk" : "Gram, P1 row-major, 10 lower blocks per chunk",
           rig.median_ms(
               [&] {
                 if (!kmajor)
                   CK(cublasGemmBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, kBs, kBs, kChunk, &one, da, CUDA_R_32F, kR, db,
                                          CUDA_R_32F, kR, &zero, (void* const*)dc, CUDA_R_32F, kR, cnt, kTf32,
                                          CUBLAS_GEMM_DEFAULT));
                 else
                   CK(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, kBs, kBs, kChunk, &one, da, CUDA_R_32F, kA, db,
                                          CUDA_R_32F, kA, &zero, (void* const*)dc, CUDA_R_32F, kR, cnt, kTf32,
                                          CUBLAS_GEMM_DEFAULT));
               },
               reps),
           block_flop);
  }

  // ---- second solve: Y = P1 X2, Y row-major a x r (column-major Y^T = X^T P1^T, r x a, ld r) ----
  for (cublasOperation_t ox : {CUBLAS_OP_N, CUBLAS_OP_T}) {
    // P1 stored r x a row-major = column-major a x r (ld a): op(B) = P1^T from it is T.
    for (bool kmajor : {false, true}) {
      char name[64];
      snprintf(name, sizeof name, "second solve, P1 %s (X%s)", kmajor ? "stored r x a" : "row-major",
               ox == CUBLAS_OP_N ? " as is" : "^T");
      report(name,
             rig.median_ms(
                 [&] {
                   CK(cublasGemmStridedBatchedEx(h, ox, kmajor ? CUBLAS_OP_T : CUBLAS_OP_N, kR, kA, kR, &one, X,
                                                 CUDA_R_32F, kR, (long)kR * kR, kmajor ? P1t : P1, CUDA_R_32F,
                                                 kmajor ? kA : kR, per, &zero, Y, CUDA_R_32F, kR, per, kT, kTf32,
                                                 CUBLAS_GEMM_DEFAULT));
                 },
                 reps),
             gemm_flop);
    }
  }

  // ---- the library layout's Gram by row chunks and lower blocks: S chunks x nb x nb blocks ----
  // (gram_splits' S = 4 and triangle_blocks' nb = 4 above; the parts' sum, a pass over T S r^2 floats, not timed)
  for (int a_rows : {kA, 2048})
    for (int S : {1, 2, 4, 8, 16})
      for (int nb : {1, 2, 4, 8}) {
        const int chunk = a_rows / S, bs = kR / nb;
        if (chunk < 256) continue;
        std::vector<const void*> a, b, c;
        for (int t = 0; t < kT; ++t)
          for (int q = 0; q < S; ++q)
            for (int j = 0; j < nb; ++j)
              for (int i = j; i < nb; ++i) {
                const float* base = P1 + (long)t * a_rows * kR + (long)q * chunk * kR;
                a.push_back(base + j * bs);
                b.push_back(base + i * bs);
                c.push_back(parts + ((long)t * S + q) * kR * kR + (long)i * bs * kR + j * bs);
              }
        const void** da = device_ptrs(a);
        const void** db = device_ptrs(b);
        const void** dc = device_ptrs(c);
        const int cnt = (int)a.size();
        char name[96];
        snprintf(name, sizeof name, "Gram sweep: a = %d, S = %d, %d x %d blocks", a_rows, S, nb, nb);
        report(name,
               rig.median_ms(
                   [&] {
                     CK(cublasGemmBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, bs, bs, chunk, &one, da, CUDA_R_32F, kR, db,
                                            CUDA_R_32F, kR, &zero, (void* const*)dc, CUDA_R_32F, kR, cnt, kTf32,
                                            CUBLAS_GEMM_DEFAULT));
                   },
                   reps),
               2.0 * kT * a_rows * (double)kR * kR * (nb + 1) / (2.0 * nb));
        CK(cudaFree(da));
        CK(cudaFree(db));
        CK(cudaFree(dc));
      }
  CK(cudaDeviceSynchronize());
  return 0;
}

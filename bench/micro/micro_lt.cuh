// SPDX-License-Identifier: MIT
// What the micro-benchmarks that time cuBLASLt's algorithms share (link
// -lcublasLt): a matrix layout with its batch (strided or pointer-array),
// and the timing of the first algorithms of cuBLASLt's heuristic for one
// product.
#pragma once
#include <cublasLt.h>

#include "micro_util.cuh"

// rows x cols (column-major, ld) of type t, a batch of `batch`: strided by
// `stride` elements, or, with pointer_array, the pointers the call passes.
inline cublasLtMatrixLayout_t lt_layout(cudaDataType_t t, int rows, int cols, int ld, int batch, long stride,
                                        bool pointer_array = false) {
  cublasLtMatrixLayout_t l;
  CK(cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld));
  const int32_t bc = batch;
  CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof(bc)));
  if (pointer_array) {
    const uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof(mode)));
  } else {
    const int64_t so = stride;
    CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &so, sizeof(so)));
  }
  return l;
}

// A matmul descriptor: fp32 scale type, the given compute type and transposes.
inline cublasLtMatmulDesc_t lt_desc(cublasComputeType_t compute, cublasOperation_t oa, cublasOperation_t ob) {
  cublasLtMatmulDesc_t d;
  CK(cublasLtMatmulDescCreate(&d, compute, CUDA_R_32F));
  CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof(oa)));
  CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof(ob)));
  return d;
}

// An algorithm's configuration attribute (T(-1) where it has none).
template <class T>
T lt_cfg(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t w = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &w) != CUBLAS_STATUS_SUCCESS) return T(-1);
  return v;
}

// The first `max_algos` algorithms of cuBLASLt's heuristic for D = C = A B
// (+ C) with these layouts and at most `workspace` bytes of workspace, into
// res; their count in *count (0 where the call fails, its status returned).
inline cublasStatus_t lt_heuristic(cublasLtHandle_t lt, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                                   cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, uint64_t workspace,
                                   int max_algos, cublasLtMatmulHeuristicResult_t* res, int* count) {
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                          sizeof(workspace)));
  *count = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, max_algos, res, count);
  if (st != CUBLAS_STATUS_SUCCESS) *count = 0;
  cublasLtMatmulPreferenceDestroy(pref);
  return st;
}

struct LtTiming {
  float first = -1;           // the heuristic's first algorithm (ms; -1: none ran)
  float best = 1e30f;         // the fastest of those that ran
  int best_index = -1, count = 0;  // its place in the heuristic's list; the list's length
};

// Times (rig.median_ms, `reps`) each of the first `max_algos` algorithms the
// heuristic returns for D = C = alpha A B + beta C with the layouts given;
// call(algo) enqueues the product with that algorithm and returns its status
// (an algorithm whose call fails is skipped).
template <class Call>
LtTiming lt_time_algos(MicroRig& rig, cublasLtHandle_t lt, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                       cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, int max_algos, int reps, Call&& call) {
  LtTiming r;
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(max_algos));
  const cublasStatus_t hs = lt_heuristic(lt, desc, la, lb, lc, rig.wsz, max_algos, res.data(), &r.count);
  if (hs != CUBLAS_STATUS_SUCCESS) printf("heuristic: status %d\n", (int)hs);
  for (int i = 0; i < r.count; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    bool ok = true;
    const float t = rig.median_ms(
        [&] {
          if (call(&res[i].algo) != CUBLAS_STATUS_SUCCESS) ok = false;
        },
        reps);
    if (!ok) continue;
    if (i == 0) r.first = t;
    if (t < r.best) r.best = t, r.best_index = i;
  }
  CK(cudaStreamSynchronize(rig.st));
  CK(cudaGetLastError());
  return r;
}

// Dion's error feedback / update product C += P R^T as lowrank_gemm passes
// it (C row-major a x b, P a x r, R b x r, `batch` of each, zeroed, es bytes
// per element of type t, at compute type `compute`): column-major C^T = R
// P^T, the device array of pointers dp holding R's, then P's, then C's, and
// the cuBLASLt descriptor and layouts of that product. cublas_ms() times
// cuBLAS's default algorithm for it (cublasGemmBatchedEx, median of 9),
// lt_matmul() enqueues it with a cuBLASLt algorithm; free() releases
// everything.
struct LowrankPointers {
  int a, b, r, batch;
  cudaDataType_t t;
  cublasComputeType_t compute;
  std::vector<void*> hp;
  void** dp = nullptr;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t l1, l2, lc;
  LowrankPointers(int a_, int b_, int r_, int batch_, cudaDataType_t t_, cublasComputeType_t compute_)
      : a(a_), b(b_), r(r_), batch(batch_), t(t_), compute(compute_), hp(3 * static_cast<size_t>(batch_)) {
    const size_t es = t == CUDA_R_16BF ? 2 : 4;
    for (int i = 0; i < batch; ++i) {
      CK(cudaMalloc(&hp[i], es * b * r));              // R (first operand: C^T = R P^T)
      CK(cudaMalloc(&hp[batch + i], es * a * r));      // P
      CK(cudaMalloc(&hp[2 * batch + i], es * a * b));  // C
      CK(cudaMemset(hp[i], 0, es * b * r));
      CK(cudaMemset(hp[batch + i], 0, es * a * r));
      CK(cudaMemset(hp[2 * batch + i], 0, es * a * b));
    }
    CK(cudaMalloc(&dp, sizeof(void*) * hp.size()));
    CK(cudaMemcpy(dp, hp.data(), sizeof(void*) * hp.size(), cudaMemcpyHostToDevice));
    // column-major C^T (b x a) = R (b x r, stored r x b col-major: OP_T, ld r) P^T (r x a, OP_N, ld r)
    desc = lt_desc(compute, CUBLAS_OP_T, CUBLAS_OP_N);
    l1 = lt_layout(t, r, b, r, batch, 0, true);
    l2 = lt_layout(t, r, a, r, batch, 0, true);
    lc = lt_layout(t, b, a, b, batch, 0, true);
  }
  float cublas_ms(MicroRig& rig) const {
    const float one = 1.f;
    return rig.median_ms(
        [&] {
          CK(cublasGemmBatchedEx(rig.h, CUBLAS_OP_T, CUBLAS_OP_N, b, a, r, &one, (const void* const*)dp, t, r,
                                 (const void* const*)(dp + batch), t, r, &one, dp + 2 * batch, t, b, batch, compute,
                                 CUBLAS_GEMM_DEFAULT));
        },
        9);
  }
  cublasStatus_t lt_matmul(cublasLtHandle_t lt, const cublasLtMatmulAlgo_t* algo, MicroRig& rig) const {
    const float one = 1.f;
    return cublasLtMatmul(lt, desc, &one, dp, l1, dp + batch, l2, &one, dp + 2 * batch, lc, dp + 2 * batch, lc, algo,
                          rig.ws, rig.wsz, rig.st);
  }
  void free() {
    cublasLtMatrixLayoutDestroy(l1);
    cublasLtMatrixLayoutDestroy(l2);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    for (void* p : hp) CK(cudaFree(p));
    CK(cudaFree(dp));
  }
};

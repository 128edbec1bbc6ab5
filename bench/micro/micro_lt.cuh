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
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t wsb = rig.wsz;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(max_algos));
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, max_algos, res.data(),
                                                           &r.count);
  if (hs != CUBLAS_STATUS_SUCCESS) {
    printf("heuristic: status %d\n", (int)hs);
    r.count = 0;
  }
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
  cublasLtMatmulPreferenceDestroy(pref);
  return r;
}

// SPDX-License-Identifier: MIT
// The compute interface the algorithms (src/algo) are written against. One
// implementation per backend: src/backend/host (BLAS/LAPACK and loops) and
// src/backend/cuda (cuBLAS, cuSOLVER, kernels/).
//
// Conventions: matrices are fp32, row-major, batched with a fixed element
// stride between consecutive matrices (stride 0 broadcasts one matrix).
// Typed buffers (parameters, gradients, states) are converted at load/store.
// All calls are enqueued in order on the backend's current stream.
#pragma once
#include <cstddef>
#include <cstdint>

#include "dion.h"
#include "rng.hpp"

namespace dion {

// A batch of row-major fp32 matrices.
struct MatBatch {
  float* p;
  int64_t rows, cols;
  int64_t ld;      // leading dimension (elements between rows), >= cols
  int64_t stride;  // elements between consecutive matrices
  int64_t batch;
};

struct ConstMatBatch {
  const float* p;
  int64_t rows, cols, ld, stride, batch;
  ConstMatBatch(const MatBatch& m) : p(m.p), rows(m.rows), cols(m.cols), ld(m.ld), stride(m.stride), batch(m.batch) {}
  ConstMatBatch(const float* p_, int64_t r, int64_t c, int64_t ld_, int64_t s, int64_t b)
      : p(p_), rows(r), cols(c), ld(ld_), stride(s), batch(b) {}
};

// Which side's slices (rows of a matrix = axis 0, columns = axis 1) an
// operation reduces over or selects.
enum Axis : int { kRows = 0, kCols = 1 };

class Backend {
 public:
  virtual ~Backend() = default;

  // ---- memory (backend-owned buffers) ----
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // any direction the backend can reach
  virtual void synchronize() = 0;

  // ---- conversions ----
  virtual void load(float* dst, const void* src, dion_dtype_t dt, int64_t n) = 0;
  virtual void store(void* dst, dion_dtype_t dt, const float* src, int64_t n) = 0;
  // True if any of the n typed elements is NaN or +-Inf.
  virtual bool has_nonfinite(const void* src, dion_dtype_t dt, int64_t n) = 0;

  // ---- random ----
  // out[i] = scale * N(0,1) drawn for global index index_of(i), where the
  // buffer is a (rows x cols) window at (row0, col0) of a global matrix with
  // `global_cols` columns: index = (row0 + i / cols) * global_cols + col0 + i % cols.
  virtual void randn(float* out, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t global_cols,
                     const PhiloxKey& key, float scale) = 0;

  // ---- dense linear algebra (fp32, row-major) ----
  // C = alpha * op(A) * op(B) + beta * C, per matrix of the batch.
  virtual void gemm(bool trans_a, bool trans_b, float alpha, ConstMatBatch a, ConstMatBatch b, float beta,
                    MatBatch c, dion_matmul_precision_t precision) = 0;
  // In place: A (p x r, p >= r) <- the Q factor of its thin Householder QR.
  virtual void qr_q(MatBatch a) = 0;
  // In place: A (p x r) <- R factor (upper r x r in the leading block) of its Householder QR.
  virtual void qr_r(MatBatch a, MatBatch r_out) = 0;
  // In place: A (n x n, symmetric) <- upper Cholesky factor U (A = U^T U); the
  // strictly lower part is zeroed. info[b] = 0 on success, > 0 on failure.
  virtual void cholesky_upper(MatBatch a, int32_t* info_host) = 0;
  // B (rows x n) <- B * U^{-1} with U (n x n) upper triangular.
  virtual void trsm_right_upper(ConstMatBatch u, MatBatch b) = 0;

  // ---- element-wise and reductions (fp32 buffers of n elements) ----
  // y = a * y + b * x
  virtual void axpby(float a, const float* x, float b, float* y, int64_t n) = 0;
  // z = a * x + b * y
  virtual void lincomb(float a, const float* x, float b, const float* y, float* z, int64_t n) = 0;
  // x *= s
  virtual void scale(float* x, float s, int64_t n) = 0;
  // NaN -> 0, +-Inf -> +-FLT_MAX
  virtual void nan_to_num(float* x, int64_t n) = 0;
  virtual bool all_zero(const float* x, int64_t n) = 0;
  // Each matrix of the batch: m /= (factor * ||m||_F + eps)
  virtual void frob_normalize(MatBatch m, float factor, float eps) = 0;
  // Column normalisation: m[:, j] /= (||m[:, j]|| + eps)
  virtual void col_normalize(MatBatch m, float eps) = 0;
  // Per-slice L1 norms along `axis` (axis kRows: one value per row) -> out
  virtual void slice_l1(ConstMatBatch m, Axis axis, float* out) = 0;

  // ---- fused optimizer updates (fp32 buffers of n elements) ----
  // Decay and orthonormal update (Muon family): with cautious, x -= lr*wd*x*[x*u >= 0],
  // else x *= 1 - lr*wd; then x -= lr_adj * u.
  virtual void apply_update(float* x, const float* u, int64_t n, float lr, float wd, float lr_adj,
                            bool cautious) = 0;
  // AdamW (legacy form, spec §1.4) with bias corrections bc1 = 1-beta1^t, bc2 = 1-beta2^t.
  virtual void adamw(float* x, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                     float eps, float wd, float bc1, float bc2, bool cautious) = 0;
  // Lion (spec §1.4).
  virtual void lion(float* x, const float* g, float* m, int64_t n, float lr, float beta1, float beta2, float wd,
                    bool cautious) = 0;
  // NorMuon neuron-wise normalisation (spec §4.2) of each matrix of `u`:
  // neurons are the slices along `neuron_axis`; v holds one variance per
  // neuron per matrix (contiguous, batch-major) and is updated by a lerp with
  // weight 1 - beta2. If `selected` is not null, only those neurons' variances
  // are read and written (NorDion2: u holds k selected neurons whose variance
  // indices are selected[b*k + j]).
  virtual void neuron_normalize(MatBatch u, Axis neuron_axis, float* v, int64_t v_per_matrix, float beta2,
                                const int32_t* selected) = 0;

  // ---- slice selection (Dion2) ----
  // Indices of the k largest scores of each of `batch` score vectors of length n -> idx[b*k + j].
  virtual void topk(const float* scores, int64_t batch, int64_t n, int64_t k, int32_t* idx) = 0;
  // out (k slices) <- m's slices idx along axis (axis kRows: out is k x cols; kCols: rows x k).
  virtual void gather_slices(ConstMatBatch m, Axis axis, const int32_t* idx, int64_t k, MatBatch out) = 0;
  // m's slices idx along axis *= s
  virtual void scale_slices(MatBatch m, Axis axis, const int32_t* idx, int64_t k, float s) = 0;
  // m's slices idx along axis += alpha * u (u shaped as gather_slices' out)
  virtual void add_slices(MatBatch m, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u, float alpha) = 0;
};

// Created by the backend implementations.
Backend* make_host_backend();

}  // namespace dion

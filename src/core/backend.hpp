// SPDX-License-Identifier: MIT
// The compute interface the algorithms (src/algo) are written against. One
// implementation per backend: src/backend/host (BLAS/LAPACK and loops) and
// src/backend/cuda (cuBLAS, cuSOLVER, kernels/).
//
// Conventions:
//  - Every pointer argument is backend memory (host memory for the host
//    backend, device memory of the optimizer's device for CUDA) unless its
//    name ends in _host.
//  - Work matrices are fp32, row-major, batched with a fixed element stride
//    between consecutive matrices (stride 0 broadcasts one matrix).
//  - Typed buffers (parameters, gradients, states) are reached through a
//    TensorEntry table and converted at load/store.
//  - All calls are enqueued in order on the backend's current stream
//    (set_stream) and never wait for the device, except synchronize() and
//    the *_sync memory calls. After a first call with given shapes, no call
//    allocates (internal scratch grows on first use only).
//  - Hyperparameters that a captured CUDA graph must see change (lr,
//    weight_decay, beta1, beta2) and the step counter are read from a
//    GroupScalars block in backend memory; the others are passed by value.
//  - `skip` (nullable) points to the step's non-finite flag: calls that take
//    it write nothing when *skip != 0. Only those calls write parameters or
//    states, so a skipped step changes neither.
#pragma once
#include <cstddef>
#include <algorithm>
#include <cstdint>

#include "dion.h"
#include "error.hpp"
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

// One tensor of a batch, as the kernels see it (an array of these lives in
// backend memory; the optimizer rebuilds it when pointers change).
enum Field : int { kParam = 0, kGrad = 1, kState0 = 2, kState1 = 3 };
struct TensorEntry {
  void* ptr[4];       // indexed by Field: param, grad, state 0, state 1 (nullptr if absent)
  int32_t dtype[4];   // dion_dtype_t of each
  int64_t n;          // local elements
  uint32_t tensor_id; // the tensor's index in the optimizer (random-number key)
  uint32_t pad;
};

// Per-group values kept in backend memory (one block per group).
struct GroupScalars {
  double lr, weight_decay, beta1, beta2;
  int64_t step;  // steps taken (not skipped) by this group
  int64_t pad;
};

// The Frobenius scale of the bf16 iteration's first step, as
// frob_scale_bf16 takes it: sc = inv (power 1) or inv * inv (power 2), inv =
// 1 / (factor sqrt(t) + eps), t the total of parts[b * nparts .. + nparts).
struct FrobScale {
  const double* parts;
  int64_t nparts;
  float factor, eps;
  int power;
};

// Per-optimizer step status in backend memory.
struct StepStatus {
  int32_t skip;           // this (last) step was skipped: a gradient held NaN/Inf (what writes read)
  int32_t skip_mesh;      // the copy reduced over the meshes, OR-ed into skip (see Optimizer::step)
  int64_t skipped_steps;  // total skipped
};

// What a blocking wait does while the device has not finished (optimizers
// with NCCL meshes install one): poll() may throw to end the wait (a
// communicator reported an asynchronous error); after timeout_s seconds
// (<= 0: never) on_timeout() runs (it aborts the communicators so hung
// kernels end) and the wait throws DION_ERROR_NCCL.
struct WaitGuard {
  virtual ~WaitGuard() = default;
  virtual void poll() = 0;
  virtual void on_timeout() = 0;
  double timeout_s = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // True if backend memory is host memory the caller may read directly.
  virtual bool host_memory() const = 0;
  // The stream the following calls are enqueued on (a cudaStream_t for CUDA; ignored by the host).
  virtual void set_stream(void* stream) = 0;
  // The stream set last (nullptr: the legacy default stream; always nullptr on the host).
  virtual void* stream() const { return nullptr; }
  // Backend memory the backend itself holds for this optimizer, beyond what
  // alloc() handed out: scratch of the factorizations and reductions, the
  // BLAS workspace (dion_get_memory_usage counts it as workspace). The host
  // backend's LAPACK and staging scratch is per thread, shared by every
  // optimizer, and not counted (0).
  virtual size_t scratch_bytes() const { return 0; }

  // ---- memory (backend-owned buffers) ----
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  // Enqueued copy between backend buffers.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Enqueued strided copy of `height` rows of `width` bytes, rows `spitch`
  // bytes apart in src and `dpitch` bytes apart in dst (cudaMemcpy2D's
  // contract): reassembles shards of a matrix gathered from several ranks.
  virtual void copy2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) = 0;
  // Copies that complete before returning; either side may be host or
  // backend memory. They first wait as synchronize() does.
  virtual void copy_sync(void* dst, const void* src, size_t bytes) = 0;
  // Waits for the last step (see end_step), for the current stream if one
  // was set, and for the backend's own work.
  virtual void synchronize() = 0;
  // Writes *flag = value (backend memory) at once, without waiting for the
  // work in flight (which may be hung): work already enqueued that reads the
  // flag later sees the value.
  virtual void poke_flag(int32_t* flag, int32_t value) = 0;
  // Installs (or, with nullptr, removes) the guard of the blocking waits;
  // backends whose waits cannot hang ignore it.
  virtual void set_wait_guard(WaitGuard* guard) { (void)guard; }
  // Marks the end of a step's work on the current stream: the blocking calls
  // (copy_sync, synchronize) wait for it, so they never need the step's stream.
  virtual void end_step() {}

  // ---- the communication stream (overlap, Optimizer::step) ----
  // A second stream owned by the backend, on which an overlapped step runs
  // its collectives while the algorithms compute on the current stream. The
  // two are tied only by the enqueued waits below (no host synchronisation,
  // so a step stays capturable: the first comm_wait_main of a captured step
  // forks the capture onto the comm stream, a later main_wait_comm joins it).
  // Creates the stream and its events: setup time only (dion_add_group),
  // idempotent. False where there is none: the host backend, whose
  // collectives complete before they return, has nothing to overlap.
  virtual bool make_comm_stream() { return false; }
  // The communication stream (a cudaStream_t; nullptr before make_comm_stream).
  virtual void* comm_stream() const { return nullptr; }
  // The comm stream waits for everything enqueued so far on the current stream.
  virtual void comm_wait_main() {}
  // The current stream waits for everything enqueued so far on the comm stream.
  virtual void main_wait_comm() {}
  // Records mark `slot` (0 or 1) on the comm stream; main_wait_mark(slot)
  // makes the current stream wait for the work before that mark's latest
  // record only (not for what the comm stream got after it).
  static constexpr int kCommMarks = 2;
  virtual void comm_mark(int slot) { (void)slot; }
  virtual void main_wait_mark(int slot) { (void)slot; }
  // load / store (as below), enqueued on the comm stream.
  virtual void load_comm(float* dst, const void* src, dion_dtype_t dt, int64_t n) { load(dst, src, dt, n); }
  virtual void store_comm(void* dst, dion_dtype_t dt, const float* src, int64_t n) { store(dst, dt, src, n); }

  // ---- conversions ----
  virtual void load(float* dst, const void* src, dion_dtype_t dt, int64_t n) = 0;
  virtual void store(void* dst, dion_dtype_t dt, const float* src, int64_t n) = 0;
  // src split into two bf16 parts, hi = bf16(src) and lo = bf16(src - hi)
  // (round to nearest even, as store(BF16)), so that hi + lo is src to
  // 2^-16 relative (|src - hi - lo| <= 2^-8 |src - hi| <= 2^-16 |src|) and
  // a product with an exactly-bf16 factor can run as two bf16 products with
  // fp32 accumulation (RCQR's sketch at matmul precision FP32).
  virtual void split_bf16(void* hi, void* lo, const float* src, int64_t n) = 0;
  // Batched over `count` tensors of `n` elements each: dst[i*n + j] = field f of list[i], element j.
  virtual void load_multi(float* dst, const TensorEntry* list, int64_t count, Field f, int64_t n) = 0;
  // The same into bf16 elements (dst: count x n, dense): store(BF16) of
  // load_multi's values, in one pass (a copy from a bf16 field).
  virtual void load_multi_bf16(void* dst, const TensorEntry* list, int64_t count, Field f, int64_t n) = 0;
  virtual void store_multi(const TensorEntry* list, int64_t count, Field f, const float* src, int64_t n,
                           const int32_t* skip) = 0;
  // The same from bf16 elements (src: count x n, dense): each is widened
  // exactly and stored as store_multi stores it (a copy into a bf16 field).
  virtual void store_multi_bf16(const TensorEntry* list, int64_t count, Field f, const void* src, int64_t n,
                                const int32_t* skip) = 0;
  // Field f of each of the `count` tensors (its first n elements) scaled in
  // place: x <- a x in fp32, rounded to the field's dtype as store rounds
  // (the bits of load_multi, the product, store_multi). Nothing when *skip.
  // Dion's error feedback at full rank (src/algo/dion.cpp, full_rank_ef).
  virtual void scale_multi(const TensorEntry* list, int64_t count, Field f, int64_t n, float a,
                           const int32_t* skip) = 0;
  // *flag = 1 if field f of any of the `count` tensors (list[i].n elements each,
  // at most max_n) holds NaN or +-Inf; otherwise *flag is left unchanged.
  virtual void check_nonfinite(const TensorEntry* list, int64_t count, int64_t max_n, Field f, int32_t* flag) = 0;
  // Called once per group per step after the checks: if !status->skip, ++gs->step.
  virtual void advance_step(GroupScalars* gs, const StepStatus* status) = 0;
  // Called once per step after advance_step: if status->skip, ++status->skipped_steps.
  virtual void count_skip(StepStatus* status) = 0;
  // status->skip |= status->skip_mesh.
  virtual void merge_skip(StepStatus* status) = 0;

  // ---- random ----
  // For each of `batch` matrices: out[b][i] = scale * N(0,1) drawn for global
  // index (row0 + i / cols) * global_cols + col0 + i % cols, where the matrix
  // b is a (rows x cols) window of a global matrix with `global_cols` columns.
  // The key's tensor is tensors[b].tensor_id when `tensors` is not null, and
  // its step *step when `step` is not null.
  virtual void randn(float* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                     int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors, const int64_t* step,
                     float scale) = 0;
  // randn's numbers rounded to bf16 (out: bf16 elements, as store(BF16)
  // writes them): the bf16 sketch of RCQR at matmul precision BF16.
  virtual void randn_bf16(void* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                          int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors, const int64_t* step,
                          float scale) = 0;

  // ---- dense linear algebra (fp32, row-major) ----
  // C = alpha * op(A) * op(B) + beta * C, per matrix of the batch.
  virtual void gemm(bool trans_a, bool trans_b, float alpha, ConstMatBatch a, ConstMatBatch b, float beta,
                    MatBatch c, dion_matmul_precision_t precision) = 0;
  // C = A^T A per matrix (c: a.cols x a.cols), at `precision`: the Gram
  // matrix of (R)CQR's Cholesky step. A backend may split the sum over A's
  // rows (the CUDA one does when the batch's products are too few to fill
  // the device); the default is one gemm.
  virtual void gram(ConstMatBatch a, MatBatch c, dion_matmul_precision_t precision) {
    gemm(true, false, 1.0f, a, a, 0.0f, c, precision);
  }
  // The same on bf16 matrices (p of each batch points to bf16 elements, ld and
  // stride count elements): fp32 accumulation, alpha and beta in fp32, C
  // rounded to bf16. The Muon family's iterations at matmul precision BF16.
  virtual void gemm_bf16(bool trans_a, bool trans_b, float alpha, ConstMatBatch a, ConstMatBatch b, float beta,
                         MatBatch c) = 0;
  // gemm_bf16 reading C from `c` and writing the result to `d` (distinct
  // dense buffers of one shape): d = bf16(alpha op(A) op(B) + beta c). The
  // bf16 iteration's B = c A A + b A without a copy of A into B.
  virtual void gemm_bf16_out(bool trans_a, bool trans_b, float alpha, ConstMatBatch a, ConstMatBatch b, float beta,
                             ConstMatBatch c, MatBatch d) = 0;
  // The same with C in fp32 (A and B bf16; C, scaled by beta, and the
  // result in fp32, never rounded to bf16; k = 0: C = beta C): Dion's
  // products of its bf16 momentum at matmul precision BF16.
  virtual void gemm_bf16_f32(bool trans_a, bool trans_b, float alpha, ConstMatBatch a, ConstMatBatch b, float beta,
                             MatBatch c) = 0;
  // gemm_bf16 for a square C whose product and input are symmetric: the
  // Gram matrix X X^T or X^T X (a == b, trans_b == !trans_a) and A A of a
  // symmetric A, with beta 0 or a symmetric C. A device backend may form
  // only the blocks on and below the diagonal of a grid of bs x bs blocks
  // (the products of the Muon family's iterations: 3/8 of the FLOPs fewer at
  // 4 x 4 blocks, 7/16 at 8 x 8), leaving those above it as they were for mirror_bf16;
  // each element formed is the one gemm_bf16 would compute, up to the
  // products' summation order. Returns bs, or 0 where the whole product was
  // formed (by default: gemm_bf16's).
  virtual int64_t gemm_bf16_lower(bool trans_a, bool trans_b, float alpha, ConstMatBatch a, ConstMatBatch b,
                                  float beta, MatBatch c) {
    gemm_bf16(trans_a, trans_b, alpha, a, b, beta, c);
    return 0;
  }
  // Completes gemm_bf16_lower's m (n x n bf16 matrices, bs > 0 the block
  // size it returned): the blocks above the diagonal <- the transposes of
  // those below it, so m is exactly symmetric; where `copy` is given (same
  // shape), m's blocks on and below the diagonal copied into it (those a
  // following gemm_bf16_lower reads as its C; the others are left); then
  // `diag` added to m's diagonal (rounded to bf16; none when 0).
  // With `scale` (the bf16 iteration's first step): the matrix and copy
  // frob_scale_bf16(m, *scale, diag) would leave after the mirror without the shift, bit for bit (or before
  // it, where diag is 0), in the same pass.
  // By default no product is formed by blocks, so there is nothing to complete.
  virtual void mirror_bf16(MatBatch m, int64_t bs, float diag, const MatBatch* copy, const FrobScale* scale) {
    (void)m, (void)diag, (void)copy, (void)scale;
    fail(DION_ERROR_INTERNAL, "mirror_bf16: blocks of %lld, but this backend forms whole products",
         static_cast<long long>(bs));
  }
  // C = op(X_i) B for each listed tensor i, X_i its field f (rows x cols,
  // row-major dense, of dtype x_dtype): Dion's products with the momentum
  // read where it is stored. x_dtype BF16: b holds bf16 elements, the
  // products exact with fp32 accumulation (gemm_bf16_f32's); FP32: b fp32
  // at `precision` (gemm's). The bits of load_multi (or the bf16 field
  // itself) and that call up to the products' summation order. Like
  // update_lowrank and accumulate_lowrank (pointer-array GEMMs), it needs
  // every field pointer 16-byte aligned (Batch::aligned16). c_dtype BF16
  // (x_dtype BF16 only; c dense): c holds bf16 elements, each the fp32
  // product rounded (store(BF16)'s rounding, up to the summation order).
  // b_field >= 0 (x_dtype FP32 only): B_i is that field of tensor i (fp32,
  // b.rows x b.cols row-major dense: Dion's Q read from its state, without
  // a copy in the workspace), and b.p is not read.
  virtual void gemm_field(const TensorEntry* list, int64_t count, Field f, int64_t rows, int64_t cols,
                          dion_dtype_t x_dtype, bool trans_x, ConstMatBatch b, MatBatch c,
                          dion_matmul_precision_t precision, dion_dtype_t c_dtype, int b_field) = 0;
  // m[b] (bf16 elements, as for gemm_bf16) += v on its diagonal, rounded to bf16.
  virtual void add_diag_bf16(MatBatch m, float v) = 0;
  // The bf16 iteration's step between A = X X^T and B = c A A + B where the
  // products are whole (no blocks; the iteration calls it for the first
  // step's scale, later steps take gemm_bf16_out): for each n x n matrix of `a` (bf16
  // elements, as for gemm_bf16), in fp32, b <- bf16((coef x + diag [i == j])
  // sc) with x = a's element and sc = 1. With `scale` (the first step from an
  // unnormalised start; its power is not read) and inv its inverse norm:
  // first a <- bf16(inv^2 x) and a3 <- bf16(inv^3 x) (a3: n x n dense
  // matrices, a batch stride of n * n), then b as above from the new a with
  // sc = inv; the product c a3 a then adds about inv c A A, so b = inv (a I +
  // b A + c A A) of the scaled A without a pass over b after the product
  // (frob_scale_bf16 on A and on b, and a copy, took three). The products and
  // sums in the order written (coef x, + diag, * sc).
  virtual void ns_shift_bf16(MatBatch a, MatBatch b, float coef, float diag, const FrobScale* scale, void* a3) = 0;
  // In place: A (p x r, p >= r) <- the Q factor of its thin Householder QR.
  virtual void qr_q(MatBatch a) = 0;
  // R (r x r) <- the R factor of A's (p x r, p >= r) QR; A may be overwritten.
  virtual void qr_r(MatBatch a, MatBatch r_out) = 0;
  // In place: A (n x n, symmetric) <- upper Cholesky factor U (A = U^T U); the
  // strictly lower part is zeroed. info[b] = 0 on success, != 0 on failure
  // (including a non-finite or non-positive pivot).
  virtual void cholesky_upper(MatBatch a, int32_t* info) = 0;
  // out (rows x n) <- B * U^{-1} with U (n x n) upper triangular; out is B
  // itself (in place) or a batch of B's shape that does not overlap it.
  // `precision` is that of the products a backend may use for it (the CUDA
  // backend multiplies by the explicit inverse, computed in fp32, for tall B,
  // writing the product straight into out when out is not B; TF32 there for
  // any precision but FP32); the host backend always solves in fp32.
  virtual void trsm_right_upper(ConstMatBatch u, ConstMatBatch b, MatBatch out,
                                dion_matmul_precision_t precision) = 0;
  void trsm_right_upper(ConstMatBatch u, MatBatch b, dion_matmul_precision_t precision) {
    trsm_right_upper(u, b, b, precision);
  }
  void trsm_right_upper(ConstMatBatch u, MatBatch b) { trsm_right_upper(u, b, b, DION_MATMUL_FP32); }
  // Several solves whose triangular factors lie in one batch: for each part
  // i, part.out <- part.in * U^{-1} matrix by matrix, with the factors
  // u[part.first, part.first + part.in.batch) (out not overlapping in). The
  // same as one trsm_right_upper per part (this default); a backend may form
  // the inverses of all of u in one go (the CUDA backend's explicit-inverse
  // path), since their cost is per call rather than per matrix.
  // A part's `in_bf16`, where not null, is its input as dense bf16 matrices
  // of in's shape (in.p is then not read; out must be dense): the CUDA
  // backend multiplies them by the inverses rounded to bf16 (bf16 tensor
  // cores, fp32 accumulation) at precision BF16 (Dion's P as its bf16
  // collectives left it, ahead of RCQR's second pass); otherwise, and in
  // this default, they are widened into out and solved in place.
  // A part with `precondition` set only preconditions its input for a
  // Cholesky QR pass that follows (RCQR's first solve, P R1^-1), which
  // absorbs the solve's error: where every part is so and the precision is
  // TF32 or BF16, the CUDA backend forms the inverses with TF32 GEMMs
  // (their error, ~ |U| |U^-1| 2^-11, is that of the TF32 product's own
  // rounding of the inverse, and a quarter of the bf16 rounding the bf16
  // parts take; DION_INVERSE_TF32=0 keeps fp32 GEMMs).
  struct TrsmPart {
    ConstMatBatch in;
    MatBatch out;
    int64_t first;
    const void* in_bf16 = nullptr;
    bool precondition = false;
  };
  virtual void trsm_right_upper_many(ConstMatBatch u, const TrsmPart* parts, int64_t count,
                                     dion_matmul_precision_t precision) {
    for (int64_t i = 0; i < count; ++i) {
      const TrsmPart& pt = parts[i];
      const ConstMatBatch ui(u.p + pt.first * u.stride, u.rows, u.cols, u.ld, u.stride, pt.in.batch);
      if (pt.in_bf16) {
        widen_dense(pt.out, pt.in_bf16);
        trsm_right_upper(ui, pt.out, pt.out, precision);
      } else {
        trsm_right_upper(ui, pt.in, pt.out, precision);
      }
    }
  }
  // out (dense) <- the widening of the dense bf16 matrices x of its shape.
  void widen_dense(MatBatch out, const void* x) {
    if (out.ld != out.cols || out.stride != out.rows * out.cols)
      fail(DION_ERROR_INTERNAL, "widen_dense: the output must be dense");
    load(out.p, x, DION_DTYPE_BF16, out.batch * out.rows * out.cols);
  }
  // dst <- src, matrix by matrix (the same shape; one copy when both are dense).
  void copy_mats(ConstMatBatch src, MatBatch dst) {
    const size_t row = sizeof(float) * static_cast<size_t>(src.cols);
    if (src.ld == src.cols && dst.ld == dst.cols && src.stride == src.rows * src.cols &&
        dst.stride == dst.rows * dst.cols) {
      copy(dst.p, src.p, row * static_cast<size_t>(src.rows * src.batch));
      return;
    }
    for (int64_t b = 0; b < src.batch; ++b)
      copy2d(dst.p + b * dst.stride, sizeof(float) * static_cast<size_t>(dst.ld), src.p + b * src.stride,
             sizeof(float) * static_cast<size_t>(src.ld), row, static_cast<size_t>(src.rows));
  }
  // For each matrix b with info[b] != 0: P[b] <- an orthonormal basis of the
  // columns of P0[b] (p x r, p >= r; rank-deficient columns are completed).
  virtual void orth_fallback(MatBatch p, ConstMatBatch p0, const int32_t* info) = 0;
  // The same with P0 given as dense bf16 matrices of p's shape (its values
  // widened exactly). No backend needs it but the CUDA one (Dion's bf16
  // collectives of P).
  virtual void orth_fallback_bf16(MatBatch p, const void* p0, const int32_t* info) {
    (void)p, (void)p0, (void)info;
    fail(DION_ERROR_INTERNAL, "orth_fallback_bf16: not implemented by this backend");
  }

  // ---- element-wise and reductions (fp32 buffers of n elements) ----
  // y = a * y + b * x
  virtual void axpby(float a, const float* x, float b, float* y, int64_t n) = 0;
  // z = a * x + b * y
  virtual void lincomb(float a, const float* x, float b, const float* y, float* z, int64_t n) = 0;
  // NaN -> 0, +-Inf -> +-FLT_MAX
  virtual void nan_to_num(float* x, int64_t n) = 0;
  // Dion's zero handling: for each matrix b whose m[b] is all zero, p[b] = 0 and r[b] = q[b].
  virtual void zero_fixup(ConstMatBatch m, MatBatch p, MatBatch r, ConstMatBatch q) = 0;
  // The same in two halves, for matrices sharded over ranks (the flags are
  // reduced over the mesh in between): flags[b] = 1 if m[b] holds a non-zero
  // element, else 0; then p[b] = 0 and r[b] = q[b] where flags[b] == 0.
  virtual void nonzero_flags(ConstMatBatch m, int32_t* flags) = 0;
  virtual void zero_fixup_flagged(const int32_t* flags, MatBatch p, MatBatch r, ConstMatBatch q) = 0;
  // Dion's finish of P and R (dense batches: ld = cols, stride = rows *
  // cols), each the sequence in its comment with fewer passes over memory
  // and the same operations, so the bits are the sequence's. pb / rb
  // (nullable) receive bf16 copies (store(BF16), dense, the matrices one
  // after the other).
  //   finish_p: nan_to_num(p); zero_fixup_flagged's p half (p[b] = 0 where
  //     flags[b] == 0); pb <- bf16(p). Unless pb_all, pb must hold bf16(p)
  //     on entry (the copy R = B^T P was formed from): only the changed
  //     elements are rewritten; with pb_all every element is.
  //   finish_r: nan_to_num(r); its r half (r[b] = q[b] where flags[b] ==
  //     0; with qlist, q[b] is field qf of qlist[b], load_multi's values,
  //     and q is not read); rb <- bf16(r); sumsq[b * cols + j] <- sum_i
  //     r[b](i, j)^2 in double, as col_normalize sums.
  //   col_scale_store: r(i, j) *= 1 / (sqrt(sumsq[j]) + eps) in double, as
  //     col_normalize scales; rb <- bf16(r); with list (one matrix of r per
  //     tensor): store_multi(list, r.batch, f, r, rows * cols, skip). With
  //     write_r false only the copies are written (r is left as it was).
  // So finish_r then col_scale_store is nan_to_num, the fix-up and
  // col_normalize (the sums in double: a column of 1e30s does not overflow).
  virtual void finish_p(MatBatch p, const int32_t* flags, void* pb, bool pb_all) = 0;
  virtual void finish_r(MatBatch r, const int32_t* flags, ConstMatBatch q, const TensorEntry* qlist, Field qf,
                        void* rb, double* sumsq) = 0;
  virtual void col_scale_store(MatBatch r, const double* sumsq, float eps, void* rb, const TensorEntry* list, Field f,
                               const int32_t* skip, bool write_r) = 0;
  // Each matrix of the batch: m /= (factor * ||m||_F + eps)
  virtual void frob_normalize(MatBatch m, float factor, float eps) = 0;
  // Column normalisation: m[:, j] /= (||m[:, j]|| + eps)
  virtual void col_normalize(MatBatch m, float eps) = 0;
  // Per-slice L1 norms along `axis` (axis kRows: one value per row) -> out
  virtual void slice_l1(ConstMatBatch m, Axis axis, float* out) = 0;
  // frob_normalize(x, factor, eps) followed by store(out, DION_DTYPE_BF16, x)
  // in one pass that leaves x unchanged: out (dense, rows * cols bf16
  // elements per matrix, matrices one after the other) = bf16(x * inv) with
  // inv the float frob_normalize computes, so the bits are those of the two
  // calls. The Muon family's bf16 iteration starts from it.
  virtual void frob_normalize_bf16(ConstMatBatch x, float factor, float eps, void* out) = 0;
  // The same with ||x[b]||_F^2 the total of parts[b * nparts .. + nparts)
  // (select_momentum_multi's sums), summed in order: no pass to sum x.
  virtual void frob_normalize_bf16_parts(ConstMatBatch x, const double* parts, int64_t nparts, float factor,
                                         float eps, void* out) = 0;
  // In place on bf16 matrices (as for gemm_bf16): m[b] <- bf16(sc * (m[b] +
  // diag * I)), the sum and product in fp32, sc the FrobScale's (inv as
  // frob_normalize takes it, or its square). The scaling of the bf16
  // iteration's first step on an unnormalised start X = s Y (Y the unit-norm
  // matrix, s = 1 / inv): A = inv^2 X X^T and (a I + B) inv, so X is never
  // rescaled. The classic iteration scales in mirror_bf16's or
  // ns_shift_bf16's pass instead (this defines, and the tests check,
  // mirror_bf16's scaled result); the Gram form (src/algo/ns_bf16.hpp) calls
  // it on a raw start's first R, where it was formed whole, and on P.
  virtual void frob_scale_bf16(MatBatch m, const FrobScale& scale, float diag) = 0;

  // ---- optimizer updates ----
  // Decay and orthonormal update (fp32 buffers): with lr = gs->lr, wd =
  // gs->weight_decay: cautious: x -= lr*wd*x where x*u >= 0, else x *= 1 - lr*wd;
  // then x -= lr * lr_mult * u.
  virtual void apply_update(float* x, const float* u, int64_t n, const GroupScalars* gs, float lr_mult,
                            bool cautious) = 0;
  // x *= 1 - gs->lr * gs->weight_decay
  virtual void decay(float* x, int64_t n, const GroupScalars* gs) = 0;
  // AdamW (legacy form, spec §1.4) on the typed buffers of `count` tensors
  // (param, grad, state 0 = m, state 1 = v), bias corrections from gs->step.
  virtual void adamw(const TensorEntry* list, int64_t count, int64_t max_n, const GroupScalars* gs, float eps,
                     bool cautious, const int32_t* skip) = 0;
  // Lion (spec §1.4) on typed buffers (param, grad, state 0 = m).
  virtual void lion(const TensorEntry* list, int64_t count, int64_t max_n, const GroupScalars* gs, bool cautious,
                    const int32_t* skip) = 0;
  // NorMuon neuron-wise normalisation (spec §4.2) of each matrix of `u`:
  // neurons are the slices along `neuron_axis`; v holds one variance per
  // neuron per matrix (contiguous, batch-major) and is updated by a lerp with
  // weight 1 - beta2. If `selected` is not null, only those neurons' variances
  // are read and written (NorDion2: u holds k selected neurons whose variance
  // indices are selected[b*k + j]).
  virtual void neuron_normalize(MatBatch u, Axis neuron_axis, float* v, int64_t v_per_matrix, float beta2,
                                const int32_t* selected) = 0;
  // neuron_normalize's statistics of `batch` dense bf16 rows x cols matrices
  // (in_bf16) without its pass over them (no `selected`): v updated as
  // there, each neuron's scale into scales[b * N + s] and each matrix's
  // rescale into scales[batch * N + b] (N neurons per matrix), in double:
  // neuron_normalize would leave float(x * scale * rescale) in that order
  // (up to the order of the sums of squares).
  // NorMuon's update then applies them (apply_update_neuron_multi).
  virtual void neuron_scales(int64_t batch, int64_t rows, int64_t cols, Axis neuron_axis, const void* in_bf16,
                             float* v, int64_t v_per_matrix, float beta2, double* scales) = 0;
  // The doubles neuron_scales writes for `batch` matrices of n neurons.
  static int64_t neuron_scales_count(int64_t batch, int64_t n) { return batch * n + batch; }
  // The same in workspace floats (two per double).
  static int64_t neuron_scales_floats(int64_t batch, int64_t n) { return 2 * neuron_scales_count(batch, n); }

  // ---- slice selection (Dion2) ----
  // Indices of the k largest scores of each of `batch` score vectors of
  // length n -> idx[b*k + j], ascending; ties go to the lower index.
  virtual void topk(const float* scores, int64_t batch, int64_t n, int64_t k, int32_t* idx) = 0;
  // out (k slices) <- m's slices idx along axis (axis kRows: out is k x cols; kCols: rows x k).
  virtual void gather_slices(ConstMatBatch m, Axis axis, const int32_t* idx, int64_t k, MatBatch out) = 0;
  // m's slices idx along axis *= s
  virtual void scale_slices(MatBatch m, Axis axis, const int32_t* idx, int64_t k, float s) = 0;
  // m's slices idx along axis += alpha * u (u shaped as gather_slices' out),
  // alpha = mult * gs->lr (mult when gs is null).
  virtual void add_slices(MatBatch m, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u,
                          const GroupScalars* gs, float mult) = 0;

  // ---- fused passes over typed buffers (Dion, the Muon family, Dion2) ----
  // Each replaces a sequence of the calls above, named in its comment, that
  // loads typed buffers into fp32 workspace, runs element-wise ops there and
  // stores back: one pass over the typed buffers instead of one per call,
  // with the same fp32 operations in the same order and the same roundings,
  // so the results are the sequence's bit for bit. `count` tensors of the
  // table, n elements each; fp32 buffers hold tensor i at offset i * n.
  // Typed fields are written only when !*skip; fp32 outputs always.
  //
  // Momentum, with M = state 0 and G = grad:
  //   load_multi(m, kState0); load_multi(g, kGrad); axpby(mu, g, g_scale, m);
  //   [store_state: store_multi(kState0, m, skip)];
  //   nesterov ? lincomb(mu, m, g_scale, g, u) : u = m
  // i.e. m = mu M + g_scale G; M <- m; u = nesterov ? mu m + g_scale G : m
  // (u from the unrounded m). M is not written when !store_state.
  // u is written in u_dtype (FP32, or BF16: then rounded as store rounds).
  // nonzero (may be null; count flags the caller zeroed): nonzero[t] = 1
  // where u's matrix t holds an element != 0 as written (NaN counts, -0 does
  // not), the flags of nonzero_flags(u) without a second pass over u. u may
  // be null with store_state (M itself is the product's input; fp32 or bf16
  // momentum): then the flags are M's as it is written (as computed when
  // *skip).
  virtual void momentum_multi(const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale,
                              bool nesterov, bool store_state, void* u, dion_dtype_t u_dtype, const int32_t* skip,
                              int32_t* nonzero) = 0;
  // momentum_multi(..., store_state = true, u (not null), u_dtype, skip,
  // nullptr) that also takes, in the same pass, momentum_parts(count, n)
  // partial sums of the squares of each tensor's u as written (in double,
  // their total ||u[t]||_F^2; the same on every run): the Muon family's bf16
  // iteration then starts from u unnormalised (its first step scales its
  // small products: mirror_bf16, ns_shift_bf16).
  virtual void momentum_multi_sums(const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale,
                                   bool nesterov, void* u, dion_dtype_t u_dtype, const int32_t* skip,
                                   double* sumsq) = 0;
  // The partial sums momentum_multi_sums gives per tensor (0: it cannot);
  // never more than select_parts_max(1, n).
  virtual int64_t momentum_parts(int64_t count, int64_t n) = 0;
  // The parameter update: load_multi(x, kParam); apply_update(x, u, count * n,
  // gs, lr_mult, cautious); store_multi(kParam, x, skip). u holds elements
  // of u_dtype (a bf16 u is the Muon family's bf16 iteration's result,
  // widened exactly: the bits of load(u) and apply_update on it).
  virtual void apply_update_multi(const TensorEntry* list, int64_t count, int64_t n, const void* u,
                                  dion_dtype_t u_dtype, const GroupScalars* gs, float lr_mult, bool cautious,
                                  const int32_t* skip) = 0;
  // apply_update_multi with each tensor one rows x cols matrix (n = rows *
  // cols) and u normalised as neuron_normalize would leave it, from
  // neuron_scales' `scales` (count matrices, neurons along `neuron_axis`):
  // the same bits as neuron_normalize on the widened u, then
  // apply_update_multi on its fp32 result, without that result's pass.
  virtual void apply_update_neuron_multi(const TensorEntry* list, int64_t count, int64_t rows, int64_t cols,
                                         const void* u, dion_dtype_t u_dtype, const double* scales, Axis neuron_axis,
                                         const GroupScalars* gs, float lr_mult, bool cautious,
                                         const int32_t* skip) = 0;
  // Dion's update from its factors: for each listed tensor i, X_i (field
  // kParam, rows x cols row-major dense, of dtype x_dtype) <- decay X_i - lr
  // lr_mult (A_i B_i^T), with A_i (rows x r) and B_i (cols x r) the matrices
  // of a and b, of dtype ab_dtype (elements; ld and stride count elements),
  // lr and decay = 1 - lr wd from gs as apply_update computes them:
  // apply_update_multi's non-cautious update of U = A B^T, but with the
  // product accumulated in fp32 and never rounded on its own (one rounding
  // to x_dtype). fp32 factors are multiplied at `precision` (a backend's
  // GEMM precision; the host's is always fp32), bf16 ones exactly with fp32
  // accumulation. Nothing when *skip. Only for the dtypes that
  // update_lowrank_takes accepts: bf16 factors with fp32 or bf16
  // parameters, fp32 factors with fp32 parameters.
  virtual void update_lowrank(const TensorEntry* list, int64_t count, ConstMatBatch a, ConstMatBatch b,
                              dion_dtype_t ab_dtype, dion_dtype_t x_dtype, dion_matmul_precision_t precision,
                              const GroupScalars* gs, float lr_mult, const int32_t* skip) = 0;
  // Dion's error feedback into the momentum state: for each listed tensor
  // i, M_i (field kState0, rows x cols row-major dense, of dtype x_dtype)
  // <- M_i + alpha (A_i B_i^T), the product accumulated in fp32 and added
  // with one rounding to x_dtype (a GEMM with M as C, beta 1); the operand
  // dtypes and precisions as update_lowrank's, update_lowrank_takes' pairs.
  // Nothing when *skip.
  virtual void accumulate_lowrank(const TensorEntry* list, int64_t count, ConstMatBatch a, ConstMatBatch b,
                                  dion_dtype_t ab_dtype, dion_dtype_t x_dtype, dion_matmul_precision_t precision,
                                  float alpha, const int32_t* skip) = 0;
  static bool update_lowrank_takes(dion_dtype_t ab_dtype, dion_dtype_t x_dtype) {
    if (ab_dtype == DION_DTYPE_BF16) return x_dtype == DION_DTYPE_FP32 || x_dtype == DION_DTYPE_BF16;
    return ab_dtype == DION_DTYPE_FP32 && x_dtype == DION_DTYPE_FP32;
  }
  // store_multi(f) of the selected slices of m only (the rest of field f is
  // left as it is): m holds count * per matrices (per = m.batch / count),
  // tensor i's at i * per, and field f of tensor i holds its `per` matrices
  // dense (rows x cols each, one after the other). idx as scale_slices takes it.
  virtual void store_slices_multi(const TensorEntry* list, int64_t count, Field f, ConstMatBatch m, Axis axis,
                                  const int32_t* idx, int64_t k, const int32_t* skip) = 0;
  // Dion2's selection on the typed momentum, without an fp32 copy of it:
  // the `count` tensors hold `per` dense rows x cols matrices each (matrix b
  // of the batch is tensor b / per's (b % per)-th), M = state 0, G = grad,
  // and m = M + G as momentum_multi(mu = 1, g_scale = 1) computes it.
  //   momentum_l1_multi: momentum_multi(..., store_state = false, m, FP32);
  //     slice_l1(m, axis, out) (out: count * per * N scores). Writes nothing
  //     typed.
  //   select_momentum_multi: momentum_multi(..., store_state = true, m,
  //     FP32, skip); gather_slices(m, axis, idx, k, out); scale_slices(m,
  //     axis, idx, k, decay); store_slices_multi(kState0, m, axis, idx, k,
  //     skip): M <- m with its selected slices times decay (when !*skip),
  //     out <- the selected slices of m (always). k >= 1; idx as
  //     scale_slices takes it (distinct per matrix).
  // Each reads M and G once, where the sequence wrote and re-read m.
  // nonfinite (nullable): set to 1 where a gradient element is NaN or Inf
  // (never cleared; check_nonfinite's flag for these tensors, taken in the
  // same pass).
  virtual void momentum_l1_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                                 Axis axis, float* out, int32_t* nonfinite) = 0;
  // sumsq (nullable; only where select_momentum_parts(...) > 0): that many
  // partial sums of the squares of each out matrix's elements (in double,
  // their total ||out[b]||_F^2; the same on every run), taken in the same
  // pass, for frob_normalize_bf16_parts and the unnormalised bf16 start. out_dtype
  // BF16: out's elements are bf16 (ld and stride count them), each slice
  // element rounded once, and the sums are those of the rounded values.
  virtual void select_momentum_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                                     Axis axis, const int32_t* idx, int64_t k, float decay, MatBatch out,
                                     dion_dtype_t out_dtype, const int32_t* skip, double* sumsq) = 0;
  // The partial sums select_momentum_multi gives per matrix (0: it cannot);
  // never more than select_parts_max(rows, cols), so a caller can size their
  // room without the backend.
  virtual int64_t select_momentum_parts(int64_t count, int64_t per, int64_t rows, int64_t cols) = 0;
  static int64_t select_parts_max(int64_t rows, int64_t cols) {
    return std::min<int64_t>(4096, std::max<int64_t>(1, (rows * cols + 2047) / 2048));
  }
  // Dion2's parameter update: the params of the `count` tensors, each `per`
  // dense rows x cols matrices, as one fp32 batch x of count * per matrices
  // (u holds as many, shaped as gather_slices' out):
  //   load_multi(x, kParam); decay(x, all, gs);
  //   k > 0: add_slices(x, axis, idx, k, u, gs, mult); store_multi(kParam, x, skip)
  // u_dtype BF16: u's elements are bf16 (ld and stride count them), widened
  // exactly: the bf16 result of an orthogonalization, read where it lies.
  // scales (nullable; axis kRows only): u normalised as neuron_normalize
  // would leave it, from neuron_scales' scales of u's B = count * per
  // matrices of k neurons: u's row s of matrix b taken as
  // float(u * scales[b k + s] * scales[B k + b]) (apply_update_neuron_multi's
  // formula), without a pass that writes the normalised u (NorDion2).
  // The indices of a matrix must be distinct (topk's are).
  virtual void decay_add_slices_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                                      Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u, dion_dtype_t u_dtype,
                                      const double* scales, const GroupScalars* gs, float mult,
                                      const int32_t* skip) = 0;
};

// Created by the backend implementations.
Backend* make_host_backend();
#if DION_WITH_CUDA
// Creates the CUDA backend on `device` (throws Error on failure).
Backend* make_cuda_backend(int device);
// Checks that `p` is device memory of `device` usable by the backend; throws
// INVALID_ARGUMENT with `what` in the message otherwise.
void cuda_check_pointer(const void* p, int device, size_t bytes, size_t align, const char* what);
#endif

}  // namespace dion

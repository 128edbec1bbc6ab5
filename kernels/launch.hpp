// SPDX-License-Identifier: MIT
// Host-side launchers of the CUDA backend's kernels (kernels/*.cu). Each one
// enqueues its kernels on ctx.stream and checks the launch; none allocates or
// waits. Launchers that need temporary device memory take it as an argument
// and say how much through a *_scratch() function, so the backend can grow its
// scratch before the first launch (and never during a CUDA graph capture).
// Shapes are those of the Backend methods of the same name (core/backend.hpp).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/backend.hpp"

namespace dion::kernels {

struct Ctx {
  cudaStream_t stream;
  int sms;  // multiprocessors of the device: sizes grid-stride launches
};

// ---- elementwise.cu ----
void load(const Ctx& c, float* dst, const void* src, dion_dtype_t dt, int64_t n);
void store(const Ctx& c, void* dst, dion_dtype_t dt, const float* src, int64_t n);
void split_bf16(const Ctx& c, void* hi, void* lo, const float* src, int64_t n);
void load_multi(const Ctx& c, float* dst, const TensorEntry* list, int64_t count, Field f, int64_t n);
void load_multi_bf16(const Ctx& c, void* dst, const TensorEntry* list, int64_t count, Field f, int64_t n);
void store_multi(const Ctx& c, const TensorEntry* list, int64_t count, Field f, const float* src, int64_t n,
                 const int32_t* skip);
void store_multi_bf16(const Ctx& c, const TensorEntry* list, int64_t count, Field f, const void* src, int64_t n,
                      const int32_t* skip);
void scale_multi(const Ctx& c, const TensorEntry* list, int64_t count, Field f, int64_t n, float a,
                 const int32_t* skip);
void check_nonfinite(const Ctx& c, const TensorEntry* list, int64_t count, int64_t max_n, Field f, int32_t* flag);
void advance_step(const Ctx& c, GroupScalars* gs, const StepStatus* status);
void count_skip(const Ctx& c, StepStatus* status);
void merge_skip(const Ctx& c, StepStatus* status);
void axpby(const Ctx& c, float a, const float* x, float b, float* y, int64_t n);
void lincomb(const Ctx& c, float a, const float* x, float b, const float* y, float* z, int64_t n);
void nan_to_num(const Ctx& c, float* x, int64_t n);
void apply_update(const Ctx& c, float* x, const float* u, int64_t n, const GroupScalars* gs, float lr_mult,
                  bool cautious);
void decay(const Ctx& c, float* x, int64_t n, const GroupScalars* gs);
// Backend::momentum_parts and momentum_multi_sums.
int64_t momentum_parts(const Ctx& c, int64_t count, int64_t n);
void momentum_multi_sums(const Ctx& c, const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale,
                         bool nesterov, void* u, dion_dtype_t u_dtype, const int32_t* skip, double* sumsq);
void momentum_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale,
                    bool nesterov, bool store_state, void* u, dion_dtype_t u_dtype, const int32_t* skip,
                    int32_t* nonzero);
void apply_update_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t n, const void* u,
                        dion_dtype_t u_dtype, const GroupScalars* gs, float lr_mult, bool cautious,
                        const int32_t* skip);
// C = beta * C (0 where beta == 0, whatever C held): a GEMM with k == 0.
void scale_matrix(const Ctx& c, MatBatch m, float beta);

// ---- optim.cu ----
void adamw(const Ctx& c, const TensorEntry* list, int64_t count, int64_t max_n, const GroupScalars* gs, float eps,
           bool cautious, const int32_t* skip);
void lion(const Ctx& c, const TensorEntry* list, int64_t count, int64_t max_n, const GroupScalars* gs, bool cautious,
          const int32_t* skip);

// ---- reduce.cu ----
size_t frob_normalize_scratch(const Ctx& c, const MatBatch& m);
void frob_normalize(const Ctx& c, MatBatch m, float factor, float eps, void* scratch);
// Takes frob_normalize_scratch(c, m) too.
void frob_normalize_bf16(const Ctx& c, ConstMatBatch m, float factor, float eps, void* out, void* scratch);
// The same from given partial sums of squares (nparts per matrix, summed in order).
void frob_normalize_bf16_parts(const Ctx& c, ConstMatBatch m, const double* parts, int64_t nparts, float factor,
                               float eps, void* out);
// Backend::frob_scale_bf16.
void frob_scale_bf16(const Ctx& c, MatBatch m, const double* parts, int64_t nparts, float factor, float eps, int power,
                     float diag);
size_t col_normalize_scratch(const Ctx& c, const MatBatch& m);
void col_normalize(const Ctx& c, MatBatch m, float eps, void* scratch);
// Backend::finish_p, finish_r (scratch: finish_r_scratch bytes) and
// col_scale_store: Dion's finish of P and R, fused.
void finish_p(const Ctx& c, MatBatch p, const int32_t* flags, void* pb, bool pb_all);
size_t finish_r_scratch(const Ctx& c, const ConstMatBatch& r);
void finish_r(const Ctx& c, MatBatch r, const int32_t* flags, ConstMatBatch q, const TensorEntry* qlist, Field qf,
              void* rb, double* sumsq, void* scratch);
void col_scale_store(const Ctx& c, MatBatch r, const double* sumsq, float eps, void* rb, const TensorEntry* list,
                     Field f, const int32_t* skip, bool write_r);
size_t slice_l1_scratch(const Ctx& c, const ConstMatBatch& m, Axis axis);
void slice_l1(const Ctx& c, ConstMatBatch m, Axis axis, float* out, void* scratch);
size_t zero_fixup_scratch(const Ctx& c, const ConstMatBatch& m);
void zero_fixup(const Ctx& c, ConstMatBatch m, MatBatch p, MatBatch r, ConstMatBatch q, void* scratch);
void nonzero_flags(const Ctx& c, ConstMatBatch m, int32_t* flags);
void zero_fixup_flagged(const Ctx& c, const int32_t* flags, MatBatch p, MatBatch r, ConstMatBatch q);
size_t neuron_normalize_scratch(const Ctx& c, const MatBatch& u, Axis axis);
void neuron_normalize(const Ctx& c, MatBatch u, Axis axis, float* v, int64_t v_per_matrix, float beta2,
                      const int32_t* selected, void* scratch);
// Backend::neuron_scales; scratch: neuron_normalize_scratch of the shape.
void neuron_scales(const Ctx& c, int64_t batch, int64_t rows, int64_t cols, Axis axis, const void* in, float* v,
                   int64_t v_per_matrix, float beta2, void* scratch, double* scales);
// Backend::apply_update_neuron_multi.
void apply_update_neuron_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t rows, int64_t cols,
                               const void* u, dion_dtype_t u_dtype, const double* scales, bool rows_are_neurons,
                               const GroupScalars* gs, float lr_mult, bool cautious, const int32_t* skip);

// ---- select.cu ----
void topk(const Ctx& c, const float* scores, int64_t batch, int64_t n, int64_t k, int32_t* idx);
void gather_slices(const Ctx& c, ConstMatBatch m, Axis axis, const int32_t* idx, int64_t k, MatBatch out);
void scale_slices(const Ctx& c, MatBatch m, Axis axis, const int32_t* idx, int64_t k, float s);
void add_slices(const Ctx& c, MatBatch m, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u,
                const GroupScalars* gs, float mult);
void store_slices_multi(const Ctx& c, const TensorEntry* list, int64_t count, Field f, ConstMatBatch m, Axis axis,
                        const int32_t* idx, int64_t k, const int32_t* skip);
// Backend::momentum_l1_multi and select_momentum_multi (Dion2's selection on
// the typed momentum); select_momentum_multi's scratch is
// decay_add_slices_multi_scratch's (the same position map).
size_t momentum_l1_multi_scratch(const Ctx& c, int64_t count, int64_t per, int64_t rows, int64_t cols, Axis axis);
void momentum_l1_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                       Axis axis, float* out, void* scratch, int32_t* nonfinite);
// sumsq (nullable; per == 1): select_momentum_parts(...) partial sums of the
// squares of each out matrix's elements, for frob_normalize_bf16_parts and
// frob_scale_bf16; out_bf16: out's elements are bf16.
int64_t select_momentum_parts(const Ctx& c, int64_t count, int64_t per, int64_t rows, int64_t cols);
void select_momentum_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t per, int64_t rows,
                           int64_t cols, Axis axis, const int32_t* idx, int64_t k, float decay, MatBatch out,
                           bool out_bf16, const int32_t* skip, void* scratch, double* sumsq);
size_t decay_add_slices_multi_scratch(int64_t count, int64_t per, int64_t rows, int64_t cols, Axis axis, int64_t k);
void decay_add_slices_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t per, int64_t rows,
                            int64_t cols, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u, bool u_bf16,
                            const double* scales, const GroupScalars* gs, float mult, const int32_t* skip,
                            void* scratch);

// The operand pointer arrays of a pointer-array GEMM (update_lowrank,
// accumulate_lowrank, gemm_field): out[j * count + i] = source j's pointer
// for matrix i, a base + i * stride (bytes), or list[i]'s field when field
// >= 0. With coef: coef = {-lr mult, 1 - lr wd} as apply_update computes
// them (gs not null) or {mult, 1} (gs null), {0, 1} when *skip (the GEMM's
// alpha and beta, read from the device).
struct PtrSource {
  const void* base;
  int64_t stride;
  int field;
};
void gemm_pointers(const Ctx& c, const TensorEntry* list, int64_t count, const PtrSource (&src)[3], const void** out,
                   const GroupScalars* gs, float mult, const int32_t* skip, float* coef);

// ---- linalg.cu ----
// ptrs[b] = base + b * stride (device pointer arrays for the batched cuBLAS/cuSOLVER calls).
void fill_pointers(const Ctx& c, float** ptrs, const float* base, int64_t stride, int64_t batch);
// Pointer arrays to blocks of batched matrices, several at once: array a
// (a < count_arrays, `count` pointers each, one after the other in out) holds
// out[a * count + j] = specs[a].base + (j / per) * specs[a].outer + (j % per) * specs[a].inner,
// i.e. block j % per of matrix j / per.
struct BlockPointers {
  const float* base;
  int64_t outer, inner;
};
constexpr int kMaxBlockPointerArrays = 5;  // count_arrays above it is refused (an internal error)
void fill_block_pointers(const Ctx& c, float** out, const BlockPointers* specs, int count_arrays, int64_t per,
                         int64_t count);
// out[b] = in[b]^T: in is rows x cols (row-major, ld_in, stride_in), out cols x rows (ld_out, stride_out).
// With list, in[b] is instead the field `field` of list[b] (fp32, ld_in; stride_in and in unused).
void transpose(const Ctx& c, const float* in, int64_t rows, int64_t cols, int64_t ld_in, int64_t stride_in, float* out,
               int64_t ld_out, int64_t stride_out, int64_t batch, const TensorEntry* list = nullptr, int field = 0);
// r_out[b] (r x r, row-major) <- the upper triangle of the column-major p x r
// geqrf result at cm + b * p * r, zeros below the diagonal.
void extract_r(const Ctx& c, const float* cm, int64_t p, MatBatch r_out);
// The leaves of the triangular inverse by levels: for each matrix b of the
// batch and j < blocks, inv's diagonal block j (L x L at (j L, j L),
// row-major, L <= 64) <- U_jj^{-1} of u's diagonal block j (upper
// triangular, row-major; u.stride 0: one U for all), zeros below its
// diagonal, and the blocks below it in its block column zeroed: inv's
// strictly lower part is then zero, and the levels' GEMMs write the rest.
// One CTA per block (back substitution, a thread per column of the
// inverse), in place of an identity fill and a batched trsm against it.
void tri_inverse_leaves(const Ctx& c, ConstMatBatch u, MatBatch inv, int64_t L, int64_t blocks);
// out[b] = sum of parts[b S .. b S + S - 1] in that order (dense out.rows x
// out.cols matrices): the Gram matrices' split sums (Backend::gram). bs > 0:
// the parts hold only the bs x bs blocks on and below the block diagonal of
// symmetric matrices, and out's elements above it are their transposes' sums.
void sum_parts(const Ctx& c, const float* parts, int64_t S, MatBatch out, int64_t bs = 0);
// Backend::gemm_bf16_lower and gram on an nb x nb grid of bs x bs blocks
// (elements of es bytes, bf16 or fp32; ld and stride count elements): the
// pointer arrays of one pointer-array GEMM over the blocks on
// and below the diagonal of every matrix, cnt = batch nb (nb + 1) / 2 each,
// in the column-major call's operand order: out[e] = op(B)'s columns of
// block column j, out[cnt + e] = op(A)'s rows of block row i, out[2 cnt + e]
// = C's block (i, j). upper: the blocks on and above the diagonal instead,
// (j, i) for each (i, j) (a symmetric product's lower triangle read
// column-major). es: the elements' size in bytes (ld and strides count
// elements).
void sym_block_pointers(const Ctx& c, ConstMatBatch a, bool ta, ConstMatBatch b, bool tb, MatBatch m, int64_t nb,
                        int64_t bs, int64_t es, const void** out, bool upper = false);
// Backend::mirror_bf16 (copy.p null: no copy; power 0: no scale, else
// frob_scale_bf16's scale from parts); bs a multiple of 32 dividing n.
void mirror_bf16(const Ctx& c, MatBatch m, int64_t bs, float diag, MatBatch copy, const double* parts, int64_t nparts,
                 float factor, float eps, int power);
// m[b] (bf16 elements; ld and stride count elements) += v on the diagonal.
void add_diag_bf16(const Ctx& c, MatBatch m, float v);
// Backend::ns_shift_bf16 (parts null: no scale, a3 unused).
void ns_shift_bf16(const Ctx& c, MatBatch a, MatBatch b, float coef, float diag, const double* parts, int64_t nparts,
                   float factor, float eps, void* a3);
// out[b] (rows x cols, row-major, dense) <- m[b] in double.
void to_double(const Ctx& c, ConstMatBatch m, double* out);
// r_out[b] (n x n row-major) <- the upper triangle of l[b] (n x n, dense,
// read row-major: the lower factor of a column-major potrf), zeros below.
void extract_r_double(const Ctx& c, const double* l, MatBatch r_out);
// After potrf on row-major a (as column-major lower): zero the strictly lower
// row-major part, and turn info[b] into a failure index when a diagonal entry
// is non-finite or not positive.
void cholesky_fixup(const Ctx& c, MatBatch a, int32_t* info);
// One diagonal block of the backend's left-looking blocked Cholesky
// (column-major lower factor, A = L L^T) of every matrix of a batch, one
// CTA per matrix: block (o, o) of size nb <= kCholBlock, already updated by
// the block column's GEMM, is factored in shared memory and, where a panel
// follows (inv not null), its inverse L_oo^-1 written to inv (kCholBlock x
// kCholBlock per matrix, column-major, zeros above the diagonal). info[b]:
// at the first block the 1-based column of the first pivot that is not
// positive (NaN included), 0 if none; at later blocks set only while still
// 0 (the first failure, as LAPACK's potrf reports it).
constexpr int kCholBlock = 64;
template <class T>
struct CholBlock {
  T* a;
  int64_t ld, stride, batch;
  int64_t o;
  int nb;
  T* inv;
  int32_t* info;
  bool first;
};
template <class T>
void chol_block(const Ctx& c, const CholBlock<T>& g);
// The left-looking blocked Cholesky's last step: every entry below the
// diagonal blocks of the n x n column-major matrices of a (ld, stride),
// element (i, j) with i / kCholBlock > j / kCholBlock, copied from its
// mirror (j, i) in the strictly upper part, where the factorization wrote
// the panels transposed. One launch for the batch (tiles of 32 x 32
// through shared memory, so both sides are read and written by rows).
template <class T>
void chol_mirror_panels(const Ctx& c, T* a, int64_t n, int64_t ld, int64_t stride, int64_t batch);
// Sets chol_block's shared-memory size on the current device (at the
// backend's creation: before any launch or capture).
void chol_block_init();
// ---- householder.cu ----
// Backend::qr_q by blocks for a whole batch (the backend's qr_q_batched
// drives these with batched SGEMMs): the matrices are column-major p x r
// (ld p, stride p r), the reflectors follow LAPACK's larfg (the same Q as
// sgeqrf + sorgqr, to rounding).
// The outer blocks' width: the trailing updates are products of this inner
// dimension, and an outer block's T is at most this square.
constexpr int kHouseholderBlock = 128;
// Sets the kernels' shared-memory sizes on `device` (current; at the
// backend's creation) and returns the device's opt-in limit per block;
// *clusters: whether the panels may run over clusters of CTAs there
// (Hopper and later; householder_panel's cluster argument).
int householder_init(int device, bool* clusters);
// The panel width for p rows (32 or 16: the panel, in shared memory,
// within smem_optin bytes), or 0 where not even 16 columns fit (narrower
// panels would make the panel updates' products too thin to pay: qr_q then
// takes cuSOLVER's path).
int householder_panel_width(int64_t p, int smem_optin);
// Panel j0 .. j0 + b - 1 (b <= nb, nb householder_panel_width's) of the
// outer block that starts at J0: factored, its explicit V written over its
// columns from row J0 (zeros above the unit diagonal), tau (r per matrix)
// and its T (nb x nb, ld nb, stride nb^2) written. cluster >= 2 (Hopper, at
// most 8, householder_panel_cluster's): each matrix's panel over a cluster
// of that many CTAs, its rows spread over them.
void householder_panel(const Ctx& c, float* cm, int64_t p, int64_t r, int64_t J0, int64_t j0, int64_t b, int nb,
                       float* tau, float* t, int64_t batch, int cluster = 1);
// The cluster size for the panel at column j0 of a batch of p-row
// matrices: the largest power of two up to 8 that leaves each CTA at least
// one round of its pass (128 rows at nb 32, 256 at 16) and keeps the
// batch's CTAs within one per multiprocessor; 1 where not even two would.
int householder_panel_cluster(const Ctx& c, int64_t p, int64_t j0, int nb, int64_t batch);
// T (n x n, n <= kHouseholderBlock; ld ldt, stride st) of the n reflectors
// from J0 on, from S = V^T V (n x n, lds, ss; above its diagonal read) and tau.
void householder_block_t(const Ctx& c, const float* s, int64_t lds, int64_t ss, const float* tau, int64_t r,
                         int64_t J0, int64_t n, float* t, int64_t ldt, int64_t st, int64_t batch);
// a[b](i, j) <- (i == j): the first a.cols columns of I, row-major.
void identity(const Ctx& c, MatBatch a);
size_t orth_fallback_scratch(const Ctx& c, const MatBatch& p);
// p0_bf16 given: P0's elements are bf16 there (dense, p0's shape; p0.p not read).
void orth_fallback(const Ctx& c, MatBatch p, ConstMatBatch p0, const uint16_t* p0_bf16, const int32_t* info,
                   void* scratch);

// ---- lowrank_tf32x3.cu (sm_90a; built where the architectures include 90) ----
// Dion's error feedback and update products C_g = alpha A_g B_g^T + beta C_g
// (lowrank_gemm's operands: A count x (m x k), B count x (n x k) fp32
// strided batches, C fp32 m x n row-major at cptr[g] with ldc, alpha =
// coef[0], beta = coef[1] on the device) at FP32 accuracy on Hopper's tensor
// cores: each factor split into two TF32 parts, three products, their sums
// promoted to fp32 every 16 of k (the file's comment has the method and the
// measured error, at most cuBLAS SGEMM's).
// Whether this build and `device` run it (compute capability 9.0, a driver
// with tensor maps); sets the kernel's shared-memory size, so it is called
// at the backend's creation.
bool lowrank_tf32x3_init(int device);
// Scratch bytes of the split parts of count products.
size_t lowrank_tf32x3_scratch(int64_t count, int64_t m, int64_t n, int64_t k);
// As many products per launch as scratch_bytes holds the parts of (one at
// least). False, nothing launched, where the kernel cannot take the shapes
// (k = 0, a dimension of 2^31 or more, scratch for less than one product).
bool lowrank_tf32x3(const Ctx& c, ConstMatBatch a, ConstMatBatch b, void* const* cptr, const float* coef,
                    int64_t ldc, void* scratch, size_t scratch_bytes);
// An operand's matrices: ptr[g] (device pointer array), or base + g stride
// where ptr is null; ld its row stride.
struct X3Operand {
  const void* const* ptr;
  const float* base;
  int64_t stride, ld;
};
// gemm_field's products at FP32 the same way (and the backend's FP32 gemm,
// from strided batches): out_g (m x n fp32, strided) = op(X_g) B_g, X_g m x
// k, or k x m read transposed (trans_x; 16-byte aligned for the fast
// copies), B_g k x n, times alpha. X is split as the kernel reads it; B, transposed,
// into the scratch, as many products per launch as scratch_bytes holds (one
// at least); where the batch's tiles leave the multiprocessors idle, the
// inner dimension is split and the partial sums (in the scratch too)
// summed. symmetric (m = n, a Gram matrix X^T X): only the tiles that hold
// the result's lower triangle are formed, and that triangle is mirrored onto
// the upper one, so the two agree bit for bit.
// False, nothing launched, where the kernel cannot take the shapes.
// field_tf32x3_scratch: the bytes for `products` of a call of `count`.
size_t field_tf32x3_scratch(const Ctx& c, int64_t count, int64_t m, int64_t n, int64_t k, int64_t products,
                            bool symmetric);
bool field_tf32x3(const Ctx& c, X3Operand b, X3Operand x, bool trans_x, MatBatch out, int64_t k, float alpha,
                  void* scratch, size_t scratch_bytes, bool symmetric);

// ---- randn.cu ----
// Returns the launch status (the file has no dependency on the rest of the
// backend, so the RNG test can compile it alone).
cudaError_t randn(cudaStream_t stream, float* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0,
                  int64_t col0, int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors,
                  const int64_t* step, float scale);
// The same numbers rounded to bf16 (out: bf16 elements).
cudaError_t randn_bf16(cudaStream_t stream, void* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0,
                       int64_t col0, int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors,
                       const int64_t* step, float scale);

}  // namespace dion::kernels

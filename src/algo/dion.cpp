// SPDX-License-Identifier: MIT
// Dion: low-rank orthonormal updates with error feedback (spec §2; arXiv 2504.05295).
//
// Per matrix, with the working matrix B = M or M^T chosen tall (a x b, a >= b
// unless sharding dictates otherwise, §2.2) and Q (b x r):
//   M += G;  P = orth(B Q);  R = B^T P;  M -= (1 - mu) P R^T (in B's orientation);
//   Q = colnorm(R);  X = (1 - lr wd) X - lr sqrt(m/n) P Q^T (in B's orientation).
// The momentum is not decayed by mu before G is added: the decay is the error
// feedback (at full rank exactly M <- mu M, full_rank_ef). Factorizations run
// in fp32 whatever the parameter dtype.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "common.hpp"
#include "rank.hpp"
#include "side_comm.hpp"

namespace dion {

namespace {

// Transposition flag tau (spec §2.2): the working matrix is tall by default;
// sharding fixes it so that the outer-sharded dim is B's column dim and the
// inner-sharded dim B's row dim.
bool dion_tau(const Tensor& t) {
  bool tau = t.geom.m < t.geom.n;
  if (t.inner_shard_dim == 0 || t.outer_shard_dim == 1) tau = false;
  if (t.outer_shard_dim == 0 || t.inner_shard_dim == 1) tau = true;
  return tau;
}

struct Shape {
  int64_t a, b, r, k;  // the local B is a x b; Q is b x r; sketch rows k
  int64_t ag, a_off;   // B's global row count and the local rows' offset (inner sharding)
  bool bT;             // B = S^T, S the storage matrix
};

Shape shape_of(const dion_group_options_t& o, const Tensor& t) {
  Shape s;
  s.bT = (t.dion_transposed != t.geom.storage_transposed);
  s.a = s.bT ? t.geom.scols : t.geom.srows;
  s.b = s.bT ? t.geom.srows : t.geom.scols;
  const int adim = t.dion_transposed ? 1 : 0;  // the logical dim of B's rows
  s.ag = t.shape[adim];
  s.a_off = t.local_offset[adim];
  s.r = t.rank;
  s.k = 128 * static_cast<int64_t>(std::ceil(o.oversample * static_cast<double>(s.r) / 128.0));
  return s;
}

// The momentum's dtype: the group's momentum_dtype, else the parameter's.
dion_dtype_t momentum_dtype_of(const dion_group_options_t& o, const Tensor& t) {
  return o.momentum_dtype == DION_DTYPE_UNSET ? t.param_dtype : o.momentum_dtype;
}

// Whether Dion's large products read a bf16 momentum (step): matmul
// precision BF16 with a bf16 momentum, on the CUDA backend only (the host's
// reference arithmetic stays fp32).
bool bf16_products(const dion_group_options_t& o, dion_dtype_t momentum_dtype) {
  return o.matmul_precision == DION_MATMUL_BF16 && momentum_dtype == DION_DTYPE_BF16;
}

void init_state(Optimizer& opt, Group& g, Tensor& t) {
  const dion_group_options_t& o = g.opt;
  t.rank = dion_rank(o, t.geom.m, t.geom.n);
  t.dion_transposed = dion_tau(t);
  const dion_dtype_t mdt = momentum_dtype_of(o, t);
  dion_dtype_t qdt = o.q_dtype == DION_DTYPE_UNSET ? t.param_dtype : o.q_dtype;
  opt.add_state(t, "momentum", mdt, t.ndim, t.shape, t.local_shape, t.local_offset, t.layout);
  // Q is (b x r) over the global b; its rows follow B's columns (the logical
  // dim that B's columns index), sharded like that dim.
  const int bdim = t.dion_transposed ? 0 : 1;  // logical dim of B's columns
  int64_t gshape[2] = {t.shape[bdim], t.rank};
  int64_t lshape[2] = {t.local_shape[bdim], t.rank};
  int64_t loff[2] = {t.local_offset[bdim], 0};
  int32_t qi = opt.add_state(t, "Q", qdt, 2, gshape, lshape, loff, DION_LAYOUT_ROW_MAJOR);
  StateBuf& q = opt.states[qi];
  if (q.numel == 0) return;
  // Q0 ~ N(0, 1), not normalised, drawn from the counter-based generator so
  // every rank holding rows of Q draws its slice of one global matrix.
  float* tmp = static_cast<float*>(opt.backend->alloc(sizeof(float) * static_cast<size_t>(q.numel)));
  PhiloxKey key{opt.options.seed, kRngInitQ, static_cast<uint32_t>(t.index), 0};
  opt.backend->randn(tmp, 1, lshape[0], lshape[1], loff[0], 0, gshape[1], key, nullptr, nullptr, 1.0f);
  opt.backend->store(q.data, q.dtype, tmp, q.numel);
  opt.backend->synchronize();  // tmp is released below
  opt.backend->release(tmp);
}

// The meshes a batch's step reduces over (spec §2.6): B's columns are
// sharded over `outer`, its rows over `inner` (§2.2); either is null when
// that dim is whole on this rank. `rep` is set when P and R are averaged
// over the replicas instead of the gradient (compressed sync).
struct Dist {
  Collectives* outer = nullptr;
  Collectives* inner = nullptr;
  Collectives* rep = nullptr;
  const std::vector<int64_t>* a_off = nullptr;  // every inner rank's rows of B
  const std::vector<int64_t>* a_ext = nullptr;
  bool any() const { return outer || inner || rep; }
};

Dist dist_of(const Optimizer& opt, const Tensor& t) {
  Dist d;
  if (opt.outer && t.outer_shard_dim >= 0) d.outer = opt.outer.get();
  if (opt.inner && t.inner_shard_dim >= 0) {
    d.inner = opt.inner.get();
    d.a_off = &t.shard_off[1];
    d.a_ext = &t.shard_ext[1];
  }
  if (opt.dion_compressed(t, DION_ALGO_DION)) d.rep = opt.rep.get();  // (usable before the group is in opt.groups)
  return d;
}

// Spec §2.6 paths 1 and 2: the T matrices of a batch are orthogonalized each
// on one rank of a mesh (outer for an outer-sharded matrix, replicate for a
// matrix no shard mesh splits) and all-gathered, instead of on every rank.
// Rank q owns the slots [q B, min(T, (q + 1) B)), B = ceil(T / W): the blocks
// an equal-block reduce-scatter of the batch padded to W B slots leaves on
// each rank. A batch of one is not split (no rank would have less to do).
// Path 3 splits the small factorizations of its batch the same way
// (inner_split).
struct Split {
  Collectives* mesh = nullptr;  // null: every rank orthogonalizes every matrix
  ReduceOp op = ReduceOp::kSum;
  // P still differs between the mesh's ranks (partial sums over outer; each
  // replica's own P under compressed sync) and is reduced over it first:
  // with a reduce-scatter when `scatter`, otherwise with an all-reduce
  // (after which every rank holds the same P and keeps to its slots).
  bool reduce = false, scatter = false;
  int64_t block = 0, first = 0, count = 0;  // this rank's slots [first, first + count)
  int64_t slots = 0;                        // P's slots in the workspace: W B with scatter, else T
};

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

// A reduce-scatter hands in the padded batch: it is used while the padding
// at most doubles the batch, so that it moves no more than the all-reduce it
// replaces (on a ring, (W-1)/W * W B matrices per rank against
// 2 (W-1)/W * T). Beyond that (T < W / 2) P is all-reduced and the slots are
// still split.
bool scatter_pays(int64_t T, int64_t W) { return W * ceil_div(T, W) <= 2 * T; }

// The slots a batch of T matrices takes in the workspace when it is reduced
// over W ranks (`slots`: W B with the reduce-scatter, else T) and the
// receive buffer of the scatter (`own`: B, else 0). Batches of one are not
// split.
struct SlotPad {
  int64_t slots, own;
};
SlotPad slot_pad(int64_t T, int64_t W) {
  if (T < 2 || !scatter_pays(T, W)) return {T, 0};
  return {W * ceil_div(T, W), ceil_div(T, W)};
}

// No split: every rank orthogonalizes the T matrices.
Split unsplit(int64_t T) {
  Split sp;
  sp.slots = T;
  return sp;
}

// Rank q's slots of a batch of T split over `mesh` (q its rank there),
// reduced over it with `op` first when `reduce`.
Split split_over(Collectives* mesh, int64_t T, bool reduce, ReduceOp op) {
  Split sp;
  sp.mesh = mesh;
  sp.reduce = reduce;
  sp.op = op;
  const int64_t W = mesh->size(), q = mesh->rank();
  sp.block = ceil_div(T, W);
  sp.first = std::min(T, q * sp.block);
  sp.count = std::min(T, sp.first + sp.block) - sp.first;
  sp.scatter = reduce && scatter_pays(T, W);
  sp.slots = sp.scatter ? slot_pad(T, W).slots : T;
  return sp;
}

Split split_of(const Optimizer& opt, const Dist& d, int64_t T) {
  // Path 3 (inner sharding) keeps P distributed by rows; only its small
  // factorizations are split (inner_split).
  if (T < 2 || d.inner) return unsplit(T);
  // P = B Q is a partial sum over outer.
  if (d.outer) return split_over(d.outer, T, true, ReduceOp::kSum);
  // Without compressed sync the replicas hold the same gradient (averaged
  // here, or synchronized by the caller when replicate_grad_sync is off),
  // hence the same P: each orthogonalizes its slots and gathers the rest.
  if (opt.rep) return split_over(opt.rep.get(), T, d.rep != nullptr, ReduceOp::kAvg);
  return unsplit(T);
}

// Spec §2.6 path 3: the small matrices of the distributed (R)CQR of a
// row-sharded P (S P, k x r, and the Gram matrix, r x r, per matrix) are
// partial sums over the inner mesh. For a batch of two or more they are
// summed with the same split as P in paths 1 and 2, so that each QR or
// Cholesky runs on one inner rank only, and the r x r factors are
// all-gathered (orth). A batch of one is summed with an all-reduce and
// factored on every inner rank.
Split inner_split(const Dist& d, int64_t T) {
  if (!d.inner || T < 2) return unsplit(T);
  return split_over(d.inner, T, true, ReduceOp::kSum);
}

// The padding slots of a reduce-scatter (sp.slots > T) are summed and never
// factored nor gathered; zeros keep them finite. Enqueued on the compute
// stream before the collective (reduce_slots). x: T matrices of e elements
// of `elem` bytes (fp32 unless said otherwise).
void zero_padding(Backend& be, const Split& sp, void* x, int64_t T, int64_t e, size_t elem = sizeof(float)) {
  if (sp.scatter && sp.slots > T)
    be.zero(static_cast<char*>(x) + static_cast<size_t>(T * e) * elem, elem * static_cast<size_t>((sp.slots - T) * e));
}

// This rank's slots of the T matrices x (e floats each, room for sp.slots,
// the padding zeroed) reduced over sp.mesh: received in `own` (sp.block
// matrices) from the reduce-scatter, else in place in x after the all-reduce
// (or as they are when the mesh's ranks hold the same x already).
float* reduce_slots(const Split& sp, float* x, int64_t T, int64_t e, float* own) {
  if (sp.scatter) {
    sp.mesh->reduce_scatter(x, own, sp.block * e, sp.op);
    return own;
  }
  if (sp.reduce) sp.mesh->all_reduce(x, T * e, sp.op);
  return x + sp.first * e;
}

// Every rank's slots all-gathered along the batch dim into x (T matrices of
// e floats); this rank's sp.count matrices are `mine`, in place when they
// lie at their slots of x.
void gather_slots(Optimizer& opt, const Split& sp, int64_t T, int64_t e, const float* mine, float* x) {
  const int32_t W = sp.mesh->size();
  std::vector<int64_t>& cd = opt.coll_idx;  // capacity reserved at dion_create
  cd.assign(2 * static_cast<size_t>(W), 0);
  for (int32_t q = 0; q < W; ++q) {
    const int64_t first = std::min(T, q * sp.block);
    cd[static_cast<size_t>(q)] = (std::min(T, first + sp.block) - first) * e;
    cd[static_cast<size_t>(W + q)] = first * e;
  }
  sp.mesh->all_gather_v(mine, x, cd.data(), cd.data() + W);
}

// The workspace of inner_fallback: the whole matrices of P0, of the result
// and the gather's receive buffer.
size_t inner_fallback_floats(const Shape& s, int64_t T) { return 3 * ws_floats(T * s.ag * s.r); }

// RCQR's sketch in sketch_product (below).
size_t sketch_floats(int64_t T, const Shape& s) {
  return std::max(ws_floats(s.k * s.a), ws_floats((s.k * s.a + 1) / 2) + ws_floats((T * s.a * s.r + 1) / 2));
}

size_t workspace_floats(const Group& g, const Tensor& t, int64_t count) {
  const Shape s = shape_of(g.opt, t);
  const int64_t T = count, mn = t.geom.srows * t.geom.scols;
  const bool inner = !t.shard_ext[1].empty(), outer = !t.shard_ext[0].empty();
  // P's slots and the reduce-scatter's receive buffer (split_of). The outer
  // mesh's size is known here; the replicate mesh's is not, but a scatter
  // over W >= 2 replicas takes W B <= 2 T slots and leaves B <= ceil(T / 2).
  SlotPad p{T, 0};
  if (T >= 2 && !inner)
    p = outer ? slot_pad(T, static_cast<int64_t>(t.shard_ext[0].size())) : SlotPad{2 * T, ceil_div(T, 2)};
  // M (M + G; later U where update_lowrank is not used), P, the owned slots, R, Q; with bf16
  // products (step) M in bf16 and bf16 copies of Q, P and R instead (this
  // does not know the backend: the larger of the two).
  size_t m_part = ws_floats(T * mn);
  if (bf16_products(g.opt, momentum_dtype_of(g.opt, t))) {
    const auto half = [](int64_t n) { return ws_floats((n + 1) / 2); };
    const size_t lowp = half(T * mn) + half(T * s.a * s.r) + 2 * half(T * s.b * s.r);
    m_part = std::max(m_part, lowp);
  }
  size_t w = m_part + ws_floats(p.slots * s.a * s.r) + ws_floats(p.own * s.a * s.r) + 2 * ws_floats(T * s.b * s.r);
  // P communicated in bf16 (bf16_comm, orth_split_bf16): its bf16 copy for
  // the reduction and the reduce-scatter's bf16 slots
  if (T >= 2 && !inner && g.opt.power_iters == 1 && bf16_products(g.opt, momentum_dtype_of(g.opt, t)))
    w += ws_floats((p.slots * s.a * s.r + 1) / 2) + ws_floats((p.own * s.a * s.r + 1) / 2);
  // Inner sharding: S P and the Gram matrix padded for the reduce-scatter
  // over the inner mesh, and its receive buffers (inner_split).
  const SlotPad f = inner ? slot_pad(T, static_cast<int64_t>(t.shard_ext[1].size())) : SlotPad{T, 0};
  // per power iteration: the orthogonalisation of at most T matrices (the
  // result and RCQR's P1, sketch k x a, S P k x r, two r x r factors,
  // Cholesky info) and a copy of R
  size_t per_iter = 2 * ws_floats(T * s.a * s.r) + sketch_floats(T, s) + ws_floats(f.slots * s.k * s.r) +
                    ws_floats(f.own * s.k * s.r) + ws_floats(T * s.r * s.r) + ws_floats(f.slots * s.r * s.r) +
                    ws_floats(f.own * s.r * s.r) + ws_floats(T) + ws_floats(T * s.b * s.r);
  // inner sharding: the fallback's whole matrices (inner_fallback)
  if (inner) per_iter += inner_fallback_floats(s, T);
  // the zero flags and column sums (in double)
  const size_t flags = ws_floats(T) + ws_floats(2 * T * s.r);
  return w + flags + per_iter * static_cast<size_t>(g.opt.power_iters);
}

// Gathers the row shards of P (each inner rank's T x a_q x r) into whole
// matrices full (T x ag x r) on every inner rank. tmp: T * ag * r floats.
void gather_rows(Optimizer& opt, const Dist& d, const Shape& s, int64_t T, const float* local, float* full,
                 float* tmp) {
  const int W = d.inner->size();
  std::vector<int64_t>& cd = opt.coll_idx;  // capacity reserved at dion_create
  cd.assign(2 * static_cast<size_t>(W), 0);
  for (int q = 0; q < W; ++q) {
    cd[static_cast<size_t>(q)] = T * (*d.a_ext)[static_cast<size_t>(q)] * s.r;
    cd[static_cast<size_t>(W + q)] = T * (*d.a_off)[static_cast<size_t>(q)] * s.r;
  }
  d.inner->all_gather_v(local, tmp, cd.data(), cd.data() + W);
  for (int q = 0; q < W; ++q) {
    const int64_t aq = (*d.a_ext)[static_cast<size_t>(q)], oq = (*d.a_off)[static_cast<size_t>(q)];
    opt.backend->copy2d(full + oq * s.r, sizeof(float) * static_cast<size_t>(s.ag * s.r), tmp + T * oq * s.r,
                        sizeof(float) * static_cast<size_t>(aq * s.r), sizeof(float) * static_cast<size_t>(aq * s.r),
                        static_cast<size_t>(T));
  }
}

// This rank's rows of whole matrices full (T x ag x r) -> local (T x a x r).
void take_rows(Optimizer& opt, const Shape& s, int64_t T, const float* full, float* local) {
  opt.backend->copy2d(local, sizeof(float) * static_cast<size_t>(s.a * s.r), full + s.a_off * s.r,
                      sizeof(float) * static_cast<size_t>(s.ag * s.r), sizeof(float) * static_cast<size_t>(s.a * s.r),
                      static_cast<size_t>(T));
}

// The reverse: local (T x a x r) -> this rank's rows of full (T x ag x r);
// the other rows of full are left as they are.
void place_rows(Optimizer& opt, const Shape& s, int64_t T, const float* local, float* full) {
  opt.backend->copy2d(full + s.a_off * s.r, sizeof(float) * static_cast<size_t>(s.ag * s.r), local,
                      sizeof(float) * static_cast<size_t>(s.a * s.r), sizeof(float) * static_cast<size_t>(s.a * s.r),
                      static_cast<size_t>(T));
}

// The Cholesky fallback of a batch whose rows are sharded over the inner
// mesh (P: this rank's rows of the input, Y: of the result, T matrices).
// The inner ranks agree on info (they factored the same G, or gathered each
// slot's flag from its owner); the whole P0 is gathered for the failed
// matrices unless the host can see that none failed (on a device, reading
// info would wait for the step, so there it is gathered every step). Only
// P0: the fallback writes whole matrices where info is set and leaves the
// others as they are, so a whole-matrix buffer holding just this rank's
// rows of Y gives back, by take_rows, Y's own rows for the matrices that did
// not fail and the fallback's for those that did. Workspace: 3 T ag r
// floats (inner_fallback_floats).
void inner_fallback(Optimizer& opt, const Dist& d, const Shape& s, ConstMatBatch P, MatBatch Y, const int32_t* info) {
  Backend& be = *opt.backend;
  const int64_t T = Y.batch;
  if (be.host_memory()) {
    bool any = false;
    for (int64_t i = 0; i < T; ++i) any = any || info[i] != 0;
    if (!any) return;
  }
  MatBatch Pf{opt.ws.take(T * s.ag * s.r), s.ag, s.r, s.r, s.ag * s.r, T};
  MatBatch P0f{opt.ws.take(T * s.ag * s.r), s.ag, s.r, s.r, s.ag * s.r, T};
  float* tmp = opt.ws.take(T * s.ag * s.r);
  gather_rows(opt, d, s, T, P.p, P0f.p, tmp);
  place_rows(opt, s, T, Y.p, Pf.p);
  be.orth_fallback(Pf, P0f, info);
  take_rows(opt, s, T, Pf.p, Y.p);
}

// RCQR's sketch product SP = S P for the T matrices of P: one sketch S (k x
// ag, N(0, 1/k) entries) for all of them, a batched product whose S stride is
// 0. S is keyed by (iteration, P's global shape, step), the step read on the
// device, so a replayed CUDA graph draws a new sketch every step, every rank
// and every batch that holds a matrix of that shape draws the same S (spec
// §13.2's I2 without communication: the single-process run, a mesh's slots
// and a row shard's columns all see one global sketch), and a step draws one
// k x ag matrix per shape instead of one per matrix (the generator was 1.5
// of the 26.6 ms of a gpt-1.3b bf16 step). Sharing S among the matrices
// costs nothing in RCQR's guarantee: each S P_i is the sketch of P_i by a
// Gaussian matrix drawn independently of P_i, which is all the method uses
// (spec §13.2: "any Gaussian S is valid"). A rank holding rows [a_off,
// a_off + a) of P draws those columns of S. At matmul precision BF16 on a
// device, S is drawn in bf16 and multiplied with P's bf16 copy (fp32
// accumulation) at bf16 tensor-core rates, as the reference multiplies in P's
// dtype for bf16 parameters; R1 = qr_r(S P) only preconditions P (the
// Cholesky step after it orthonormalizes P1 = P R1^-1 in fp32, and the
// result is P's Q factor whatever R1 is), so the product's precision reaches
// the result only through P1's conditioning. P16 (nullable): P already in
// bf16 (bf16(P) exactly: the reduced bf16 slots P was widened from,
// bf16_comm), which saves rounding P again. (A TF32 product of the fp32 S and P,
// without P's bf16 copy, was slower: docs/benchmarks.md.)
// At matmul precision FP32 on a device, with `split` (T a r floats of the
// workspace that are free until the first solve writes P1 there), the same bf16
// S multiplies P split into two bf16 parts (split_bf16: P = hi + lo to 2^-16),
// two bf16 products accumulated in fp32, at the bf16 tensor-core rate instead
// of the SIMT fp32 one (the sketch is 0.39 of gpt-1.3b's 5.98 TFLOP at r = 0.25
// and 5.7 of 36.4 at r = 1.0). Rounding S is no loss: a bf16 S is as much a
// random sketch independent of P as the fp32 one. Only P's error in the product
// could matter, by leaving P1 = P R1^-1 less well conditioned (cond(P1) grows
// with that error times cond(P)) and so Cholesky QR's result less orthonormal;
// the GPU suite's SketchSplit test asserts P's orthonormal factor to 1e-5 at
// cond(P) ~ 1e6, where the host measured the split (emulated) at 3.3e-7 against
// the exact sketch's 2.5e-7, and P rounded to TF32 at 2.9e-3.
// DION_SKETCH_SPLIT=0 keeps the SGEMM.
// Workspace: sketch_floats (the fp32 S, or the bf16 S and P).
void sketch_product(Optimizer& opt, const Group& g, const Shape& s, int iter, ConstMatBatch P, MatBatch SP,
                    dion_matmul_precision_t prec, const void* P16 = nullptr, float* split = nullptr) {
  Backend& be = *opt.backend;
  const int64_t T = SP.batch;
  const uint32_t shape_id = static_cast<uint32_t>(s.ag) * 0x9E3779B1u + static_cast<uint32_t>(s.k);
  const PhiloxKey key{opt.options.seed, static_cast<uint32_t>(kRngSketch | (iter << 8)), shape_id, 0};
  const float scale = static_cast<float>(std::sqrt(1.0 / static_cast<double>(s.k)));
  // The bf16 forms: BF16's (S times bf16(P), or P16 where the caller has
  // P in bf16) and FP32's split (S hi + S lo). A rank's empty row shard
  // (path 3, a = 0) takes the fp32 product, whose empty sum writes S P = 0
  // (gemm_bf16_f32 would too, but only the NCCL suites reach this case).
  const bool dense = !be.host_memory() && s.a > 0 && P.ld == s.r && P.stride == s.a * s.r;
  const bool two = dense && prec == DION_MATMUL_FP32 && split && env_on("DION_SKETCH_SPLIT");  // read at each step
  if (two || (dense && prec == DION_MATMUL_BF16)) {
    float* S = opt.ws.take((s.k * s.a + 1) / 2);
    be.randn_bf16(S, 1, s.k, s.a, 0, s.a_off, s.ag, key, nullptr, &g.scalars->step, scale);
    const int64_t n = T * s.a * s.r;
    const void* hi = P16;
    uint16_t* lo = nullptr;
    if (two) {
      // lo 16-byte aligned after hi: round_up(n, 8) + n bf16 fit in the
      // ws_floats(n) floats (a multiple of 16) that `split` was taken as
      lo = reinterpret_cast<uint16_t*>(split) + (n + 7) / 8 * 8;
      be.split_bf16(split, lo, P.p, n);
      hi = split;
    } else if (!hi) {
      float* x = opt.ws.take((n + 1) / 2);
      be.store(x, DION_DTYPE_BF16, P.p, n);
      hi = x;
    }
    const ConstMatBatch Sb(S, s.k, s.a, s.a, 0, T);
    const auto part = [&](const void* x) {  // bf16 elements
      return ConstMatBatch(static_cast<const float*>(x), s.a, s.r, s.r, s.a * s.r, T);
    };
    be.gemm_bf16_f32(false, false, 1.0f, Sb, part(hi), 0.0f, SP);
    if (lo) be.gemm_bf16_f32(false, false, 1.0f, Sb, part(lo), 1.0f, SP);
    return;
  }
  float* S = opt.ws.take(s.k * s.a);
  be.randn(S, 1, s.k, s.a, 0, s.a_off, s.ag, key, nullptr, &g.scalars->step, scale);
  be.gemm(false, false, 1.0f, ConstMatBatch(S, s.k, s.a, s.a, 0, T), P, 0.0f, SP, prec);
}

// The group's QR method this step: CQR starts with RCQR for its warm-up steps.
int qr_method_now(const Group& g) {
  int method = g.opt.qr_method;
  if (method == DION_QR_CQR && g.host_step <= g.opt.cqr_warmup_steps) method = DION_QR_RCQR;
  return method;
}

// The small factorizations of path 3, on the T partial sums (over `inner`;
// null: already complete) of a batch or a phased group: with the batch
// split over the inner mesh (sp from inner_split) each slot is reduced to
// its owner, factored there and the factors gathered; otherwise the sums
// are all-reduced and every rank factors them all. own: the reduce-scatter's
// receive buffer (sp.block matrices) where sp.scatter.
// The sums x (T matrices of e floats) this rank factors: its slots, first
// .. first + count - 1, reduced to it, or all of them.
struct OwnedSums {
  float* p;
  int64_t first, count;
};
OwnedSums owned_sums(Backend& be, const Split& sp, Collectives* inner, float* x, int64_t T, int64_t e, float* own) {
  if (!sp.mesh) {
    if (inner) inner->all_reduce(x, T * e, ReduceOp::kSum);
    return {x, 0, T};
  }
  zero_padding(be, sp, x, T, e);
  return {reduce_slots(sp, x, T, e, own), sp.first, sp.count};
}
// R1 = qr_r(S P) of the k x r sketches SP (dense).
void split_qr_r(Optimizer& opt, const Split& sp, Collectives* inner, MatBatch SP, MatBatch R1, float* own) {
  const int64_t T = SP.batch, k = SP.rows, r = SP.cols, kr = k * r, rr = r * r;
  const OwnedSums o = owned_sums(*opt.backend, sp, inner, SP.p, T, kr, own);
  float* r1 = R1.p + o.first * rr;  // gathered in place
  if (o.count > 0) opt.backend->qr_r(MatBatch{o.p, k, r, r, kr, o.count}, MatBatch{r1, r, r, r, rr, o.count});
  if (sp.mesh) gather_slots(opt, sp, T, rr, r1, R1.p);
}
// The Cholesky factors of the r x r Gram matrices G (dense), in place, and
// their flags (info, T; the same on every rank of the mesh).
void split_cholesky(Optimizer& opt, const Split& sp, Collectives* inner, MatBatch G, int32_t* info, float* own) {
  Backend& be = *opt.backend;
  const int64_t T = G.batch, r = G.rows, rr = r * r;
  const OwnedSums o = owned_sums(be, sp, inner, G.p, T, rr, own);
  // Over a mesh each slot's flag is written by its owner only and summed
  // over the mesh (the others hold 0), so every rank learns every matrix's:
  // the fallback is decided the same way on all of them.
  if (sp.mesh) be.zero(info, sizeof(int32_t) * static_cast<size_t>(T));
  if (o.count > 0) be.cholesky_upper(MatBatch{o.p, r, r, r, rr, o.count}, info + o.first);
  if (!sp.mesh) return;
  gather_slots(opt, sp, T, rr, o.p, G.p);
  sp.mesh->all_reduce(info, T, ReduceOp::kSum);
}

// An orthonormal basis of the columns of P (a x r per matrix, a >= r; spec
// §1.3), returned as the buffer that holds it: P itself for Householder QR
// (in place), else a workspace buffer: the (R)CQR solves write out of place
// (no copies of P), and P is left as it was for the fallback. A failed
// Cholesky never lets garbage through: the matrices whose factor failed are
// re-orthonormalised from P (orth_fallback: Householder QR on the host,
// Gram-Schmidt twice on the GPU), decided per matrix on the device, so no
// step waits for the host.
//
// With B's rows sharded over the inner mesh (P row-sharded), the randomized
// Cholesky QR is distributed (spec §2.6 path 3): each rank sketches its rows
// with its columns of the global sketch, and the k x r and r x r products are
// summed over the mesh. In a batch of two or more each rank factors only its
// slots of the sums and the factors are all-gathered (inner_split); a batch
// of one is factored on every rank. Either way every rank then solves its
// rows with the same factors. The Householder cases (square P, a failed
// Cholesky) gather the whole P.
float* orth(Optimizer& opt, const Group& g, const Shape& s, const Dist& d, MatBatch P, int iter,
           const void* P16 = nullptr) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const dion_matmul_precision_t prec = o.matmul_precision;
  const int64_t T = P.batch;
  int method = qr_method_now(g);
  // A square P gains nothing from a Cholesky-based QR and squares its
  // condition number: use Householder QR for it whatever the method.
  if (s.ag <= s.r) method = DION_QR_QR;
  if (method == DION_QR_QR) {
    if (!d.inner) {
      be.qr_q(P);
      return P.p;
    }
    MatBatch Pf{opt.ws.take(T * s.ag * s.r), s.ag, s.r, s.r, s.ag * s.r, T};
    float* tmp = opt.ws.take(T * s.ag * s.r);
    gather_rows(opt, d, s, T, P.p, Pf.p, tmp);
    be.qr_q(Pf);  // the same input and the same factorization on every inner rank
    take_rows(opt, s, T, Pf.p, P.p);
    return P.p;
  }
  // The result. The fallback starts again from P itself, which the solves
  // leave as it is: after RCQR's first solve a rank-deficient P may already
  // have turned into Inf/NaN.
  MatBatch Y{opt.ws.take(T * s.a * s.r), s.a, s.r, s.r, s.a * s.r, T};
  ConstMatBatch P1 = P;  // the Cholesky step's input: P1 = P R1^-1 (RCQR), else P
  const Split sp = inner_split(d, T);
  const int64_t rr = s.r * s.r;
  MatBatch G{opt.ws.take(sp.slots * rr), s.r, s.r, s.r, rr, T};
  int32_t* info = reinterpret_cast<int32_t*>(opt.ws.take(T));
  if (method == DION_QR_RCQR) {
    // Randomized Cholesky QR: R1 = qr_r(S P); P1 = P R1^-1; P2 = P1 chol(P1^T P1)^-1.
    MatBatch SP{opt.ws.take(sp.slots * s.k * s.r), s.k, s.r, s.r, s.k * s.r, T};
    MatBatch R1{opt.ws.take(T * rr), s.r, s.r, s.r, rr, T};
    MatBatch X{opt.ws.take(T * s.a * s.r), s.a, s.r, s.r, s.a * s.r, T};  // P1; first the sketch's scratch
    sketch_product(opt, g, s, iter, P, SP, prec, P16, X.p);
    split_qr_r(opt, sp, d.inner, SP, R1, sp.scatter ? opt.ws.take(sp.block * s.k * s.r) : nullptr);
    be.trsm_right_upper(R1, P, X, prec);
    P1 = X;
  }
  // (R)CQR's Cholesky step on P (or P1). The Gram matrix is formed at the
  // group's precision, but never below TF32: an error E in G leaves
  // P2^T P2 = I + U^-T E U^-1, of the order of the product's unit roundoff
  // times cond(P1)^2, and RCQR's P1 is well conditioned; so FP32 groups keep
  // an fp32 Gram matrix, while for TF32 and BF16 groups, whose P comes out
  // of products at that precision, TF32 (2^-11) adds less than they already
  // carry, at 8x the fp32 rate (the largest fp32 GEMM of their step before).
  be.gram(P1, G, prec == DION_MATMUL_FP32 ? DION_MATMUL_FP32 : DION_MATMUL_TF32);
  split_cholesky(opt, sp, d.inner, G, info, sp.scatter ? opt.ws.take(sp.block * rr) : nullptr);
  be.trsm_right_upper(G, P1, Y, prec);
  if (!d.inner) {
    be.orth_fallback(Y, P, info);
    return Y.p;
  }
  inner_fallback(opt, d, s, P, Y, info);
  return Y.p;
}

// Whether a batch's P is communicated in bf16: on the lowp path (bf16
// momentum, BF16 products: P's bf16 copy is what every product after the
// orthogonalization reads), for a batch split over a mesh that reduces P
// (outer partial sums, or the replicas' own P under compressed sync). P's
// partial sums are rounded to bf16 and summed in bf16 (as the reference
// communicates P in the bf16 parameters' dtype; reduce_slots_bf16), the
// owners widen their reduced slots to fp32 for the orthogonalization, and
// the orthonormal slots, finished by their owners (finish_own_bf16), are
// gathered as the bf16 copy the products read (the same bits as gathering
// fp32 and rounding after). Half the bytes of both collectives. The gather
// moves pairs of bf16 as floats, so a matrix of P must have an even number
// of elements. The phased step does this for every such bucket, step() for
// one power iteration (orth_split_bf16).
// DION_P_BF16_COMM=0 keeps P's collectives in fp32 (read once).
bool bf16_comm(bool lowp, const Split& sp, const Shape& s) {
  static const bool enabled = env_on("DION_P_BF16_COMM");
  return enabled && lowp && sp.mesh && sp.reduce && (s.a * s.r) % 2 == 0;
}

// bf16_comm's reduction: the batch's bf16 P (all: sp.slots matrices of e
// elements, the padding zeroed) reduced to this rank's slots over sp.mesh
// (the reduce-scatter into ownb, else the all-reduce in place), then
// averaged over the replicas where the split mesh is not the replicate one.
// Returns this rank's sp.count reduced matrices.
uint16_t* reduce_slots_bf16(const Split& sp, const Dist& d, uint16_t* all, uint16_t* ownb, int64_t T, int64_t e) {
  uint16_t* mb = all + sp.first * e;
  if (sp.scatter) {
    mb = ownb;
    sp.mesh->reduce_scatter_bf16(all, mb, sp.block * e, sp.op);
  } else {
    sp.mesh->all_reduce_bf16(all, T * e, sp.op);
  }
  if (d.rep && sp.mesh != d.rep) d.rep->all_reduce_bf16(mb, sp.count * e, ReduceOp::kAvg);
  return mb;
}

// bf16_comm's owners: their orthonormal slots Y rounded into their bf16 copy
// own16 and finished there (finish_p; nz: their all-zero flags, reduced
// over the meshes), ready to be gathered.
void finish_own_bf16(Backend& be, MatBatch Y, const int32_t* nz, uint16_t* own16) {
  be.finish_p(Y, nz, own16, true);
}

// P <- orth(P) with the batch split over sp.mesh (spec §2.6 paths 1 and 2):
// P is reduced over the mesh (the outer partial sums; the replicas' P under
// compressed sync), each rank orthogonalizes its slots, and the mesh gathers
// them. Under compressed sync an outer-sharded P is also averaged over the
// replicas, but only this rank's slots: the others arrive averaged by their
// owners. `own` (B matrices) receives the reduce-scatter.
void orth_split(Optimizer& opt, const Group& g, const Shape& s, const Dist& d, const Split& sp, MatBatch P,
                float* own, int iter) {
  const int64_t ar = s.a * s.r, T = P.batch;
  zero_padding(*opt.backend, sp, P.p, T, ar);
  float* mine = reduce_slots(sp, P.p, T, ar, own);
  // The ranks of a replicate mesh sit at the same place of their outer
  // meshes, so they own the same slots.
  if (d.rep && sp.mesh != d.rep) d.rep->all_reduce(mine, sp.count * ar, ReduceOp::kAvg);
  const float* res = sp.count > 0 ? orth(opt, g, s, d, MatBatch{mine, s.a, s.r, s.r, ar, sp.count}, iter) : mine;
  // In place when the slots were orthogonalized in P itself.
  gather_slots(opt, sp, T, ar, res, P.p);
}

// orth_split with P communicated in bf16 (bf16_comm): P's partial sums
// (`all`: the batch's bf16 P, formed by m_product_bf16, sp.slots
// matrices) reduced in bf16, this rank's slots widened into P (or `own`),
// orthogonalized, finished into their bf16 copy in Pb (finish_own_bf16; nz
// reduced over the meshes already) and gathered into Pb, which then holds
// the batch's final P for every product (P's fp32 values only at this
// rank's slots). Workspace: the bf16 P and the reduce-scatter's bf16 slots.
void orth_split_bf16(Optimizer& opt, const Group& g, const Shape& s, const Dist& d, const Split& sp, MatBatch P,
                     uint16_t* all, float* own, const int32_t* nz, MatBatch Pb, int iter) {
  Backend& be = *opt.backend;
  const int64_t ar = s.a * s.r, T = P.batch, c = sp.count;
  uint16_t* ownb = sp.scatter ? reinterpret_cast<uint16_t*>(opt.ws.take((sp.block * ar + 1) / 2)) : nullptr;
  zero_padding(be, sp, all, T, ar, sizeof(uint16_t));
  const uint16_t* mb = reduce_slots_bf16(sp, d, all, ownb, T, ar);
  uint16_t* own16 = reinterpret_cast<uint16_t*>(Pb.p) + sp.first * ar;
  if (c > 0) {
    float* mine = sp.scatter ? own : P.p + sp.first * ar;
    be.load(mine, mb, DION_DTYPE_BF16, c * ar);
    float* res = orth(opt, g, s, d, MatBatch{mine, s.a, s.r, s.r, ar, c}, iter, mb);
    finish_own_bf16(be, MatBatch{res, s.a, s.r, s.r, ar, c}, nz + sp.first, own16);
  }
  gather_slots(opt, sp, T, ar / 2, reinterpret_cast<const float*>(own16), Pb.p);
}

// bf16_products on the CUDA backend: M + G is formed in bf16 (the momentum's own rounding,
// done before the error feedback instead of after it), the large products
// read it and bf16 copies of Q, P and R (the roundings a BF16-precision
// product applies to its fp32 operands anyway) at bf16 tensor-core rates
// instead of converting fp32 operands inside cuBLAS (about 3x slower on an
// H100), the error feedback and the update read bf16 copies of P, R and
// Q. P, R, Q and every factorization stay fp32.
bool lowp_path(const Backend& be, const dion_group_options_t& o, dion_dtype_t momentum_dtype) {
  return !be.host_memory() && bf16_products(o, momentum_dtype);
}

// Whether the error feedback goes straight into the momentum state
// (accumulate_lowrank, on a device backend, where it takes the state's
// dtype with the step's factors: bf16 ones on the lowp path, fp32 ones
// into an fp32 state). The momentum pass then stores M + G in the state,
// and the store of M after the error feedback (a pass over it) goes away.
// The batch's pointers must be 16-byte aligned (Batch::aligned16).
bool ef_in_state(const Backend& be, const Batch& bt, bool lowp, dion_dtype_t momentum_dtype) {
  return !be.host_memory() && bt.aligned16 &&
         Backend::update_lowrank_takes(lowp ? DION_DTYPE_BF16 : DION_DTYPE_FP32, momentum_dtype);
}

// Whether the momentum state is also the products' input (gemm_field), so
// that M + G needs no copy in the workspace: the error feedback goes into
// the state, the state holds the products' operand dtype (bf16 on the lowp
// path, fp32 otherwise) and the update takes the parameters' dtype (finish
// then never needs M's buffer). DION_MOMENTUM_IN_STATE=0 keeps the copy.
bool m_in_state(const Backend& be, const Batch& bt, bool lowp, dion_dtype_t momentum_dtype, dion_dtype_t param_dtype) {
  static const bool off = !env_on("DION_MOMENTUM_IN_STATE");
  const dion_dtype_t ab = lowp ? DION_DTYPE_BF16 : DION_DTYPE_FP32;
  return !off && ef_in_state(be, bt, lowp, momentum_dtype) && momentum_dtype == ab &&
         Backend::update_lowrank_takes(ab, param_dtype);
}

// Whether the error feedback is the decay M <- mu M instead of the product
// M - (1 - mu) P R^T: at full rank, r = min(m, n). There P P^T B = B, so
// P R^T = P P^T B = B and M - (1 - mu) P R^T = mu M in exact arithmetic.
// Either P is square (r = a: orthogonal, P P^T = I), or P (a x b, r = b) has
// orthonormal columns spanning B Q's column space, which is B's (Q is b x b
// and nonsingular; where B Q is rank deficient and the Cholesky fails,
// orth_fallback completes an orthonormal basis that still holds B's columns).
// Under sharding too: a row shard of P P^T B is the shard of B, and
// R = B^T P is reduced over the meshes first. The product would give mu M
// plus (1 - mu) (I - P P^T) B, B's part that the rounding errors of
// P = orth(B Q) leave outside P's span (about eps ||B|| cond(Q)), which exact
// Dion does not have; the decay is one pass over M instead of a product of
// 2 a b r FLOPs (a quarter of the step's rank-r products). Compressed sync
// never applies here ((m + n) r < m n fails). DION_FULL_RANK_EF=0 (read at
// each step) keeps the product.
bool full_rank_ef(const Tensor& t) {
  return t.rank == std::min(t.geom.m, t.geom.n) && env_on("DION_FULL_RANK_EF");
}

// The bf16 copy (store(BF16)) of n floats: Q's, P's or R's for the lowp path's products.
void to_bf16(Backend& be, float* dst, const float* src, int64_t n) { be.store(dst, DION_DTYPE_BF16, src, n); }

// A batch's M + G, one pass over the typed momentum and gradient
// (momentum_multi): into the state where the error feedback goes there
// (ef_in_state), into M unless the state is the products' input
// (in_state: M is null then; else fp32, or bf16 elements on the lowp path),
// and nz[i] = whether matrix i holds a nonzero element (the zero handling).
struct MomentumPass {
  float* M;
  int32_t* nz;
};
MomentumPass momentum_pass(Optimizer& opt, const Batch& bt, bool lowp, bool in_state) {
  Backend& be = *opt.backend;
  const int64_t T = bt.count, n_el = bt.t.numel_local;
  const dion_dtype_t mdt = state_of(opt, bt.t, 0).dtype;
  float* M = in_state ? nullptr : opt.ws.take(lowp ? (T * n_el + 1) / 2 : T * n_el);
  int32_t* nz = reinterpret_cast<int32_t*>(opt.ws.take(T));
  be.zero(nz, sizeof(int32_t) * static_cast<size_t>(T));
  be.momentum_multi(bt.list, T, n_el, 1.0f, 1.0f, false, ef_in_state(be, bt, lowp, mdt), M,
                    lowp ? DION_DTYPE_BF16 : DION_DTYPE_FP32, opt.skip_flag(), nz);
  return {M, nz};
}

// Whether P = B Q reads Q where its state holds it (gemm_field's b_field)
// instead of an fp32 copy in the workspace: where the momentum state is the
// products' input (in_state) in fp32 and Q's state is fp32 too, so the
// product reads the values load_ws would copy. On the GPU at TF32 the
// K-major copy of Q (tf32_kmajor) is then made from the state in the one
// pass that was load_ws's: on an H200 (2026-11-29, A/B in one binary)
// gpt-1.3b Dion tf32 30.10-30.21 -> 29.81-29.97 ms per step, gpt-160m
// fp32 5.86-5.87 -> 5.83-5.85. DION_Q_IN_STATE=0 keeps the copy.
bool q_in_state(Optimizer& opt, const Batch& bt, bool lowp, bool in_state) {
  static const bool off = !env_on("DION_Q_IN_STATE");
  return !off && in_state && !lowp && state_of(opt, bt.t, 1).dtype == DION_DTYPE_FP32;
}

// Q (b x r per matrix) as the batch's products read it: in fp32 (Qm), or,
// straight from the state, its bf16 copy on the lowp path (Qtb) or the
// state itself (q_in_state); Qm.p is null in those two cases, and finish()
// has finish_r's fix-up read the state instead.
struct QLoad {
  MatBatch Qm;
  ConstMatBatch Qtb;
};
QLoad load_q(Optimizer& opt, const Batch& bt, const Shape& s, bool lowp, bool in_state) {
  const int64_t T = bt.count, br = s.b * s.r;
  const bool copy = !lowp && !q_in_state(opt, bt, lowp, in_state);
  QLoad q{MatBatch{copy ? load_ws(opt, bt, kState1, br) : nullptr, s.b, s.r, s.r, br, T},
          ConstMatBatch(nullptr, s.b, s.r, s.r, br, T)};
  if (lowp) {
    float* x = opt.ws.take((T * br + 1) / 2);
    opt.backend->load_multi_bf16(x, bt.list, T, kState1, br);
    q.Qtb.p = x;
  }
  return q;
}

// C = op(M) B (op: transposed when `trans`) for the batch's momentum M + G:
// from the state (in_state), else from its workspace copy Mm (bf16
// elements on the lowp path, and B bf16 too). Mm's shape is used either way.
// B.p null on the fp32 path (in_state only): B is Q in its state (load_q).
void m_product(Backend& be, const Batch& bt, bool in_state, bool lowp, bool trans, ConstMatBatch Mm, ConstMatBatch B,
               MatBatch C, dion_matmul_precision_t prec) {
  const int b_field = !lowp && !B.p ? kState1 : -1;
  DION_REQUIRE(b_field < 0 || in_state, DION_ERROR_INTERNAL, "dion: Q read from its state without the momentum's");
  if (in_state)
    be.gemm_field(bt.list, bt.count, kState0, Mm.rows, Mm.cols, lowp ? DION_DTYPE_BF16 : DION_DTYPE_FP32, trans, B, C,
                  prec, DION_DTYPE_FP32, b_field);
  else if (lowp)
    be.gemm_bf16_f32(trans, false, 1.0f, Mm, B, 0.0f, C);
  else
    be.gemm(trans, false, 1.0f, Mm, B, 0.0f, C, prec);
}

// m_product on the lowp path with C in bf16 (C16: dense bf16 elements, each
// the fp32 product rounded): P = B Q where only its bf16 rounding is used
// (bf16_comm reduces the rounded partial sums), without an fp32 P and a
// pass rounding it.
void m_product_bf16(Backend& be, const Batch& bt, bool in_state, bool trans, ConstMatBatch Mm, ConstMatBatch B,
                    MatBatch C16, dion_matmul_precision_t prec) {
  if (in_state)
    be.gemm_field(bt.list, bt.count, kState0, Mm.rows, Mm.cols, DION_DTYPE_BF16, trans, B, C16, prec, DION_DTYPE_BF16,
                  -1);
  else
    be.gemm_bf16(trans, false, 1.0f, Mm, B, 0.0f, C16);
}

// R = B^T P (partial over the inner mesh) from the orthonormal P (dense);
// on the lowp path from P's bf16 copy, made into Pb (which the error
// feedback and the update read too).
void r_product(Backend& be, const Batch& bt, bool in_state, bool lowp, bool bT, ConstMatBatch Mm, ConstMatBatch P,
               MatBatch Pb, MatBatch R, dion_matmul_precision_t prec) {
  if (lowp) to_bf16(be, Pb.p, P.p, P.batch * P.rows * P.cols);
  m_product(be, bt, in_state, lowp, !bT, Mm, lowp ? ConstMatBatch(Pb) : P, R, prec);
}

// "All zero" over every mesh that shares the matrices: nz as finish reads
// it (step() reduces it just before; the phased step with P in phase A).
void reduce_nz(const Dist& d, int32_t* nz, int64_t T) {
  for (Collectives* c : {d.rep, d.outer, d.inner})
    if (c) c->all_reduce(nz, T, ReduceOp::kMax);
}

// The end of a batch's step once P (orthonormal) and R = B^T P are known:
// the zero / NaN handling, the error feedback into the momentum, Q =
// colnorm(R) and its store, and the parameter update. M holds M + G (bf16
// elements on the lowp path, with Pb and Rb the bf16 copies' room), or is
// null where the state holds it (m_in_state).
void finish(Optimizer& opt, Group& g, const Batch& bt, const Shape& s, const Dist& d, bool lowp, float* M,
            int32_t* nz, MatBatch Qm, MatBatch P, MatBatch R, MatBatch Pb, MatBatch Rb, bool pb_final = false) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const Tensor& t = bt.t;
  const int64_t T = bt.count, n_el = t.numel_local;
  const dion_matmul_precision_t prec = o.matmul_precision;
  MatBatch Mm{M, t.geom.srows, t.geom.scols, t.geom.scols, n_el, T};  // bf16 elements on the lowp path
  // Zero / NaN handling (§2.8): an all-zero momentum leaves the update at zero
  // and carries Q over (normalised); NaN/Inf never reach the state. Over
  // meshes, "all zero" is decided for the whole matrix (every shard, and
  // every replica's momentum under compressed sync), so P and R stay the
  // same on every rank that shares them. In the same passes: the bf16
  // copies of P and R for the error feedback (lowp) and R's column sums of
  // squares for Q = colnorm(R).
  double* ss = reinterpret_cast<double*>(opt.ws.take(2 * T * s.r));
  // pb_final (the phased step's bf16 gather, lowp only): the owners ran
  // finish_p on their slots before gathering Pb, and P is not read again.
  if (!pb_final) be.finish_p(P, nz, lowp ? Pb.p : nullptr, false);
  // Q not loaded in fp32 (load_q, lowp): the fix-up reads the state.
  be.finish_r(R, nz, Qm, Qm.p ? nullptr : bt.list, kState1, lowp ? Rb.p : nullptr, ss);
  // The error feedback's and the update's product is A B^T in storage
  // orientation: P R^T (then P Q^T), or R P^T when B is stored transposed;
  // of the bf16 copies on the lowp path. (Rb and R hold Q for the update:
  // the views read what the buffers hold at each call.)
  const dion_dtype_t ab = lowp ? DION_DTYPE_BF16 : DION_DTYPE_FP32;
  const ConstMatBatch Pf = lowp ? ConstMatBatch(Pb) : ConstMatBatch(P);
  const ConstMatBatch Rf = lowp ? ConstMatBatch(Rb) : ConstMatBatch(R);
  const ConstMatBatch A = !s.bT ? Pf : Rf, B = !s.bT ? Rf : Pf;
  auto product_into_m = [&](float alpha, float beta) {  // Mm = alpha A B^T + beta Mm
    if (lowp)
      be.gemm_bf16(false, true, alpha, A, B, beta, Mm);
    else
      be.gemm(false, true, alpha, A, B, beta, Mm, prec);
  };
  // Error feedback: B -= (1 - mu) P R^T: on a device, straight into the
  // momentum state (which holds M + G), where accumulate_lowrank takes its
  // dtype; else into M, then stored. At full rank the decay M <- mu M
  // (full_rank_ef) of the state, which holds M + G or receives it here.
  const float ef = static_cast<float>(-(1.0 - o.mu));
  const dion_dtype_t mdt = state_of(opt, t, 0).dtype;
  const bool decay = full_rank_ef(t);
  if (ef_in_state(be, bt, lowp, mdt)) {
    if (!decay) be.accumulate_lowrank(bt.list, T, A, B, ab, mdt, prec, ef, opt.skip_flag());
  } else {
    if (!decay) product_into_m(ef, 1.0f);
    if (lowp)
      be.store_multi_bf16(bt.list, T, kState0, M, n_el, opt.skip_flag());
    else
      store_ws(opt, bt, kState0, M, n_el);
  }
  if (decay) be.scale_multi(bt.list, T, kState0, n_el, static_cast<float>(o.mu), opt.skip_flag());
  // Q = colnorm(R), stored (and its bf16 copy, lowp, for the update), in
  // one pass from finish_r's column sums of squares. R's rows (B's columns)
  // sharded over the outer mesh: those sums (double) are partial, and are
  // reduced over it first.
  // On the lowp path R's fp32 values are not read again (the update reads Rb).
  if (d.outer) d.outer->all_reduce(ss, T * s.r, ReduceOp::kSum);
  be.col_scale_store(R, ss, static_cast<float>(o.epsilon), lowp ? Rb.p : nullptr, bt.list, kState1,
                     opt.skip_flag(), !lowp);
  // X = (1 - lr wd) X - lr sqrt(m/n) P Q^T (in storage orientation). On a
  // device, one product per batch updates the parameters in place from P and
  // Q (update_lowrank: the bf16 copies on the lowp path, for fp32 and bf16
  // parameters; else P and Q themselves at the group's precision, for fp32
  // parameters); otherwise the momentum's buffer (stored above) receives
  // U = P Q^T, and the typed parameters are updated from it in one pass.
  const float lr_mult = static_cast<float>(std::sqrt(static_cast<double>(t.geom.m) / static_cast<double>(t.geom.n)));
  if (!be.host_memory() && bt.aligned16 && Backend::update_lowrank_takes(ab, t.param_dtype)) {
    be.update_lowrank(bt.list, T, A, B, ab, t.param_dtype, prec, g.scalars, lr_mult, opt.skip_flag());
    return;
  }
  product_into_m(1.0f, 0.0f);  // U = P Q^T
  be.apply_update_multi(bt.list, T, n_el, M, ab, g.scalars, lr_mult, false, opt.skip_flag());
}

void step(Optimizer& opt, Group& g, const Batch& bt) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const Tensor& t = bt.t;
  const Shape s = shape_of(o, t);
  const Dist d = dist_of(opt, t);
  const int64_t T = bt.count;
  const int64_t n_el = t.numel_local;
  const dion_matmul_precision_t prec = o.matmul_precision;
  const bool lowp = lowp_path(be, o, state_of(opt, t, 0).dtype);
  auto half = [&](int64_t n) { return opt.ws.take((n + 1) / 2); };  // bf16 elements in the fp32 workspace

  const bool in_state = m_in_state(be, bt, lowp, state_of(opt, t, 0).dtype, t.param_dtype);
  const auto [M, nz] = momentum_pass(opt, bt, lowp, in_state);
  const QLoad q = load_q(opt, bt, s, lowp, in_state);

  MatBatch Mm{M, t.geom.srows, t.geom.scols, t.geom.scols, n_el, T};  // bf16 elements on the lowp path
  const Split sp = split_of(opt, d, T);
  const int64_t ar = s.a * s.r, br = s.b * s.r;  // one matrix of P, of R
  MatBatch P{opt.ws.take(sp.slots * ar), s.a, s.r, s.r, ar, T};
  float* const p_buf = P.p;  // P = B Q of each power iteration; orth may leave its result elsewhere
  float* own = sp.scatter ? opt.ws.take(sp.block * ar) : nullptr;  // this rank's reduced slots
  MatBatch R{opt.ws.take(T * br), s.b, s.r, s.r, br, T};
  // The power iteration's right factor: Q, then R; on the lowp path bf16
  // copies of it (Qtb), of P and of R.
  ConstMatBatch Qt = q.Qm, Qtb = q.Qtb;
  MatBatch Pb{lowp ? half(T * ar) : nullptr, s.a, s.r, s.r, ar, T};
  MatBatch Rb{lowp ? half(T * br) : nullptr, s.b, s.r, s.r, br, T};
  // P in bf16 over the split mesh (one power iteration: Pb is then final,
  // finished by the slots' owners, which need the all-zero flags first).
  const bool comm16 = o.power_iters == 1 && bf16_comm(lowp, sp, s);
  if (comm16) reduce_nz(d, nz, T);
  for (int it = 0; it < o.power_iters; ++it) {
    P.p = p_buf;
    if (comm16) {
      // P = B Q (partial over outer) straight into bf16, orthogonalized by
      // the slots' owners and gathered into Pb; R = B^T P from that final Pb
      uint16_t* all = reinterpret_cast<uint16_t*>(half(sp.slots * ar));
      m_product_bf16(be, bt, in_state, s.bT, Mm, Qtb, MatBatch{reinterpret_cast<float*>(all), s.a, s.r, s.r, ar, T},
                     prec);
      orth_split_bf16(opt, g, s, d, sp, P, all, own, nz, Pb, it);
      m_product(be, bt, in_state, true, !s.bT, Mm, ConstMatBatch(Pb), R, prec);
    } else {
      m_product(be, bt, in_state, lowp, s.bT, Mm, lowp ? Qtb : Qt, P, prec);  // P = B Q (partial over outer)
      if (!sp.mesh) {
        if (d.outer) d.outer->all_reduce(P.p, T * ar, ReduceOp::kSum);
        // Compressed replicate sync (spec §2.6): average P = B Q and R = B^T P
        // over the replicas instead of the gradient.
        if (d.rep) d.rep->all_reduce(P.p, T * ar, ReduceOp::kAvg);
        P.p = orth(opt, g, s, d, P, it);
      } else {
        orth_split(opt, g, s, d, sp, P, own, it);
      }
      r_product(be, bt, in_state, lowp, s.bT, Mm, P, Pb, R, prec);
    }
    if (d.inner) d.inner->all_reduce(R.p, T * br, ReduceOp::kSum);
    if (d.rep) d.rep->all_reduce(R.p, T * br, ReduceOp::kAvg);
    if (it + 1 < o.power_iters) {  // never with comm16 (one power iteration)
      // The next iteration starts from the un-normalised R: on the lowp path
      // its bf16 copy replaces Q~'s (this iteration's product has read it).
      if (lowp) {
        to_bf16(be, const_cast<float*>(Qtb.p), R.p, T * br);
      } else {
        float* Rn = opt.ws.take(T * br);
        be.copy(Rn, R.p, sizeof(float) * static_cast<size_t>(T * br));
        Qt = ConstMatBatch(Rn, s.b, s.r, s.r, br, T);
      }
    }
  }
  if (!comm16) reduce_nz(d, nz, T);
  finish(opt, g, bt, s, d, lowp, M, nz, q.Qm, P, R, Pb, Rb, comm16);
}

// ---- The phased step of a group ----
//
// RCQR's small factorizations cost per call, not per matrix (potrfBatched of
// 512 x 512 matrices on an H100: 0.63 ms for 24, 0.81 ms for 96), and a
// group's buckets (one per shape) often share r and k: gpt-1.3b's four
// classes all have r = 512. With one power iteration and a Cholesky-based
// method, the buckets of a group are stepped in phases so that each
// factorization runs once for all of them:
//   A (per bucket)  M + G, P = B Q, P reduced over the meshes to this rank's
//                   slots (spec §2.6 paths 1 and 2, split_of), the sketch S P
//                   of those slots (into one array for all)
//   B (all)         R1 = qr_r(S P)                               (RCQR only)
//   C (per bucket)  P1 = P R1^-1, G = P1^T P1 (into one array)
//   D (all)         cholesky(G), P = P1 chol^-1
//   E (per bucket)  the fallback from P, the slots gathered
//                   over the mesh, R = B^T P, finish()
// (CQR: P1 is P.) Over the outer and replicate meshes each rank factors only
// its slots of each bucket, all buckets' at once: under FSDP over W ranks a
// rank's share of a group is about 1/W of it, in one call per kind. A group
// whose buckets all have B's rows sharded over the inner mesh (path 3: P
// stays distributed by rows) is phased too: the partial sums S P and the
// Gram matrices of all buckets are reduced to their owners over the inner
// mesh in one collective each (inner_split over the group's slots), and
// their factors gathered; with B's columns over the outer mesh as well,
// each bucket's P is first reduced to its slots' owners over outer
// (phased_split), so that an outer rank and its inner mesh orthogonalize
// only their share; a group that mixes path 3 with other buckets is
// not phased, nor is a group whose gradients the overlapped replicate sync averages (a bucket
// starts there as soon as its own gradients are averaged; with compressed
// sync Dion averages P and R instead, and the group is phased). A bucket
// whose P is square or wide (B's global rows at most r: full rank, factored
// by Householder QR, no sketch or Cholesky) takes no part in the phases: it
// is stepped on its own first, and the others are phased where two or more
// remain (gpt-160m at r = 1.0: the out projections, d x d, on their own,
// the qkv, fc1 and fc2 classes phased).
// The same arithmetic as the bucket-by-bucket step (each bucket's matrices
// see the same operations and collectives, only batched with others' and in
// another order between buckets), so the results are the same to the
// factorizations' batching (bit for bit where the backend's batched calls
// are per matrix, as the host's are). M (unless the state holds it:
// m_in_state), P, this rank's slots and P1 of every bucket stay alive from A
// to E: group_workspace bounds the sum, and the phased step is used only
// while that sum is at most twice the batch workspace cap
// (DION_BATCH_WORKSPACE_MIB; DION_PHASED=0 turns it off).

// Per bucket, what the phases hand on.
struct PhasedRun {
  const Batch* bt = nullptr;
  Shape s{};
  Dist d{};
  Split sp{};
  bool lowp = false, in_state = false;  // lowp_path; m_in_state (M is null then)
  float* M = nullptr;
  int32_t* nz = nullptr;
  // Pall: the whole batch's P (sp.slots); P: this rank's slots of it; P1
  // their preconditioned copy (RCQR); Y the orthonormal result. Where
  // solve16, Pall and P have no storage (fp32_p_planned): P only gives the
  // slots' count and shape
  MatBatch Qm{}, Pall{}, P{}, P1{}, Y{};
  // P in bf16 (p16): over a mesh (bf16_comm) the batch's P in bf16
  // (sp.slots), the reduce-scatter's bf16 slots, this rank's reduced slots
  // in bf16 (widened into P unless solve16), and Pb: the bf16 P gathered;
  // on one rank (p16_local) the batch's P in bf16, which is also this
  // rank's slots, and Pb the orthonormal P's bf16 copy its owner finished
  bool p16 = false;
  // p16 with RCQR and no inner mesh (solve16_on): this rank's slots stay
  // in bf16 (mineb), where the first solve and the fallback read them, and
  // are not widened into P
  bool solve16 = false;
  int64_t first_slot() const { return sp.mesh ? sp.first : 0; }  // this rank's first slot in the batch
  void *Pallb = nullptr, *ownb = nullptr, *mineb = nullptr, *Pb = nullptr;
  ConstMatBatch Qtb{nullptr, 0, 0, 0, 0, 0};
  int64_t first = 0;  // the bucket's first slot in the group's factorization arrays
};

bool phased_enabled() { return env_on("DION_PHASED"); }

// Whether a bucket that no mesh reduces, splits or shares (one rank
// orthogonalizes its whole batch; spec §2.6 does not apply) takes P in
// bf16 all the same, as bf16_comm's buckets do: on the lowp path P = B Q is
// written straight into bf16 (the reference's P = M Q in the bf16
// parameters' dtype), the sketch and RCQR's first solve read it there
// (solve16_on), the owner finishes the orthonormal P into its bf16 copy Pb
// (finish_own_bf16, nan_to_num and the zero fix-up included), and R = B^T P,
// the error feedback and the update read that copy. Against P in fp32: no
// fp32 P written, no pass rounding it for the sketch, a bf16 first solve
// instead of a TF32 one, and no second rounding pass for R = B^T P; the
// orthogonalization starts from bf16(P) instead of P (a relative change of
// 2^-9 per element, the one bf16_comm makes; tests/gpu/test_cuda_precision.cu
// bounds the step against the fp32 host with and without it).
// DION_P_BF16_LOCAL=0 keeps P in fp32 there (read at each step; the
// workspace is planned for either).
bool p16_local(bool lowp, const Split& sp, const Dist& d) { return lowp && !sp.mesh && !d.any(); }
bool p16_local_on(bool lowp, const Split& sp, const Dist& d) {
  return p16_local(lowp, sp, d) && env_on("DION_P_BF16_LOCAL");
}
// Whether the phased step takes a bucket's P in bf16 (PhasedRun::p16).
bool p16_on(bool lowp, const Split& sp, const Shape& s, const Dist& d) {
  return bf16_comm(lowp, sp, s) || p16_local_on(lowp, sp, d);
}

// Where P's slots arrive in bf16 (bf16_comm), RCQR's first solve P R1^-1
// multiplies them as they are by R1^-1 rounded to bf16 (bf16 tensor cores,
// fp32 accumulation), instead of widening them into fp32 for a TF32 product
// with the fp32 inverse: P itself is exact in bf16, and the solve only
// preconditions P for the Cholesky QR pass that follows, which absorbs the
// inverse's rounding (2^-9 against TF32's 2^-12) as it does the TF32
// product's; the fallback reads the bf16 slots too. DION_P_BF16_SOLVE=0 keeps
// the widening (read once).
bool solve16_on(bool p16, bool inner, int method, dion_matmul_precision_t prec) {
  static const bool enabled = env_on("DION_P_BF16_SOLVE");
  return enabled && p16 && method == DION_QR_RCQR && !inner && prec == DION_MATMUL_BF16;
}

// A bucket whose P is in bf16 and whose first solve reads it there (p16 and
// solve16) has no fp32 P: the batch's P (Pall) and the reduce-scatter's
// fp32 slots are neither written nor read, and are not taken. Planned
// (phased_floats) where every step would be so: RCQR at every step (not
// CQR, which factors P itself after its warm-up) and DION_P_BF16_LOCAL on
// when the workspace is sized; switched off afterwards, the bucket needs the
// fp32 P again, the group step no longer fits and the buckets are stepped
// one by one.
bool fp32_p_planned(const dion_group_options_t& o, bool lowp, const Split& sp, const Shape& s, const Dist& d) {
  return !solve16_on(p16_on(lowp, sp, s, d), d.inner != nullptr, o.qr_method, o.matmul_precision);
}

// A bucket's split in the phased step: split_of's, except that a path-3
// batch of two or more (rows over inner) whose P is a partial sum over the
// outer mesh is reduced to its slots' owners over outer as in path 2, so
// that each outer rank orthogonalizes (with its inner mesh, which shares
// its outer rank and so its slots) only its share, and the results are
// gathered over outer; step() all-reduces such a P and orthogonalizes all of
// it on every outer rank.
Split phased_split(const Optimizer& opt, const Dist& d, int64_t T) {
  if (d.inner && d.outer && T >= 2) return split_over(d.outer, T, true, ReduceOp::kSum);
  return split_of(opt, d, T);
}

// Whether Optimizer::step may call step_group for g: always in a sequential
// step; in an overlapped one (the replicate gradient sync pipelined with the
// buckets) only for a group none of whose gradients is averaged (every
// tensor compressed), which the pipeline steps as one.
bool group_steppable(const Optimizer& opt, const Group& g) {
  return !opt.steps_overlap() || !opt.group_grads_averaged(g);
}

// The slots of a batch of T that this rank factors: all T, or its share of
// the split (split_of).
int64_t owned_count(const Split& sp, int64_t T) { return sp.mesh ? sp.count : T; }

// Whether a bucket of tensors like t takes part in the phases: not where P
// is square or wide (full rank: Householder QR; such a bucket is stepped on
// its own).
bool phased_member(const dion_group_options_t& o, const Tensor& t) {
  const Shape s = shape_of(o, t);
  return s.ag > s.r;
}

// Whether the buckets (tensor t with `count` matrices each) that take part
// in the phases (phased_member; two or more) can be phased together, and
// the workspace floats that takes (0 if not).
size_t phased_floats(const Optimizer& opt, const Group& g, const std::vector<Batch>& bs) {
  const dion_group_options_t& o = g.opt;
  const Batch* first = nullptr;  // the first member
  int members = 0;
  for (const Batch& bt : bs)
    if (phased_member(o, bt.t) && members++ == 0) first = &bt;
  if (members < 2 || !group_steppable(opt, g) || o.power_iters != 1 || o.qr_method == DION_QR_QR || !phased_enabled())
    return 0;
  const Shape s0 = shape_of(o, first->t);
  const bool inner = dist_of(opt, first->t).inner != nullptr;  // path 3: every bucket's, or none
  size_t sum = 0, shared = 0;
  int64_t slots = 0;
  for (const Batch& bt : bs) {
    const Tensor& t = bt.t;
    if (!phased_member(o, t)) continue;
    const int64_t T = bt.count;
    const Shape s = shape_of(o, t);
    if (s.r != s0.r || s.k != s0.k || t.geom.srows * t.geom.scols != t.numel_local) return 0;
    const Dist d = dist_of(opt, t);
    if ((d.inner != nullptr) != inner) return 0;
    const Split sp = phased_split(opt, d, T);
    const int64_t c = owned_count(sp, T);
    const int64_t mn = t.numel_local, ar = s.a * s.r, br = s.b * s.r;
    const dion_dtype_t mdt = momentum_dtype_of(o, t);
    const bool lowp = !opt.backend->host_memory() && bf16_products(o, mdt);
    const auto half = [](int64_t n) { return ws_floats((n + 1) / 2); };
    // A..E: M (unless the state holds it), nz, Q, Q~ in bf16, P (the
    // batch's slots) and the reduce-scatter's slots (unless P is in bf16
    // only), P1 and Y (this rank's)
    const size_t m_copy = m_in_state(*opt.backend, bt, lowp, mdt, t.param_dtype) ? 0
                          : lowp                                              ? half(T * mn)
                                                                              : ws_floats(T * mn);
    const bool p32 = fp32_p_planned(o, lowp, sp, s, d);
    sum += m_copy + ws_floats(T) + ws_floats(T * br) + half(T * br) + (p32 ? ws_floats(sp.slots * ar) : 0) +
           ws_floats(p32 && sp.scatter ? sp.block * ar : 0) + 2 * ws_floats(c * ar);
    if (bf16_comm(lowp, sp, s))  // P, the scatter's slots and the gathered P in bf16
      sum += half(sp.slots * ar) + (sp.scatter ? half(sp.block * ar) : 0) + half(T * ar);
    else if (p16_local(lowp, sp, d))  // P and its finished copy in bf16 (whether or not p16_local_on)
      sum += half(T * ar) + half(T * ar);
    // A: the sketch (one at a time); E: R, bf16 P and R, column sums
    // (double), one bucket at a time
    shared = std::max({shared, sketch_floats(c, s),
                       ws_floats(T * br) + half(T * ar) + half(T * br) + ws_floats(2 * T * s.r),
                       inner ? inner_fallback_floats(s, T) : 0});
    slots += c;
  }
  // the group's S P, R1, Gram matrices and Cholesky info (this rank's
  // slots); over the inner mesh (every slot a partial sum) S P and the Gram
  // matrices padded for the reduce-scatter, and its receive buffers
  const SlotPad f = inner ? slot_pad(slots, opt.inner->size()) : SlotPad{slots, 0};
  sum += ws_floats(f.slots * s0.k * s0.r) + ws_floats(f.own * s0.k * s0.r) + ws_floats(slots * s0.r * s0.r) +
         ws_floats(f.slots * s0.r * s0.r) + ws_floats(f.own * s0.r * s0.r) + ws_floats(slots);
  return sum + shared;
}

size_t group_workspace(const Optimizer& opt, const Group& g) {
  return group_reservation(opt, phased_floats(opt, g, bucket_batches(opt, g)));
}

bool step_group(Optimizer& opt, Group& g) {
  // Host-side lists: their capacity is kept (thread_local), so a steady-state step allocates nothing.
  thread_local std::vector<Batch> active, batches, singles;
  active_batches(opt, g, active);
  if (!group_step_fits(opt, phased_floats(opt, g, active))) return false;
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  // The buckets that take no part in the phases (phased_member) first, one
  // by one; the others go to `batches`.
  batches.clear();
  singles.clear();
  for (const Batch& bt : active) (phased_member(o, bt.t) ? batches : singles).push_back(bt);
  for (const Batch& bt : singles) {
    opt.ws.reset();
    step(opt, g, bt);
  }
  opt.ws.reset();
  const dion_matmul_precision_t prec = o.matmul_precision;
  const int method = qr_method_now(g);  // orth's choice (P is never square here)
  const Shape s0 = shape_of(o, batches[0].t);
  const int64_t r = s0.r, k = s0.k, rr = r * r;
  thread_local std::vector<PhasedRun> runs;
  runs.assign(batches.size(), PhasedRun{});
  const int64_t nb = static_cast<int64_t>(runs.size());
  int64_t slots = 0;  // the slots this rank factors, over all buckets
  for (size_t i = 0; i < batches.size(); ++i) {
    PhasedRun& u = runs[i];
    u.bt = &batches[i];
    u.s = shape_of(o, u.bt->t);
    u.d = dist_of(opt, u.bt->t);
    u.sp = phased_split(opt, u.d, u.bt->count);
    u.first = slots;
    slots += owned_count(u.sp, u.bt->count);
  }
  // Path 3 (B's rows over the inner mesh, every bucket's: phased_floats):
  // S P and the Gram matrices are partial sums over the inner mesh, reduced
  // to each slot's owner there, which factors it, and gathered (as orth()
  // does for one batch, inner_split: here over all buckets' slots at once).
  const Dist& d0 = runs[0].d;
  const Split fs = inner_split(d0, slots);
  MatBatch SP{opt.ws.take(fs.slots * k * r), k, r, r, k * r, slots};
  float* own_sp = fs.scatter ? opt.ws.take(fs.block * k * r) : nullptr;
  MatBatch R1{opt.ws.take(slots * rr), r, r, r, rr, slots};
  MatBatch G{opt.ws.take(fs.slots * rr), r, r, r, rr, slots};
  float* own_g = fs.scatter ? opt.ws.take(fs.block * rr) : nullptr;
  int32_t* info = reinterpret_cast<int32_t*>(opt.ws.take(slots));
  auto half = [&](int64_t n) { return opt.ws.take((n + 1) / 2); };
  auto slice = [](const MatBatch& m, int64_t first, int64_t count) {
    return MatBatch{m.p + first * m.stride, m.rows, m.cols, m.ld, m.stride, count};
  };
  SideComm side(opt);
  // A: M + G, P = B Q, reduced to this rank's slots (deferred: bucket i's
  // reduction overlaps bucket i + 1's momentum pass and product), their sketch.
  auto sketch = [&](PhasedRun& u) {  // once this bucket's reduction is done
    if (u.p16 && !u.solve16 && u.P.batch > 0) be.load(u.P.p, u.mineb, DION_DTYPE_BF16, u.P.batch * u.s.a * u.s.r);
    if (method != DION_QR_RCQR || u.P.batch == 0) return;
    const size_t m = opt.ws.mark();
    sketch_product(opt, g, u.s, 0, u.P, slice(SP, u.first, u.P.batch), prec, u.p16 ? u.mineb : nullptr,
                   u.P1.p);  // P1 (c a r floats) is free until the first solve
    opt.ws.rewind(m);
  };
  for (int64_t i = 0; i < nb; ++i) {
    PhasedRun& u = runs[static_cast<size_t>(i)];
    const Batch& bt = *u.bt;
    const Tensor& t = bt.t;
    const int64_t T = bt.count, n_el = t.numel_local, c = owned_count(u.sp, T);
    const dion_dtype_t mdt = state_of(opt, t, 0).dtype;
    u.lowp = lowp_path(be, o, mdt);
    u.in_state = m_in_state(be, bt, u.lowp, mdt, t.param_dtype);
    const int64_t ar = u.s.a * u.s.r;
    const MomentumPass mp = momentum_pass(opt, bt, u.lowp, u.in_state);
    u.M = mp.M;
    u.nz = mp.nz;
    const QLoad q = load_q(opt, bt, u.s, u.lowp, u.in_state);
    u.Qm = q.Qm;
    u.Qtb = q.Qtb;
    u.p16 = p16_on(u.lowp, u.sp, u.s, u.d);
    u.solve16 = solve16_on(u.p16, u.d.inner != nullptr, method, prec);
    const bool p32 = !u.solve16;  // fp32_p_planned: no fp32 P where solve16
    u.Pall = MatBatch{p32 ? opt.ws.take(u.sp.slots * ar) : nullptr, u.s.a, u.s.r, u.s.r, ar, T};
    float* own = p32 && u.sp.scatter ? opt.ws.take(u.sp.block * ar) : nullptr;
    u.P1 = MatBatch{opt.ws.take(c * ar), u.s.a, u.s.r, u.s.r, ar, c};
    u.Y = MatBatch{opt.ws.take(c * ar), u.s.a, u.s.r, u.s.r, ar, c};
    if (u.p16) {
      u.Pallb = half(u.sp.slots * ar);
      u.ownb = u.sp.scatter ? half(u.sp.block * ar) : nullptr;
      u.Pb = half(T * ar);
    }
    const MatBatch Mm{u.M, t.geom.srows, t.geom.scols, t.geom.scols, n_el, T};
    // As step() and orth_split(): P is a partial sum over outer, and each
    // replica's own under compressed sync.
    float* mine = u.Pall.p;
    if (u.p16) {
      // P straight into bf16; this rank's slots land in `own` (fp32) after
      // the widening, as reduce_slots would put them
      m_product_bf16(be, bt, u.in_state, u.s.bT, Mm, u.Qtb,
                     MatBatch{static_cast<float*>(u.Pallb), u.s.a, u.s.r, u.s.r, ar, T}, prec);
      mine = !p32 ? nullptr : u.sp.scatter ? own : u.Pall.p + u.sp.first * ar;  // not read where solve16
      zero_padding(be, u.sp, u.Pallb, T, ar, sizeof(uint16_t));
    } else {
      m_product(be, bt, u.in_state, u.lowp, u.s.bT, Mm, u.lowp ? u.Qtb : ConstMatBatch(u.Qm), u.Pall, prec);
      if (u.sp.mesh) zero_padding(be, u.sp, u.Pall.p, T, ar);
    }
    side.deferred(static_cast<int>(i % 2), [&] {
      reduce_nz(u.d, u.nz, T);  // finish's, early: not between the next gather and this bucket's products
      if (u.p16 && !u.sp.mesh) {
        u.mineb = u.Pallb;  // p16_local: the whole batch is this rank's
      } else if (u.p16) {
        u.mineb = reduce_slots_bf16(u.sp, u.d, static_cast<uint16_t*>(u.Pallb), static_cast<uint16_t*>(u.ownb), T, ar);
      } else if (!u.sp.mesh) {
        if (u.d.outer) u.d.outer->all_reduce(mine, T * ar, ReduceOp::kSum);
        if (u.d.rep) u.d.rep->all_reduce(mine, T * ar, ReduceOp::kAvg);
      } else {
        mine = reduce_slots(u.sp, u.Pall.p, T, ar, own);
        if (u.d.rep && u.sp.mesh != u.d.rep) u.d.rep->all_reduce(mine, c * ar, ReduceOp::kAvg);
      }
    });
    u.P = MatBatch{mine, u.s.a, u.s.r, u.s.r, ar, c};
    if (i > 0) {
      side.wait(static_cast<int>((i - 1) % 2));
      sketch(runs[static_cast<size_t>(i - 1)]);
    }
  }
  side.wait(static_cast<int>((nb - 1) % 2));
  sketch(runs.back());
  // X U^-1 for every bucket's slots (in -> out) in one call, which may form
  // all the inverses at once.
  // (first: RCQR's first solve, which takes the bf16 slots where solve16,
  // and only preconditions: TrsmPart::precondition.)
  auto solve_all = [&](const MatBatch& U, MatBatch PhasedRun::*in, MatBatch PhasedRun::*out, bool first) {
    thread_local std::vector<Backend::TrsmPart> parts;  // capacity kept: no allocation after the first step
    parts.clear();
    for (PhasedRun& u : runs)
      if (u.P.batch > 0)
        parts.push_back(Backend::TrsmPart{u.*in, u.*out, u.first, first && u.solve16 ? u.mineb : nullptr, first});
    be.trsm_right_upper_many(U, parts.data(), static_cast<int64_t>(parts.size()), prec);
  };
  // B, C: R1 for all, then P1 = P R1^-1 (RCQR); the Gram matrices.
  if (method == DION_QR_RCQR && slots > 0) {
    split_qr_r(opt, fs, d0.inner, SP, R1, own_sp);
    solve_all(R1, &PhasedRun::P, &PhasedRun::P1, true);
  }
  for (PhasedRun& u : runs) {
    if (method != DION_QR_RCQR) u.P1 = u.P;  // CQR factors P itself
    if (u.P.batch > 0)
      be.gram(u.P1, slice(G, u.first, u.P.batch), prec == DION_MATMUL_FP32 ? DION_MATMUL_FP32 : DION_MATMUL_TF32);
  }
  // D: the Cholesky factors of all, and P = P1 U^-1 for all in one call.
  if (slots > 0) {
    split_cholesky(opt, fs, d0.inner, G, info, own_g);
    solve_all(G, &PhasedRun::P1, &PhasedRun::Y, false);
  }
  // E: per bucket, the fallback from P where the Cholesky failed and the
  // slots gathered (deferred: bucket i's gather overlaps bucket i - 1's
  // rest), then R = B^T P and the rest.
  auto rest = [&](PhasedRun& u) {
    const Batch& bt = *u.bt;
    const Tensor& t = bt.t;
    const int64_t T = bt.count, n_el = t.numel_local, ar = u.s.a * u.s.r, br = u.s.b * u.s.r;
    const size_t m = opt.ws.mark();
    MatBatch R{opt.ws.take(T * br), u.s.b, u.s.r, u.s.r, br, T};
    MatBatch Pb{u.p16 ? static_cast<float*>(u.Pb) : u.lowp ? half(T * ar) : nullptr, u.s.a, u.s.r, u.s.r, ar, T};
    MatBatch Rb{u.lowp ? half(T * br) : nullptr, u.s.b, u.s.r, u.s.r, br, T};
    const MatBatch P = u.sp.mesh ? u.Pall : u.Y;  // the batch's orthonormal P (not read with p16)
    const MatBatch Mm{u.M, t.geom.srows, t.geom.scols, t.geom.scols, n_el, T};
    if (u.p16)
      m_product(be, bt, u.in_state, true, !u.s.bT, Mm, ConstMatBatch(Pb), R, prec);  // Pb gathered, final
    else
      r_product(be, bt, u.in_state, u.lowp, u.s.bT, Mm, P, Pb, R, prec);
    if (u.d.inner) u.d.inner->all_reduce(R.p, T * br, ReduceOp::kSum);  // path 3: a partial sum
    if (u.d.rep) u.d.rep->all_reduce(R.p, T * br, ReduceOp::kAvg);
    finish(opt, g, bt, u.s, u.d, u.lowp, u.M, u.nz, u.Qm, P, R, Pb, Rb, u.p16);
    opt.ws.rewind(m);
  };
  for (int64_t i = 0; i < nb; ++i) {
    PhasedRun& u = runs[static_cast<size_t>(i)];
    const int64_t T = u.bt->count, c = u.P.batch, ar = u.s.a * u.s.r;
    uint16_t* own16 = u.p16 ? static_cast<uint16_t*>(u.Pb) + u.first_slot() * ar : nullptr;
    if (c > 0) {
      if (u.d.inner) {  // path 3: whole matrices gathered for it
        const size_t m = opt.ws.mark();
        inner_fallback(opt, u.d, u.s, u.P, u.Y, info + u.first);
        opt.ws.rewind(m);
      } else if (u.solve16) {
        be.orth_fallback_bf16(u.Y, u.mineb, info + u.first);
      } else {
        be.orth_fallback(u.Y, u.P, info + u.first);
      }
      if (u.p16) finish_own_bf16(be, u.Y, u.nz + u.first_slot(), own16);  // the flags are reduced
    }
    if (u.p16 && u.sp.mesh)  // pairs of bf16 as floats (bf16_comm: a r even)
      side.deferred(static_cast<int>(i % 2), [&] {
        gather_slots(opt, u.sp, T, ar / 2, reinterpret_cast<const float*>(own16), static_cast<float*>(u.Pb));
      });
    else if (u.sp.mesh)
      side.deferred(static_cast<int>(i % 2), [&] { gather_slots(opt, u.sp, T, ar, u.Y.p, u.Pall.p); });
    if (i > 0) {
      if (runs[static_cast<size_t>(i - 1)].sp.mesh) side.wait(static_cast<int>((i - 1) % 2));
      rest(runs[static_cast<size_t>(i - 1)]);
    }
  }
  if (runs.back().sp.mesh) side.wait(static_cast<int>((nb - 1) % 2));
  rest(runs.back());
  return true;
}

}  // namespace

extern const Algorithm kDion = {"dion", false, init_state, workspace_floats, step, step_group, group_workspace};

}  // namespace dion

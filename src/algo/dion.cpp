// SPDX-License-Identifier: MIT
// Dion: low-rank orthonormal updates with error feedback (spec §2; arXiv 2504.05295).
//
// Per matrix, with the working matrix B = M or M^T chosen tall (a x b, a >= b
// unless sharding dictates otherwise, §2.2) and Q (b x r):
//   M += G;  P = orth(B Q);  R = B^T P;  M -= (1 - mu) P R^T (in B's orientation);
//   Q = colnorm(R);  X = (1 - lr wd) X - lr sqrt(m/n) P Q^T (in B's orientation).
// The momentum is not decayed by mu before G is added: the decay is the error
// feedback. Factorizations run in fp32 whatever the parameter dtype.
#include <algorithm>
#include <cmath>

#include "common.hpp"

namespace dion {

namespace {

// r = min(m, n, q * ceil(rank_fraction * min(m, n) / q)), in IEEE double as the
// reference computes it (0.07 * 100 = 7.000000000000001 gives 8).
int64_t dion_rank(const dion_group_options_t& o, int64_t m, int64_t n) {
  const int64_t mn = std::min(m, n);
  const double q = static_cast<double>(o.rank_multiple_of);
  const double r = q * std::ceil(o.rank_fraction * static_cast<double>(mn) / q);
  return std::min<int64_t>(mn, static_cast<int64_t>(r));
}

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
  int64_t a, b, r, k;  // B is a x b; Q is b x r; sketch rows k
  bool bT;             // B = S^T, S the storage matrix
};

Shape shape_of(const dion_group_options_t& o, const Tensor& t) {
  Shape s;
  s.bT = (t.dion_transposed != t.geom.storage_transposed);
  s.a = s.bT ? t.geom.scols : t.geom.srows;
  s.b = s.bT ? t.geom.srows : t.geom.scols;
  s.r = t.rank;
  s.k = 128 * static_cast<int64_t>(std::ceil(o.oversample * static_cast<double>(s.r) / 128.0));
  return s;
}

void init_state(Optimizer& opt, Group& g, Tensor& t) {
  const dion_group_options_t& o = g.opt;
  t.rank = dion_rank(o, t.geom.m, t.geom.n);
  t.dion_transposed = dion_tau(t);
  dion_dtype_t mdt = o.momentum_dtype == DION_DTYPE_UNSET ? t.param_dtype : o.momentum_dtype;
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
  opt.backend->randn(tmp, lshape[0], lshape[1], loff[0], 0, gshape[1], key, 1.0f);
  opt.backend->store(q.data, q.dtype, tmp, q.numel);
  opt.backend->release(tmp);
}

size_t workspace_floats(const Group& g, const Tensor& t) {
  Shape s = shape_of(g.opt, t);
  const int64_t mn = t.geom.srows * t.geom.scols;
  size_t w = 2 * ws_floats(mn) + ws_floats(s.a * s.r) + 2 * ws_floats(s.b * s.r);
  // per power iteration: the orthogonalisation (sketch k x a, S P k x r, two
  // r x r factors) and a copy of R
  const size_t per_iter = ws_floats(s.k * s.a) + ws_floats(s.k * s.r) + 2 * ws_floats(s.r * s.r) + ws_floats(s.b * s.r);
  return w + per_iter * static_cast<size_t>(g.opt.power_iters);
}

// P (a x r, a >= r) <- an orthonormal basis of its columns (spec §1.3).
void orth(Optimizer& opt, const Group& g, const Tensor& t, const Shape& s, MatBatch P, int iter) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const dion_matmul_precision_t prec = o.matmul_precision;
  int method = o.qr_method;
  if (method == DION_QR_CQR && g.step <= o.cqr_warmup_steps) method = DION_QR_RCQR;
  // A square P gains nothing from a Cholesky-based QR and squares its
  // condition number: use Householder QR for it whatever the method.
  if (s.a <= s.r) method = DION_QR_QR;
  if (method == DION_QR_QR) {
    be.qr_q(P);
    return;
  }
  MatBatch G{opt.ws.take(s.r * s.r), s.r, s.r, s.r, s.r * s.r, 1};
  int32_t info = 0;
  if (method == DION_QR_CQR) {
    be.gemm(true, false, 1.0f, P, P, 0.0f, G, DION_MATMUL_FP32);
    be.cholesky_upper(G, &info);
    if (info == 0) {
      be.trsm_right_upper(G, P);
      return;
    }
    // Cholesky failed (P^T P not positive definite in fp32): fall back to RCQR.
  }
  // Randomized Cholesky QR: R1 = qr_r(S P); P1 = P R1^-1; P2 = P1 chol(P1^T P1)^-1.
  MatBatch S{opt.ws.take(s.k * s.a), s.k, s.a, s.a, s.k * s.a, 1};
  MatBatch SP{opt.ws.take(s.k * s.r), s.k, s.r, s.r, s.k * s.r, 1};
  MatBatch R1{opt.ws.take(s.r * s.r), s.r, s.r, s.r, s.r * s.r, 1};
  PhiloxKey key{opt.options.seed, static_cast<uint32_t>(kRngSketch | (iter << 8)), static_cast<uint32_t>(t.index),
                static_cast<uint64_t>(g.step)};
  be.randn(S.p, s.k, s.a, 0, 0, s.a, key, static_cast<float>(std::sqrt(1.0 / static_cast<double>(s.k))));
  be.gemm(false, false, 1.0f, S, P, 0.0f, SP, prec);
  be.qr_r(SP, R1);
  be.trsm_right_upper(R1, P);
  be.gemm(true, false, 1.0f, P, P, 0.0f, G, DION_MATMUL_FP32);
  be.cholesky_upper(G, &info);
  if (info == 0) {
    be.trsm_right_upper(G, P);
  } else {
    // The reference ignores this failure and lets garbage through to its
    // NaN clean-up; P1 spans the right space, so finish with Householder QR.
    be.qr_q(P);
  }
}

void step(Optimizer& opt, Group& g, Tensor& t) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const Shape s = shape_of(o, t);
  StateBuf& Ms = state_of(opt, t, 0);
  StateBuf& Qs = state_of(opt, t, 1);
  const int64_t n_el = t.numel_local;
  const dion_matmul_precision_t prec = o.matmul_precision;

  float* M = load_ws(opt, Ms.data, Ms.dtype, n_el);
  float* W = load_ws(opt, t.grad, t.grad_dtype, n_el);  // G now, X later
  be.axpby(1.0f, W, 1.0f, M, n_el);                      // M += G
  float* Q = load_ws(opt, Qs.data, Qs.dtype, s.b * s.r);

  MatBatch Mm{M, t.geom.srows, t.geom.scols, t.geom.scols, n_el, 1};
  MatBatch P{opt.ws.take(s.a * s.r), s.a, s.r, s.r, s.a * s.r, 1};
  MatBatch R{opt.ws.take(s.b * s.r), s.b, s.r, s.r, s.b * s.r, 1};
  MatBatch Qm{Q, s.b, s.r, s.r, s.b * s.r, 1};
  ConstMatBatch Qt = Qm;
  for (int it = 0; it < o.power_iters; ++it) {
    be.gemm(s.bT, false, 1.0f, Mm, Qt, 0.0f, P, prec);  // P = B Q~
    orth(opt, g, t, s, P, it);
    be.gemm(!s.bT, false, 1.0f, Mm, P, 0.0f, R, prec);  // R = B^T P
    if (it + 1 < o.power_iters) {
      // the next iteration starts from the un-normalised R
      float* Rn = opt.ws.take(s.b * s.r);
      be.copy(Rn, R.p, sizeof(float) * static_cast<size_t>(s.b * s.r));
      Qt = ConstMatBatch(Rn, s.b, s.r, s.r, s.b * s.r, 1);
    }
  }
  // Zero / NaN handling (§2.8): an all-zero momentum leaves the update at zero
  // and carries Q over (normalised); NaN/Inf never reach the state.
  be.nan_to_num(P.p, s.a * s.r);
  be.nan_to_num(R.p, s.b * s.r);
  if (be.all_zero(M, n_el)) {
    be.zero(P.p, sizeof(float) * static_cast<size_t>(s.a * s.r));
    be.copy(R.p, Q, sizeof(float) * static_cast<size_t>(s.b * s.r));
  }
  // Error feedback: B -= (1 - mu) P R^T, i.e. S -= (1-mu) P R^T or R P^T.
  const float ef = static_cast<float>(-(1.0 - o.mu));
  if (!s.bT)
    be.gemm(false, true, ef, P, R, 1.0f, Mm, prec);
  else
    be.gemm(false, true, ef, R, P, 1.0f, Mm, prec);
  be.store(Ms.data, Ms.dtype, M, n_el);
  // Q = colnorm(R)
  be.col_normalize(R, static_cast<float>(o.epsilon));
  be.store(Qs.data, Qs.dtype, R.p, s.b * s.r);
  // X = (1 - lr wd) X - lr sqrt(m/n) P Q^T (in storage orientation)
  be.load(W, t.param, t.param_dtype, n_el);
  MatBatch X{W, t.geom.srows, t.geom.scols, t.geom.scols, n_el, 1};
  const double lr = o.lr;
  const float alpha = static_cast<float>(-lr * std::sqrt(static_cast<double>(t.geom.m) / t.geom.n));
  const float beta = static_cast<float>(1.0 - lr * o.weight_decay);
  if (!s.bT)
    be.gemm(false, true, alpha, P, R, beta, X, prec);
  else
    be.gemm(false, true, alpha, R, P, beta, X, prec);
  be.store(t.param, t.param_dtype, W, n_el);
}

}  // namespace

extern const Algorithm kDion = {"dion", init_state, workspace_floats, step};

}  // namespace dion

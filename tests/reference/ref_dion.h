// SPDX-License-Identifier: MIT
//
// tests/reference/ref_dion.h — Dion, the low-rank orthonormal optimizer (spec
// §2.2-§2.3, §2.8), one 2-D parameter on one device, as a textbook
// implementation (the paper form, arXiv 2504.05295):
//
//   tau = (m < n); B = M (a x b = m x n) if !tau, else B = M^T.  Q is (b x r).
//   M := M + G
//   repeat power_iters times:  P := orth(B Q~);  R := B^T P;  Q~ := R   (Q~ starts at Q)
//   if M == 0 entirely:  P := 0,  R := Q              (spec §2.8)
//   M := M - (1 - mu) P R^T   (or R P^T when tau)
//   Q_new := colnorm(R),  colnorm(R)_:,j = R_:,j / (||R_:,j|| + eps)
//   X := (1 - lr wd) X - lr sqrt(m/n) (P Q_new^T   or   Q_new P^T)
//   Q := Q_new
//
// orth() is the Householder Q factor with a non-negative diag(R). QR, CQR and
// RCQR of a full-column-rank P all return P T^-1 with T upper triangular, i.e.
// this same matrix up to column signs, and the update is invariant under such
// sign flips (R and Q_new flip with P), so one exact method is the oracle for
// all of them. The initial Q must be the library's (read through the state
// API): the update depends on the basis, not only on the span.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "ref_common.h"

namespace dionref {

// Spec §2.2: r = min(m, n, q * ceil(rank_fraction * min(m, n) / q)) in IEEE
// double, left to right, so 0.07 * 100 = 7.000000000000001 gives r = 8.
inline int64_t dion_rank(int64_t m, int64_t n, double rank_fraction, int64_t q) {
  const int64_t mn = std::min(m, n);
  const double x = rank_fraction * static_cast<double>(mn) / static_cast<double>(q);
  const int64_t r = q * static_cast<int64_t>(std::ceil(x));
  return std::min(mn, r);
}

// Shape (b, r) of Dion's Q for an m x n parameter: b is the short dim.
inline void dion_q_shape(int64_t m, int64_t n, double rank_fraction, int64_t q, int64_t* b, int64_t* r) {
  *b = m < n ? m : n;
  *r = dion_rank(m, n, rank_fraction, q);
}

// One Dion step on `s` (shape {m, n}, q already holding the current Q).
// `cholesky` orthogonalizes with cholesky_qr instead of Householder: only for
// the testbed's naive fp32 run of a case that uses the library's CQR.
template <class T>
void dion_step(TensorState& s, const std::vector<double>& g, const Hyper& h, const Dtypes& dt,
               bool cholesky = false) {
  if (s.shape.size() != 2) throw std::invalid_argument("dion_step: Dion needs a 2-D parameter");
  const int64_t m = s.shape[0], n = s.shape[1];
  const bool tau = m < n;

  // 1. M := M + G. Within a step the working value (type T) is used; only the
  // copy stored between steps is rounded to the momentum dtype (the library's
  // convention: fp32 working buffers, rounded on store).
  Matrix<T> mom(m, n);
  bool all_zero = true;
  for (size_t i = 0; i < s.momentum.size(); ++i) {
    mom.v[i] = static_cast<T>(s.momentum[i]) + static_cast<T>(g[i]);
    all_zero = all_zero && mom.v[i] == T(0);
  }
  const Matrix<T> b_mat = tau ? transpose(mom) : mom;  // a x b
  const Matrix<T> q_prev = matrix_cast<T>(s.q);        // b x r
  const int64_t a = b_mat.rows, r = q_prev.cols;

  // 2-4. Power iteration (with the zero fix-up of §2.8).
  Matrix<T> p(a, r), rr;
  if (all_zero) {
    rr = q_prev;  // P stays 0: no error feedback, Q_new = colnorm(Q_prev)
  } else {
    Matrix<T> qt = q_prev;
    for (int it = 0; it < std::max(1, h.power_iters); ++it) {
      p = cholesky ? cholesky_qr(matmul(b_mat, qt)) : householder_q(matmul(b_mat, qt));
      rr = matmul_tn(b_mat, p);  // b x r
      qt = rr;                   // un-normalised between iterations
    }
  }

  // 5. Error feedback: M -= (1 - mu) P R^T (or R P^T); then M is stored.
  const Matrix<T> prt = matmul_nt(p, rr);  // a x b
  const T keep = static_cast<T>(1.0 - h.mu);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const T upd = tau ? prt(j, i) : prt(i, j);
      const T mij = mom(i, j) - keep * upd;
      s.momentum[static_cast<size_t>(i * n + j)] = round_to(dt.momentum, static_cast<double>(mij));
    }

  // 6. Q_new := colnorm(R).
  Matrix<T> q_new = rr;
  for (int64_t j = 0; j < r; ++j) {
    T ss = 0;
    for (int64_t i = 0; i < q_new.rows; ++i) ss += rr(i, j) * rr(i, j);
    const T denom = std::sqrt(ss) + static_cast<T>(h.epsilon);
    for (int64_t i = 0; i < q_new.rows; ++i) q_new(i, j) = rr(i, j) / denom;
  }

  // 7. X := (1 - lr wd) X - lr sqrt(m/n) (P Q_new^T or its transpose). Dion's
  // scale is fixed: adjust_lr does not apply (spec §1.1).
  const Matrix<T> upd = matmul_nt(p, q_new);  // a x b
  const T decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  const T scale = static_cast<T>(h.lr * std::sqrt(static_cast<double>(m) / static_cast<double>(n)));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double& xij = s.x[static_cast<size_t>(i * n + j)];
      const T u = tau ? upd(j, i) : upd(i, j);
      xij = round_to(dt.param, static_cast<double>(decay * static_cast<T>(xij) - scale * u));
    }

  // 8. Q := Q_new, stored in the Q dtype.
  for (size_t i = 0; i < q_new.v.size(); ++i) s.q.v[i] = round_to(dt.q, static_cast<double>(q_new.v[i]));
}

}  // namespace dionref

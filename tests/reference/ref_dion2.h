// SPDX-License-Identifier: MIT
//
// tests/reference/ref_dion2.h — Dion2 (spec §5.2-§5.3, local scope, unsharded)
// and NorDion2 / Dion3 (spec §6.2), per matrix of a tensor:
//
//   Dion2:    select rows if rows <= cols, else columns (the shorter dim);
//   NorDion2: always rows; the error-feedback decay is mu instead of ef_decay.
//   N := size of the selected dim;  k := max(1, ceil(fraction N))   (double)
//   M := M + G
//   nu_s := L1 norm of slice s of M;  I := indices of the k largest nu
//   S := M[I] (k x long; a column selection is taken transposed)
//   M[I] := decay S
//   O := Orth(S)
//   NorDion2: normalise O's rows as NorMuon with V[I] only (others untouched)
//   X := (1 - lr wd) X;  X[I] := X[I] - lr_adj O,  lr_adj from the FULL matrix
//
// Orth of a transposed matrix is the transpose of Orth (exactly, for both
// polynomial iterations), so taking a column selection transposed is only a
// choice of layout. Ties in the top-k are broken towards the lower index; the
// suites use random data, where ties have probability zero.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ref_common.h"
#include "ref_muon.h"

namespace dionref {

// Spec §5.3: k = max(1, ceil(fraction * N)) in double.
inline int64_t dion2_k(double fraction, int64_t n) {
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(fraction * static_cast<double>(n))));
}

// One Dion2 (normalize = false) or NorDion2 (normalize = true) step.
template <class T>
void dion2_step(TensorState& s, const std::vector<double>& g, const Hyper& h, const Dtypes& dt, bool normalize) {
  // M := M + G on every entry (the unselected slices accumulate undecayed).
  // The working value mw (type T) is used within the step; the stored copy is
  // rounded at the end (the library's convention).
  std::vector<T> mw(s.x.size());
  for (size_t i = 0; i < s.x.size(); ++i) mw[i] = static_cast<T>(s.momentum[i]) + static_cast<T>(g[i]);

  const MatrixView mv = matrix_view(s.shape, h.flatten);
  const int64_t rows = mv.rows, cols = mv.cols, per = rows * cols;
  const bool select_rows = normalize || rows <= cols;
  const int64_t n_sel = select_rows ? rows : cols;  // number of slices
  const int64_t len = select_rows ? cols : rows;    // length of one slice
  const int64_t k = std::min(dion2_k(h.fraction, n_sel), n_sel);
  const T decay = static_cast<T>(normalize ? h.mu : h.ef_decay);
  const T wd_decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  const T lr_adj = static_cast<T>(adjusted_lr(h.lr, h.adjust_lr, rows, cols));

  // Flat index of element e of slice `sl` of matrix `b`.
  auto at = [&](int64_t b, int64_t sl, int64_t e) -> size_t {
    return static_cast<size_t>(b * per + (select_rows ? sl * cols + e : e * cols + sl));
  };

  for (int64_t b = 0; b < mv.batch; ++b) {
    // L1 norms of the slices and the top-k.
    std::vector<T> l1(static_cast<size_t>(n_sel), T(0));
    for (int64_t sl = 0; sl < n_sel; ++sl)
      for (int64_t e = 0; e < len; ++e) l1[static_cast<size_t>(sl)] += std::abs(mw[at(b, sl, e)]);
    std::vector<int64_t> order(static_cast<size_t>(n_sel));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t i, int64_t j) { return l1[static_cast<size_t>(i)] > l1[static_cast<size_t>(j)]; });
    const std::vector<int64_t> sel(order.begin(), order.begin() + k);

    // Gather S (values before the decay), then decay the selected slices of M.
    Matrix<T> sm(k, len);
    for (int64_t r = 0; r < k; ++r)
      for (int64_t e = 0; e < len; ++e) {
        T& m_e = mw[at(b, sel[static_cast<size_t>(r)], e)];
        sm(r, e) = m_e;
        m_e = decay * m_e;
      }

    Matrix<T> o = orthogonalize(h.ortho, sm, h.ortho_steps, h.epsilon);
    if (normalize) neuron_normalize(o, s.variance_neuron, b * rows, sel, h.muon_beta2, dt.param);

    // X := (1 - lr wd) X everywhere, then X[I] -= lr_adj O; each entry is stored once.
    std::vector<T> update(static_cast<size_t>(per), T(0));
    for (int64_t r = 0; r < k; ++r)
      for (int64_t e = 0; e < len; ++e) update[at(0, sel[static_cast<size_t>(r)], e)] = o(r, e);
    for (int64_t i = 0; i < per; ++i) {
      double& x = s.x[static_cast<size_t>(b * per + i)];
      x = round_to(dt.param,
                   static_cast<double>(wd_decay * static_cast<T>(x) - lr_adj * update[static_cast<size_t>(i)]));
    }
  }
  for (size_t i = 0; i < mw.size(); ++i) s.momentum[i] = round_to(dt.momentum, static_cast<double>(mw[i]));
}

}  // namespace dionref

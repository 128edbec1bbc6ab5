// SPDX-License-Identifier: MIT
//
// tests/reference/ref_muon.h — Muon (spec §3.2) and NorMuon (spec §4.2) for
// one tensor of ndim >= 2 (leading dims = a batch of independent matrices, or
// one (shape[0], prod(rest)) matrix with flatten):
//
//   M := mu M + G
//   U := nesterov ? mu M + G : M
//   O := Orth(U)                                (per matrix; Polar Express or NS)
//   NorMuon only, per matrix (1e-8 hard-coded):
//     f := ||O||_F;  nu_i := mean_j O_ij^2;  V := V + (1 - beta2)(nu - V)
//     O := O / (sqrt(V) + 1e-8);  O := O f / max(||O||_F, 1e-8)
//   lr_adj := adjust(lr, rows, cols)           (spec §1.1)
//   cautious_wd:  X := X - lr wd X [X O >= 0]   else  X := (1 - lr wd) X
//   X := X - lr_adj O
//
// Stored values (M, V, X) are rounded to their dtype when written; within a
// step the unrounded working values are used (the library's convention: fp32
// working buffers, rounded on store).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "ref_common.h"

namespace dionref {

// NorMuon's neuron-wise normalisation of one (rows x cols) matrix `o`. Row i
// uses the variance_neuron entry v[v_offset + rows_of_v[i]] (stored in
// `v_dtype`); the lerped value is used unrounded within the step and stored
// rounded.
template <class T>
void neuron_normalize(Matrix<T>& o, std::vector<double>& v, int64_t v_offset, const std::vector<int64_t>& rows_of_v,
                      double beta2, Dtype v_dtype) {
  const T f = frobenius(o);
  const T w = static_cast<T>(1.0 - beta2);
  for (int64_t i = 0; i < o.rows; ++i) {
    T ss = 0;
    for (int64_t j = 0; j < o.cols; ++j) ss += o(i, j) * o(i, j);
    const T nu = ss / static_cast<T>(o.cols);
    double& vi = v[static_cast<size_t>(v_offset + rows_of_v[static_cast<size_t>(i)])];
    const T vt = static_cast<T>(vi);
    const T vnew = vt + w * (nu - vt);  // lerp(V, nu, 1 - beta2)
    vi = round_to(v_dtype, static_cast<double>(vnew));
    const T denom = std::sqrt(vnew) + static_cast<T>(kNeuronEps);
    for (int64_t j = 0; j < o.cols; ++j) o(i, j) /= denom;
  }
  const T fh = frobenius(o);
  const T rescale = f / std::max(fh, static_cast<T>(kNeuronEps));
  for (T& e : o.v) e *= rescale;
}

// Final parameter update shared by Muon and NorMuon: `o` is the full
// (orthogonalized, possibly normalized) update, flat like x.
template <class T>
void muon_apply_update(TensorState& s, const std::vector<T>& o, const Hyper& h, Dtype param_dtype, double lr_adj) {
  const T lr_wd = static_cast<T>(h.lr * h.weight_decay);
  const T decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  const T la = static_cast<T>(lr_adj);
  for (size_t i = 0; i < s.x.size(); ++i) {
    const T x = static_cast<T>(s.x[i]);
    T nx;
    if (h.cautious_wd) {
      const T mask = (x * o[i] >= T(0)) ? T(1) : T(0);  // zeros count as aligned
      nx = x - lr_wd * x * mask;
    } else {
      nx = decay * x;
    }
    nx -= la * o[i];
    s.x[i] = round_to(param_dtype, static_cast<double>(nx));
  }
}

// One Muon (normalize = false) or NorMuon (normalize = true) step.
template <class T>
void muon_step(TensorState& s, const std::vector<double>& g, const Hyper& h, const Dtypes& dt, bool normalize) {
  const size_t n = s.x.size();
  const T mu = static_cast<T>(h.mu);
  std::vector<T> u(n);
  for (size_t i = 0; i < n; ++i) {
    const T mi = mu * static_cast<T>(s.momentum[i]) + static_cast<T>(g[i]);  // working value
    s.momentum[i] = round_to(dt.momentum, static_cast<double>(mi));          // stored copy
    u[i] = h.nesterov ? mu * mi + static_cast<T>(g[i]) : mi;
  }
  const MatrixView mv = matrix_view(s.shape, h.flatten);
  const int64_t per = mv.rows * mv.cols;
  std::vector<T> o(n);
  std::vector<int64_t> identity_rows(static_cast<size_t>(mv.rows));
  for (int64_t i = 0; i < mv.rows; ++i) identity_rows[static_cast<size_t>(i)] = i;
  for (int64_t b = 0; b < mv.batch; ++b) {
    Matrix<T> ub(mv.rows, mv.cols);
    std::copy(u.begin() + b * per, u.begin() + (b + 1) * per, ub.v.begin());
    Matrix<T> ob = orthogonalize(h.ortho, ub, h.ortho_steps, h.epsilon);
    if (normalize) neuron_normalize(ob, s.variance_neuron, b * mv.rows, identity_rows, h.muon_beta2, dt.param);
    std::copy(ob.v.begin(), ob.v.end(), o.begin() + b * per);
  }
  muon_apply_update(s, o, h, dt.param, adjusted_lr(h.lr, h.adjust_lr, mv.rows, mv.cols));
}

}  // namespace dionref

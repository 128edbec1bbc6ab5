// SPDX-License-Identifier: MIT
// Dion2 (spec §5.3, local selection scope): orthogonalize only the fraction
// of rows (or columns) of the momentum with the largest L1 norms.
//   M += G;  I = top-k slices of M by L1 norm, k = max(1, ceil(fraction * N));
//   S = M[I];  M[I] = ef_decay * S;  X = (1 - lr wd) X;  X[I] -= lr_adj orth(S)
// Slices are rows when the matrix is wide or square, columns when it is tall
// (the shorter dim is selected, so orth works on k x long). NorDion2 always
// selects rows (neurons), uses mu as the decay and normalises the selected
// rows with the "variance_neuron" state (spec §6.2).
#include <algorithm>
#include <cmath>

#include "common.hpp"

namespace dion {

namespace {

struct Sel {
  Axis axis;     // storage axis of the selected slices
  int64_t N;     // slices per matrix
  int64_t len;   // length of a slice
  int64_t k;
};

Sel selection(const Group& g, const Tensor& t, bool nor) {
  // Logical selection: rows if rows <= cols (Dion2), always rows (NorDion2).
  bool logical_rows = nor || t.geom.m <= t.geom.n;
  Sel s;
  s.axis = (logical_rows != t.geom.storage_transposed) ? kRows : kCols;
  s.N = s.axis == kRows ? t.geom.srows : t.geom.scols;
  s.len = s.axis == kRows ? t.geom.scols : t.geom.srows;
  double kd = std::ceil(g.opt.fraction * static_cast<double>(s.N));
  s.k = std::min<int64_t>(s.N, std::max<int64_t>(1, static_cast<int64_t>(kd)));
  return s;
}

}  // namespace

size_t dion2_family_workspace(const Group& g, const Tensor& t, int64_t count) {
  const bool nor = g.opt.algorithm == DION_ALGO_NORDION2;
  Sel s = selection(g, t, nor);
  const int64_t B = t.geom.batch * count;
  size_t w = 2 * ws_floats(t.numel_local * count) + ws_floats(B * s.N) + ws_floats(B * s.k) +
             ws_floats(B * s.k * s.len);
  int64_t sr = s.axis == kRows ? s.k : s.len, sc = s.axis == kRows ? s.len : s.k;
  w += orthogonalize_ws_floats(sr, sc, B);
  if (nor) w += ws_floats(B * s.N);
  return w;
}

void dion2_family_step(Optimizer& opt, Group& g, const Batch& bt, bool nor) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const Tensor& t = bt.t;
  const int64_t n = t.numel_local, T = bt.count;
  const Sel s = selection(g, t, nor);
  const int64_t B = t.geom.batch * T;  // matrices in the batch
  float* M = load_ws(opt, bt, kState0, n);
  float* W = load_ws(opt, bt, kGrad, n);  // G, later X
  be.axpby(1.0f, W, 1.0f, M, n * T);       // M += G (no decay here)
  MatBatch Mm{M, t.geom.srows, t.geom.scols, t.geom.scols, t.geom.srows * t.geom.scols, B};
  float* scores = opt.ws.take(B * s.N);
  int32_t* idx = reinterpret_cast<int32_t*>(opt.ws.take(B * s.k));
  be.slice_l1(Mm, s.axis, scores);
  be.topk(scores, B, s.N, s.k, idx);
  const int64_t sr = s.axis == kRows ? s.k : s.len, sc = s.axis == kRows ? s.len : s.k;
  MatBatch S{opt.ws.take(B * s.k * s.len), sr, sc, sc, sr * sc, B};
  be.gather_slices(Mm, s.axis, idx, s.k, S);
  const float decay = static_cast<float>(nor ? o.mu : o.ef_decay);
  be.scale_slices(Mm, s.axis, idx, s.k, decay);  // error feedback on the selected slices only
  store_ws(opt, bt, kState0, M, n);
  orthogonalize(opt, o, S);
  if (nor) {
    const StateBuf& Vs = state_of(opt, t, 1);
    float* V = load_ws(opt, bt, kState1, Vs.numel);
    be.neuron_normalize(S, s.axis, V, s.N, static_cast<float>(o.muon_beta2), idx);
    store_ws(opt, bt, kState1, V, Vs.numel);
  }
  be.load_multi(W, bt.list, T, kParam, n);
  MatBatch X{W, t.geom.srows, t.geom.scols, t.geom.scols, t.geom.srows * t.geom.scols, B};
  be.decay(W, n * T, g.scalars);
  const double lr_mult = adjusted_lr(o, 1.0, t.geom.m, t.geom.n);  // from the FULL matrix shape
  be.add_slices(X, s.axis, idx, s.k, S, g.scalars, static_cast<float>(-lr_mult));
  store_ws(opt, bt, kParam, W, n);
}

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  add_momentum(opt, g, t);
}
void step(Optimizer& opt, Group& g, const Batch& b) { dion2_family_step(opt, g, b, false); }
}  // namespace

extern const Algorithm kDion2 = {"dion2", false, init_state, dion2_family_workspace, step};

}  // namespace dion

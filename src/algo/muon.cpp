// SPDX-License-Identifier: MIT
// Muon (spec §3.2): SGD momentum, then an orthogonalized update.
//   M = mu M + G;  U = nesterov ? mu M + G : M;  O = orth(U)
//   X = (1 - lr wd) X - lr_adj O   (cautious: decay only where X O >= 0)
// Leading dims of a tensor are a batch of independent matrices (flatten=1
// makes each tensor one shape[0] x prod(rest) matrix, per tensor).
#include "common.hpp"

namespace dion {

size_t muon_family_workspace(const Group& g, const Tensor& t, int64_t count) {
  const int64_t n = t.numel_local * count;
  size_t w = 4 * ws_floats(n) + orthogonalize_ws_floats(t.geom.srows, t.geom.scols, t.geom.batch * count);
  if (g.opt.algorithm == DION_ALGO_NORMUON)
    w += ws_floats(count * t.geom.batch * (t.geom.storage_transposed ? t.geom.scols : t.geom.srows));
  return w;
}

void muon_family_step(Optimizer& opt, Group& g, const Batch& bt, bool normalize) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const Tensor& t = bt.t;
  const int64_t n = t.numel_local, T = bt.count, N = n * T;
  float* M = load_ws(opt, bt, kState0, n);
  float* G = load_ws(opt, bt, kGrad, n);
  const float mu = static_cast<float>(o.mu);
  be.axpby(mu, G, 1.0f, M, N);  // M = mu M + G
  store_ws(opt, bt, kState0, M, n);
  float* U = opt.ws.take(N);
  if (o.nesterov)
    be.lincomb(mu, M, 1.0f, G, U, N);
  else
    be.copy(U, M, sizeof(float) * static_cast<size_t>(N));
  MatBatch Um{U, t.geom.srows, t.geom.scols, t.geom.scols, t.geom.srows * t.geom.scols, t.geom.batch * T};
  orthogonalize(opt, o, Um);
  if (normalize) {
    const StateBuf& Vs = state_of(opt, t, 1);
    float* V = load_ws(opt, bt, kState1, Vs.numel);
    const Axis ax = logical_rows_axis(t);
    const int64_t per = ax == kRows ? t.geom.srows : t.geom.scols;
    be.neuron_normalize(Um, ax, V, per, static_cast<float>(o.muon_beta2), nullptr);
    store_ws(opt, bt, kState1, V, Vs.numel);
  }
  float* X = load_ws(opt, bt, kParam, n);
  const double lr_mult = adjusted_lr(o, 1.0, t.geom.m, t.geom.n);
  be.apply_update(X, U, N, g.scalars, static_cast<float>(lr_mult), o.cautious_wd != 0);
  store_ws(opt, bt, kParam, X, n);
}

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  add_momentum(opt, g, t);
}
void step(Optimizer& opt, Group& g, const Batch& b) { muon_family_step(opt, g, b, false); }
}  // namespace

extern const Algorithm kMuon = {"muon", false, init_state, muon_family_workspace, step};

}  // namespace dion

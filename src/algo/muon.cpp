// SPDX-License-Identifier: MIT
// Muon (spec §3.2): SGD momentum, then an orthogonalized update.
//   M = mu M + G;  U = nesterov ? mu M + G : M;  O = orth(U)
//   X = (1 - lr wd) X - lr_adj O   (cautious: decay only where X O >= 0)
// Leading dims of a tensor are a batch of independent matrices (flatten=1
// makes each tensor one shape[0] x prod(rest) matrix, per tensor).
#include "common.hpp"

namespace dion {

size_t muon_family_workspace(const Group& g, const Tensor& t) {
  const int64_t n = t.numel_local;
  size_t w = 4 * ws_floats(n) + orthogonalize_ws_floats(t.geom.srows, t.geom.scols, t.geom.batch);
  if (g.opt.algorithm == DION_ALGO_NORMUON) w += ws_floats(t.geom.batch * (t.geom.storage_transposed ? t.geom.scols : t.geom.srows));
  return w;
}

void muon_family_step(Optimizer& opt, Group& g, Tensor& t, bool normalize) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const int64_t n = t.numel_local;
  StateBuf& Ms = state_of(opt, t, 0);
  float* M = load_ws(opt, Ms.data, Ms.dtype, n);
  float* G = load_ws(opt, t.grad, t.grad_dtype, n);
  const float mu = static_cast<float>(o.mu);
  be.axpby(mu, G, 1.0f, M, n);  // M = mu M + G
  be.store(Ms.data, Ms.dtype, M, n);
  float* U = opt.ws.take(n);
  if (o.nesterov)
    be.lincomb(mu, M, 1.0f, G, U, n);
  else
    be.copy(U, M, sizeof(float) * static_cast<size_t>(n));
  MatBatch Um{U, t.geom.srows, t.geom.scols, t.geom.scols, t.geom.srows * t.geom.scols, t.geom.batch};
  orthogonalize(opt, o, Um);
  if (normalize) {
    StateBuf& Vs = state_of(opt, t, 1);
    float* V = load_ws(opt, Vs.data, Vs.dtype, Vs.numel);
    const Axis ax = logical_rows_axis(t);
    const int64_t per = ax == kRows ? t.geom.srows : t.geom.scols;
    be.neuron_normalize(Um, ax, V, per, static_cast<float>(o.muon_beta2), nullptr);
    be.store(Vs.data, Vs.dtype, V, Vs.numel);
  }
  float* X = load_ws(opt, t.param, t.param_dtype, n);
  const double lr_adj = adjusted_lr(o, o.lr, t.geom.m, t.geom.n);
  be.apply_update(X, U, n, static_cast<float>(o.lr), static_cast<float>(o.weight_decay), static_cast<float>(lr_adj),
                  o.cautious_wd != 0);
  be.store(t.param, t.param_dtype, X, n);
}

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  add_momentum(opt, g, t);
}
void step(Optimizer& opt, Group& g, Tensor& t) { muon_family_step(opt, g, t, false); }
}  // namespace

extern const Algorithm kMuon = {"muon", init_state, muon_family_workspace, step};

}  // namespace dion

// SPDX-License-Identifier: MIT
// AdamW (spec §1.4, the fused "legacy" form with the group's step counter):
//   m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g^2
//   x = (1 - lr wd) x - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)
// Cautious weight decay decays only where m x >= 0.
#include <cmath>

#include "common.hpp"

namespace dion {

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  dion_dtype_t vdt = g.opt.variance_dtype == DION_DTYPE_UNSET ? t.param_dtype : g.opt.variance_dtype;
  add_momentum(opt, g, t);
  opt.add_state(t, "variance", vdt, t.ndim, t.shape, t.local_shape, t.local_offset, t.layout);
}
size_t workspace(const Group&, const Tensor& t) { return 4 * ws_floats(t.numel_local); }
void step(Optimizer& opt, Group& g, Tensor& t) {
  const dion_group_options_t& o = g.opt;
  const int64_t n = t.numel_local;
  StateBuf& Ms = state_of(opt, t, 0);
  StateBuf& Vs = state_of(opt, t, 1);
  float* X = load_ws(opt, t.param, t.param_dtype, n);
  float* G = load_ws(opt, t.grad, t.grad_dtype, n);
  float* M = load_ws(opt, Ms.data, Ms.dtype, n);
  float* V = load_ws(opt, Vs.data, Vs.dtype, n);
  const double st = static_cast<double>(g.step);
  const double bc1 = 1.0 - std::pow(o.beta1, st), bc2 = 1.0 - std::pow(o.beta2, st);
  opt.backend->adamw(X, G, M, V, n, static_cast<float>(o.lr), static_cast<float>(o.beta1),
                     static_cast<float>(o.beta2), static_cast<float>(o.epsilon), static_cast<float>(o.weight_decay),
                     static_cast<float>(bc1), static_cast<float>(bc2), o.cautious_wd != 0);
  opt.backend->store(t.param, t.param_dtype, X, n);
  opt.backend->store(Ms.data, Ms.dtype, M, n);
  opt.backend->store(Vs.data, Vs.dtype, V, n);
}
}  // namespace

extern const Algorithm kAdamW = {"adamw", init_state, workspace, step};

}  // namespace dion

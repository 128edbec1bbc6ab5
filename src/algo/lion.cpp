// SPDX-License-Identifier: MIT
// Lion (spec §1.4): u = sign(b1 m + (1 - b1) g);  m = b2 m + (1 - b2) g;
//   x = (1 - lr wd) x - lr u   (cautious: decay only where x u >= 0)
#include "common.hpp"

namespace dion {

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  add_momentum(opt, g, t);
}
size_t workspace(const Group&, const Tensor& t) { return 3 * ws_floats(t.numel_local); }
void step(Optimizer& opt, Group& g, Tensor& t) {
  const dion_group_options_t& o = g.opt;
  const int64_t n = t.numel_local;
  StateBuf& Ms = state_of(opt, t, 0);
  float* X = load_ws(opt, t.param, t.param_dtype, n);
  float* G = load_ws(opt, t.grad, t.grad_dtype, n);
  float* M = load_ws(opt, Ms.data, Ms.dtype, n);
  opt.backend->lion(X, G, M, n, static_cast<float>(o.lr), static_cast<float>(o.beta1), static_cast<float>(o.beta2),
                    static_cast<float>(o.weight_decay), o.cautious_wd != 0);
  opt.backend->store(t.param, t.param_dtype, X, n);
  opt.backend->store(Ms.data, Ms.dtype, M, n);
}
}  // namespace

extern const Algorithm kLion = {"lion", init_state, workspace, step};

}  // namespace dion

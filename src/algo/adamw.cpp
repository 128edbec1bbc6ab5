// SPDX-License-Identifier: MIT
// AdamW (spec §1.4, the fused "legacy" form with the group's step counter):
//   m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g^2
//   x = (1 - lr wd) x - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)
// Cautious weight decay decays only where m x >= 0.
#include "common.hpp"

namespace dion {

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  dion_dtype_t vdt = g.opt.variance_dtype == DION_DTYPE_UNSET ? t.param_dtype : g.opt.variance_dtype;
  add_momentum(opt, g, t);
  opt.add_state(t, "variance", vdt, t.ndim, t.shape, t.local_shape, t.local_offset, t.layout);
}
size_t workspace(const Group&, const Tensor&, int64_t) { return 0; }
// One multi-tensor update over the typed buffers of the whole group; the
// step counter (bias corrections) and lr/wd/betas are read on the device.
void step(Optimizer& opt, Group& g, const Batch& b) {
  opt.backend->adamw(b.list, b.count, b.max_n, g.scalars, static_cast<float>(g.opt.epsilon), g.opt.cautious_wd != 0,
                     opt.skip_flag());
}
}  // namespace

extern const Algorithm kAdamW = {"adamw", true, init_state, workspace, step};

}  // namespace dion

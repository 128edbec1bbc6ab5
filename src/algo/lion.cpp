// SPDX-License-Identifier: MIT
// Lion (spec §1.4): u = sign(b1 m + (1 - b1) g);  m = b2 m + (1 - b2) g;
//   x = (1 - lr wd) x - lr u   (cautious: decay only where x u >= 0)
#include "common.hpp"

namespace dion {

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  add_momentum(opt, g, t);
}
size_t workspace(const Group&, const Tensor&, int64_t) { return 0; }
void step(Optimizer& opt, Group& g, const Batch& b) {
  opt.backend->lion(b.list, b.count, b.max_n, g.scalars, g.opt.cautious_wd != 0, opt.skip_flag());
}
}  // namespace

extern const Algorithm kLion = {"lion", true, init_state, workspace, step};

}  // namespace dion

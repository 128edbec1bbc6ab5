// SPDX-License-Identifier: MIT
// NorDion2 / Dion3 (spec §6.2): Dion2 selecting rows (neurons) always, with
// mu as the error-feedback decay and NorMuon's neuron-wise normalisation of
// the selected rows (only their variances are updated). See dion2.cpp.
#include "common.hpp"

namespace dion {

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  dion2_family_check(g, t);
  add_momentum(opt, g, t);
  add_variance_neuron(opt, g, t);
}
void step(Optimizer& opt, Group& g, const Batch& b) { dion2_family_step(opt, g, b, true); }
bool step_group(Optimizer& opt, Group& g) { return dion2_family_step_group(opt, g, true); }
}  // namespace

extern const Algorithm kNorDion2 = {"nordion2", false, init_state, dion2_family_workspace, step, step_group,
                                    dion2_group_workspace, dion2_family_prepass_floats, dion2_family_prepass};

}  // namespace dion

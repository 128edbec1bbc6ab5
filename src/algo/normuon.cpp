// SPDX-License-Identifier: MIT
// NorMuon (spec §4.2): Muon whose orthogonalized update is normalised per
// neuron (logical row) by an EMA of its mean square, then rescaled to keep
// the update's Frobenius norm:
//   v = lerp(v, mean_j O_ij^2, 1 - beta2);  O' = O / (sqrt(v) + 1e-8);  O' *= ||O|| / max(||O'||, 1e-8)
#include "common.hpp"

namespace dion {

void add_variance_neuron(Optimizer& opt, const Group& g, Tensor& t) {
  // One value per logical row of each matrix: shape[:-1] + (1,) (or (m, 1) with flatten).
  int64_t gs[DION_MAX_DIMS], ls[DION_MAX_DIMS], lo[DION_MAX_DIMS];
  int32_t nd;
  if (g.opt.flatten && t.ndim >= 3) {
    nd = 2;
    gs[0] = t.shape[0];
    ls[0] = t.local_shape[0];
    lo[0] = t.local_offset[0];
    gs[1] = ls[1] = 1;
    lo[1] = 0;
  } else {
    nd = t.ndim;
    for (int d = 0; d < nd; ++d) {
      gs[d] = t.shape[d];
      ls[d] = t.local_shape[d];
      lo[d] = t.local_offset[d];
    }
    gs[nd - 1] = ls[nd - 1] = 1;
    lo[nd - 1] = 0;
  }
  // fp32 by default would be more accurate; the reference keeps it in the
  // parameter dtype, and so does a checkpoint's shape contract.
  opt.add_state(t, "variance_neuron", t.param_dtype, nd, gs, ls, lo, DION_LAYOUT_ROW_MAJOR);
}

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  add_momentum(opt, g, t);
  add_variance_neuron(opt, g, t);
}
void step(Optimizer& opt, Group& g, const Batch& b) { muon_family_step(opt, g, b, true); }
bool step_group(Optimizer& opt, Group& g) { return muon_family_step_group(opt, g, true); }
}  // namespace

extern const Algorithm kNorMuon = {"normuon", false, init_state, muon_family_workspace, step, step_group,
                                   muon_group_workspace};

}  // namespace dion

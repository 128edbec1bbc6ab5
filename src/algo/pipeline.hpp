// SPDX-License-Identifier: MIT
// The Muon family's pipelined group step (muon.cpp, dion2.cpp): the buckets
// of a group whose matrices cross one mesh (a one-level megabatch plan)
// stepped as
//   A0 S0 | A1 S1 O0 K0 | A2 S2 O1 K1 X0 | ... | O(n-1) K(n-1) X(n-2) | X(n-1)
// A: the bucket's work before its exchange (momentum pass, selection), S:
// the exchange's collective, O: the paste of the owned matrices, their
// orthogonalization (and normalisation) and the staging of the way back, K:
// the collective back, X: the update. S and K are deferred on the backend's
// comm stream (SideComm), so bucket i + 1's exchange runs while bucket i is
// orthogonalized and bucket i's way back while bucket i + 1 is (the
// reference pipelines its batches the same way). A bucket that is not
// pipelined is stepped whole where its A would run. Each bucket's
// operations and collectives are the bucket-by-bucket step's, so the
// results are the same bits. Every bucket's buffers stay alive to the end
// of the step, so the pipeline is used only while the sum of the buckets'
// workspaces is at most twice the batch workspace cap, for two or more
// pipelined buckets, and not for a group whose gradients the overlapped
// replicate sync averages (the optimizer pipelines those bucket by bucket).
// DION_MEGABATCH_PIPELINE=0 steps bucket by bucket (docs/ENV.md).
#pragma once
#include <vector>

#include "side_comm.hpp"

namespace dion {

inline bool megabatch_pipeline_enabled() { return env_on("DION_MEGABATCH_PIPELINE"); }

// What the pipeline asks of an algorithm: whether a bucket is pipelined,
// and a bucket's workspace (the algorithm's workspace_floats).
struct PipelineKind {
  bool (*piped)(const Optimizer& opt, const Group& g, const Batch& bt);
  size_t (*floats)(const Group& g, const Tensor& t, int64_t count);
};

// The workspace of the pipelined step of the nb buckets bs of g (0: not
// pipelined).
inline size_t pipeline_floats(const Optimizer& opt, const Group& g, const Batch* bs, size_t nb, PipelineKind k) {
  if (nb < 2 || !megabatch_pipeline_enabled() || (opt.steps_overlap() && opt.group_grads_averaged(g))) return 0;
  size_t sum = 0, n = 0;
  for (size_t i = 0; i < nb; ++i) {
    n += k.piped(opt, g, bs[i]) ? 1 : 0;
    sum += k.floats(g, bs[i].t, bs[i].count);
  }
  return n >= 2 ? sum : 0;
}

// pipeline_floats over all of g's buckets, for dion_add_group's reservation
// (0 above twice the batch workspace cap).
inline size_t pipeline_group_workspace(const Optimizer& opt, const Group& g, PipelineKind k) {
  std::vector<Batch> bs;
  for (const Bucket& b : g.buckets)
    bs.push_back(Batch{opt.tensors[static_cast<size_t>(b.tensors[0])], static_cast<int64_t>(b.tensors.size()), nullptr,
                       0, b.aligned16});
  const size_t need = pipeline_floats(opt, g, bs.data(), bs.size(), k);
  return need <= 2 * opt.batch_workspace_floats ? need : 0;
}

// The step's start: g's active buckets (in a list whose capacity is kept:
// a steady-state step allocates nothing) with the workspace reset, or null
// when the group is not pipelined this step.
inline const std::vector<Batch>* pipeline_begin(Optimizer& opt, Group& g, PipelineKind k) {
  thread_local std::vector<Batch> batches;
  batches.clear();
  for (Bucket& b : g.buckets)
    if (b.active) batches.push_back(opt.batch_of(b));
  const size_t need = pipeline_floats(opt, g, batches.data(), batches.size(), k);
  if (need == 0 || need > opt.ws.capacity_floats()) return nullptr;
  opt.ws.reset();
  return &batches;
}

// The schedule above: start(i) runs A and defers S (or steps bucket i
// whole), middle(i) waits for S and runs O and defers K, finish(i) waits
// for K and runs X (middle and finish do nothing for a bucket start()
// stepped whole).
template <class Start, class Middle, class Finish>
void run_pipeline(size_t nb, Start start, Middle middle, Finish finish) {
  if (nb == 0) return;
  start(0);
  for (size_t i = 1; i < nb; ++i) {
    start(i);
    middle(i - 1);
    if (i >= 2) finish(i - 2);
  }
  middle(nb - 1);
  if (nb >= 2) finish(nb - 2);
  finish(nb - 1);
}

}  // namespace dion

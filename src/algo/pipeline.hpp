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
#include <optional>
#include <vector>

#include "megabatch.hpp"
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
// pipelined); piped (nullable) receives each bucket's k.piped.
inline size_t pipeline_floats(const Optimizer& opt, const Group& g, const Batch* bs, size_t nb, PipelineKind k,
                              std::vector<char>* piped = nullptr) {
  if (nb < 2 || !megabatch_pipeline_enabled() || (opt.steps_overlap() && opt.group_grads_averaged(g))) return 0;
  if (piped) piped->clear();
  size_t sum = 0, n = 0;
  for (size_t i = 0; i < nb; ++i) {
    const bool p = k.piped(opt, g, bs[i]);
    if (piped) piped->push_back(p ? 1 : 0);
    n += p ? 1 : 0;
    sum += k.floats(g, bs[i].t, bs[i].count);
  }
  return n >= 2 ? sum : 0;
}

// pipeline_floats over all of g's buckets, for dion_add_group's reservation.
inline size_t pipeline_group_workspace(const Optimizer& opt, const Group& g, PipelineKind k) {
  const std::vector<Batch> bs = bucket_batches(opt, g);
  return group_reservation(opt, pipeline_floats(opt, g, bs.data(), bs.size(), k));
}

// A step's buckets: the active ones and whether each is pipelined (lists
// whose capacity is kept: a steady-state step allocates nothing).
struct PipelineBuckets {
  std::vector<Batch> batches;
  std::vector<char> piped;
};

// The step's start: g's buckets with the workspace reset, or null when the
// group is not pipelined this step.
inline const PipelineBuckets* pipeline_begin(Optimizer& opt, Group& g, PipelineKind k) {
  thread_local PipelineBuckets pb;
  active_batches(opt, g, pb.batches);
  if (!group_step_fits(opt, pipeline_floats(opt, g, pb.batches.data(), pb.batches.size(), k, &pb.piped)))
    return nullptr;
  return &pb;
}

// The schedule above: start(i, piped) runs A and defers S, or steps bucket
// i whole where it is not pipelined; middle(i) waits for S, runs O and
// defers K; finish(i) waits for K and runs X (middle and finish for the
// pipelined buckets only).
template <class Start, class Middle, class Finish>
void run_pipeline(const PipelineBuckets& pb, Start start, Middle middle, Finish finish) {
  const size_t nb = pb.batches.size();
  const auto mid = [&](size_t i) {
    if (pb.piped[i]) middle(i);
  };
  const auto fin = [&](size_t i) {
    if (pb.piped[i]) finish(i);
  };
  if (nb == 0) return;
  start(0, pb.piped[0] != 0);
  for (size_t i = 1; i < nb; ++i) {
    start(i, pb.piped[i] != 0);
    mid(i - 1);
    if (i >= 2) fin(i - 2);
  }
  mid(nb - 1);
  if (nb >= 2) fin(nb - 2);
  fin(nb - 1);
}

// The exchanges of a pipelined step: bucket i's Unshard, with its
// collectives (S, K) on the comm stream, deferred (SideComm; the two marks
// alternate between buckets). The Unshards are dropped with the step (they
// refer to the optimizer).
class PipelineExchanges {
 public:
  PipelineExchanges(Optimizer& opt, size_t nb) : opt_(opt), side_(opt), ex_(storage()) {
    ex_.clear();
    ex_.resize(nb);
  }
  ~PipelineExchanges() { ex_.clear(); }
  PipelineExchanges(const PipelineExchanges&) = delete;
  PipelineExchanges& operator=(const PipelineExchanges&) = delete;
  // End of A: bucket i's `slots` pieces in buf sent to their owners (S).
  void send(size_t i, const MbPlan& plan, const MbPiece& piece, int64_t slots, float* buf) {
    ex_[i].emplace(opt_, plan, piece, slots);
    side_.deferred(mark(i), [&] { ex_[i]->send(buf); });
  }
  // Start of O: the owned slots, once S is done.
  MatBatch received(size_t i) {
    side_.wait(mark(i));
    Unshard& u = *ex_[i];
    const MbPiece& w = u.whole();
    return MatBatch{u.paste(), w.rows(), w.cols(), w.cols(), w.rows() * w.cols(), u.count()};
  }
  // End of O: the owned slots sent back into buf (K).
  void send_back(size_t i, float* buf) {
    ex_[i]->cut(buf);
    side_.deferred(mark(i), [&] { ex_[i]->send_back(buf); });
  }
  // Start of X: once K is done.
  void wait_back(size_t i) { side_.wait(mark(i)); }

 private:
  static int mark(size_t i) { return static_cast<int>(i % 2); }
  static std::vector<std::optional<Unshard>>& storage() {
    thread_local std::vector<std::optional<Unshard>> v;  // capacity kept
    return v;
  }
  Optimizer& opt_;
  SideComm side_;
  std::vector<std::optional<Unshard>>& ex_;
};

}  // namespace dion

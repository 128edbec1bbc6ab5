// SPDX-License-Identifier: MIT
// SideComm: a step's collectives on the backend's communication stream,
// some of them deferred so that they overlap the compute issued after them.
#pragma once
#include "common.hpp"

namespace dion {

// A group step's collectives on the backend's communication stream, in
// the order they are issued (one stream, so the GPU runs them in that order
// on every rank), instead of on the compute stream. Every collective is
// joined (StreamJoin: ordered with the compute stream as if enqueued there)
// except those run through deferred() (Dion's phased step: phase A's
// reductions of P and phase E's gathers; the Muon family's pipelined step:
// the exchanges of each bucket), which wait for the compute stream's work so
// far but are not waited for until wait(slot), so that they overlap the next
// bucket's compute. A deferred function must issue collectives only: any
// other backend call in it would run on the compute stream, unordered with
// them. Used on a device backend with a comm stream (made at
// dion_add_group for any multi-rank mesh) unless DION_OVERLAP=0; otherwise
// every call runs as issued, on the compute stream. The marks are the
// backend's two (Backend::kCommMarks): a mark re-recorded by a later
// collective is still after the earlier one (one stream), so a wait on it
// only waits longer.
class SideComm {
 public:
  explicit SideComm(Optimizer& opt)
      : opt_(opt), on_(!opt.backend->host_memory() && opt.backend->comm_stream() && opt.overlap_allowed) {
    if (!on_) return;
    const auto m = opt.meshes();
    for (size_t i = 0; i < m.size(); ++i)
      if (m[i]) {
        saved_[i] = {m[i]->stream(), m[i]->join()};
        m[i]->set_stream(opt.backend->comm_stream());
        m[i]->set_join(&opt.comm_join);
      }
  }
  ~SideComm() {
    if (!on_) return;
    const auto m = opt_.meshes();
    for (size_t i = 0; i < m.size(); ++i)
      if (m[i]) {
        m[i]->set_join(saved_[i].join);
        m[i]->set_stream(saved_[i].stream);
      }
  }
  SideComm(const SideComm&) = delete;
  SideComm& operator=(const SideComm&) = delete;
  template <class F>
  void deferred(int slot, F&& f) {
    if (!on_) {
      f();
      return;
    }
    opt_.backend->comm_wait_main();
    set_joins(nullptr);
    f();
    set_joins(&opt_.comm_join);
    opt_.backend->comm_mark(slot);
  }
  void wait(int slot) {
    if (on_) opt_.backend->main_wait_mark(slot);
  }

 private:
  void set_joins(StreamJoin* j) {
    for (Collectives* c : opt_.meshes())
      if (c) c->set_join(j);
  }
  struct Saved {
    void* stream = nullptr;
    StreamJoin* join = nullptr;
  };
  Optimizer& opt_;
  const bool on_;
  Saved saved_[3];
};

}  // namespace dion

// SPDX-License-Identifier: MIT
// Pieces shared by the algorithms: typed <-> fp32 workspace helpers and the
// Muon-family orthogonalizers (Polar Express, quintic Newton-Schulz).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../core/error.hpp"
#include "../core/log.hpp"
#include "../core/optimizer.hpp"

namespace dion {

// A switch for comparisons and benchmarks (docs/ENV.md): on unless the
// environment variable is "0".
inline bool env_on(const char* name) {
  const char* e = std::getenv(name);
  return !(e && std::strcmp(e, "0") == 0);
}

// The Gram form of the Muon family's bf16 iteration (src/algo/ns_bf16.hpp;
// CUDA backend, matmul precision BF16): on unless DION_NS_GRAM is "0"
// (docs/ENV.md). Read at each step.
inline bool ns_gram_on() { return env_on("DION_NS_GRAM"); }
// Its restarts as NsPlan::gram_restarts takes them: DION_NS_GRAM_RESTARTS, a
// comma-separated list of the steps (1 to 31) after which X and R are formed
// again ("none": no restart); unset or malformed, `dflt` (a malformed value
// is logged as a warning). Read at each step.
inline uint32_t ns_gram_restarts(uint32_t dflt) {
  const char* e = std::getenv("DION_NS_GRAM_RESTARTS");
  if (!e || !*e) return dflt;
  if (std::strcmp(e, "none") == 0) return 0;
  uint32_t mask = 0;
  for (const char* c = e; *c;) {
    char* end = nullptr;
    const long k = std::strtol(c, &end, 10);
    if (end == c || k < 1 || k > 31 || (*end && *end != ',') || (*end == ',' && !end[1])) {
      DION_LOG_WARN("DION_NS_GRAM_RESTARTS=\"%s\" is not a list of steps 1 to 31 (e.g. \"1,3\") or \"none\": "
                    "the default restarts are used", e);
      return dflt;
    }
    mask |= 1u << k;
    c = *end ? end + 1 : end;
  }
  return mask;
}

// Loads field f (n elements per tensor) of the batch's tensors into a fresh
// workspace buffer: tensor i at offset i * n.
inline float* load_ws(Optimizer& opt, const Batch& b, Field f, int64_t n) {
  float* p = opt.ws.take(n * b.count);
  opt.backend->load_multi(p, b.list, b.count, f, n);
  return p;
}
// Stores it back (nothing is written in a skipped step).
inline void store_ws(Optimizer& opt, const Batch& b, Field f, const float* src, int64_t n) {
  opt.backend->store_multi(b.list, b.count, f, src, n, opt.skip_flag());
}

inline StateBuf& state_of(Optimizer& opt, const Tensor& t, size_t k) { return opt.states[t.states.at(k)]; }

// x's squared Frobenius norms as partial sums (nparts per matrix, as
// select_momentum_multi takes them); parts null: none given.
struct FrobParts {
  const double* parts = nullptr;
  int64_t nparts = 0;
};

// Orthogonalizes each (rows x cols) matrix of `x` in place with the group's
// orthogonalizer (spec §1.2). Workspace: orthogonalize_ws_floats().
// With `bf16_result` not null, a result computed in bf16 (matmul precision
// BF16 on the CUDA backend) is not widened into x: *bf16_result points to it
// (workspace, dense: the matrices one after the other) and x is left
// unspecified; otherwise *bf16_result = nullptr and x holds the result.
// `given` norms spare the bf16 iteration its pass to sum x (the fp32
// iteration sums x itself).
void orthogonalize(Optimizer& opt, const dion_group_options_t& o, MatBatch x, const void** bf16_result = nullptr,
                   FrobParts given = {});
size_t orthogonalize_ws_floats(int64_t rows, int64_t cols, int64_t batch);
// The bf16 iteration (CUDA backend, matmul precision BF16) from an
// unnormalised bf16 start: xb (dense bf16 matrices, as select_momentum_multi
// writes them with out_dtype BF16) with its squared Frobenius norms as
// partial sums. The first step scales its small s x s matrices instead of
// xb (Backend::mirror_bf16 or ns_shift_bf16; frob_scale_bf16 in the Gram
// form), so no pass normalises xb; xb may be overwritten. *bf16_result points to the result (xb's buffer or workspace
// within orthogonalize_ws_floats). The same iteration as orthogonalize's up
// to bf16 rounding: that one rounds the normalised start, this one the start
// and the scaled Gram matrices.
void orthogonalize_bf16_unnormalised(Optimizer& opt, const dion_group_options_t& o, MatBatch xb, FrobParts sums,
                                     const void** bf16_result);
// The same for n classes of one short side s at once, in the Gram form with
// their s x s products shared (ns_bf16.hpp, newton_schulz_gram_bf16_classes):
// xb[c] and sums[c] as above, results[c] receives class c's bf16 result.
// Workspace: orthogonalize_classes_ws_floats(s, total batch, elems, n), with
// elems[c] the elements of xb[c].
void orthogonalize_bf16_classes(Optimizer& opt, const dion_group_options_t& o, const MatBatch* xb,
                                const FrobParts* sums, int n, const void** results);
size_t orthogonalize_classes_ws_floats(int64_t s, int64_t total_batch, const int64_t* elems, int n);


// The "momentum" state every algorithm has: the parameter's shape, sharding
// and layout, in the group's momentum_dtype (default: the parameter dtype).
inline void add_momentum(Optimizer& opt, const Group& g, Tensor& t) {
  dion_dtype_t mdt = g.opt.momentum_dtype == DION_DTYPE_UNSET ? t.param_dtype : g.opt.momentum_dtype;
  opt.add_state(t, "momentum", mdt, t.ndim, t.shape, t.local_shape, t.local_offset, t.layout);
}

// Matrix algorithms: the storage axis holding the logical rows.
inline Axis logical_rows_axis(const Tensor& t) { return t.geom.storage_transposed ? kCols : kRows; }

// A group step (Algorithm::step_group: Dion's phased step, the Muon
// family's pipelined one) works on all of a group's buckets at once and
// keeps every bucket's buffers to the end of the step. At dion_add_group it
// sizes its workspace on every bucket with all its tensors
// (bucket_batches), and reserves it only up to twice the batch workspace cap
// (group_reservation: 0, stepped bucket by bucket, above it). At a step it
// runs on the active buckets (active_batches, into a list whose capacity the
// caller keeps: a steady-state step allocates nothing) when the workspace
// holds what it needs (group_step_fits, which then resets the workspace).
inline std::vector<Batch> bucket_batches(const Optimizer& opt, const Group& g) {
  std::vector<Batch> bs;
  for (const Bucket& b : g.buckets)
    bs.push_back(Batch{opt.tensors[static_cast<size_t>(b.tensors[0])], static_cast<int64_t>(b.tensors.size()), nullptr,
                       0, b.aligned16});
  return bs;
}
inline size_t group_reservation(const Optimizer& opt, size_t need) {
  return need <= 2 * opt.batch_workspace_floats ? need : 0;
}
inline void active_batches(Optimizer& opt, Group& g, std::vector<Batch>& out) {
  out.clear();
  for (Bucket& b : g.buckets)
    if (b.active) out.push_back(opt.batch_of(b));
}
inline bool group_step_fits(Optimizer& opt, size_t need) {
  if (need == 0 || need > opt.ws.capacity_floats()) return false;
  opt.ws.reset();
  return true;
}

}  // namespace dion

namespace dion {
// Muon and NorMuon share their step (muon.cpp); NorMuon adds the neuron-wise
// normalisation with the "variance_neuron" state (state slot 1).
void muon_family_step(Optimizer& opt, Group& g, const Batch& b, bool normalize);
size_t muon_family_workspace(const Group& g, const Tensor& t, int64_t count);
// Their pipelined group step (muon.cpp): false when the group is stepped
// bucket by bucket instead; its workspace (0: not pipelined).
bool muon_family_step_group(Optimizer& opt, Group& g, bool normalize);
size_t muon_group_workspace(const Optimizer& opt, const Group& g);
// Dion2 and NorDion2 share theirs (dion2.cpp).
void dion2_family_step(Optimizer& opt, Group& g, const Batch& b, bool normalize);
size_t dion2_family_workspace(const Group& g, const Tensor& t, int64_t count);
bool dion2_family_step_group(Optimizer& opt, Group& g, bool normalize);
size_t dion2_group_workspace(const Optimizer& opt, const Group& g);
size_t dion2_family_prepass_floats(const Optimizer& opt, const Group& g, const Tensor& t, int64_t count);
void dion2_family_prepass(Optimizer& opt, Group& g, const Batch& b, float* out, int32_t* nonfinite);
// Refuses (NOT_SUPPORTED) a tensor whose sharding the selection cannot follow.
void dion2_family_check(const Group& g, const Tensor& t);
// The "variance_neuron" state of NorMuon / NorDion2: one value per logical row.
void add_variance_neuron(Optimizer& opt, const Group& g, Tensor& t);
}  // namespace dion

// SPDX-License-Identifier: MIT
// Muon (spec §3.2): SGD momentum, then an orthogonalized update.
//   M = mu M + G;  U = nesterov ? mu M + G : M;  O = orth(U)
//   X = (1 - lr wd) X - lr_adj O   (cautious: decay only where X O >= 0)
// Leading dims of a tensor are a batch of independent matrices (flatten=1
// makes each tensor one shape[0] x prod(rest) matrix, per tensor).
#include <algorithm>
#include <vector>

#include "megabatch.hpp"
#include "ns_bf16.hpp"
#include "pipeline.hpp"

namespace dion {

namespace {

// NorMuon's "variance_neuron" state of B matrices as load_ws takes it
// (with_owned_variances), the largest shard of any rank.
size_t variance_floats(const Tensor& t, int64_t B, bool flatten) {
  return ws_floats(B * max_local_extent(t, flatten && t.ndim >= 3 ? 0 : t.ndim - 2));
}
// The neurons' scales and the matrices' rescales of B matrices (doubles;
// neuron_scales, finish_bf16), at most.
size_t neuron_scale_floats(const Tensor& t, int64_t B) {
  return ws_floats(Backend::neuron_scales_floats(B, t.geom.m + t.geom.n));
}

}  // namespace

size_t muon_family_workspace(const Group& g, const Tensor& t, int64_t count) {
  // Rank-independent (megabatch.hpp): the largest shard of any rank.
  const bool flatten = g.opt.flatten != 0;
  const int64_t N = max_local_numel(t) * count, B = max_local_batch(t, flatten) * count;
  const MbPlan plan = megabatch_plan(nullptr, t, flatten, B);
  const MbSizes u = megabatch_sizes(plan, matrix_piece(t, plan, flatten), B);
  // U (M, G and X stay in their typed buffers); the exchange; the
  // orthogonalization of the owned matrices
  size_t w = ws_floats(N) + u.ws_floats + orthogonalize_ws_floats(u.whole.rows(), u.whole.cols(), u.owned);
  // U's sums of squares for the unnormalised bf16 start (muon_family_step)
  if (plan.levels == 0) w += ws_floats(2 * count * Backend::select_parts_max(1, max_local_numel(t)));
  if (g.opt.algorithm == DION_ALGO_NORMUON) {
    w += variance_floats(t, B, flatten) + megabatch_sizes(plan, neuron_piece(t, plan, flatten), B).ws_floats;
    // With the bf16 start, U (bf16) and the iteration's second bf16 buffer
    // take two half-size buffers where the fp32 path takes one of N floats
    // (at most two alignment units more), then the neurons' scales and the
    // matrices' rescales (doubles; neuron_scales).
    if (plan.levels == 0) w += 2 * ws_floats(1) + neuron_scale_floats(t, B);
  }
  return w;
}

namespace {

// NorMuon's "variance_neuron" state of the batch, exchanged like the
// matrices (plan): loaded, the owned matrices' variances handed to
// use(Vo), then sent back and stored (no exchange: Vo is the loaded buffer).
template <class Use>
void with_owned_variances(Optimizer& opt, const dion_group_options_t& o, const Batch& bt, const MbPlan& plan,
                          Use&& use) {
  const Tensor& t = bt.t;
  const StateBuf& Vs = state_of(opt, t, 1);
  float* V = load_ws(opt, bt, kState1, Vs.numel);
  Unshard uv(opt, plan, neuron_piece(t, plan, o.flatten != 0), t.geom.batch * bt.count);
  use(uv.forward(V));
  uv.backward(V);
  store_ws(opt, bt, kState1, V, Vs.numel);
}

// NorMuon's neuron-wise normalisation of the owned matrices Um: on the
// owner, over whole rows and the whole matrix, the single-device statistics
// (the reference normalizes each rank's row shard after the return, with a
// per-shard Frobenius rescale, spec §4.2).
void normalize_owned(Optimizer& opt, const dion_group_options_t& o, const Batch& bt, const MbPlan& plan, MatBatch Um) {
  const Tensor& t = bt.t;
  with_owned_variances(opt, o, bt, plan, [&](float* Vo) {
    opt.backend->neuron_normalize(Um, logical_rows_axis(t), Vo, t.geom.m, static_cast<float>(o.muon_beta2), nullptr);
  });
}

// The update's learning-rate multiplier (the shape adjustment).
float update_lr_mult(const dion_group_options_t& o, const Tensor& t) {
  return static_cast<float>(adjusted_lr(o, 1.0, t.geom.m, t.geom.n));
}

// X = (1 - lr wd) X - lr_adj O for the batch, O (the batch's local pieces)
// of dtype `dt`.
void update(Optimizer& opt, const Group& g, const Batch& bt, const void* O, dion_dtype_t dt) {
  const dion_group_options_t& o = g.opt;
  opt.backend->apply_update_multi(bt.list, bt.count, bt.t.numel_local, O, dt, g.scalars, update_lr_mult(o, bt.t),
                                  o.cautious_wd != 0, opt.skip_flag());
}

// The rest of a bucket's step where the orthogonalizer left its bf16 result
// Ob laid out as U (no exchange): Muon's update reads it where it lies;
// NorMuon takes its statistics from it there and the update normalises as it
// reads it (in fp32, the bits of the normalised fp32 U), so the normalised
// matrices are never written.
void finish_bf16(Optimizer& opt, const Group& g, const Batch& bt, const MbPlan& plan, const MatBatch& Um, const void* Ob,
                 bool normalize) {
  if (!normalize) {
    update(opt, g, bt, Ob, DION_DTYPE_BF16);
    return;
  }
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const Tensor& t = bt.t;
  const Axis axis = logical_rows_axis(t);
  const int64_t nn = axis == kRows ? Um.rows : Um.cols;
  double* sc = reinterpret_cast<double*>(opt.ws.take(Backend::neuron_scales_floats(Um.batch, nn)));
  with_owned_variances(opt, o, bt, plan, [&](float* Vo) {
    be.neuron_scales(Um.batch, Um.rows, Um.cols, axis, Ob, Vo, t.geom.m, static_cast<float>(o.muon_beta2), sc);
  });
  be.apply_update_neuron_multi(bt.list, bt.count, Um.rows, Um.cols, Ob, DION_DTYPE_BF16, sc, axis, g.scalars,
                               update_lr_mult(o, t), o.cautious_wd != 0, opt.skip_flag());
}

// The parts of U's sums of squares where the momentum pass writes U straight
// in bf16 for an unnormalised start (muon_family_step), else 0: without
// meshes, one matrix per tensor, matmul precision BF16 on the CUDA backend,
// DION_MUON_BF16_START not 0 (read at each step).
int64_t bf16_start_parts(const Optimizer& opt, const dion_group_options_t& o, const Tensor& t, int64_t count,
                         const MbPlan& plan) {
  Backend& be = *opt.backend;
  if (plan.levels != 0 || t.geom.batch != 1 || o.matmul_precision != DION_MATMUL_BF16 || be.host_memory() ||
      !env_on("DION_MUON_BF16_START"))
    return 0;
  const int64_t np = be.momentum_parts(count, t.numel_local);
  return np > Backend::select_parts_max(1, t.numel_local) ? 0 : np;
}

// The bf16 start of a bucket (nparts > 0, bf16_start_parts): M = mu M + G
// stored back and U = the (Nesterov) momentum written straight in bf16, with
// its sums of squares in nparts parts per matrix, in one pass
// (Backend::momentum_multi_sums).
struct Bf16Start {
  float* U;  // bf16 elements
  FrobParts sums;
};
Bf16Start bf16_start(Optimizer& opt, const dion_group_options_t& o, const Batch& bt, int64_t nparts) {
  const int64_t n = bt.t.numel_local, T = bt.count;
  Bf16Start st;
  st.sums.nparts = nparts;
  st.sums.parts = reinterpret_cast<const double*>(opt.ws.take(2 * T * nparts));
  st.U = opt.ws.take((n * T + 1) / 2);
  opt.backend->momentum_multi_sums(bt.list, T, n, static_cast<float>(o.mu), 1.0f, o.nesterov != 0, st.U,
                                   DION_DTYPE_BF16, opt.skip_flag(), const_cast<double*>(st.sums.parts));
  return st;
}

}  // namespace

// Each rank orthogonalizes whole matrices: those of its share of the batch
// when they are sharded or replicated over a multi-rank mesh (megabatch.hpp),
// else all of its own.
void muon_family_step(Optimizer& opt, Group& g, const Batch& bt, bool normalize) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const Tensor& t = bt.t;
  const bool flatten = o.flatten != 0;
  const int64_t n = t.numel_local, T = bt.count, N = n * T, B = t.geom.batch * T;
  const MbPlan plan = megabatch_plan(&opt, t, flatten, B);
  // Muon and NorMuon without meshes, bf16 iteration, one matrix per tensor:
  // U is written straight in bf16 with its sums of squares, and the
  // iteration starts from it unnormalised (its first step scales the small
  // Gram matrices), so no pass normalises and rounds U. DION_MUON_BF16_START=0
  // keeps the fp32 U (read at each step).
  FrobParts sums;
  float* U = nullptr;
  if (const int64_t np = bf16_start_parts(opt, o, t, T, plan); np > 0) {
    const Bf16Start st = bf16_start(opt, o, bt, np);
    U = st.U;
    sums = st.sums;
  } else {
    // M = mu M + G, stored back; U = nesterov ? mu M + G : M in fp32: one
    // pass over the typed M and G (Backend::momentum_multi).
    U = opt.ws.take(N);
    be.momentum_multi(bt.list, T, n, static_cast<float>(o.mu), 1.0f, o.nesterov != 0, true, U, DION_DTYPE_FP32,
                      opt.skip_flag(), nullptr);
  }
  Unshard uu(opt, plan, matrix_piece(t, plan, flatten), B);
  float* Uo = uu.forward(U);
  const MbPiece& w = uu.whole();
  MatBatch Um{Uo, w.rows(), w.cols(), w.cols(), w.rows() * w.cols(), uu.count()};
  // Without an exchange or a normalisation the update reads the
  // orthogonalizer's bf16 result (if it has one) where it lies, laid out as U.
  const void* Ob = nullptr;
  if (sums.parts)
    orthogonalize_bf16_unnormalised(opt, o, Um, sums, &Ob);
  else
    orthogonalize(opt, o, Um, plan.levels == 0 && !normalize ? &Ob : nullptr);
  if (Ob) {
    finish_bf16(opt, g, bt, plan, Um, Ob, normalize);
    return;
  }
  if (normalize) normalize_owned(opt, o, bt, plan, Um);
  uu.backward(U);
  update(opt, g, bt, U, DION_DTYPE_FP32);
}

// ---- The pipelined group step (pipeline.hpp) ----
// A: the momentum pass (U); S, K: U's exchange and its way back; O: the
// orthogonalization (and NorMuon's normalisation); X: the update. Buckets
// with one exchange level are pipelined (two levels, FSDP x TP: a level's
// paste must precede the next level's collective).

namespace {

bool muon_piped(const Optimizer& opt, const Group& g, const Batch& bt) {
  return megabatch_plan(&opt, bt.t, g.opt.flatten != 0, bt.t.geom.batch * bt.count).levels == 1;
}

const PipelineKind kMuonPipeline{muon_piped, muon_family_workspace};

}  // namespace

// ---- The lockstep group step ----
// Without meshes, from the bf16 start, the buckets of a group whose matrices
// take the Gram form at one short side s < 1024 (ns_lockstep_pays: a GPT
// block's qkv, fc1 and fc2 at s = d) run their iterations as one
// (orthogonalize_bf16_classes): each one's momentum pass, then their s x s
// products over all of their matrices at once, then each one's update (and
// NorMuon's normalisation). One bucket's s x s products at gpt-160m's s = 768
// are 12 matrices, 432 tiles of 128 x 128 or 3.3 waves of an H200's 132 SMs;
// the three classes' together 9.8 waves. Their starts and results are alive
// at once, so such a step takes the sum of their workspaces
// (muon_group_workspace reserves it up to twice the batch cap; a step it
// would not fit runs bucket by bucket). Where the buckets' short sides
// differ, those of the most common one run together, the others bucket by
// bucket. DION_NS_LOCKSTEP=0 steps bucket by bucket (read at each step).

namespace {

struct LockLane {
  size_t batch;                // the bucket's index in the step's batches
  MbPlan plan;                 // its megabatch plan (no levels)
  int64_t rows, cols, parts;  // its matrices; its bf16 start's parts
};

// A bucket's lane where its step may join a lockstep (false where it may
// not); the parts are left to the caller.
bool lockstep_lane(const Optimizer& opt, const Group& g, const Batch& bt, size_t i, LockLane* lane) {
  const dion_group_options_t& o = g.opt;
  const Tensor& t = bt.t;
  if (o.matmul_precision != DION_MATMUL_BF16 || opt.backend->host_memory() || t.geom.batch != 1) return false;
  const bool flatten = o.flatten != 0;
  lane->batch = i;
  lane->plan = megabatch_plan(&opt, t, flatten, bt.count);
  if (lane->plan.levels != 0) return false;
  const MbPiece pc = matrix_piece(t, lane->plan, flatten);
  lane->rows = pc.rows();
  lane->cols = pc.cols();
  lane->parts = 0;
  return ns_lockstep_pays(lane->rows, lane->cols);
}

// Keeps in `lanes` those of the most common short side (ties: the first
// seen); false where fewer than two.
bool keep_common_side(std::vector<LockLane>& lanes) {
  auto side = [](const LockLane& l) { return std::min(l.rows, l.cols); };
  int64_t best = 0;
  size_t most = 0;
  for (const LockLane& a : lanes) {
    size_t k = 0;
    for (const LockLane& b : lanes) k += side(b) == side(a) ? 1 : 0;
    if (k > most) {
      most = k;
      best = side(a);
    }
  }
  if (most < 2) return false;
  size_t w = 0;
  for (const LockLane& l : lanes)
    if (side(l) == best) lanes[w++] = l;
  lanes.resize(w);  // shrinks: no allocation
  return true;
}

// The workspace of a lockstep over `lanes` of the batches bs: each bucket's
// start (sums and U in bf16), the iteration's, then the largest of NorMuon's
// tails (its variances and scales, muon_family_workspace's bounds).
size_t lockstep_floats(const Group& g, const Batch* bs, const std::vector<LockLane>& lanes) {
  thread_local std::vector<int64_t> elems;
  elems.clear();
  size_t front = 0, tail = 0;
  int64_t total = 0;
  const bool flatten = g.opt.flatten != 0;
  for (const LockLane& l : lanes) {
    const Batch& bt = bs[l.batch];
    const Tensor& t = bt.t;
    const int64_t T = bt.count;
    front += ws_floats(2 * T * l.parts) + ws_floats((t.numel_local * T + 1) / 2);
    elems.push_back(l.rows * l.cols * T);
    total += T;
    if (g.opt.algorithm == DION_ALGO_NORMUON)
      tail = std::max(tail, variance_floats(t, T, flatten) + neuron_scale_floats(t, T));
  }
  const int64_t s = std::min(lanes[0].rows, lanes[0].cols);
  return front + orthogonalize_classes_ws_floats(s, total, elems.data(), static_cast<int>(lanes.size())) + tail;
}

// dion_add_group's reservation: every bucket's tensors, the bf16 start's
// largest parts (none where DION_NS_LOCKSTEP or DION_NS_GRAM is 0 then; a
// step that finds too little workspace runs bucket by bucket).
size_t lockstep_group_workspace(const Optimizer& opt, const Group& g) {
  if (g.opt.matmul_precision != DION_MATMUL_BF16 || opt.backend->host_memory() || !env_on("DION_NS_LOCKSTEP") ||
      !ns_gram_on())
    return 0;
  const std::vector<Batch> bs = bucket_batches(opt, g);
  std::vector<LockLane> lanes;
  for (size_t i = 0; i < bs.size(); ++i) {
    LockLane l;
    if (!lockstep_lane(opt, g, bs[i], i, &l)) continue;
    l.parts = Backend::select_parts_max(1, bs[i].t.numel_local);
    lanes.push_back(l);
  }
  if (!keep_common_side(lanes)) return 0;
  return group_reservation(opt, lockstep_floats(g, bs.data(), lanes));
}

// The lockstep step of g; false where it does not apply this step (the
// group is then stepped bucket by bucket).
bool muon_lockstep(Optimizer& opt, Group& g, bool normalize) {
  if (!env_on("DION_NS_LOCKSTEP") || !ns_gram_on()) return false;
  const dion_group_options_t& o = g.opt;
  thread_local std::vector<Batch> bs;  // the lists keep their capacity: a steady-state step allocates nothing
  thread_local std::vector<LockLane> lanes;
  thread_local std::vector<MatBatch> xs;
  thread_local std::vector<FrobParts> sums;
  thread_local std::vector<const void*> res;
  thread_local std::vector<char> joined;
  active_batches(opt, g, bs);
  lanes.clear();
  for (size_t i = 0; i < bs.size(); ++i) {
    LockLane l;
    if (!lockstep_lane(opt, g, bs[i], i, &l)) continue;
    l.parts = bf16_start_parts(opt, o, bs[i].t, bs[i].count, l.plan);
    if (l.parts > 0) lanes.push_back(l);
  }
  if (!keep_common_side(lanes) || lockstep_floats(g, bs.data(), lanes) > opt.ws.capacity_floats()) return false;
  joined.assign(bs.size(), 0);
  for (const LockLane& l : lanes) joined[l.batch] = 1;
  for (size_t i = 0; i < bs.size(); ++i)
    if (!joined[i]) {
      opt.ws.reset();
      muon_family_step(opt, g, bs[i], normalize);
    }
  opt.ws.reset();
  xs.clear();
  sums.clear();
  for (const LockLane& l : lanes) {
    const Bf16Start st = bf16_start(opt, o, bs[l.batch], l.parts);
    xs.push_back(MatBatch{st.U, l.rows, l.cols, l.cols, l.rows * l.cols, bs[l.batch].count});
    sums.push_back(st.sums);
  }
  res.assign(lanes.size(), nullptr);
  orthogonalize_bf16_classes(opt, o, xs.data(), sums.data(), static_cast<int>(lanes.size()), res.data());
  const size_t mark = opt.ws.mark();
  for (size_t j = 0; j < lanes.size(); ++j) {
    opt.ws.rewind(mark);
    finish_bf16(opt, g, bs[lanes[j].batch], lanes[j].plan, xs[j], res[j], normalize);
  }
  return true;
}

}  // namespace

size_t muon_group_workspace(const Optimizer& opt, const Group& g) {
  return std::max(pipeline_group_workspace(opt, g, kMuonPipeline), lockstep_group_workspace(opt, g));
}

bool muon_family_step_group(Optimizer& opt, Group& g, bool normalize) {
  const PipelineBuckets* pb = pipeline_begin(opt, g, kMuonPipeline);
  if (!pb) return muon_lockstep(opt, g, normalize);
  const std::vector<Batch>& batches = pb->batches;
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const bool flatten = o.flatten != 0;
  struct Run {
    MbPlan plan;
    float* U = nullptr;
  };
  thread_local std::vector<Run> runs;
  runs.assign(batches.size(), Run{});
  PipelineExchanges ex(opt, batches.size());
  auto start = [&](size_t i, bool piped) {  // A, then S deferred
    const Batch& bt = batches[i];
    if (!piped) {
      muon_family_step(opt, g, bt, normalize);
      return;
    }
    const Tensor& t = bt.t;
    const int64_t n = t.numel_local, T = bt.count, B = t.geom.batch * T;
    Run& u = runs[i];
    u.plan = megabatch_plan(&opt, t, flatten, B);
    u.U = opt.ws.take(n * T);
    be.momentum_multi(bt.list, T, n, static_cast<float>(o.mu), 1.0f, o.nesterov != 0, true, u.U, DION_DTYPE_FP32,
                      opt.skip_flag(), nullptr);
    ex.send(i, u.plan, matrix_piece(t, u.plan, flatten), B, u.U);
  };
  auto middle = [&](size_t i) {  // O, then K deferred
    const MatBatch Um = ex.received(i);
    orthogonalize(opt, o, Um, nullptr);
    if (normalize) normalize_owned(opt, o, batches[i], runs[i].plan, Um);
    ex.send_back(i, runs[i].U);
  };
  auto finish = [&](size_t i) {  // X, once K is done
    ex.wait_back(i);
    update(opt, g, batches[i], runs[i].U, DION_DTYPE_FP32);
  };
  run_pipeline(*pb, start, middle, finish);
  return true;
}

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  add_momentum(opt, g, t);
}
void step(Optimizer& opt, Group& g, const Batch& b) { muon_family_step(opt, g, b, false); }
bool step_group(Optimizer& opt, Group& g) { return muon_family_step_group(opt, g, false); }
}  // namespace

extern const Algorithm kMuon = {"muon", false, init_state, muon_family_workspace, step, step_group,
                                muon_group_workspace};

}  // namespace dion

// SPDX-License-Identifier: MIT
// Communication/computation overlap of the replicate gradient sync (CUDA
// backend, NCCL; see the comment above Optimizer::step in
// src/core/optimizer.cpp). Run under mpiexec with one rank per GPU (rank r
// uses device r % device_count; MPI only carries the ncclUniqueId and
// compares results between ranks); with fewer GPUs than ranks the program
// says "needs one GPU per rank" and exits 0, which ctest reports as skipped.
//
// The layout is DDP: one replicate mesh of all ranks (an NCCL communicator
// made through dion_comm_init_nccl), replicate_grad_sync on, every rank the
// same initial parameters and its own gradients. The model has several
// groups and, within them, several buckets of different shapes and dtypes:
//   muon   3 x (64, 48) fp32, 2 x (32, 96) fp32, 1 x (48, 48) bf16      -> 3 buckets
//   dion   rank_fraction 1.0 (uncompressed: the full gradients are averaged)
//          2 x (40, 40) fp32, 1 x (24, 56) fp32, 1 x (32, 32) bf16       -> 3 buckets
//   dionc  rank_fraction 0.25 (compressed: P and R averaged inside the
//          algorithm, interleaved with the pipeline's gradient averages)
//          2 x (64, 64), (96, 64), (64, 128) fp32, all r = 16            -> 3 buckets
//          No gradient of this group is averaged, so the pipeline steps
//          it as one unit: Dion's phased step, whose reductions of P and
//          gathers run on the comm stream, deferred (src/algo/dion.cpp,
//          SideComm), against the sequential step's on the caller's stream.
//   adamw  (100), (7, 13), (256) bf16, (33), and one without a gradient  -> 1 bucket
//   lion   (64), (5, 9) bf16, (128)                                      -> 1 bucket
// bf16 gradients go through the comm stream's staging buffer, fp32 ones are
// averaged in place.
//
// What is asserted, and why a difference would mean what it says:
//  * OverlappedEqualsSequential: an optimizer created with DION_OVERLAP unset
//    (overlapped steps) and one created with DION_OVERLAP=0 (the sequential
//    step: every gradient averaged on the caller's stream before any bucket
//    computes) take 3 steps with the same gradients. Their parameters and
//    every state must agree BIT FOR BIT: the overlapped step runs the same
//    all-reduce over the same elements for each gradient and the same
//    kernels on the same inputs; only streams and the order of independent
//    tensors differ. A difference means a race (a bucket computing before
//    its gradients were averaged, a comm-stream average reading a gradient
//    before the caller's upload or writing a buffer still in use) or a
//    different reduction. Also: replicas end bit-identical to each other
//    (DDP), and the steps did change the parameters.
//  * NonFiniteGradientOnOneRankSkipsTheStepEverywhere: a NaN in one rank's
//    gradient at step 2 makes EVERY rank skip step 2 (counted, parameters
//    and step counters unchanged), in both modes, and step 3 is applied
//    again; the two modes agree bit for bit at the end.
//  * SwitchIsAgreedAcrossRanks: DION_OVERLAP=0 on one rank only makes every
//    rank sequential (dion_add_group agrees on the mode over the replicate
//    mesh), and the run equals the sequential one.
//  * CapturedOverlappedStepEqualsEagerSteps: an overlapped dion_step captured
//    into a CUDA graph (after one eager warm-up step) and replayed twice
//    equals three eager overlapped steps bit for bit. Capture needs the comm
//    stream to fork from and join back into the captured stream with events
//    only (an unjoined fork makes cudaStreamEndCapture fail).
// Bit equality also needs NCCL to pick the same algorithm and protocol for
// the same message size each time, which it does on one communicator (with
// NVLink SHARP off, as tools/gpu_dist_round.sh and bench/run_mesh.sh set;
// the failure messages give the size of a difference to tell a rounding-
// level NCCL choice from a race).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/optimizer.hpp"
#include "dion.h"
#include "../mpi/rank_printer.hpp"
#include "../hash_uniform.h"
#include "../scoped_env.h"

namespace {

// ---- the world ----

struct World {
  int P = 1, me = 0, ndev = 0, dev = 0;
  bool ready = false, skipped = false;
  std::string why;
  cudaStream_t stream = nullptr;
  dion_comm_t comm = nullptr;  // the replicate mesh: every rank
} g;

// True on every rank iff `ok` holds on every rank: the tests bail out
// together, never leaving a rank alone in a collective.
bool everyone(bool ok) {
  int v = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all != 0;
}

#define CUDA_EXPECT(call)                                                               \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    EXPECT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_);              \
  } while (0)

// ---- data ----

uint16_t to_bf16(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f = 0;
  std::memcpy(&f, &u, 4);
  return f;
}

size_t dtype_bytes(dion_dtype_t dt) { return dt == DION_DTYPE_FP32 ? 4 : 2; }

// Element i of a typed host buffer, as a double (for messages).
double element(const std::vector<uint8_t>& b, dion_dtype_t dt, size_t i) {
  if (dt == DION_DTYPE_FP32) {
    float f = 0;
    std::memcpy(&f, b.data() + 4 * i, 4);
    return f;
  }
  uint16_t h = 0;
  std::memcpy(&h, b.data() + 2 * i, 2);
  return from_bf16(h);  // bf16 (the only 16-bit dtype used here)
}

// Values as a typed host buffer.
std::vector<uint8_t> encode(const std::vector<float>& v, dion_dtype_t dt) {
  std::vector<uint8_t> b(v.size() * dtype_bytes(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == DION_DTYPE_FP32) {
      std::memcpy(b.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = to_bf16(v[i]);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

// ---- the model ----

struct TensorSpec {
  std::string name;
  int64_t m, n;  // n == 0: a vector of m elements
  dion_dtype_t dt;
  bool has_grad;
  int64_t numel() const { return n ? m * n : m; }
};

struct GroupSpec {
  std::string name;
  dion_algorithm_t algo;
  double rank_fraction;
  std::vector<TensorSpec> tensors;
};

std::vector<GroupSpec> model() {
  const dion_dtype_t F = DION_DTYPE_FP32, B = DION_DTYPE_BF16;
  return {
      {"muon", DION_ALGO_MUON, 1.0,
       {{"muon.a0", 64, 48, F, true},
        {"muon.b0", 32, 96, F, true},
        {"muon.a1", 64, 48, F, true},
        {"muon.c0", 48, 48, B, true},
        {"muon.b1", 32, 96, F, true},
        {"muon.a2", 64, 48, F, true}}},
      {"dion", DION_ALGO_DION, 1.0,
       {{"dion.a0", 40, 40, F, true}, {"dion.b0", 24, 56, F, true}, {"dion.a1", 40, 40, F, true},
        {"dion.c0", 32, 32, B, true}}},
      {"dionc", DION_ALGO_DION, 0.25,
       {{"dionc.a0", 64, 64, F, true},
        {"dionc.b0", 96, 64, F, true},
        {"dionc.a1", 64, 64, F, true},
        {"dionc.c0", 64, 128, F, true}}},
      {"adamw", DION_ALGO_ADAMW, 1.0,
       {{"adamw.v0", 100, 0, F, true},
        {"adamw.m0", 7, 13, F, true},
        {"adamw.v1", 256, 0, B, true},
        {"adamw.frozen", 50, 0, F, false},
        {"adamw.v2", 33, 0, F, true}}},
      {"lion", DION_ALGO_LION, 1.0,
       {{"lion.v0", 64, 0, F, true}, {"lion.m0", 5, 9, B, true}, {"lion.v1", 128, 0, F, true}}},
  };
}

// Tensor k's initial parameter (the same on every rank) and rank w's
// gradient at step s (0-based).
float param_value(size_t k, int64_t i) { return 0.05f * hash_uniform(17 + k, static_cast<uint64_t>(i)); }
float grad_value(int w, int s, size_t k, int64_t i) {
  return hash_uniform(1000 + 37 * static_cast<uint64_t>(w) + 7919 * static_cast<uint64_t>(s) + 104729 * k,
                      static_cast<uint64_t>(i));
}

// One optimizer over its own device tensors, built on every rank.
struct OptRun {
  dion_optimizer_t opt = nullptr;
  std::vector<TensorSpec> specs;  // flattened, in tensor index order
  std::vector<void*> param, grad;
  int32_t groups = 0;
  ~OptRun() {
    dion_destroy(opt);
    for (void* p : param) cudaFree(p);
    for (void* p : grad) cudaFree(p);
  }
};

const char* mode_name(bool overlap) { return overlap ? "overlapped (DION_OVERLAP unset)" : "sequential (DION_OVERLAP=0)"; }

// Creates the optimizer (overlapped or sequential) and its groups, uploads
// the initial parameters. Returns false on every rank if it failed on any.
// `env_overlap` is this rank's DION_OVERLAP setting (unset or "0"); the mode
// the optimizer must take is `overlap` (they differ only when another rank
// set DION_OVERLAP=0).
bool build(OptRun& r, bool overlap, bool env_overlap) {
  bool ok = true;
  dion_options_t o;
  dion_options_init(&o);
  o.backend = DION_BACKEND_CUDA;
  o.device = g.dev;
  o.seed = 7;
  o.replicate_comm = g.comm;
  const dion_status_t cs = [&] {  // the optimizer reads DION_OVERLAP at its creation
    ScopedEnv overlap_env("DION_OVERLAP", env_overlap ? nullptr : "0");
    return dion_create(&r.opt, &o);
  }();
  EXPECT_EQ(cs, DION_SUCCESS) << "dion_create: " << dion_last_error(nullptr);
  if (!everyone(cs == DION_SUCCESS)) return false;
  for (const GroupSpec& gs : model()) {
    std::vector<dion_tensor_t> ts;
    for (const TensorSpec& t : gs.tensors) {
      const size_t k = r.specs.size();
      r.specs.push_back(t);
      const size_t bytes = static_cast<size_t>(t.numel()) * dtype_bytes(t.dt);
      void *p = nullptr, *gr = nullptr;
      CUDA_EXPECT(cudaMalloc(&p, bytes));
      if (t.has_grad) CUDA_EXPECT(cudaMalloc(&gr, bytes));
      r.param.push_back(p);
      r.grad.push_back(gr);
      std::vector<float> v(static_cast<size_t>(t.numel()));
      for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = param_value(k, i);
      const std::vector<uint8_t> b = encode(v, t.dt);
      if (p) CUDA_EXPECT(cudaMemcpy(p, b.data(), bytes, cudaMemcpyHostToDevice));
      if (gr) CUDA_EXPECT(cudaMemset(gr, 0, bytes));
      dion_tensor_t d;
      dion_tensor_init(&d);
      d.name = r.specs.back().name.c_str();
      d.param = p;
      d.grad = gr;
      d.param_dtype = t.dt;
      d.grad_dtype = t.dt;
      d.ndim = t.n ? 2 : 1;
      d.shape[0] = t.m;
      d.shape[1] = t.n ? t.n : 1;
      ts.push_back(d);
    }
    if (!everyone(!::testing::Test::HasFailure())) return false;
    dion_group_options_t go;
    dion_group_options_init(&go, gs.algo);
    go.lr = 0.02;
    go.weight_decay = 0.1;
    if (gs.algo == DION_ALGO_DION) go.rank_fraction = gs.rank_fraction;
    const dion_status_t s = dion_add_group(r.opt, &go, ts.data(), ts.size(), nullptr);
    EXPECT_EQ(s, DION_SUCCESS) << "dion_add_group '" << gs.name << "': " << dion_last_error(r.opt);
    ok = ok && s == DION_SUCCESS;
    if (!everyone(ok)) return false;
    ++r.groups;
  }
  // The mode the test relies on is the one the optimizer took (otherwise the
  // comparison could be sequential against sequential).
  const bool took = reinterpret_cast<dion::Optimizer*>(r.opt)->overlap;
  EXPECT_EQ(took, overlap) << "the optimizer created " << mode_name(overlap) << " has Optimizer::overlap = " << took
                           << ": the overlap switch or its conditions (CUDA backend, multi-rank replicate mesh, "
                              "replicate_grad_sync) are not what this test expects";
  return everyone(took == overlap);
}
bool build(OptRun& r, bool overlap) { return build(r, overlap, overlap); }

// Uploads rank g.me's gradients of step s on the test stream; tensor
// `nan_tensor` (if >= 0) gets a NaN at element 3.
void upload_grads(OptRun& r, int s, int nan_tensor = -1) {
  for (size_t k = 0; k < r.specs.size(); ++k) {
    if (!r.grad[k]) continue;
    const TensorSpec& t = r.specs[k];
    std::vector<float> v(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = grad_value(g.me, s, k, i);
    if (static_cast<int>(k) == nan_tensor) v[3] = std::nanf("");
    const std::vector<uint8_t> b = encode(v, t.dt);
    CUDA_EXPECT(cudaMemcpyAsync(r.grad[k], b.data(), b.size(), cudaMemcpyHostToDevice, g.stream));
    CUDA_EXPECT(cudaStreamSynchronize(g.stream));  // b is freed at the end of this iteration
  }
}

// One eager dion_step on the test stream, completed. False on every rank if it failed on any.
bool step(OptRun& r, const char* what) {
  const dion_status_t s = dion_step(r.opt, reinterpret_cast<dion_stream_t>(g.stream));
  EXPECT_EQ(s, DION_SUCCESS) << what << ": dion_step: " << dion_last_error(r.opt);
  const cudaError_t e = cudaStreamSynchronize(g.stream);
  EXPECT_EQ(e, cudaSuccess) << what << ": cudaStreamSynchronize after dion_step: " << cudaGetErrorString(e);
  return everyone(s == DION_SUCCESS && e == cudaSuccess);
}

// Everything the comparison looks at, raw bytes.
struct Snapshot {
  std::vector<std::string> names;     // "param <tensor>" / "state <name> of <tensor>"
  std::vector<dion_dtype_t> dtypes;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<int64_t> steps;         // per group
  int64_t skipped = -1;
  int32_t last_skipped = -1;
  size_t params = 0;                  // the first `params` entries are the parameters
};

Snapshot snapshot(OptRun& r) {
  Snapshot s;
  CUDA_EXPECT(cudaStreamSynchronize(g.stream));
  for (size_t k = 0; k < r.specs.size(); ++k) {
    const TensorSpec& t = r.specs[k];
    std::vector<uint8_t> b(static_cast<size_t>(t.numel()) * dtype_bytes(t.dt));
    CUDA_EXPECT(cudaMemcpy(b.data(), r.param[k], b.size(), cudaMemcpyDeviceToHost));
    s.names.push_back("param of " + t.name);
    s.dtypes.push_back(t.dt);
    s.bytes.push_back(std::move(b));
  }
  s.params = s.bytes.size();
  int32_t n = 0;
  EXPECT_EQ(dion_state_count(r.opt, &n), DION_SUCCESS) << dion_last_error(r.opt);
  for (int32_t i = 0; i < n; ++i) {
    dion_state_info_t info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    EXPECT_EQ(dion_state_info(r.opt, i, &info), DION_SUCCESS) << dion_last_error(r.opt);
    std::vector<uint8_t> b(info.local_bytes);
    EXPECT_EQ(dion_state_read(r.opt, i, b.data(), info.local_bytes, reinterpret_cast<dion_stream_t>(g.stream)),
              DION_SUCCESS)
        << dion_last_error(r.opt);
    s.names.push_back(std::string("state '") + info.name + "' of " + r.specs[static_cast<size_t>(info.tensor)].name);
    s.dtypes.push_back(info.dtype);
    s.bytes.push_back(std::move(b));
  }
  for (int32_t gi = 0; gi < r.groups; ++gi) {
    int64_t st = -1;
    EXPECT_EQ(dion_group_get_step(r.opt, gi, &st), DION_SUCCESS) << dion_last_error(r.opt);
    s.steps.push_back(st);
  }
  EXPECT_EQ(dion_get_skipped_steps(r.opt, &s.skipped, &s.last_skipped, reinterpret_cast<dion_stream_t>(g.stream)),
            DION_SUCCESS)
      << dion_last_error(r.opt);
  return s;
}

// Bit-for-bit comparison of a and b (entries [from, to)); each difference is
// reported with its size.
void expect_same_bits(const Snapshot& a, const Snapshot& b, const std::string& a_name, const std::string& b_name,
                      size_t from = 0, size_t to = SIZE_MAX) {
  ASSERT_EQ(a.bytes.size(), b.bytes.size()) << a_name << " and " << b_name << " have different numbers of buffers";
  to = std::min(to, a.bytes.size());
  for (size_t k = from; k < to; ++k) {
    ASSERT_EQ(a.bytes[k].size(), b.bytes[k].size()) << a.names[k];
    if (a.bytes[k] == b.bytes[k]) continue;
    const size_t es = dtype_bytes(a.dtypes[k]), n = a.bytes[k].size() / es;
    size_t diffs = 0, first = n;
    double worst = 0;
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(a.bytes[k].data() + i * es, b.bytes[k].data() + i * es, es) == 0) continue;
      ++diffs;
      if (first == n) first = i;
      const double x = element(a.bytes[k], a.dtypes[k], i), y = element(b.bytes[k], b.dtypes[k], i);
      const double rel = std::fabs(x - y) / std::max(std::fabs(y), 1e-30);
      if (!(rel <= worst)) worst = rel;  // NaN counts as the worst
    }
    ADD_FAILURE() << a.names[k] << ": " << a_name << " and " << b_name << " differ in " << diffs << " of " << n
                  << " elements; first at " << first << ": " << element(a.bytes[k], a.dtypes[k], first) << " vs "
                  << element(b.bytes[k], b.dtypes[k], first) << "; largest relative difference " << worst
                  << (worst < 1e-5 ? " (rounding level: a different reduction order)"
                                   : " (large: stale or racing data, e.g. a bucket computing before its gradients "
                                     "were averaged)");
  }
}

// Every rank's parameters equal rank 0's (DDP replicas stay identical).
void expect_replicas_agree(const Snapshot& s, const char* what) {
  for (size_t k = 0; k < s.params; ++k) {
    uint64_t h = 1469598103934665603ull;
    for (uint8_t c : s.bytes[k]) h = (h ^ c) * 1099511628211ull;
    std::vector<uint64_t> all(static_cast<size_t>(g.P));
    MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
    for (int w = 1; w < g.P; ++w)
      EXPECT_EQ(all[static_cast<size_t>(w)], all[0])
          << what << ": " << s.names[k] << " on rank " << w << " differs from rank 0's: the replicas diverged (a "
          << "gradient not averaged, or averaged after its bucket used it)";
  }
}

class Overlap : public ::testing::Test {
 protected:
  void SetUp() override {
    if (g.ready) return;
    if (g.skipped) GTEST_SKIP() << g.why;
    FAIL() << g.why;
  }
};

// 3 steps with per-rank gradients; the snapshot after them.
bool three_steps(bool overlap, Snapshot* out, Snapshot* initial = nullptr) {
  OptRun r;
  if (!build(r, overlap)) return false;
  if (initial) *initial = snapshot(r);
  for (int s = 0; s < 3; ++s) {
    upload_grads(r, s);
    if (!step(r, (std::string(mode_name(overlap)) + " step " + std::to_string(s + 1)).c_str())) return false;
  }
  *out = snapshot(r);
  return everyone(!::testing::Test::HasFailure());
}

TEST_F(Overlap, OverlappedEqualsSequential) {
  Snapshot ov, seq, init;
  ASSERT_TRUE(three_steps(true, &ov, &init)) << "the overlapped run failed (see the errors above)";
  ASSERT_TRUE(three_steps(false, &seq)) << "the sequential run failed (see the errors above)";
  expect_same_bits(ov, seq, "the overlapped run", "the sequential run");
  for (size_t gi = 0; gi < ov.steps.size(); ++gi) {
    EXPECT_EQ(ov.steps[gi], 3) << "group " << gi << " step counter (overlapped)";
    EXPECT_EQ(seq.steps[gi], 3) << "group " << gi << " step counter (sequential)";
  }
  EXPECT_EQ(ov.skipped, 0);
  EXPECT_EQ(seq.skipped, 0);
  expect_replicas_agree(ov, "overlapped run");
  expect_replicas_agree(seq, "sequential run");
  // The steps did something (a run that silently skipped every step would compare equal too).
  const std::vector<TensorSpec> specs = [] {
    std::vector<TensorSpec> v;
    for (const GroupSpec& gs : model()) v.insert(v.end(), gs.tensors.begin(), gs.tensors.end());
    return v;
  }();
  for (size_t k = 0; k < ov.params; ++k) {
    if (specs[k].has_grad)
      EXPECT_NE(ov.bytes[k], init.bytes[k]) << ov.names[k] << " was not changed by 3 overlapped steps";
    else
      EXPECT_EQ(ov.bytes[k], init.bytes[k]) << ov.names[k] << " has no gradient but was changed";
  }
}

// Steps 1..3, a NaN on the last rank's gradient of `nan_tensor` at step 2.
bool nan_run(bool overlap, int nan_tensor, Snapshot* out) {
  OptRun r;
  if (!build(r, overlap)) return false;
  const std::string m = mode_name(overlap);
  upload_grads(r, 0);
  if (!step(r, (m + " step 1").c_str())) return false;
  const Snapshot after1 = snapshot(r);
  upload_grads(r, 1, g.me == g.P - 1 ? nan_tensor : -1);
  if (!step(r, (m + " step 2 (NaN on the last rank)").c_str())) return false;
  const Snapshot after2 = snapshot(r);
  EXPECT_EQ(after2.skipped, 1) << m << ": rank " << g.me << " did not count step 2 as skipped (the NaN was on rank "
                               << g.P - 1 << "): the non-finite flag was not reduced over the replicate mesh";
  EXPECT_EQ(after2.last_skipped, 1) << m << ": rank " << g.me << ": step 2 not reported as skipped";
  for (size_t gi = 0; gi < after2.steps.size(); ++gi)
    EXPECT_EQ(after2.steps[gi], 1) << m << ": group " << gi << "'s step counter advanced on a skipped step";
  // Parameters and states unchanged by the skipped step.
  expect_same_bits(after2, after1, m + " after the skipped step 2", "after step 1");
  upload_grads(r, 2);
  if (!step(r, (m + " step 3").c_str())) return false;
  *out = snapshot(r);
  EXPECT_EQ(out->skipped, 1) << m << ": step 3 (clean) was counted as skipped";
  EXPECT_EQ(out->last_skipped, 0) << m << ": step 3 (clean) reported as skipped";
  for (size_t gi = 0; gi < out->steps.size(); ++gi) EXPECT_EQ(out->steps[gi], 2) << m << ": group " << gi;
  size_t changed = 0;
  for (size_t k = 0; k < out->params; ++k) changed += out->bytes[k] != after2.bytes[k];
  EXPECT_GT(changed, 0u) << m << ": step 3 changed no parameter";
  return everyone(!::testing::Test::HasFailure());
}

TEST_F(Overlap, NonFiniteGradientOnOneRankSkipsTheStepEverywhere) {
  // The NaN goes into the last group's bf16 tensor (lion.m0): the flag is
  // reduced at the start of the step, so even the pipeline's last bucket
  // (whose gradient average runs last on the comm stream) is covered.
  const std::vector<GroupSpec> groups = model();
  int nan_tensor = 0;
  for (const GroupSpec& gs : groups)
    for (const TensorSpec& t : gs.tensors) {
      if (t.name == "lion.m0") break;
      ++nan_tensor;
    }
  Snapshot ov, seq;
  ASSERT_TRUE(nan_run(true, nan_tensor, &ov)) << "the overlapped run failed (see the errors above)";
  ASSERT_TRUE(nan_run(false, nan_tensor, &seq)) << "the sequential run failed (see the errors above)";
  expect_same_bits(ov, seq, "the overlapped run", "the sequential run");
  expect_replicas_agree(ov, "overlapped run with a skipped step");
}

TEST_F(Overlap, SwitchIsAgreedAcrossRanks) {
  // DION_OVERLAP=0 on the last rank only: an overlapped rank and a
  // sequential one would issue their NCCL operations in different orders
  // (a hang or garbage), so dion_add_group agrees: sequential everywhere.
  Snapshot mixed, seq;
  {
    OptRun r;
    ASSERT_TRUE(build(r, /*overlap=*/false, /*env_overlap=*/g.me != g.P - 1))
        << "with DION_OVERLAP=0 on rank " << g.P - 1 << " only, every rank must run sequential steps";
    bool ok = true;
    for (int s = 0; s < 3 && ok; ++s) {
      upload_grads(r, s);
      ok = step(r, "mixed DION_OVERLAP");
    }
    ASSERT_TRUE(ok);
    mixed = snapshot(r);
  }
  ASSERT_TRUE(three_steps(false, &seq));
  expect_same_bits(mixed, seq, "the run with DION_OVERLAP=0 on one rank", "the sequential run");
}

TEST_F(Overlap, CapturedOverlappedStepEqualsEagerSteps) {
  Snapshot captured, eager;
  {
    OptRun r;
    ASSERT_TRUE(build(r, true));
    upload_grads(r, 0);
    ASSERT_TRUE(step(r, "eager warm-up step before the capture"));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_EXPECT(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeGlobal));
    const dion_status_t s = dion_step(r.opt, reinterpret_cast<dion_stream_t>(g.stream));
    const cudaError_t end = cudaStreamEndCapture(g.stream, &graph);  // always end the capture
    EXPECT_EQ(s, DION_SUCCESS) << "dion_step under capture: " << dion_last_error(r.opt);
    EXPECT_EQ(end, cudaSuccess) << "cudaStreamEndCapture: " << cudaGetErrorString(end)
                                << " (cudaErrorStreamCaptureUnjoined: the comm stream was not joined back into "
                                   "the captured stream at the end of the step)";
    if (end == cudaSuccess && graph) {
      const cudaError_t ie = cudaGraphInstantiate(&exec, graph, 0);
      EXPECT_EQ(ie, cudaSuccess) << "cudaGraphInstantiate: " << cudaGetErrorString(ie);
    }
    (void)cudaGetLastError();
    if (!everyone(exec != nullptr)) {
      if (graph) cudaGraphDestroy(graph);
      FAIL() << "the overlapped step could not be captured on every rank";
    }
    for (int st = 1; st < 3; ++st) {
      upload_grads(r, st);
      CUDA_EXPECT(cudaGraphLaunch(exec, g.stream));
      const cudaError_t e = cudaStreamSynchronize(g.stream);
      EXPECT_EQ(e, cudaSuccess) << "replay " << st << ": " << cudaGetErrorString(e);
      if (!everyone(e == cudaSuccess)) break;
    }
    captured = snapshot(r);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  ASSERT_TRUE(everyone(!HasFailure()));
  ASSERT_TRUE(three_steps(true, &eager)) << "the eager overlapped run failed (see the errors above)";
  expect_same_bits(captured, eager, "1 eager step + 2 replays of the captured step", "3 eager steps");
  for (size_t gi = 0; gi < captured.steps.size(); ++gi)
    EXPECT_EQ(captured.steps[gi], 3) << "group " << gi << ": the replays did not advance the step counter";
  expect_replicas_agree(captured, "captured run");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  MPI_Comm_size(MPI_COMM_WORLD, &g.P);
  MPI_Comm_rank(MPI_COMM_WORLD, &g.me);
  print_failures_only_unless_rank0(g.me);
  // A hang (a misordered collective) becomes an error naming the timeout
  // well before ctest's 300 s limit kills the run without a message.
  setenv("DION_COMM_TIMEOUT", "120", 0);
  if (cudaGetDeviceCount(&g.ndev) != cudaSuccess) g.ndev = 0;
  (void)cudaGetLastError();
  int fewest = g.ndev;
  MPI_Allreduce(&g.ndev, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (fewest < g.P) {
    if (g.me == 0) std::printf("test_nccl_overlap: needs one GPU per rank (%d ranks, %d GPUs)\n", g.P, fewest);
    MPI_Finalize();
    return 0;
  }
  g.dev = g.me % g.ndev;
  bool ok = cudaSetDevice(g.dev) == cudaSuccess && cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking) == cudaSuccess;
  dion_nccl_unique_id_t id;
  std::memset(&id, 0, sizeof id);
  int st = DION_SUCCESS;
  if (g.me == 0) st = dion_nccl_get_unique_id(&id);
  MPI_Bcast(&st, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Bcast(id.internal, DION_NCCL_UNIQUE_ID_BYTES, MPI_BYTE, 0, MPI_COMM_WORLD);
  if (st == DION_SUCCESS && ok) {
    const dion_status_t s = dion_comm_init_nccl(&g.comm, &id, g.P, g.me, g.dev);
    if (s != DION_SUCCESS) {
      g.why = std::string("dion_comm_init_nccl: ") + dion_last_error(nullptr);
      ok = false;
    }
  } else {
    g.why = st != DION_SUCCESS ? "dion_nccl_get_unique_id failed on rank 0" : "CUDA device or stream setup failed";
    ok = false;
  }
  g.ready = everyone(ok);
  if (!g.ready && g.why.empty()) g.why = "the NCCL setup failed on another rank";
  const int rc = RUN_ALL_TESTS();
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g.comm) dion_comm_destroy(g.comm);
  if (g.stream) cudaStreamDestroy(g.stream);
  MPI_Finalize();
  return worst;
}

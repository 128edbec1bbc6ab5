// SPDX-License-Identifier: MIT
// Reliability, threads (docs/reliability.md): distinct optimizer handles are
// fully independent (include/dion.h, "Threading"). Eight threads each create
// their own optimizer (a different algorithm mix each), step it 50 times,
// read every state buffer and destroy it, while other threads hammer the
// handle-free entry points (dion_last_error(NULL), dion_status_string,
// dion_version). Asserted:
//   - every thread's final parameters and states are bit-identical to a
//     single-threaded run of the same configuration (no shared mutable state:
//     the backend's scratch, the workspace, the random generator);
//   - a failing call's message lands on its own handle and on its own
//     thread's last error, never on another thread's;
//   - the handle-free functions return the same values under contention.
// tools/sanitize.sh tsan runs this suite under ThreadSanitizer with
// OPENBLAS_NUM_THREADS=1 (OpenBLAS's own worker threads are not instrumented).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dion.h"
#include "../hash_uniform.h"

namespace {

constexpr int kThreads = 8;
constexpr int kSteps = 50;

// What one configuration produces: every parameter and every state buffer.
struct Result {
  std::vector<std::vector<unsigned char>> params, states;
  std::string error;  // the first failure, if any
};

struct TensorSpec {
  std::vector<int64_t> shape;
  dion_dtype_t dtype;
};

struct GroupSpec {
  dion_algorithm_t algo;
  dion_qr_method_t qr;
  std::vector<TensorSpec> tensors;
};

// Configuration `c` (0..7): the algorithms in turn, with an AdamW group of
// vectors beside each matrix group, mixed dtypes and shapes.
std::vector<GroupSpec> config(int c) {
  static const dion_algorithm_t algos[kThreads] = {DION_ALGO_DION,     DION_ALGO_DION,  DION_ALGO_MUON,
                                                   DION_ALGO_NORMUON,  DION_ALGO_DION2, DION_ALGO_NORDION2,
                                                   DION_ALGO_ADAMW,    DION_ALGO_LION};
  const dion_dtype_t dt = c % 3 == 2 ? DION_DTYPE_BF16 : DION_DTYPE_FP32;
  GroupSpec g{algos[c], c == 1 ? DION_QR_CQR : DION_QR_RCQR, {}};
  if (g.algo == DION_ALGO_ADAMW || g.algo == DION_ALGO_LION)
    g.tensors = {{{24, 16}, dt}, {{3, 5, 7}, dt}};
  else
    g.tensors = {{{24 + 4 * c, 16}, dt}, {{16, 20}, dt}, {{24 + 4 * c, 16}, dt}};
  GroupSpec v{DION_ALGO_ADAMW, DION_QR_RCQR, {{{33}, DION_DTYPE_FP32}, {{8}, dt}}};
  return {g, v};
}

size_t esize(dion_dtype_t dt) { return dt == DION_DTYPE_FP32 ? 4 : 2; }

void put(std::vector<unsigned char>& b, dion_dtype_t dt, size_t i, float v) {
  if (dt == DION_DTYPE_FP32) {
    std::memcpy(b.data() + 4 * i, &v, 4);
  } else {  // bf16, round to nearest even
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    const uint16_t h = static_cast<uint16_t>(u >> 16);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
}

// Runs configuration `c` start to finish on the calling thread. `group_error`
// is a group index no configuration has: a call naming it must fail with a
// message naming it, on this handle and on this thread only.
Result run_config(int c) {
  Result r;
  auto fail = [&](const std::string& what) {
    if (r.error.empty()) r.error = "config " + std::to_string(c) + ": " + what;
  };
  const std::vector<GroupSpec> groups = config(c);
  std::vector<std::vector<unsigned char>> grads;
  std::vector<dion_dtype_t> dtypes;
  std::vector<size_t> numels;
  for (const GroupSpec& g : groups)
    for (const TensorSpec& t : g.tensors) {
      size_t n = 1;
      for (int64_t d : t.shape) n *= static_cast<size_t>(d);
      r.params.emplace_back(n * esize(t.dtype));
      grads.emplace_back(n * esize(t.dtype));
      dtypes.push_back(t.dtype);
      numels.push_back(n);
      for (size_t i = 0; i < n; ++i) put(r.params.back(), t.dtype, i, 0.5f * hash_uniform(c * 100 + r.params.size(), i));
    }
  dion_options_t o;
  dion_options_init(&o);
  o.seed = 1000 + static_cast<uint64_t>(c);
  dion_optimizer_t opt = nullptr;
  if (dion_create(&opt, &o) != DION_SUCCESS) {
    fail(std::string("dion_create: ") + dion_last_error(nullptr));
    return r;
  }
  size_t ti = 0;
  for (const GroupSpec& g : groups) {
    dion_group_options_t go;
    dion_group_options_init(&go, g.algo);
    go.qr_method = g.qr;
    go.cqr_warmup_steps = 10;  // CQR takes over from RCQR at step 11
    go.rank_fraction = 0.5;
    std::vector<dion_tensor_t> d(g.tensors.size());
    for (size_t k = 0; k < g.tensors.size(); ++k, ++ti) {
      dion_tensor_init(&d[k]);
      d[k].param = r.params[ti].data();
      d[k].grad = grads[ti].data();
      d[k].param_dtype = g.tensors[k].dtype;
      d[k].ndim = static_cast<int32_t>(g.tensors[k].shape.size());
      for (size_t s = 0; s < g.tensors[k].shape.size(); ++s) d[k].shape[s] = g.tensors[k].shape[s];
    }
    if (dion_add_group(opt, &go, d.data(), d.size(), nullptr) != DION_SUCCESS) fail(dion_last_error(opt));
  }
  const int32_t bad_group = 1000 + c;
  const std::string needle = "group = " + std::to_string(bad_group);
  for (int s = 1; s <= kSteps; ++s) {
    for (size_t t = 0; t < grads.size(); ++t)
      for (size_t i = 0; i < numels[t]; ++i)
        put(grads[t], dtypes[t], i, hash_uniform(static_cast<uint64_t>(c) * 7919 + s * 131 + t, i));
    if (s == 20) dion_group_set_hparam(opt, 0, DION_HPARAM_LR, 0.005);  // a schedule, mid-run
    if (dion_step(opt, nullptr) != DION_SUCCESS) fail(std::string("dion_step: ") + dion_last_error(opt));
    // A failing call: its message names this thread's group index, on the
    // handle and on the thread, whatever the other threads are doing.
    if (s % 10 == 0) {
      if (dion_group_set_hparam(opt, bad_group, DION_HPARAM_LR, 0.1) != DION_ERROR_INVALID_USAGE)
        fail("set_hparam on a bad group did not fail with INVALID_USAGE");
      const std::string on_handle = dion_last_error(opt), on_thread = dion_last_error(nullptr);
      if (on_handle.find(needle) == std::string::npos) fail("handle's last error is not ours: " + on_handle);
      if (on_thread.find(needle) == std::string::npos) fail("thread's last error is not ours: " + on_thread);
    }
  }
  int32_t n = 0;
  dion_state_count(opt, &n);
  for (int32_t s = 0; s < n; ++s) {
    dion_state_info_t info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (dion_state_info(opt, s, &info) != DION_SUCCESS) fail(dion_last_error(opt));
    r.states.emplace_back(static_cast<size_t>(info.local_bytes));
    if (dion_state_read(opt, s, r.states.back().data(), info.local_bytes, nullptr) != DION_SUCCESS)
      fail(dion_last_error(opt));
  }
  if (dion_destroy(opt) != DION_SUCCESS) fail("dion_destroy");
  return r;
}

TEST(ReliabilityThreads, EightOptimizersConcurrentlyMatchSingleThreadedRuns) {
  // References first, one configuration at a time on this thread.
  std::vector<Result> ref(kThreads);
  for (int c = 0; c < kThreads; ++c) {
    ref[c] = run_config(c);
    ASSERT_TRUE(ref[c].error.empty()) << ref[c].error;
  }
  const std::string ok = dion_status_string(DION_SUCCESS);
  const std::string inval = dion_status_string(DION_ERROR_INVALID_ARGUMENT);
  const int32_t version = dion_version();

  std::vector<Result> got(kThreads);
  std::atomic<bool> done{false};
  std::atomic<int> chatter_bad{0};
  std::atomic<long> chatter_calls{0};
  // Two threads calling the handle-free entry points throughout.
  std::vector<std::thread> chatter;
  for (int k = 0; k < 2; ++k)
    chatter.emplace_back([&] {
      dion_optimizer_t none = nullptr;
      while (!done.load(std::memory_order_relaxed)) {
        if (dion_status_string(DION_SUCCESS) != ok || dion_status_string(DION_ERROR_INVALID_ARGUMENT) != inval ||
            dion_version() != version || std::strcmp(dion_status_string(-5), "unknown status") != 0)
          chatter_bad.fetch_add(1);
        // A failure of this thread's own: its thread-local message must be the one it just caused.
        if (dion_step(none, nullptr) != DION_ERROR_INVALID_ARGUMENT ||
            std::string(dion_last_error(nullptr)).find("dion_step") == std::string::npos)
          chatter_bad.fetch_add(1);
        chatter_calls.fetch_add(1, std::memory_order_relaxed);
      }
    });
  std::vector<std::thread> workers;
  for (int c = 0; c < kThreads; ++c) workers.emplace_back([&, c] { got[c] = run_config(c); });
  for (std::thread& t : workers) t.join();
  done = true;
  for (std::thread& t : chatter) t.join();

  EXPECT_EQ(chatter_bad.load(), 0) << "handle-free calls misbehaved under contention";
  EXPECT_GT(chatter_calls.load(), 0);
  for (int c = 0; c < kThreads; ++c) {
    SCOPED_TRACE("configuration " + std::to_string(c));
    ASSERT_TRUE(got[c].error.empty()) << got[c].error;
    ASSERT_EQ(got[c].params.size(), ref[c].params.size());
    for (size_t t = 0; t < ref[c].params.size(); ++t)
      EXPECT_TRUE(got[c].params[t] == ref[c].params[t]) << "tensor " << t << ": parameters differ from the "
                                                         << "single-threaded run";
    ASSERT_EQ(got[c].states.size(), ref[c].states.size());
    for (size_t s = 0; s < ref[c].states.size(); ++s)
      EXPECT_TRUE(got[c].states[s] == ref[c].states[s]) << "state " << s << " differs from the single-threaded run";
  }
}

// The same configuration on two threads at once gives the same bits as on
// one: nothing in a step depends on which thread runs it or on a neighbour.
TEST(ReliabilityThreads, SameConfigurationOnManyThreadsIsBitIdentical) {
  const Result ref = run_config(0);
  ASSERT_TRUE(ref.error.empty()) << ref.error;
  std::vector<Result> got(4);
  std::vector<std::thread> ts;
  for (int k = 0; k < 4; ++k) ts.emplace_back([&, k] { got[k] = run_config(0); });
  for (std::thread& t : ts) t.join();
  for (int k = 0; k < 4; ++k) {
    ASSERT_TRUE(got[k].error.empty()) << got[k].error;
    EXPECT_TRUE(got[k].params == ref.params) << "thread " << k;
    EXPECT_TRUE(got[k].states == ref.states) << "thread " << k;
  }
}

}  // namespace

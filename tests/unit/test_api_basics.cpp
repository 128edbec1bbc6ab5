// SPDX-License-Identifier: MIT
// API contract, basics: versions, status strings, struct sizes and
// initializers, NULL-tolerant destructors, empty last error, backend
// availability, accounting queries and handle churn.
#include <thread>

#include "test_api_common.h"

using namespace dion_test;

TEST(ApiVersion, RuntimeMatchesHeader) {
  EXPECT_EQ(dion_version(), DION_VERSION_CODE);
  EXPECT_EQ(dion_version() / 10000, DION_VERSION_MAJOR);
  EXPECT_EQ(DION_VERSION(1, 2, 3), 10203);
  EXPECT_EQ(DION_VERSION_CODE, DION_VERSION_MAJOR * 10000 + DION_VERSION_MINOR * 100 + DION_VERSION_PATCH);
}

TEST(ApiStatus, EveryCodeHasDistinctText) {
  const dion_status_t codes[] = {DION_SUCCESS,          DION_ERROR_INVALID_ARGUMENT, DION_ERROR_INVALID_USAGE,
                                 DION_ERROR_NOT_SUPPORTED, DION_ERROR_OUT_OF_MEMORY, DION_ERROR_CUDA,
                                 DION_ERROR_CUBLAS,      DION_ERROR_CUSOLVER,       DION_ERROR_NCCL,
                                 DION_ERROR_MPI,         DION_ERROR_NUMERICAL,      DION_ERROR_INTERNAL};
  std::set<std::string> seen;
  for (dion_status_t c : codes) {
    const char* s = dion_status_string(c);
    ASSERT_NE(s, nullptr) << "code " << c;
    EXPECT_GT(std::strlen(s), 0u) << "code " << c;
    EXPECT_TRUE(seen.insert(s).second) << "code " << c << " repeats \"" << s << "\"";
    EXPECT_EQ(lower(s).find("unknown status"), std::string::npos) << "code " << c << ": \"" << s << "\"";
  }
  EXPECT_EQ(seen.size(), 12u);
}

TEST(ApiStatus, FixedValues) {
  EXPECT_EQ(DION_SUCCESS, 0);
  EXPECT_EQ(DION_ERROR_INVALID_ARGUMENT, 1);
  EXPECT_EQ(DION_ERROR_INVALID_USAGE, 2);
  EXPECT_EQ(DION_ERROR_NOT_SUPPORTED, 3);
  EXPECT_EQ(DION_ERROR_OUT_OF_MEMORY, 4);
  EXPECT_EQ(DION_ERROR_CUDA, 5);
  EXPECT_EQ(DION_ERROR_CUBLAS, 6);
  EXPECT_EQ(DION_ERROR_CUSOLVER, 7);
  EXPECT_EQ(DION_ERROR_NCCL, 8);
  EXPECT_EQ(DION_ERROR_MPI, 9);
  EXPECT_EQ(DION_ERROR_NUMERICAL, 10);
  EXPECT_EQ(DION_ERROR_INTERNAL, 11);
}

TEST(ApiStatus, UnknownCodesGiveFallback) {
  const dion_status_t unknown[] = {12, 13, 100, -1, -100, 2147483647, -2147483647 - 1};
  const char* known = dion_status_string(DION_ERROR_INTERNAL);
  for (dion_status_t c : unknown) {
    const char* s = dion_status_string(c);
    ASSERT_NE(s, nullptr) << "code " << c;
    EXPECT_STREQ(s, "unknown status") << "code " << c;
    EXPECT_STRNE(s, known);
  }
}

TEST(ApiStatus, TextIsStaticAndThreadSafe) {
  const char* a = dion_status_string(DION_ERROR_INVALID_ARGUMENT);
  const char* b = nullptr;
  std::thread t([&] { b = dion_status_string(DION_ERROR_INVALID_ARGUMENT); });
  t.join();
  ASSERT_NE(b, nullptr);
  EXPECT_STREQ(a, b);
  EXPECT_STREQ(a, dion_status_string(DION_ERROR_INVALID_ARGUMENT));
}

TEST(ApiSizes, SizeofFunctionsMatchHeader) {
  EXPECT_EQ(dion_options_sizeof(), sizeof(dion_options_t));
  EXPECT_EQ(dion_tensor_sizeof(), sizeof(dion_tensor_t));
  EXPECT_EQ(dion_group_options_sizeof(), sizeof(dion_group_options_t));
}

TEST(ApiInit, OptionsDefaults) {
  dion_options_t o;
  std::memset(&o, 0x5A, sizeof o);
  ASSERT_EQ(dion_options_init(&o), DION_SUCCESS);
  EXPECT_EQ(o.struct_size, sizeof(dion_options_t));
  EXPECT_EQ(o.abi_version, static_cast<uint32_t>(DION_ABI_VERSION));
  EXPECT_EQ(o.backend, DION_BACKEND_HOST);
  EXPECT_EQ(o.device, 0);
  EXPECT_EQ(o.replicate_grad_sync, 1);
  EXPECT_EQ(o.skip_nonfinite, 1);
  EXPECT_EQ(o.reserved0, 0);
  EXPECT_EQ(o.seed, 0u);
  EXPECT_EQ(o.replicate_comm, nullptr);
  EXPECT_EQ(o.outer_comm, nullptr);
  EXPECT_EQ(o.inner_comm, nullptr);
}

TEST(ApiInit, TensorDefaults) {
  dion_tensor_t t;
  std::memset(&t, 0x5A, sizeof t);
  ASSERT_EQ(dion_tensor_init(&t), DION_SUCCESS);
  EXPECT_EQ(t.struct_size, sizeof(dion_tensor_t));
  EXPECT_EQ(t.grad_dtype, DION_DTYPE_UNSET);
  EXPECT_EQ(t.layout, DION_LAYOUT_ROW_MAJOR);
  EXPECT_EQ(t.outer_shard_dim, -1);
  EXPECT_EQ(t.inner_shard_dim, -1);
  EXPECT_EQ(t.name, nullptr);
  EXPECT_EQ(t.param, nullptr);
  EXPECT_EQ(t.grad, nullptr);
}

TEST(ApiInit, GroupOptionDefaultsForEveryAlgorithm) {
  for (dion_algorithm_t a : all_algorithms()) {
    SCOPED_TRACE(algo_name(a));
    dion_group_options_t o;
    std::memset(&o, 0x5A, sizeof o);
    ASSERT_EQ(dion_group_options_init(&o, a), DION_SUCCESS) << dion_last_error(nullptr);
    EXPECT_EQ(o.struct_size, sizeof(dion_group_options_t));
    EXPECT_EQ(o.abi_version, static_cast<uint32_t>(DION_ABI_VERSION));
    EXPECT_EQ(o.algorithm, a);
    EXPECT_DOUBLE_EQ(o.lr, 0.01);
    EXPECT_DOUBLE_EQ(o.weight_decay, 0.01);
    EXPECT_DOUBLE_EQ(o.mu, 0.95);
    EXPECT_DOUBLE_EQ(o.beta1, 0.9);
    EXPECT_DOUBLE_EQ(o.beta2, 0.95);
    EXPECT_DOUBLE_EQ(o.epsilon, 1e-8);
    EXPECT_DOUBLE_EQ(o.rank_fraction, 1.0);
    EXPECT_EQ(o.rank_multiple_of, 1);
    EXPECT_EQ(o.power_iters, 1);
    EXPECT_EQ(o.qr_method, DION_QR_RCQR);
    EXPECT_EQ(o.cqr_warmup_steps, 150);
    EXPECT_DOUBLE_EQ(o.oversample, 1.25);
    EXPECT_EQ(o.orthogonalizer, DION_ORTHO_POLAR_EXPRESS);
    EXPECT_EQ(o.ortho_steps, 5);
    EXPECT_EQ(o.nesterov, 0);
    EXPECT_EQ(o.adjust_lr, DION_ADJUST_LR_SPECTRAL_NORM);
    EXPECT_EQ(o.cautious_wd, 0);
    EXPECT_DOUBLE_EQ(o.fraction, 0.25);
    EXPECT_DOUBLE_EQ(o.ef_decay, 0.95);
    EXPECT_EQ(o.selection_scope, DION_SELECTION_LOCAL);
    EXPECT_DOUBLE_EQ(o.muon_beta2, 0.95);
    EXPECT_EQ(o.flatten, 0);
    EXPECT_EQ(o.momentum_dtype, DION_DTYPE_UNSET);
    EXPECT_EQ(o.q_dtype, DION_DTYPE_UNSET);
    EXPECT_EQ(o.variance_dtype, DION_DTYPE_UNSET);
    EXPECT_EQ(o.matmul_precision, DION_MATMUL_FP32);
  }
}

TEST(ApiInit, Dion3IsNorDion2) {
  EXPECT_EQ(DION_ALGO_DION3, DION_ALGO_NORDION2);
  dion_group_options_t o = group_opts(DION_ALGO_DION3);
  EXPECT_EQ(o.algorithm, DION_ALGO_NORDION2);
}

TEST(ApiInit, InitializersRejectNull) {
  EXPECT_TRUE(is_error(dion_options_init(nullptr), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_options_init", "options"}));
  EXPECT_TRUE(is_error(dion_tensor_init(nullptr), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_tensor_init", "tensor"}));
  EXPECT_TRUE(is_error(dion_group_options_init(nullptr, DION_ALGO_MUON), DION_ERROR_INVALID_ARGUMENT,
                       nullptr, {"dion_group_options_init", "options"}));
}

TEST(ApiInit, GroupOptionsInitRejectsUnknownAlgorithm) {
  for (dion_algorithm_t a : {7, -1, 1000}) {
    dion_group_options_t o;
    std::memset(&o, 0, sizeof o);
    EXPECT_TRUE(is_error(dion_group_options_init(&o, a), DION_ERROR_INVALID_ARGUMENT, nullptr,
                         {"dion_group_options_init", "algorithm"}))
        << "algorithm " << a;
  }
}

TEST(ApiLifetime, DestroyNullIsAccepted) {
  EXPECT_EQ(dion_destroy(nullptr), DION_SUCCESS);
  EXPECT_EQ(dion_comm_destroy(nullptr), DION_SUCCESS);
}

TEST(ApiLifetime, CreateWithNullOptionsUsesDefaults) {
  dion_optimizer_t h = nullptr;
  ASSERT_EQ(dion_create(&h, nullptr), DION_SUCCESS) << dion_last_error(nullptr);
  ASSERT_NE(h, nullptr);
  int32_t n = -1;
  EXPECT_EQ(dion_group_count(h, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(dion_tensor_count(h, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(dion_state_count(h, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(dion_destroy(h), DION_SUCCESS);
}

TEST(ApiLifetime, FreshHandleHasEmptyLastError) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  ASSERT_NE(opt.get(), nullptr);
  const char* e = dion_last_error(opt);
  ASSERT_NE(e, nullptr);
  EXPECT_STREQ(e, "");
  // Successful calls leave it empty.
  Model m;
  m.add_tensor("basics.w", DION_DTYPE_FP32, {8, 6});
  m.add_group(group_opts(DION_ALGO_MUON), {0});
  ASSERT_TRUE(build(opt, m));
  step(opt);
  e = dion_last_error(opt);
  ASSERT_NE(e, nullptr);
  EXPECT_STREQ(e, "");
}

TEST(ApiLifetime, EmptyOptimizerSteps) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  EXPECT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(dion_sync_for_checkpoint(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  // An empty group is allowed (count may be 0).
  dion_group_options_t g = group_opts(DION_ALGO_ADAMW);
  int32_t gi = -1;
  EXPECT_EQ(dion_add_group(opt, &g, nullptr, 0, &gi), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(gi, 0);
  EXPECT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  int64_t st = -1;
  EXPECT_EQ(dion_group_get_step(opt, 0, &st), DION_SUCCESS);
}

TEST(ApiBackend, CudaBackendWithoutGpuOrSupport) {
  dion_options_t o = default_options();
  o.backend = DION_BACKEND_CUDA;
  dion_optimizer_t h = reinterpret_cast<dion_optimizer_t>(static_cast<uintptr_t>(0x1));
  dion_status_t s = dion_create(&h, &o);
  if (s == DION_SUCCESS) {
    dion_destroy(h);
    GTEST_SKIP() << "this build has CUDA and a usable GPU: the CUDA backend exists";
  }
  EXPECT_TRUE(is_error_any(s, {DION_ERROR_NOT_SUPPORTED, DION_ERROR_CUDA}, nullptr, {"dion_create"}));
  EXPECT_EQ(h, nullptr) << "*optimizer must be set to NULL on failure";
}

TEST(ApiAccounting, MemoryUsageEqualsSumOfStateBytes) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  uint64_t sb = 1, wb = 1;
  ASSERT_EQ(dion_get_memory_usage(opt, &sb, &wb), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(sb, 0u) << "no groups, no state";
  Model m;
  m.add_tensor("mem.dion", DION_DTYPE_FP32, {12, 8});
  m.add_tensor("mem.muon", DION_DTYPE_BF16, {6, 10});
  m.add_tensor("mem.adamw", DION_DTYPE_FP32, {10});
  m.add_tensor("mem.normuon", DION_DTYPE_FP32, {5, 7});
  m.add_tensor("mem.lion", DION_DTYPE_BF16, {2, 3, 4});
  dion_group_options_t gd = group_opts(DION_ALGO_DION);
  gd.rank_fraction = 0.5;
  m.add_group(gd, {0});
  m.add_group(group_opts(DION_ALGO_MUON), {1});
  dion_group_options_t ga = group_opts(DION_ALGO_ADAMW);
  ga.variance_dtype = DION_DTYPE_BF16;
  m.add_group(ga, {2});
  m.add_group(group_opts(DION_ALGO_NORMUON), {3});
  m.add_group(group_opts(DION_ALGO_LION), {4});
  ASSERT_TRUE(build(opt, m));
  step(opt);
  uint64_t sum = 0;
  for (const StateEntry& e : read_states(opt)) sum += e.info.local_bytes;
  ASSERT_EQ(dion_get_memory_usage(opt, &sb, &wb), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(sb, sum);
  EXPECT_GT(sum, 0u);
}

TEST(ApiAccounting, NoCommunicationOnOneProcess) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  Model m;
  m.add_tensor("comm.w", DION_DTYPE_FP32, {8, 8});
  m.add_tensor("comm.b", DION_DTYPE_FP32, {8});
  m.add_group(group_opts(DION_ALGO_DION), {0});
  m.add_group(group_opts(DION_ALGO_ADAMW), {1});
  ASSERT_TRUE(build(opt, m));
  step(opt);
  step(opt);
  for (dion_mesh_t mesh : {DION_MESH_REPLICATE, DION_MESH_OUTER, DION_MESH_INNER}) {
    uint64_t last = 7, total = 7;
    ASSERT_EQ(dion_get_comm_bytes(opt, mesh, &last, &total), DION_SUCCESS) << dion_last_error(opt);
    EXPECT_EQ(last, 0u) << "mesh " << mesh;
    EXPECT_EQ(total, 0u) << "mesh " << mesh;
  }
  dion_status_t async = DION_ERROR_INTERNAL;
  ASSERT_EQ(dion_get_async_error(opt, &async), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(async, DION_SUCCESS);
  EXPECT_EQ(dion_sync_for_checkpoint(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
}

TEST(ApiAccounting, SkippedStepsStartAtZero) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  int64_t skipped = -1;
  int32_t last = -1;
  ASSERT_EQ(dion_get_skipped_steps(opt, &skipped, &last, nullptr), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(skipped, 0);
  EXPECT_EQ(last, 0);
}

TEST(ApiLifetime, ManyHandlesInALoop) {
  Model m;
  m.add_tensor("loop.w", DION_DTYPE_FP32, {8, 8});
  m.add_tensor("loop.v", DION_DTYPE_BF16, {4, 6});
  m.add_tensor("loop.b", DION_DTYPE_FP32, {8});
  const dion_algorithm_t algos[] = {DION_ALGO_DION, DION_ALGO_MUON, DION_ALGO_DION2, DION_ALGO_NORMUON,
                                    DION_ALGO_NORDION2};
  for (int i = 0; i < 200; ++i) {
    dion_options_t o = default_options();
    o.seed = static_cast<uint64_t>(i);
    dion_optimizer_t h = nullptr;
    ASSERT_EQ(dion_create(&h, &o), DION_SUCCESS) << "iteration " << i << ": " << dion_last_error(nullptr);
    dion_group_options_t g = group_opts(algos[i % 5]);
    ASSERT_EQ(add_group(h, g, {&m.tensors[0], &m.tensors[1]}), DION_SUCCESS) << i << ": " << dion_last_error(h);
    dion_group_options_t s = group_opts(i % 2 ? DION_ALGO_ADAMW : DION_ALGO_LION);
    ASSERT_EQ(add_group(h, s, {&m.tensors[2]}), DION_SUCCESS) << i << ": " << dion_last_error(h);
    ASSERT_EQ(dion_step(h, nullptr), DION_SUCCESS) << i << ": " << dion_last_error(h);
    ASSERT_EQ(dion_destroy(h), DION_SUCCESS) << i;
  }
  for (const Tensor& t : m.tensors)
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_TRUE(std::isfinite(load(t.param, t.dtype, i))) << t.name;
}

TEST(ApiLifetime, ManyHandlesAliveAtOnce) {
  std::vector<dion_optimizer_t> hs;
  Model m;
  m.add_tensor("alive.w", DION_DTYPE_FP32, {6, 4});
  for (int i = 0; i < 64; ++i) {
    dion_options_t o = default_options();
    dion_optimizer_t h = nullptr;
    ASSERT_EQ(dion_create(&h, &o), DION_SUCCESS);
    hs.push_back(h);
  }
  for (size_t i = 0; i < hs.size(); ++i) {
    ASSERT_EQ(add_group(hs[i], group_opts(DION_ALGO_MUON), {&m.tensors[0]}), DION_SUCCESS) << dion_last_error(hs[i]);
  }
  // Destroy in an interleaved order.
  for (size_t i = 0; i < hs.size(); i += 2) EXPECT_EQ(dion_destroy(hs[i]), DION_SUCCESS);
  for (size_t i = 1; i < hs.size(); i += 2) {
    EXPECT_EQ(dion_step(hs[i], nullptr), DION_SUCCESS) << dion_last_error(hs[i]);
    EXPECT_EQ(dion_destroy(hs[i]), DION_SUCCESS);
  }
}

// Distinct handles are independent: two threads stepping two handles on
// identical inputs get the results of one thread doing it alone; and the
// thread-local last error of dion_create does not leak across threads.
TEST(ApiThreading, DistinctHandlesAreIndependent) {
  auto make_model = [] {
    Model m;
    m.add_tensor("thr.w", DION_DTYPE_FP32, {16, 12}, 3);
    m.add_tensor("thr.b", DION_DTYPE_FP32, {12}, 3);
    m.add_group(group_opts(DION_ALGO_DION), {0});
    m.add_group(group_opts(DION_ALGO_ADAMW), {1});
    return m;
  };
  auto run = [](Model& m) {
    dion_options_t o = default_options();
    o.seed = 42;
    Optimizer opt(&o);
    if (!build(opt, m)) return;
    for (int s = 0; s < 3; ++s) {
      m.new_grads(9, s);
      step(opt);
    }
  };
  Model ref = make_model(), a = make_model(), b = make_model();
  run(ref);
  std::thread ta([&] { run(a); }), tb([&] { run(b); });
  ta.join();
  tb.join();
  for (size_t i = 0; i < ref.tensors.size(); ++i) {
    EXPECT_TRUE(same_bits(ref.tensors[i].param, a.tensors[i].param));
    EXPECT_TRUE(same_bits(ref.tensors[i].param, b.tensors[i].param));
  }

  dion_options_t bad = default_options();
  bad.backend = 77;
  dion_optimizer_t h = nullptr;
  ASSERT_NE(dion_create(&h, &bad), DION_SUCCESS);
  std::string mine = dion_last_error(nullptr);
  EXPECT_FALSE(mine.empty());
  std::string theirs = "unset";
  std::thread tc([&] {
    const char* e = dion_last_error(nullptr);
    theirs = e ? e : "(null)";
  });
  tc.join();
  EXPECT_EQ(theirs, "") << "the last error of dion_create is per thread";
}

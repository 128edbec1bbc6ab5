// SPDX-License-Identifier: MIT
// API contract, optimizer state: the names, shapes, dtypes and sizes of every
// algorithm's state buffers, their initial values, read/write round trips,
// and checkpoint resume (DESIGN.md §7 invariant 5): save state -> new
// optimizer -> load state -> continue equals never stopping, bit for bit.
#include <map>

#include "test_api_common.h"

using namespace dion_test;

namespace {

std::set<std::string> expected_names(dion_algorithm_t a) {
  switch (a) {
    case DION_ALGO_DION: return {"momentum", "Q"};
    case DION_ALGO_DION2:
    case DION_ALGO_MUON:
    case DION_ALGO_LION: return {"momentum"};
    case DION_ALGO_NORMUON:
    case DION_ALGO_NORDION2: return {"momentum", "variance_neuron"};
    case DION_ALGO_ADAMW: return {"momentum", "variance"};
    default: return {};
  }
}

// r = min(m, n, q*ceil(rank_fraction*min(m,n)/q)) in double, as the spec says.
int64_t dion_rank(int64_t m, int64_t n, double rank_fraction, int32_t q) {
  const int64_t k = std::min(m, n);
  const int64_t r = static_cast<int64_t>(q * std::ceil(rank_fraction * static_cast<double>(k) / q));
  return std::min(k, r);
}

const char* dtype_str(dion_dtype_t d) { return d == DION_DTYPE_FP32 ? "FP32" : d == DION_DTYPE_BF16 ? "BF16" : "FP16"; }

uint64_t prod(const int64_t* s, int n) {
  uint64_t p = 1;
  for (int i = 0; i < n; ++i) p *= static_cast<uint64_t>(s[i]);
  return p;
}

bool all_zero(const std::vector<unsigned char>& v) {
  return std::all_of(v.begin(), v.end(), [](unsigned char c) { return c == 0; });
}

struct AlgoDtype {
  dion_algorithm_t algo;
  dion_dtype_t dtype;
};
void PrintTo(const AlgoDtype& p, std::ostream* os) { *os << algo_name(p.algo) << "/" << dtype_str(p.dtype); }
std::string algo_dtype_name(const ::testing::TestParamInfo<AlgoDtype>& i) {
  return std::string(algo_name(i.param.algo)) + "_" + dtype_str(i.param.dtype);
}
std::vector<AlgoDtype> all_algo_dtypes() {
  std::vector<AlgoDtype> v;
  for (dion_algorithm_t a : all_algorithms())
    for (dion_dtype_t d : {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP16}) v.push_back({a, d});
  return v;
}

// ------------------------------------------------------------ enumeration --

class ApiStateEnum : public ::testing::TestWithParam<AlgoDtype> {};

TEST_P(ApiStateEnum, NamesShapesDtypesAndInitialValues) {
  const dion_algorithm_t a = GetParam().algo;
  const dion_dtype_t dt = GetParam().dtype;
  dion_options_t o = default_options();
  Optimizer opt(&o);
  Model m;
  m.add_tensor("enum.tall", dt, {12, 8});
  m.add_tensor("enum.wide", dt, {6, 10});
  dion_group_options_t g = group_opts(a);
  g.rank_fraction = 0.5;
  m.add_group(g, {0, 1});
  ASSERT_TRUE(build(opt, m));

  int32_t count = -1;
  ASSERT_EQ(dion_state_count(opt, &count), DION_SUCCESS);
  EXPECT_EQ(count, static_cast<int32_t>(2 * expected_names(a).size()));
  std::map<int32_t, std::set<std::string>> names;
  for (int32_t i = 0; i < count; ++i) {
    dion_state_info_t info = state_info(opt, i);
    ASSERT_NE(info.name, nullptr);
    const std::string name = info.name;
    SCOPED_TRACE("state " + std::to_string(i) + " (" + name + " of tensor " + std::to_string(info.tensor) + ")");
    ASSERT_TRUE(info.tensor == 0 || info.tensor == 1);
    EXPECT_TRUE(names[info.tensor].insert(name).second) << "duplicate state name";
    EXPECT_EQ(info.group, 0);
    EXPECT_EQ(info.layout, DION_LAYOUT_ROW_MAJOR);
    EXPECT_EQ(info.dtype, dt) << "state dtypes default to the parameter dtype";
    const Tensor& t = m.tensors[static_cast<size_t>(info.tensor)];
    const int64_t rows = t.shape[0], cols = t.shape[1];
    std::vector<int64_t> want;
    if (name == "momentum" || name == "variance") {
      want = {rows, cols};
    } else if (name == "Q") {
      want = {std::min(rows, cols), dion_rank(rows, cols, 0.5, 1)};
    } else if (name == "variance_neuron") {
      want = {rows, 1};
    } else {
      ADD_FAILURE() << "unexpected state name";
      continue;
    }
    ASSERT_EQ(info.ndim, static_cast<int32_t>(want.size()));
    for (int d = 0; d < info.ndim; ++d) {
      EXPECT_EQ(info.global_shape[d], want[static_cast<size_t>(d)]) << "dim " << d;
      EXPECT_EQ(info.local_shape[d], info.global_shape[d]) << "dim " << d << ": one process holds everything";
      EXPECT_EQ(info.local_offset[d], 0) << "dim " << d;
    }
    EXPECT_EQ(info.local_bytes, prod(info.local_shape, info.ndim) * elem_size(info.dtype));

    int32_t found = -1;
    ASSERT_EQ(dion_state_find(opt, info.tensor, info.name, &found), DION_SUCCESS) << dion_last_error(opt);
    EXPECT_EQ(found, i);

    std::vector<unsigned char> data(static_cast<size_t>(info.local_bytes), 0xCD);
    ASSERT_EQ(dion_state_read(opt, i, data.data(), data.size(), nullptr), DION_SUCCESS) << dion_last_error(opt);
    if (name == "Q") {
      EXPECT_FALSE(all_zero(data)) << "Dion's Q starts from the seeded generator";
      for (uint64_t k = 0; k < prod(info.local_shape, info.ndim); ++k)
        ASSERT_TRUE(std::isfinite(load(data, info.dtype, static_cast<int64_t>(k))));
    } else {
      EXPECT_TRUE(all_zero(data)) << "states start at zero";
    }
  }
  for (int32_t t = 0; t < 2; ++t) EXPECT_EQ(names[t], expected_names(a)) << "tensor " << t;

  // The name pointers live as long as the optimizer.
  dion_state_info_t first = state_info(opt, 0);
  const std::string first_name = first.name;
  m.new_grads(1, 0);
  step(opt);
  EXPECT_EQ(std::string(first.name), first_name);
}

INSTANTIATE_TEST_SUITE_P(All, ApiStateEnum, ::testing::ValuesIn(all_algo_dtypes()), algo_dtype_name);

TEST(ApiState, ExplicitStateDtypes) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  Model m;
  m.add_tensor("dt.dion", DION_DTYPE_BF16, {8, 6});
  m.add_tensor("dt.muon", DION_DTYPE_BF16, {8, 6});
  m.add_tensor("dt.adamw", DION_DTYPE_FP32, {7});
  m.add_tensor("dt.lion", DION_DTYPE_FP32, {7});
  dion_group_options_t gd = group_opts(DION_ALGO_DION);
  gd.momentum_dtype = DION_DTYPE_FP32;
  gd.q_dtype = DION_DTYPE_FP32;
  dion_group_options_t gm = group_opts(DION_ALGO_MUON);
  gm.momentum_dtype = DION_DTYPE_FP32;
  dion_group_options_t ga = group_opts(DION_ALGO_ADAMW);
  ga.momentum_dtype = DION_DTYPE_BF16;
  ga.variance_dtype = DION_DTYPE_BF16;
  dion_group_options_t gl = group_opts(DION_ALGO_LION);
  gl.momentum_dtype = DION_DTYPE_BF16;
  m.add_group(gd, {0});
  m.add_group(gm, {1});
  m.add_group(ga, {2});
  m.add_group(gl, {3});
  ASSERT_TRUE(build(opt, m));
  struct Want {
    int32_t tensor;
    const char* name;
    dion_dtype_t dtype;
  };
  const Want wants[] = {{0, "momentum", DION_DTYPE_FP32}, {0, "Q", DION_DTYPE_FP32},
                        {1, "momentum", DION_DTYPE_FP32}, {2, "momentum", DION_DTYPE_BF16},
                        {2, "variance", DION_DTYPE_BF16}, {3, "momentum", DION_DTYPE_BF16}};
  uint64_t total = 0;
  for (const Want& w : wants) {
    dion_state_info_t info = state_info(opt, find_state(opt, w.tensor, w.name));
    EXPECT_EQ(info.dtype, w.dtype) << w.tensor << "/" << w.name;
    EXPECT_EQ(info.group, w.tensor);
    EXPECT_EQ(info.local_bytes, prod(info.local_shape, info.ndim) * elem_size(w.dtype)) << w.tensor << "/" << w.name;
    total += info.local_bytes;
  }
  uint64_t sb = 0, wb = 0;
  ASSERT_EQ(dion_get_memory_usage(opt, &sb, &wb), DION_SUCCESS);
  EXPECT_EQ(sb, total);
  // The mixed-precision configuration steps.
  for (int s = 0; s < 2; ++s) {
    m.new_grads(4, s);
    step(opt);
  }
}

// r = min(m, n, q*ceil(rank_fraction*min(m,n)/q)), in IEEE double: 0.07*100 is
// 7.000000000000001, so r = 8 (spec §2.2).
TEST(ApiState, DionRankFormula) {
  struct Case {
    int64_t m, n;
    double rf;
    int32_t q;
    int64_t r;
  };
  const Case cases[] = {{12, 8, 1.0, 1, 8}, {12, 8, 0.5, 1, 4},  {6, 10, 0.5, 1, 3},   {12, 8, 0.3, 3, 3},
                        {12, 8, 0.01, 1, 1}, {12, 8, 0.9, 4, 8}, {100, 100, 0.07, 1, 8}, {40, 64, 0.25, 16, 16}};
  for (const Case& c : cases) {
    ASSERT_EQ(dion_rank(c.m, c.n, c.rf, c.q), c.r) << "test's own formula";
    dion_options_t o = default_options();
    Optimizer opt(&o);
    Model m;
    m.add_tensor("rank.w", DION_DTYPE_FP32, {c.m, c.n});
    dion_group_options_t g = group_opts(DION_ALGO_DION);
    g.rank_fraction = c.rf;
    g.rank_multiple_of = c.q;
    m.add_group(g, {0});
    ASSERT_TRUE(build(opt, m));
    dion_state_info_t q = state_info(opt, find_state(opt, 0, "Q"));
    ASSERT_EQ(q.ndim, 2);
    EXPECT_EQ(q.global_shape[0], std::min(c.m, c.n)) << c.m << "x" << c.n;
    EXPECT_EQ(q.global_shape[1], c.r) << c.m << "x" << c.n << " rank_fraction " << c.rf << " q " << c.q;
  }
}

// Megabatch-family tensors of ndim 3 are batches of matrices; AdamW takes a
// scalar (ndim 0).
TEST(ApiState, BatchedAndScalarTensors) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  Model m;
  m.add_tensor("nd.muon3", DION_DTYPE_FP32, {3, 6, 4});
  m.add_tensor("nd.normuon3", DION_DTYPE_FP32, {2, 5, 7});
  m.add_tensor("nd.scalar", DION_DTYPE_FP32, {});
  m.add_tensor("nd.lion4", DION_DTYPE_FP32, {2, 1, 3, 2});
  m.add_tensor("nd.dion2_4d", DION_DTYPE_FP32, {2, 2, 4, 3});
  m.add_group(group_opts(DION_ALGO_MUON), {0});
  m.add_group(group_opts(DION_ALGO_NORMUON), {1});
  m.add_group(group_opts(DION_ALGO_ADAMW), {2});
  m.add_group(group_opts(DION_ALGO_LION), {3});
  m.add_group(group_opts(DION_ALGO_DION2), {4});
  ASSERT_TRUE(build(opt, m));
  dion_state_info_t vn = state_info(opt, find_state(opt, 1, "variance_neuron"));
  ASSERT_EQ(vn.ndim, 3);
  EXPECT_EQ(vn.global_shape[0], 2);
  EXPECT_EQ(vn.global_shape[1], 5);
  EXPECT_EQ(vn.global_shape[2], 1);
  dion_state_info_t sc = state_info(opt, find_state(opt, 2, "momentum"));
  EXPECT_EQ(sc.ndim, 0);
  EXPECT_EQ(sc.local_bytes, 4u);
  const auto before = m.params();
  m.new_grads(5, 0);
  step(opt);
  for (size_t i = 0; i < m.tensors.size(); ++i)
    EXPECT_FALSE(same_bits(before[i], m.tensors[i].param)) << m.tensors[i].name << " did not move";
}

TEST(ApiState, WriteThenReadRoundTrip) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  Model m;
  m.add_tensor("rw.dion", DION_DTYPE_FP32, {8, 6});
  m.add_tensor("rw.adamw", DION_DTYPE_BF16, {9});
  m.add_tensor("rw.normuon", DION_DTYPE_BF16, {4, 6});
  m.add_group(group_opts(DION_ALGO_DION), {0});
  m.add_group(group_opts(DION_ALGO_ADAMW), {1});
  m.add_group(group_opts(DION_ALGO_NORMUON), {2});
  ASSERT_TRUE(build(opt, m));
  std::vector<StateEntry> before = read_states(opt);
  const auto params = m.params();
  for (size_t i = 0; i < before.size(); ++i) {
    const StateEntry& e = before[i];
    std::vector<unsigned char> payload(e.data.size());
    const int64_t n = static_cast<int64_t>(e.data.size() / elem_size(e.info.dtype));
    for (int64_t k = 0; k < n; ++k)
      store(payload, e.info.dtype, k, 0.25f + 0.5f * std::fabs(hash_uniform(900 + i, static_cast<uint64_t>(k))));
    // A larger source is accepted; only local_bytes are read.
    std::vector<unsigned char> big = payload;
    big.resize(payload.size() + 64, 0xFF);
    ASSERT_EQ(dion_state_write(opt, static_cast<int32_t>(i), big.data(), big.size(), nullptr), DION_SUCCESS)
        << dion_last_error(opt);
    std::vector<unsigned char> back(payload.size(), 0);
    ASSERT_EQ(dion_state_read(opt, static_cast<int32_t>(i), back.data(), back.size(), nullptr), DION_SUCCESS);
    EXPECT_TRUE(same_bits(back, payload)) << e.name << " of tensor " << e.info.tensor;
  }
  // Writing states does not touch parameters.
  for (size_t i = 0; i < m.tensors.size(); ++i) EXPECT_TRUE(same_bits(params[i], m.tensors[i].param));
  std::vector<StateEntry> after = read_states(opt);
  ASSERT_EQ(after.size(), before.size());
}

// ------------------------------------------------------------- checkpoint --

Model checkpoint_model(dion_algorithm_t a, dion_dtype_t dt) {
  Model m;
  if (is_matrix_algo(a)) {
    m.add_tensor("ckpt.tall", dt, {12, 8}, 31);
    m.add_tensor("ckpt.wide", dt, {6, 10}, 32);
    m.add_tensor("ckpt.square", dt, {7, 7}, 33);
  } else {
    m.add_tensor("ckpt.matrix", dt, {12, 8}, 31);
    m.add_tensor("ckpt.vector", dt, {10}, 32);
    m.add_tensor("ckpt.cube", dt, {2, 3, 4}, 33);
  }
  dion_group_options_t g = group_opts(a);
  g.rank_fraction = 0.5;  // Dion: low rank, RCQR sketches
  g.weight_decay = 0.1;
  m.add_group(g, {0, 1});
  dion_group_options_t g2 = group_opts(a);
  g2.lr = 0.02;
  g2.nesterov = 1;
  m.add_group(g2, {2});
  return m;
}

dion_options_t checkpoint_options() {
  dion_options_t o = default_options();
  o.seed = 1234;
  return o;
}

// Restores A's state into B. Which parts: momentum, other states, steps.
void restore(dion_optimizer_t b, const std::vector<StateEntry>& states, const std::vector<int64_t>& steps,
             bool momentum, bool others, bool step_counts) {
  for (const StateEntry& e : states) {
    const bool is_momentum = e.name == "momentum";
    if ((is_momentum && !momentum) || (!is_momentum && !others)) continue;
    int32_t idx = find_state(b, e.info.tensor, e.name.c_str());
    dion_state_info_t info = state_info(b, idx);
    EXPECT_EQ(info.local_bytes, e.info.local_bytes);
    EXPECT_EQ(info.dtype, e.info.dtype);
    ASSERT_EQ(dion_state_write(b, idx, e.data.data(), e.data.size(), nullptr), DION_SUCCESS) << dion_last_error(b);
  }
  if (step_counts) {
    for (size_t g = 0; g < steps.size(); ++g)
      ASSERT_EQ(dion_group_set_step(b, static_cast<int32_t>(g), steps[g]), DION_SUCCESS) << dion_last_error(b);
  }
}

std::vector<int64_t> group_steps(dion_optimizer_t opt) {
  int32_t n = 0;
  EXPECT_EQ(dion_group_count(opt, &n), DION_SUCCESS);
  std::vector<int64_t> v;
  for (int32_t g = 0; g < n; ++g) {
    int64_t s = -1;
    EXPECT_EQ(dion_group_get_step(opt, g, &s), DION_SUCCESS);
    v.push_back(s);
  }
  return v;
}

bool params_equal(const Model& a, const Model& b) {
  for (size_t i = 0; i < a.tensors.size(); ++i)
    if (!same_bits(a.tensors[i].param, b.tensors[i].param)) return false;
  return true;
}

constexpr uint64_t kGradSeed = 77;

void run_steps(dion_optimizer_t opt, Model& m, int from, int to) {
  for (int s = from; s < to; ++s) {
    m.new_grads(kGradSeed, s);
    step(opt);
  }
}

void checkpoint_round_trip(Model (*make)(dion_algorithm_t, dion_dtype_t), dion_algorithm_t a, dion_dtype_t dt,
                           bool expect_step_matters) {
  const dion_options_t o = checkpoint_options();
  Model ma = make(a, dt);
  Optimizer A(&o);
  ASSERT_TRUE(build(A, ma));
  run_steps(A, ma, 0, 3);
  const std::vector<StateEntry> saved = read_states(A);
  const std::vector<int64_t> steps = group_steps(A);
  for (int64_t s : steps) EXPECT_EQ(s, 3);

  // B: everything restored. C: momentum not restored. D: steps not restored.
  Model mb = ma.clone(), mc = ma.clone(), md = ma.clone();
  Optimizer B(&o), C(&o), D(&o);
  ASSERT_TRUE(build(B, mb));
  ASSERT_TRUE(build(C, mc));
  ASSERT_TRUE(build(D, md));
  restore(B, saved, steps, true, true, true);
  restore(C, saved, steps, false, true, true);
  restore(D, saved, steps, true, true, false);
  expect_same_states(saved, read_states(B), "B right after restore");
  EXPECT_EQ(group_steps(B), steps);

  run_steps(A, ma, 3, 6);
  run_steps(B, mb, 3, 6);
  run_steps(C, mc, 3, 6);
  run_steps(D, md, 3, 6);

  for (size_t i = 0; i < ma.tensors.size(); ++i)
    EXPECT_TRUE(same_bits(ma.tensors[i].param, mb.tensors[i].param)) << "param of " << ma.tensors[i].name;
  expect_same_states(read_states(A), read_states(B), "A vs resumed B");
  EXPECT_EQ(group_steps(A), group_steps(B));
  for (int64_t s : group_steps(A)) EXPECT_EQ(s, 6);

  // The comparison can fail: dropping the momentum (or, where the algorithm
  // uses it, the step count) changes the result.
  EXPECT_FALSE(params_equal(ma, mc)) << "not restoring the momentum made no difference";
  if (expect_step_matters) {
    EXPECT_FALSE(params_equal(ma, md)) << "not restoring the step made no difference";
  }
}

class ApiCheckpoint : public ::testing::TestWithParam<AlgoDtype> {};

TEST_P(ApiCheckpoint, ResumeEqualsNeverStopping) {
  checkpoint_round_trip(checkpoint_model, GetParam().algo, GetParam().dtype, GetParam().algo == DION_ALGO_ADAMW);
}

INSTANTIATE_TEST_SUITE_P(All, ApiCheckpoint, ::testing::ValuesIn(all_algo_dtypes()), algo_dtype_name);

// Every algorithm in one optimizer (tensor numbers run across groups), with
// mixed-precision states.
Model mixed_model(dion_algorithm_t, dion_dtype_t dt) {
  Model m;
  int t = 0;
  for (dion_algorithm_t a : all_algorithms()) {
    const std::string base = std::string("mixed.") + algo_name(a);
    m.add_tensor(base + ".w", dt, {10, 6}, 50 + t);
    m.add_tensor(base + ".v", dt, is_matrix_algo(a) ? std::vector<int64_t>{5, 9} : std::vector<int64_t>{11}, 60 + t);
    dion_group_options_t g = group_opts(a);
    if (a == DION_ALGO_DION) g.rank_fraction = 0.5;
    if (a == DION_ALGO_ADAMW) g.variance_dtype = DION_DTYPE_FP32;
    if (a == DION_ALGO_MUON) g.momentum_dtype = DION_DTYPE_FP32;
    m.add_group(g, {t, t + 1});
    t += 2;
  }
  return m;
}

// Option variants that change the step sequence (QR methods, the CQR warm-up
// crossing inside the run, Newton-Schulz, Nesterov, cautious weight decay,
// other lr adjustments, fractions, state dtypes).
struct Variant {
  const char* id;
  dion_algorithm_t algo;
  void (*tweak)(dion_group_options_t&);
};
void PrintTo(const Variant& v, std::ostream* os) { *os << v.id; }
const Variant kVariants[] = {
    {"Dion_QR", DION_ALGO_DION, [](dion_group_options_t& g) { g.qr_method = DION_QR_QR; }},
    {"Dion_CQR_warmup2", DION_ALGO_DION,
     [](dion_group_options_t& g) {
       g.qr_method = DION_QR_CQR;
       g.cqr_warmup_steps = 2;
     }},
    {"Dion_rank_multiple_of_4", DION_ALGO_DION,
     [](dion_group_options_t& g) {
       g.rank_fraction = 0.3;
       g.rank_multiple_of = 4;
     }},
    {"Dion_oversample_2_fp32Q", DION_ALGO_DION,
     [](dion_group_options_t& g) {
       g.oversample = 2.0;
       g.q_dtype = DION_DTYPE_FP32;
       g.momentum_dtype = DION_DTYPE_FP32;
     }},
    {"Muon_NewtonSchulz_nesterov_cautious", DION_ALGO_MUON,
     [](dion_group_options_t& g) {
       g.orthogonalizer = DION_ORTHO_NEWTON_SCHULZ;
       g.nesterov = 1;
       g.cautious_wd = 1;
     }},
    {"Muon_rms_ortho7", DION_ALGO_MUON,
     [](dion_group_options_t& g) {
       g.adjust_lr = DION_ADJUST_LR_RMS_NORM;
       g.ortho_steps = 7;
     }},
    {"NorMuon_no_adjust_nesterov", DION_ALGO_NORMUON,
     [](dion_group_options_t& g) {
       g.adjust_lr = DION_ADJUST_LR_NONE;
       g.nesterov = 1;
     }},
    {"Dion2_fraction_1", DION_ALGO_DION2, [](dion_group_options_t& g) { g.fraction = 1.0; }},
    {"Dion2_fraction_0_6_NS", DION_ALGO_DION2,
     [](dion_group_options_t& g) {
       g.fraction = 0.6;
       g.orthogonalizer = DION_ORTHO_NEWTON_SCHULZ;
     }},
    {"NorDion2_fraction_0_5", DION_ALGO_NORDION2, [](dion_group_options_t& g) { g.fraction = 0.5; }},
    {"AdamW_fp32_states_cautious", DION_ALGO_ADAMW,
     [](dion_group_options_t& g) {
       g.momentum_dtype = DION_DTYPE_FP32;
       g.variance_dtype = DION_DTYPE_FP32;
       g.cautious_wd = 1;
     }},
    {"Lion_cautious_bf16_momentum", DION_ALGO_LION,
     [](dion_group_options_t& g) {
       g.cautious_wd = 1;
       g.momentum_dtype = DION_DTYPE_BF16;
     }},
};

const Variant* g_variant = nullptr;
Model variant_model(dion_algorithm_t a, dion_dtype_t dt) {
  Model m = checkpoint_model(a, dt);
  for (Model::Group& g : m.groups) g_variant->tweak(g.opts);
  return m;
}

class ApiCheckpointVariant : public ::testing::TestWithParam<Variant> {};

TEST_P(ApiCheckpointVariant, ResumeEqualsNeverStopping) {
  g_variant = &GetParam();
  for (dion_dtype_t dt : {DION_DTYPE_FP32, DION_DTYPE_BF16}) {
    SCOPED_TRACE(dtype_str(dt));
    checkpoint_round_trip(variant_model, GetParam().algo, dt, GetParam().algo == DION_ALGO_ADAMW);
  }
}

INSTANTIATE_TEST_SUITE_P(All, ApiCheckpointVariant, ::testing::ValuesIn(kVariants),
                         [](const ::testing::TestParamInfo<Variant>& i) { return std::string(i.param.id); });

TEST(ApiCheckpointMixed, AllAlgorithmsFP32) { checkpoint_round_trip(mixed_model, DION_ALGO_DION, DION_DTYPE_FP32, true); }
TEST(ApiCheckpointMixed, AllAlgorithmsBF16) { checkpoint_round_trip(mixed_model, DION_ALGO_DION, DION_DTYPE_BF16, true); }
TEST(ApiCheckpointMixed, AllAlgorithmsFP16) { checkpoint_round_trip(mixed_model, DION_ALGO_DION, DION_DTYPE_FP16, true); }

// dion_sync_for_checkpoint is a no-op on one process: it changes nothing.
TEST(ApiCheckpointMixed, SyncForCheckpointIsANoOpAlone) {
  const dion_options_t o = checkpoint_options();
  Model m = mixed_model(DION_ALGO_DION, DION_DTYPE_FP32);
  Optimizer A(&o);
  ASSERT_TRUE(build(A, m));
  run_steps(A, m, 0, 2);
  Snapshot before = snapshot(A, m);
  ASSERT_EQ(dion_sync_for_checkpoint(A, nullptr), DION_SUCCESS) << dion_last_error(A);
  expect_unchanged(before, snapshot(A, m), "sync_for_checkpoint");
}

}  // namespace

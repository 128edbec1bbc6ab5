// SPDX-License-Identifier: MIT
// API contract, groups at run time: hyperparameter get/set (a new value takes
// effect at the next step), step counters, and re-binding of parameter and
// gradient buffers.
#include "test_api_common.h"

using namespace dion_test;

namespace {

const dion_hparam_t kAllHparams[] = {DION_HPARAM_LR,      DION_HPARAM_WEIGHT_DECAY, DION_HPARAM_MU,
                                     DION_HPARAM_BETA1,   DION_HPARAM_BETA2,        DION_HPARAM_EPSILON,
                                     DION_HPARAM_EF_DECAY, DION_HPARAM_MUON_BETA2};

double field(const dion_group_options_t& o, dion_hparam_t h) {
  switch (h) {
    case DION_HPARAM_LR: return o.lr;
    case DION_HPARAM_WEIGHT_DECAY: return o.weight_decay;
    case DION_HPARAM_MU: return o.mu;
    case DION_HPARAM_BETA1: return o.beta1;
    case DION_HPARAM_BETA2: return o.beta2;
    case DION_HPARAM_EPSILON: return o.epsilon;
    case DION_HPARAM_EF_DECAY: return o.ef_decay;
    case DION_HPARAM_MUON_BETA2: return o.muon_beta2;
    default: return std::nan("");
  }
}

Model model_for(dion_algorithm_t a, dion_dtype_t dt = DION_DTYPE_FP32, const char* prefix = "hp") {
  Model m;
  const std::string p = prefix;
  m.add_tensor(p + ".tall", dt, {12, 8}, 41);
  m.add_tensor(p + ".wide", dt, {6, 10}, 42);
  if (!is_matrix_algo(a)) m.add_tensor(p + ".vec", dt, {9}, 43);
  dion_group_options_t g = group_opts(a);
  g.rank_fraction = 0.5;
  std::vector<int> all;
  for (size_t i = 0; i < m.tensors.size(); ++i) all.push_back(static_cast<int>(i));
  m.add_group(g, all);
  return m;
}

dion_options_t seeded() {
  dion_options_t o = default_options();
  o.seed = 99;
  return o;
}

bool params_equal(const Model& a, const Model& b) {
  for (size_t i = 0; i < a.tensors.size(); ++i)
    if (!same_bits(a.tensors[i].param, b.tensors[i].param)) return false;
  return true;
}

class ApiHparams : public ::testing::TestWithParam<dion_algorithm_t> {};

std::string algo_param_name(const ::testing::TestParamInfo<dion_algorithm_t>& i) { return algo_name(i.param); }

TEST_P(ApiHparams, GetReturnsTheConfiguredValues) {
  const dion_algorithm_t a = GetParam();
  dion_options_t o = seeded();
  Optimizer opt(&o);
  Model m = model_for(a);
  dion_group_options_t& g = m.groups[0].opts;
  g.lr = 0.0123;
  g.weight_decay = 0.0456;
  g.mu = 0.789;
  g.beta1 = 0.81;
  g.beta2 = 0.97;
  g.epsilon = 3e-7;
  g.ef_decay = 0.91;
  g.muon_beta2 = 0.93;
  ASSERT_TRUE(build(opt, m));
  for (dion_hparam_t h : kAllHparams) {
    double v = -1;
    ASSERT_EQ(dion_group_get_hparam(opt, 0, h, &v), DION_SUCCESS) << "hparam " << h << ": " << dion_last_error(opt);
    EXPECT_EQ(v, field(g, h)) << "hparam " << h;
  }
}

TEST_P(ApiHparams, SetGetRoundTrip) {
  const dion_algorithm_t a = GetParam();
  dion_options_t o = seeded();
  Optimizer opt(&o);
  Model m = model_for(a);
  dion_group_options_t other = group_opts(DION_ALGO_ADAMW);
  m.add_tensor("hp.other", DION_DTYPE_FP32, {5});
  m.add_group(other, {static_cast<int>(m.tensors.size()) - 1});
  ASSERT_TRUE(build(opt, m));
  const double values[] = {0.0321, 0.0654, 0.876, 0.85, 0.975, 1e-6, 0.9, 0.92};
  for (size_t k = 0; k < 8; ++k) {
    const dion_hparam_t h = kAllHparams[k];
    ASSERT_EQ(dion_group_set_hparam(opt, 0, h, values[k]), DION_SUCCESS) << "hparam " << h << ": "
                                                                        << dion_last_error(opt);
    double v = -1;
    ASSERT_EQ(dion_group_get_hparam(opt, 0, h, &v), DION_SUCCESS);
    EXPECT_EQ(v, values[k]) << "hparam " << h;
    // The other group is untouched.
    ASSERT_EQ(dion_group_get_hparam(opt, 1, h, &v), DION_SUCCESS);
    EXPECT_EQ(v, field(other, h)) << "hparam " << h << " of group 1";
  }
  // Zero is a valid learning rate and weight decay.
  EXPECT_EQ(dion_group_set_hparam(opt, 0, DION_HPARAM_LR, 0.0), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(dion_group_set_hparam(opt, 0, DION_HPARAM_WEIGHT_DECAY, 0.0), DION_SUCCESS) << dion_last_error(opt);
  m.new_grads(3, 0);
  step(opt);
}

// Two identical optimizers are bit-identical until one gets a new lr; from
// the next step on they differ.
TEST_P(ApiHparams, NewLrTakesEffectAtNextStep) {
  const dion_algorithm_t a = GetParam();
  dion_options_t o = seeded();
  Model ma = model_for(a), mb = model_for(a);
  Optimizer A(&o), B(&o);
  ASSERT_TRUE(build(A, ma));
  ASSERT_TRUE(build(B, mb));
  for (int s = 0; s < 2; ++s) {
    ma.new_grads(8, s);
    mb.new_grads(8, s);
    step(A);
    step(B);
  }
  ASSERT_TRUE(params_equal(ma, mb)) << "identical optimizers diverged";
  // Setting the value it already has changes nothing; the new one does.
  ASSERT_EQ(dion_group_set_hparam(A, 0, DION_HPARAM_LR, 0.01), DION_SUCCESS) << dion_last_error(A);
  ASSERT_EQ(dion_group_set_hparam(B, 0, DION_HPARAM_LR, 0.03), DION_SUCCESS) << dion_last_error(B);
  EXPECT_TRUE(params_equal(ma, mb)) << "set_hparam itself changed a parameter";
  expect_same_states(read_states(A), read_states(B), "after set_hparam, before the step");
  ma.new_grads(8, 2);
  mb.new_grads(8, 2);
  step(A);
  step(B);
  for (size_t i = 0; i < ma.tensors.size(); ++i)
    EXPECT_FALSE(same_bits(ma.tensors[i].param, mb.tensors[i].param)) << ma.tensors[i].name << " ignored the new lr";
}

// With lr = 0, (1 - lr*wd) = 1 and the update is scaled by 0: the parameters
// keep their bits while the states still advance.
TEST_P(ApiHparams, ZeroLrFreezesParams) {
  const dion_algorithm_t a = GetParam();
  dion_options_t o = seeded();
  Optimizer opt(&o);
  Model m = model_for(a);
  m.groups[0].opts.lr = 0.0;
  ASSERT_TRUE(build(opt, m));
  const auto p0 = m.params();
  const auto s0 = read_states(opt);
  m.new_grads(6, 0);
  step(opt);
  for (size_t i = 0; i < m.tensors.size(); ++i) EXPECT_TRUE(same_bits(p0[i], m.tensors[i].param)) << m.tensors[i].name;
  const auto s1 = read_states(opt);
  bool moved = false;
  for (size_t i = 0; i < s0.size(); ++i) moved = moved || !same_bits(s0[i].data, s1[i].data);
  EXPECT_TRUE(moved) << "no state changed";
}

TEST_P(ApiHparams, StepCounter) {
  const dion_algorithm_t a = GetParam();
  dion_options_t o = seeded();
  Optimizer opt(&o);
  Model m = model_for(a);
  m.add_tensor("hp.second", DION_DTYPE_FP32, {4});
  m.add_group(group_opts(DION_ALGO_LION), {static_cast<int>(m.tensors.size()) - 1});
  ASSERT_TRUE(build(opt, m));
  int64_t s0 = -1, s1 = -1;
  ASSERT_EQ(dion_group_get_step(opt, 0, &s0), DION_SUCCESS);
  EXPECT_EQ(s0, 0);
  for (int k = 1; k <= 3; ++k) {
    m.new_grads(2, k);
    step(opt);
    ASSERT_EQ(dion_group_get_step(opt, 0, &s0), DION_SUCCESS);
    ASSERT_EQ(dion_group_get_step(opt, 1, &s1), DION_SUCCESS);
    EXPECT_EQ(s0, k);
    EXPECT_EQ(s1, k);
  }
  ASSERT_EQ(dion_group_set_step(opt, 0, 100), DION_SUCCESS) << dion_last_error(opt);
  ASSERT_EQ(dion_group_get_step(opt, 0, &s0), DION_SUCCESS);
  ASSERT_EQ(dion_group_get_step(opt, 1, &s1), DION_SUCCESS);
  EXPECT_EQ(s0, 100);
  EXPECT_EQ(s1, 3) << "set_step touched another group";
  step(opt);
  ASSERT_EQ(dion_group_get_step(opt, 0, &s0), DION_SUCCESS);
  EXPECT_EQ(s0, 101);
  ASSERT_EQ(dion_group_set_step(opt, 1, 0), DION_SUCCESS) << dion_last_error(opt);
  ASSERT_EQ(dion_group_get_step(opt, 1, &s1), DION_SUCCESS);
  EXPECT_EQ(s1, 0);
}

INSTANTIATE_TEST_SUITE_P(All, ApiHparams, ::testing::ValuesIn(all_algorithms()), algo_param_name);

TEST(ApiHparamsEffect, WeightDecayAndBetasTakeEffect) {
  struct Case {
    dion_algorithm_t a;
    dion_hparam_t h;
    double v;
  };
  const Case cases[] = {{DION_ALGO_ADAMW, DION_HPARAM_WEIGHT_DECAY, 0.5}, {DION_ALGO_ADAMW, DION_HPARAM_BETA1, 0.5},
                        {DION_ALGO_ADAMW, DION_HPARAM_BETA2, 0.5},        {DION_ALGO_LION, DION_HPARAM_BETA1, 0.3},
                        {DION_ALGO_MUON, DION_HPARAM_MU, 0.5},            {DION_ALGO_DION, DION_HPARAM_MU, 0.5},
                        {DION_ALGO_DION2, DION_HPARAM_EF_DECAY, 0.5},     {DION_ALGO_NORMUON, DION_HPARAM_MUON_BETA2, 0.5},
                        {DION_ALGO_MUON, DION_HPARAM_WEIGHT_DECAY, 0.7}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(algo_name(c.a)) + " hparam " + std::to_string(c.h));
    dion_options_t o = seeded();
    Model ma = model_for(c.a), mb = model_for(c.a);
    Optimizer A(&o), B(&o);
    ASSERT_TRUE(build(A, ma));
    ASSERT_TRUE(build(B, mb));
    ma.new_grads(12, 0);
    mb.new_grads(12, 0);
    step(A);
    step(B);
    ASSERT_EQ(dion_group_set_hparam(B, 0, c.h, c.v), DION_SUCCESS) << dion_last_error(B);
    for (int s = 1; s < 3; ++s) {
      ma.new_grads(12, s);
      mb.new_grads(12, s);
      step(A);
      step(B);
    }
    EXPECT_FALSE(params_equal(ma, mb)) << "the new value had no effect";
  }
}

// -------------------------------------------------------------- rebinding --

// A: tensor 0's gradient is rebound to a second buffer after add_group.
// B: built with that second buffer from the start. C: never rebound.
TEST(ApiRebind, GradToNewBufferIsUsed) {
  for (dion_algorithm_t a : all_algorithms()) {
    SCOPED_TRACE(algo_name(a));
    dion_options_t o = seeded();
    Model ma = model_for(a, DION_DTYPE_FP32, "rb"), mb = ma.clone(), mc = ma.clone();
    Optimizer A(&o), B(&o), C(&o);
    ASSERT_TRUE(build(A, ma));
    ASSERT_TRUE(build(C, mc));
    std::vector<unsigned char> g2 = ma.tensors[0].grad;
    for (size_t k = 0; k < g2.size() / 4; ++k) store(g2, DION_DTYPE_FP32, static_cast<int64_t>(k), 0.3f * hash_uniform(5, k));
    mb.tensors[0].grad = g2;
    ASSERT_TRUE(build(B, mb));
    ASSERT_EQ(dion_tensor_rebind(A, 0, ma.tensors[0].param.data(), g2.data()), DION_SUCCESS) << dion_last_error(A);
    step(A);
    step(B);
    step(C);
    EXPECT_TRUE(same_bits(ma.tensors[0].param, mb.tensors[0].param)) << "the rebound gradient was not used";
    EXPECT_FALSE(same_bits(ma.tensors[0].param, mc.tensors[0].param)) << "the old gradient was used";
    expect_same_states(read_states(A), read_states(B), "A vs B");
  }
}

// A parameter rebound to a new buffer is updated there; the old one is left.
TEST(ApiRebind, ParamToNewBuffer) {
  for (dion_algorithm_t a : all_algorithms()) {
    SCOPED_TRACE(algo_name(a));
    dion_options_t o = seeded();
    Model ma = model_for(a, DION_DTYPE_BF16, "rp"), mb = ma.clone();
    Optimizer A(&o), B(&o);
    ASSERT_TRUE(build(A, ma));
    ASSERT_TRUE(build(B, mb));
    const std::vector<unsigned char> old = ma.tensors[1].param;
    std::vector<unsigned char> p2 = ma.tensors[1].param;  // same values, new address
    ASSERT_EQ(dion_tensor_rebind(A, 1, p2.data(), ma.tensors[1].grad.data()), DION_SUCCESS) << dion_last_error(A);
    step(A);
    step(B);
    EXPECT_TRUE(same_bits(ma.tensors[1].param, old)) << "the old parameter buffer was written";
    EXPECT_TRUE(same_bits(p2, mb.tensors[1].param)) << "the new buffer did not get the update";
    EXPECT_TRUE(same_bits(ma.tensors[0].param, mb.tensors[0].param));
  }
}

// grad = NULL skips the tensor: its parameter and states keep their bits
// while the other tensors of the same and other groups move. Rebinding a
// gradient again resumes it.
TEST(ApiRebind, NullGradSkipsTheTensor) {
  for (dion_algorithm_t a : all_algorithms()) {
    SCOPED_TRACE(algo_name(a));
    dion_options_t o = seeded();
    Model m = model_for(a, DION_DTYPE_FP32, "skip");
    m.add_tensor("skip.othergroup", DION_DTYPE_FP32, {7});
    m.add_group(group_opts(DION_ALGO_ADAMW), {static_cast<int>(m.tensors.size()) - 1});
    Optimizer opt(&o);
    ASSERT_TRUE(build(opt, m));
    m.new_grads(1, 0);
    step(opt);  // non-zero state first
    ASSERT_EQ(dion_tensor_rebind(opt, 0, m.tensors[0].param.data(), nullptr), DION_SUCCESS) << dion_last_error(opt);
    const auto p0 = m.params();
    const auto s0 = read_states(opt);
    for (int s = 1; s < 3; ++s) {
      m.new_grads(1, s);
      step(opt);
    }
    EXPECT_TRUE(same_bits(p0[0], m.tensors[0].param)) << "the skipped parameter moved";
    for (size_t i = 1; i < m.tensors.size(); ++i)
      EXPECT_FALSE(same_bits(p0[i], m.tensors[i].param)) << m.tensors[i].name << " did not move";
    const auto s1 = read_states(opt);
    ASSERT_EQ(s0.size(), s1.size());
    for (size_t i = 0; i < s0.size(); ++i) {
      if (s0[i].info.tensor == 0) {
        EXPECT_TRUE(same_bits(s0[i].data, s1[i].data)) << "state " << s0[i].name << " of the skipped tensor changed";
      } else if (s0[i].name == "momentum") {
        EXPECT_FALSE(same_bits(s0[i].data, s1[i].data)) << "momentum of tensor " << s0[i].info.tensor << " did not change";
      }
    }
    // Bind a gradient again: the tensor moves.
    ASSERT_EQ(dion_tensor_rebind(opt, 0, m.tensors[0].param.data(), m.tensors[0].grad.data()), DION_SUCCESS);
    m.new_grads(1, 3);
    step(opt);
    EXPECT_FALSE(same_bits(p0[0], m.tensors[0].param)) << "re-bound tensor did not resume";
  }
}

// A tensor added with grad = NULL is skipped from the start.
TEST(ApiRebind, AddedWithoutGradient) {
  dion_options_t o = seeded();
  Model m = model_for(DION_ALGO_MUON, DION_DTYPE_FP32, "nograd");
  Optimizer opt(&o);
  std::vector<dion_tensor_t> d = {m.tensors[0].desc(), m.tensors[1].desc()};
  d[1].grad = nullptr;
  dion_group_options_t g = group_opts(DION_ALGO_MUON);
  ASSERT_EQ(dion_add_group(opt, &g, d.data(), d.size(), nullptr), DION_SUCCESS) << dion_last_error(opt);
  const auto p0 = m.params();
  step(opt);
  EXPECT_FALSE(same_bits(p0[0], m.tensors[0].param));
  EXPECT_TRUE(same_bits(p0[1], m.tensors[1].param));
}

}  // namespace

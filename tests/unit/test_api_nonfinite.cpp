// SPDX-License-Identifier: MIT
// API contract, the non-finite guard: with skip_nonfinite = 1 (the default) a
// step whose gradients hold NaN or Inf anywhere changes no parameter, no state
// and no step counter, and is counted by dion_get_skipped_steps; the next clean
// step proceeds as if the bad one never happened. With skip_nonfinite = 0 the
// step proceeds.
#include "test_api_common.h"

using namespace dion_test;

namespace {

Model guard_model(dion_dtype_t dt) {
  Model m;
  m.add_tensor("nf.dion", dt, {12, 8}, 71);
  m.add_tensor("nf.muon", dt, {6, 10}, 72);
  m.add_tensor("nf.adamw", dt, {9}, 73);
  m.add_tensor("nf.lion", dt, {2, 3, 4}, 74);
  m.add_tensor("nf.nordion2", dt, {8, 8}, 75);
  m.add_tensor("nf.normuon", dt, {5, 7}, 76);
  m.add_tensor("nf.dion2", dt, {7, 5}, 77);
  dion_group_options_t gd = group_opts(DION_ALGO_DION);
  gd.rank_fraction = 0.5;
  m.add_group(gd, {0});
  m.add_group(group_opts(DION_ALGO_MUON), {1});
  m.add_group(group_opts(DION_ALGO_ADAMW), {2});
  m.add_group(group_opts(DION_ALGO_LION), {3});
  m.add_group(group_opts(DION_ALGO_NORDION2), {4});
  m.add_group(group_opts(DION_ALGO_NORMUON), {5});
  m.add_group(group_opts(DION_ALGO_DION2), {6});
  return m;
}

struct GuardCase {
  int tensor;  // which gradient gets the bad value
  int kind;    // 0 NaN, 1 +Inf, 2 -Inf
  dion_dtype_t dtype;
};
void PrintTo(const GuardCase& c, std::ostream* os) {
  static const char* kinds[] = {"NaN", "+Inf", "-Inf"};
  *os << "tensor " << c.tensor << " " << kinds[c.kind] << " dtype " << c.dtype;
}

float bad_value(int kind) {
  switch (kind) {
    case 0: return std::numeric_limits<float>::quiet_NaN();
    case 1: return std::numeric_limits<float>::infinity();
    default: return -std::numeric_limits<float>::infinity();
  }
}

std::string guard_name(const ::testing::TestParamInfo<GuardCase>& i) {
  static const char* kinds[] = {"NaN", "PosInf", "NegInf"};
  return std::string("tensor") + std::to_string(i.param.tensor) + "_" + kinds[i.param.kind] +
         (i.param.dtype == DION_DTYPE_FP32 ? "_FP32" : i.param.dtype == DION_DTYPE_BF16 ? "_BF16" : "_FP16");
}

std::vector<GuardCase> guard_cases() {
  std::vector<GuardCase> v;
  for (dion_dtype_t dt : {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP16})
    for (int t = 0; t < 7; ++t)
      for (int k = 0; k < 3; ++k) v.push_back({t, k, dt});
  return v;
}

void skipped(dion_optimizer_t opt, int64_t* n, int32_t* last) {
  ASSERT_EQ(dion_get_skipped_steps(opt, n, last, nullptr), DION_SUCCESS) << dion_last_error(opt);
}

class ApiNonFinite : public ::testing::TestWithParam<GuardCase> {};

TEST_P(ApiNonFinite, BadStepChangesNothingAndIsCounted) {
  const GuardCase c = GetParam();
  dion_options_t o = default_options();
  o.seed = 3;
  ASSERT_EQ(o.skip_nonfinite, 1) << "skip_nonfinite defaults to 1";
  Model m = guard_model(c.dtype), ref = m.clone();
  Optimizer opt(&o), refopt(&o);
  ASSERT_TRUE(build(opt, m));
  ASSERT_TRUE(build(refopt, ref));
  for (int s = 0; s < 2; ++s) {
    m.new_grads(19, s);
    ref.new_grads(19, s);
    step(opt);
    step(refopt);
  }
  const Snapshot before = snapshot(opt, m);

  // The bad step.
  m.new_grads(19, 2);
  Tensor& t = m.tensors[static_cast<size_t>(c.tensor)];
  store(t.grad, t.dtype, std::min<int64_t>(5, t.numel() - 1), bad_value(c.kind));
  ASSERT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  expect_unchanged(before, snapshot(opt, m), "after the skipped step");
  int64_t n = -1;
  int32_t last = -1;
  skipped(opt, &n, &last);
  EXPECT_EQ(n, 1);
  EXPECT_EQ(last, 1);
  dion_status_t async = -1;
  ASSERT_EQ(dion_get_async_error(opt, &async), DION_SUCCESS);
  EXPECT_EQ(async, DION_SUCCESS) << "a skipped step is not an error";

  // The next clean step proceeds, and equals the run that never saw the bad step.
  m.new_grads(19, 2);
  ref.new_grads(19, 2);
  step(opt);
  step(refopt);
  skipped(opt, &n, &last);
  EXPECT_EQ(n, 1);
  EXPECT_EQ(last, 0);
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    EXPECT_FALSE(same_bits(before.params[i], m.tensors[i].param)) << m.tensors[i].name << " did not move";
    EXPECT_TRUE(same_bits(ref.tensors[i].param, m.tensors[i].param)) << m.tensors[i].name << " differs from the "
                                                                        "run without the bad step";
  }
  expect_same_states(read_states(refopt), read_states(opt), "vs the run without the bad step");
  for (size_t g = 0; g < before.steps.size(); ++g) {
    int64_t st = -1;
    ASSERT_EQ(dion_group_get_step(opt, static_cast<int32_t>(g), &st), DION_SUCCESS);
    EXPECT_EQ(st, before.steps[g] + 1) << "group " << g;
  }
}

INSTANTIATE_TEST_SUITE_P(All, ApiNonFinite, ::testing::ValuesIn(guard_cases()), guard_name);

TEST(ApiNonFiniteCount, ConsecutiveSkipsAccumulate) {
  dion_options_t o = default_options();
  Model m = guard_model(DION_DTYPE_FP32);
  Optimizer opt(&o);
  ASSERT_TRUE(build(opt, m));
  const Snapshot before = snapshot(opt, m);
  for (int k = 0; k < 3; ++k) {
    m.new_grads(23, k);
    store(m.tensors[static_cast<size_t>(k)].grad, DION_DTYPE_FP32, 0, bad_value(k));
    ASSERT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  }
  expect_unchanged(before, snapshot(opt, m), "three skipped steps");
  int64_t n = -1;
  int32_t last = -1;
  skipped(opt, &n, &last);
  EXPECT_EQ(n, 3);
  EXPECT_EQ(last, 1);
  // The grads that are clean everywhere else still are not applied; a NaN in a
  // tensor whose gradient is unbound (NULL) is not looked at.
  m.new_grads(23, 9);
  store(m.tensors[2].grad, DION_DTYPE_FP32, 0, bad_value(0));
  ASSERT_EQ(dion_tensor_rebind(opt, 2, m.tensors[2].param.data(), nullptr), DION_SUCCESS) << dion_last_error(opt);
  step(opt);
  skipped(opt, &n, &last);
  EXPECT_EQ(n, 3);
  EXPECT_EQ(last, 0);
  EXPECT_FALSE(same_bits(before.params[0], m.tensors[0].param));
  EXPECT_TRUE(same_bits(before.params[2], m.tensors[2].param));
}

TEST(ApiNonFiniteOff, StepProceedsWithoutTheGuard) {
  for (int kind = 0; kind < 2; ++kind) {
    SCOPED_TRACE(kind == 0 ? "NaN" : "+Inf");
    dion_options_t o = default_options();
    o.skip_nonfinite = 0;
    Model m = guard_model(DION_DTYPE_FP32);
    Optimizer opt(&o);
    ASSERT_TRUE(build(opt, m));
    m.new_grads(29, 0);
    step(opt);
    const Snapshot before = snapshot(opt, m);
    m.new_grads(29, 1);
    store(m.tensors[2].grad, DION_DTYPE_FP32, 4, bad_value(kind));  // in the AdamW tensor
    ASSERT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
    int64_t n = -1;
    int32_t last = -1;
    skipped(opt, &n, &last);
    EXPECT_EQ(n, 0);
    EXPECT_EQ(last, 0);
    for (size_t g = 0; g < before.steps.size(); ++g) {
      int64_t st = -1;
      ASSERT_EQ(dion_group_get_step(opt, static_cast<int32_t>(g), &st), DION_SUCCESS);
      EXPECT_EQ(st, before.steps[g] + 1) << "group " << g;
    }
    // Tensors of the other groups moved normally and stay finite.
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      if (i == 2) continue;
      EXPECT_FALSE(same_bits(before.params[i], m.tensors[i].param)) << m.tensors[i].name;
      for (int64_t k = 0; k < m.tensors[i].numel(); ++k)
        ASSERT_TRUE(std::isfinite(load(m.tensors[i].param, DION_DTYPE_FP32, k))) << m.tensors[i].name;
    }
    // The AdamW element with the bad gradient is no longer finite.
    EXPECT_FALSE(std::isfinite(load(m.tensors[2].param, DION_DTYPE_FP32, 4)));
  }
}

}  // namespace

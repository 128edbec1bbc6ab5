// SPDX-License-Identifier: MIT
//
// AdamW (legacy form, t = the group step) and Lion (spec §1.4), with and
// without cautious weight decay, on the HOST backend against the float64
// references of tests/reference/ref_scalar.h. Shapes of every rank (0-D to 4-D,
// element-wise algorithms take any shape), fp32 and bf16 (fp16 where the
// library supports it), several beta pairs. Tolerances: testbed (fp32 floor
// 5e-6 on the relative error of the change: a few fp32 roundings per element
// and step).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "reference/algorithm_testbed.h"

namespace dion_algo_test {
namespace {

struct ScalarCase {
  Algo algo = Algo::kAdamW;
  std::vector<int64_t> shape;
  Dtype dtype = Dtype::kF32;
  bool cautious = false;
  double beta1 = 0.9, beta2 = 0.95;
};

std::string case_name(const ScalarCase& c) {
  std::ostringstream o;
  o << dionref::dtype_name(c.dtype) << (c.cautious ? "_Cautious" : "") << "_b" << c.beta1 << "_" << c.beta2 << "_Shape_"
    << shape_str(c.shape);
  return sanitize(o.str());
}

// Readable parameters in gtest messages.
void PrintTo(const ScalarCase& c, std::ostream* os) { *os << dionref::algo_name(c.algo) << "_" << case_name(c); }

CaseSpec to_spec(const ScalarCase& c) {
  CaseSpec s;
  s.algo = c.algo;
  s.shapes = {c.shape};
  s.dtype = c.dtype;
  s.hyper.cautious_wd = c.cautious;
  s.hyper.beta1 = c.beta1;
  s.hyper.beta2 = c.beta2;
  s.steps = 5;
  if (c.cautious) s.hyper.weight_decay = 3.0;    // lr*wd = 0.03: the mask decides a visible part of the change
  if (c.dtype != Dtype::kF32) s.x_scale = 0.01;  // updates of lr = 0.01 are then many 16-bit ulps of X
  return s;
}

std::vector<ScalarCase> cases(Algo algo) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {1}, {37}, {7, 9}, {2, 3, 5}, {2, 2, 3, 4}};
  std::vector<ScalarCase> out;
  for (const auto& sh : shapes)
    for (Dtype d : {Dtype::kF32, Dtype::kBF16})
      for (bool cautious : {false, true}) out.push_back({algo, sh, d, cautious});
  out.push_back({algo, {7, 9}, Dtype::kF32, false, 0.95, 0.98});
  out.push_back({algo, {7, 9}, Dtype::kF32, true, 0.5, 0.999});
  out.push_back({algo, {37}, Dtype::kF16, false});
  return out;
}

void run_scalar(const ScalarCase& c) {
  if (c.dtype == Dtype::kF16) {
    // FP16 parameters are optional on the host: skip (with the reason) if the
    // library reports NOT_SUPPORTED at dion_add_group.
    LibOptimizer probe;
    HostTensor t(c.shape, c.dtype);
    const dion_status_t st = probe.add_group(make_group_options(c.algo, Hyper()), {&t}, nullptr);
    if (st == DION_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "FP16 parameters not supported: " << probe.error();
  }
  run_case(to_spec(c));
}

class AdamW_MatchesReference : public ::testing::TestWithParam<ScalarCase> {};
TEST_P(AdamW_MatchesReference, FiveSteps) { run_scalar(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Shapes, AdamW_MatchesReference, ::testing::ValuesIn(cases(Algo::kAdamW)),
                         [](const ::testing::TestParamInfo<ScalarCase>& i) { return case_name(i.param); });

class Lion_MatchesReference : public ::testing::TestWithParam<ScalarCase> {};
TEST_P(Lion_MatchesReference, FiveSteps) { run_scalar(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Shapes, Lion_MatchesReference, ::testing::ValuesIn(cases(Algo::kLion)),
                         [](const ::testing::TestParamInfo<ScalarCase>& i) { return case_name(i.param); });

// AdamW's bias correction uses the group step t: after 30 steps 1 - beta^t has
// moved far from its first values.
TEST(AdamW_LongRun, ThirtyStepsBiasCorrection) {
  CaseSpec s = to_spec(ScalarCase{Algo::kAdamW, {7, 9}});
  s.steps = 30;
  run_case(s);
}

TEST(AdamW_MixedPrecision, Bf16ParamFp32States) {
  CaseSpec s = to_spec(ScalarCase{Algo::kAdamW, {7, 9}, Dtype::kBF16});
  s.knobs.momentum_dtype = DION_DTYPE_FP32;
  s.knobs.variance_dtype = DION_DTYPE_FP32;
  run_case(s);
}

// AdamW's first update is lr * G / (|G| + eps') element-wise, i.e. ~lr sign(G):
// a hand-checkable anchor independent of the reference code.
TEST(AdamW_FirstStep, IsLrTimesSignOfGradient) {
  LibOptimizer opt;
  ASSERT_EQ(opt.create_status(), DION_SUCCESS);
  HostTensor t({3, 4}, Dtype::kF32);
  std::mt19937_64 rng(5);
  const std::vector<double> x0 = randn(rng, 12, 0.1, Dtype::kF32);
  const std::vector<double> g = randn(rng, 12, 1.0, Dtype::kF32);
  t.set_param(x0);
  t.set_grad(g);
  Hyper h;
  h.weight_decay = 0.0;
  h.lr = 0.01;
  DION_ASSERT_OK(opt, opt.add_group(make_group_options(Algo::kAdamW, h), {&t}, nullptr));
  DION_ASSERT_OK(opt, opt.step());
  const std::vector<double> x = t.param();
  for (size_t i = 0; i < x.size(); ++i) {
    // m = 0.1 g, v = 0.05 g^2, bc1 = 0.1, bc2 = 0.05: step = lr g / (|g| + 1e-8)
    const double want = x0[i] - 0.01 * g[i] / (std::abs(g[i]) + 1e-8);
    EXPECT_NEAR(x[i], want, 1e-7) << "element " << i;
  }
}

// Lion moves every coordinate by exactly lr (sign update) when wd = 0.
TEST(Lion_FirstStep, MovesEachCoordinateByLr) {
  LibOptimizer opt;
  ASSERT_EQ(opt.create_status(), DION_SUCCESS);
  HostTensor t({3, 4}, Dtype::kF32);
  std::mt19937_64 rng(6);
  const std::vector<double> x0 = randn(rng, 12, 0.1, Dtype::kF32);
  const std::vector<double> g = randn(rng, 12, 1.0, Dtype::kF32);
  t.set_param(x0);
  t.set_grad(g);
  Hyper h;
  h.weight_decay = 0.0;
  DION_ASSERT_OK(opt, opt.add_group(make_group_options(Algo::kLion, h), {&t}, nullptr));
  DION_ASSERT_OK(opt, opt.step());
  const std::vector<double> x = t.param();
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], x0[i] - 0.01 * (g[i] > 0 ? 1 : -1), 1e-8) << "element " << i;
}

}  // namespace
}  // namespace dion_algo_test

// SPDX-License-Identifier: MIT
//
// Dion2 (spec §5.3, local scope, unsharded) and NorDion2 / Dion3 (spec §6.2)
// on the HOST backend against the float64 references of
// tests/reference/ref_dion2.h, plus the two equivalences of spec §5.3/§6.2:
// at fraction 1, Dion2 is Muon (no Nesterov, mu = ef_decay) and NorDion2 is
// NorMuon (no Nesterov). Shapes cover row selection (rows <= cols), column
// selection (tall), square, tiny and rank-1 matrices and 3-D batches; fractions
// from k = 1 to k = N. Tolerances: tests/reference/algorithm_testbed.h (the
// orthogonalizer argument of test_algorithms_muon.cpp applies unchanged; the
// selection itself is exact unless two L1 norms tie to fp32 precision, which
// random data makes improbable).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "reference/algorithm_testbed.h"

namespace dion_algo_test {
namespace {

struct Dion2Case {
  Algo algo = Algo::kDion2;
  std::vector<int64_t> shape;
  Dtype dtype = Dtype::kF32;
  double fraction = 0.25;
  Ortho ortho = Ortho::kPolarExpress;
};

std::string case_name(const Dion2Case& c) {
  std::ostringstream o;
  o << dionref::dtype_name(c.dtype) << "_" << (c.ortho == Ortho::kPolarExpress ? "PE" : "NS") << "_Shape_"
    << shape_str(c.shape) << "_fraction" << c.fraction;
  return sanitize(o.str());
}

// Readable parameters in gtest messages.
void PrintTo(const Dion2Case& c, std::ostream* os) { *os << dionref::algo_name(c.algo) << "_" << case_name(c); }

CaseSpec to_spec(const Dion2Case& c) {
  CaseSpec s;
  s.algo = c.algo;
  s.shapes = {c.shape};
  s.dtype = c.dtype;
  s.hyper.fraction = c.fraction;
  s.hyper.ortho = c.ortho;
  s.steps = 5;                   // enough for the error feedback to re-select slices
  if (c.dtype != Dtype::kF32) {  // bf16: the update must be many ulps of X
    s.x_scale = 0.01;
    s.hyper.lr = 0.02;
  }
  return s;
}

std::vector<Dion2Case> cases(Algo algo) {
  const std::vector<std::vector<int64_t>> shapes = {{48, 20}, {20, 48}, {32, 32}, {2, 3},      {3, 2},
                                                    {1, 5},   {5, 1},   {64, 7},  {3, 16, 24}, {2, 24, 16}};
  std::vector<Dion2Case> out;
  for (const auto& sh : shapes)
    for (double f : {0.25, 0.5, 1.0, 0.07}) out.push_back({algo, sh, Dtype::kF32, f});
  for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}, {32, 32}, {2, 16, 24}})
    for (double f : {0.25, 1.0}) out.push_back({algo, sh, Dtype::kBF16, f});
  for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}})
    out.push_back({algo, sh, Dtype::kF32, 0.5, Ortho::kNewtonSchulz});
  return out;
}

class Dion2_MatchesReference : public ::testing::TestWithParam<Dion2Case> {};
TEST_P(Dion2_MatchesReference, FiveSteps) { run_case(to_spec(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Shapes, Dion2_MatchesReference, ::testing::ValuesIn(cases(Algo::kDion2)),
                         [](const ::testing::TestParamInfo<Dion2Case>& i) { return case_name(i.param); });

class NorDion2_MatchesReference : public ::testing::TestWithParam<Dion2Case> {};
TEST_P(NorDion2_MatchesReference, FiveSteps) { run_case(to_spec(GetParam())); }
INSTANTIATE_TEST_SUITE_P(Shapes, NorDion2_MatchesReference, ::testing::ValuesIn(cases(Algo::kNorDion2)),
                         [](const ::testing::TestParamInfo<Dion2Case>& i) { return case_name(i.param); });

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

struct Variant {
  std::string name;
  std::function<void(CaseSpec&)> apply;
};

std::vector<Variant> variants() {
  return {
      {"EfDecay0", [](CaseSpec& s) { s.hyper.ef_decay = 0.0, s.hyper.mu = 0.0; }},
      {"EfDecayHalf", [](CaseSpec& s) { s.hyper.ef_decay = 0.5, s.hyper.mu = 0.5; }},
      {"EfDecay1", [](CaseSpec& s) { s.hyper.ef_decay = 1.0, s.hyper.mu = 1.0; }},
      {"AdjustLrRmsNorm", [](CaseSpec& s) { s.hyper.adjust_lr = AdjustLr::kRmsNorm; }},
      {"AdjustLrNone", [](CaseSpec& s) { s.hyper.adjust_lr = AdjustLr::kNone; }},
      {"LargeWeightDecay",
       [](CaseSpec& s) {
         s.hyper.lr = 0.05;
         s.hyper.weight_decay = 2.0;
       }},
      {"MuonBeta2Half", [](CaseSpec& s) { s.hyper.muon_beta2 = 0.5; }},
      {"OrthoSteps7", [](CaseSpec& s) { s.hyper.ortho_steps = 7; }},
      {"LongRun12Steps", [](CaseSpec& s) { s.steps = 12; }},
  };
}

struct VariantCase {
  Algo algo;
  std::vector<int64_t> shape;
  size_t variant;
};

void PrintTo(const VariantCase& v, std::ostream* os) {
  *os << dionref::algo_name(v.algo) << " " << variants()[v.variant].name << " " << shape_str(v.shape);
}

class Dion2Family_Options : public ::testing::TestWithParam<VariantCase> {};

TEST_P(Dion2Family_Options, MatchReference) {
  const VariantCase& v = GetParam();
  CaseSpec s = to_spec(Dion2Case{v.algo, v.shape, Dtype::kF32, 0.25});
  variants()[v.variant].apply(s);
  run_case(s);
}

std::vector<VariantCase> variant_cases() {
  std::vector<VariantCase> out;
  for (Algo a : {Algo::kDion2, Algo::kNorDion2})
    for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}})
      for (size_t i = 0; i < variants().size(); ++i) out.push_back({a, sh, i});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Variants, Dion2Family_Options, ::testing::ValuesIn(variant_cases()),
                         [](const ::testing::TestParamInfo<VariantCase>& i) {
                           return sanitize(std::string(dionref::algo_name(i.param.algo)) + "_" +
                                           variants()[i.param.variant].name + "_Shape_" + shape_str(i.param.shape));
                         });

// flatten = 1, per tensor (a (4, 6, 5) tensor is one 4 x 30 matrix: rows are
// selected) and several tensors in a group.
TEST(Dion2Family_Group, FlattenAndSeveralTensors) {
  for (Algo a : {Algo::kDion2, Algo::kNorDion2}) {
    CaseSpec s = to_spec(Dion2Case{a, {4, 6, 5}, Dtype::kF32, 0.5});
    s.shapes = {{4, 6, 5}, {4, 6, 5}, {6, 2, 2}};
    s.hyper.flatten = true;
    SCOPED_TRACE(std::string(dionref::algo_name(a)) + " flatten");
    run_case(s);
    CaseSpec g = to_spec(Dion2Case{a, {48, 20}, Dtype::kF32, 0.25});
    g.shapes = {{48, 20}, {20, 48}, {48, 20}, {2, 16, 24}, {32, 32}};
    SCOPED_TRACE(std::string(dionref::algo_name(a)) + " group");
    run_case(g);
  }
}

// ---------------------------------------------------------------------------
// Equivalences at fraction 1
// ---------------------------------------------------------------------------

// Runs `a` and `b` (library, same data) and compares their parameters after
// every step: both must follow the same fp64 trajectory, so they agree to twice
// the orthogonalizer tolerance.
void expect_same_trajectory(const CaseSpec& a, const CaseSpec& b, int steps) {
  CaseRunner ra(a), rb(b);
  ra.setup();
  rb.setup();
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  std::mt19937_64 rng(99);
  for (int step = 1; step <= steps; ++step) {
    for (size_t t = 0; t < a.shapes.size(); ++t) {
      const std::vector<double> g = randn(rng, dionref::numel(a.shapes[t]), 1.0, a.dtype);
      ra.tensor(t).set_grad(g);
      rb.tensor(t).set_grad(g);
    }
    DION_ASSERT_OK(ra.optimizer(), ra.optimizer().step());
    DION_ASSERT_OK(rb.optimizer(), rb.optimizer().step());
    for (size_t t = 0; t < a.shapes.size(); ++t) {
      ASSERT_EQ(ra.x0(t), rb.x0(t));  // same data seed
      const double err = rel_change_error(ra.tensor(t).param(), rb.tensor(t).param(), ra.x0(t));
      EXPECT_LE(err, 2 * case_tolerance(a.algo, a.dtype, a.hyper, a.shapes).floor)
          << dionref::algo_name(a.algo) << " vs " << dionref::algo_name(b.algo) << ", shape " << shape_str(a.shapes[t])
          << ", step " << step;
    }
  }
}

// Dion2(fraction 1, ef_decay = mu) == Muon(mu, nesterov 0): S_t = ef S_{t-1} + G_t
// is exactly Muon's momentum (spec §5.3); only the stored buffer differs by ef.
TEST(Dion2_Equivalence, FractionOneIsMuonWithoutNesterov) {
  for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}, {32, 32}, {3, 16, 24}, {1, 5}}) {
    for (Ortho o : {Ortho::kPolarExpress, Ortho::kNewtonSchulz}) {
      CaseSpec d2 = to_spec(Dion2Case{Algo::kDion2, sh, Dtype::kF32, 1.0, o});
      d2.hyper.ef_decay = 0.9;
      CaseSpec mu = d2;
      mu.algo = Algo::kMuon;
      mu.hyper.mu = 0.9;
      mu.hyper.nesterov = false;
      expect_same_trajectory(d2, mu, 5);
    }
  }
}

// NorDion2(fraction 1, mu) == NorMuon(mu, nesterov 0) (spec §6.2): both
// normalise all rows with the same variance_neuron recursion.
TEST(NorDion2_Equivalence, FractionOneIsNorMuonWithoutNesterov) {
  for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}, {32, 32}, {3, 16, 24}, {1, 5}}) {
    CaseSpec nd = to_spec(Dion2Case{Algo::kNorDion2, sh, Dtype::kF32, 1.0});
    nd.hyper.mu = 0.9;
    nd.hyper.muon_beta2 = 0.8;
    CaseSpec nm = nd;
    nm.algo = Algo::kNorMuon;
    nm.hyper.nesterov = false;
    expect_same_trajectory(nd, nm, 5);
  }
}

}  // namespace
}  // namespace dion_algo_test

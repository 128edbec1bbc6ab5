// SPDX-License-Identifier: MIT
//
// Dion (spec §2) on the HOST backend against the float64 reference of
// tests/reference/ref_dion.h: shapes (tall, wide, square, tiny, rank-1),
// rank fractions, rank_multiple_of, fp32 / bf16 / mixed-precision states, every
// QR method, power iterations, the rank-rounding rule and the fixed sqrt(m/n)
// scale. Dion's initial Q comes from the library's generator, so each case
// reads it through the state API right after dion_add_group and hands it to
// the reference; from then on the two run independently. Tolerances: see
// tests/reference/algorithm_testbed.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include <random>
#include <string>
#include <vector>

#include "reference/algorithm_testbed.h"
#include "../scoped_env.h"

namespace dion_algo_test {
namespace {

struct DionCase {
  std::vector<int64_t> shape;
  Dtype dtype = Dtype::kF32;
  double rank_fraction = 1.0;
  int rank_multiple_of = 1;
  dion_qr_method_t qr = DION_QR_RCQR;
  int cqr_warmup = 150;
  int power_iters = 1;
};

std::string qr_name(dion_qr_method_t q, int warmup) {
  if (q == DION_QR_QR) return "QR";
  if (q == DION_QR_CQR) return warmup > 0 ? "CQRwarm" + std::to_string(warmup) : "CQR";
  return "RCQR";
}

std::string case_name(const DionCase& c) {
  std::ostringstream o;
  o << dionref::dtype_name(c.dtype) << "_" << qr_name(c.qr, c.cqr_warmup) << "_Shape_" << shape_str(c.shape) << "_rf"
    << c.rank_fraction;
  if (c.rank_multiple_of != 1) o << "_q" << c.rank_multiple_of;
  if (c.power_iters != 1) o << "_pi" << c.power_iters;
  return sanitize(o.str());
}

// Readable parameters in gtest messages.
void PrintTo(const DionCase& c, std::ostream* os) { *os << case_name(c); }

CaseSpec to_spec(const DionCase& c) {
  CaseSpec s;
  s.algo = Algo::kDion;
  s.shapes = {c.shape};
  s.dtype = c.dtype;
  s.hyper.rank_fraction = c.rank_fraction;
  s.hyper.rank_multiple_of = c.rank_multiple_of;
  s.hyper.power_iters = c.power_iters;
  s.knobs.qr_method = c.qr;
  s.knobs.cqr_warmup_steps = c.cqr_warmup;
  s.steps = 4;
  if (c.dtype != Dtype::kF32) {
    // bf16: keep X small and the step large, so that the update is many bf16
    // ulps of X and the comparison measures the update, not X's quantisation.
    s.x_scale = 0.01;
    s.hyper.lr = 0.02;
  }
  return s;
}

// ---------------------------------------------------------------------------
// Dion_MatchesReference: every shape class x rank fraction x dtype (RCQR, the
// default method)
// ---------------------------------------------------------------------------

class Dion_MatchesReference : public ::testing::TestWithParam<DionCase> {};

TEST_P(Dion_MatchesReference, FourSteps) { run_case(to_spec(GetParam())); }

std::vector<DionCase> reference_cases() {
  std::vector<DionCase> out;
  const std::vector<std::vector<int64_t>> shapes = {{48, 20}, {20, 48}, {32, 32}, {2, 3}, {3, 2},
                                                    {1, 5},   {5, 1},   {1, 1},   {64, 7}};
  for (const auto& sh : shapes)
    for (double rf : {1.0, 0.5, 0.25}) out.push_back({sh, Dtype::kF32, rf});
  for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}, {32, 32}, {2, 3}, {1, 5}})
    for (double rf : {1.0, 0.25}) out.push_back({sh, Dtype::kBF16, rf});
  // rank_multiple_of: r = 4 ceil(0.25*20/4) = 8; r = 8 ceil(0.3*20/8) = 8; r = min(20, 16 ceil(0.9*20/16)) = 20.
  out.push_back({{48, 20}, Dtype::kF32, 0.25, 4});
  out.push_back({{20, 48}, Dtype::kF32, 0.3, 8});
  out.push_back({{48, 20}, Dtype::kF32, 0.9, 16});
  // a = 200 rows > RCQR's k = 128 sketch rows (all the smaller shapes have k > a).
  out.push_back({{200, 150}, Dtype::kF32, 0.5});
  out.push_back({{150, 200}, Dtype::kF32, 0.5});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Dion_MatchesReference, ::testing::ValuesIn(reference_cases()),
                         [](const ::testing::TestParamInfo<DionCase>& i) { return case_name(i.param); });

// ---------------------------------------------------------------------------
// Dion_QrMethods: QR, CQR (no warm-up, and a warm-up covering the first two
// steps: those use RCQR) and RCQR all compute the same Q factor up to column
// signs, so each must match the same reference.
// ---------------------------------------------------------------------------

class Dion_QrMethods : public ::testing::TestWithParam<DionCase> {};

TEST_P(Dion_QrMethods, MatchReference) { run_case(to_spec(GetParam())); }

std::vector<DionCase> qr_cases() {
  std::vector<DionCase> out;
  for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}, {32, 32}, {2, 3}})
    for (double rf : {1.0, 0.25})
      for (auto m : std::vector<std::pair<dion_qr_method_t, int>>{{DION_QR_QR, 0}, {DION_QR_CQR, 0}, {DION_QR_CQR, 2}})
        out.push_back({sh, Dtype::kF32, rf, 1, m.first, m.second});
  for (auto m : std::vector<std::pair<dion_qr_method_t, int>>{{DION_QR_QR, 0}, {DION_QR_CQR, 0}})
    out.push_back({{200, 150}, Dtype::kF32, 0.5, 1, m.first, m.second});
  out.push_back({{48, 20}, Dtype::kBF16, 0.25, 1, DION_QR_QR, 0});
  out.push_back({{48, 20}, Dtype::kBF16, 0.25, 1, DION_QR_CQR, 0});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Methods, Dion_QrMethods, ::testing::ValuesIn(qr_cases()),
                         [](const ::testing::TestParamInfo<DionCase>& i) { return case_name(i.param); });

// The methods against each other directly, on one optimizer per method built
// from the same seed: the initial Q must be the same (the generator is keyed by
// seed and tensor, not by options), and the parameters after 4 steps must agree
// to the sum of their bounds against the same reference (each is within its
// own: the fp32 floor, or ten times a textbook fp32 Cholesky QR's error for
// CQR, see CaseRunner).
TEST(Dion_QrMethodsAgree, PairwiseAfterFourSteps) {
  for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}, {32, 32}}) {
    for (double rf : {1.0, 0.25}) {
      std::vector<std::vector<double>> results, q0s;
      std::vector<double> bounds;  // each method's bound against the reference at the last step
      std::vector<std::string> names;
      std::vector<double> x0;
      for (auto m : std::vector<std::pair<dion_qr_method_t, int>>{
               {DION_QR_RCQR, 150}, {DION_QR_QR, 0}, {DION_QR_CQR, 0}, {DION_QR_CQR, 2}}) {
        CaseRunner runner(to_spec(DionCase{sh, Dtype::kF32, rf, 1, m.first, m.second}));
        runner.run();
        if (HasFatalFailure()) return;
        results.push_back(runner.tensor(0).param());
        q0s.push_back(runner.q0(0));
        names.push_back(qr_name(m.first, m.second));
        bounds.push_back(runner.param_bound(0));
        x0 = runner.x0(0);
      }
      for (size_t i = 1; i < results.size(); ++i) {
        EXPECT_TRUE(q0s[i] == q0s[0]) << "initial Q differs between optimizers of the same seed (" << names[i] << ")";
        const double err = rel_change_error(results[i], results[0], x0);
        EXPECT_LE(err, bounds[0] + bounds[i])
            << names[i] << " vs RCQR, shape " << shape_str(sh) << " rank_fraction " << rf;
      }
    }
  }
}

// Power iterations > 1: P = orth(B Q~), R = B^T P repeated with Q~ := R.
class Dion_PowerIters : public ::testing::TestWithParam<DionCase> {};

TEST_P(Dion_PowerIters, MatchReference) { run_case(to_spec(GetParam())); }

std::vector<DionCase> power_cases() {
  std::vector<DionCase> out;
  for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}})
    for (double rf : {0.25, 0.5})
      for (int pi : {2, 3})
        for (dion_qr_method_t q : {DION_QR_RCQR, DION_QR_QR}) out.push_back({sh, Dtype::kF32, rf, 1, q, 0, pi});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Iterations, Dion_PowerIters, ::testing::ValuesIn(power_cases()),
                         [](const ::testing::TestParamInfo<DionCase>& i) { return case_name(i.param); });

// ---------------------------------------------------------------------------
// Rank and Q shape
// ---------------------------------------------------------------------------

// r = min(m, n, q ceil(rank_fraction min(m,n) / q)) in IEEE double (spec §2.2):
// 0.07 * 100 = 7.000000000000001, so r = 8, not 7. Q is (b, r), b = the short dim.
TEST(Dion_Rank, RoundingInDoubleAndQShape) {
  struct Row {
    int64_t m, n;
    double rf;
    int q;
    int64_t b, r;
  };
  const Row rows[] = {
      {100, 100, 0.07, 1, 100, 8},  // the spec's example
      {100, 120, 0.07, 1, 100, 8}, {120, 100, 0.07, 1, 100, 8}, {48, 20, 0.25, 4, 20, 8},
      {20, 48, 0.3, 8, 20, 8},     {48, 20, 0.9, 16, 20, 20},   {1, 5, 0.1, 1, 1, 1},
      {5, 1, 1.0, 1, 1, 1},        {64, 7, 0.5, 1, 7, 4},       {30, 30, 1.0 / 3.0, 1, 30, 10},
  };
  ASSERT_EQ(0.07 * 100, 7.000000000000001);  // the premise of the first row
  for (const Row& row : rows) {
    int64_t b = 0, r = 0;
    dionref::dion_q_shape(row.m, row.n, row.rf, row.q, &b, &r);
    ASSERT_EQ(b, row.b) << "test table";
    ASSERT_EQ(r, row.r) << "test table";
    LibOptimizer opt;
    ASSERT_EQ(opt.create_status(), DION_SUCCESS) << opt.create_error();
    HostTensor t({row.m, row.n}, Dtype::kF32);
    std::mt19937_64 rng(1);
    t.set_param(randn(rng, t.numel(), 0.1, Dtype::kF32));
    Hyper h;
    h.rank_fraction = row.rf;
    h.rank_multiple_of = row.q;
    DION_ASSERT_OK(opt, opt.add_group(make_group_options(Algo::kDion, h), {&t}, nullptr));
    StateBuffer q;
    DION_ASSERT_OK(opt, opt.read_state(0, "Q", &q));
    EXPECT_EQ(q.shape, (std::vector<int64_t>{row.b, row.r}))
        << row.m << "x" << row.n << " rank_fraction " << row.rf << " rank_multiple_of " << row.q;
    StateBuffer m;
    DION_ASSERT_OK(opt, opt.read_state(0, "momentum", &m));
    EXPECT_EQ(m.shape, (std::vector<int64_t>{row.m, row.n}));
  }
}

// The initial Q is Gaussian and NOT normalised (spec §2.4): its entries have
// mean ~0 and variance ~1, and are finite.
TEST(Dion_InitialQ, IsUnnormalisedGaussian) {
  LibOptimizer opt(/*seed=*/3);
  ASSERT_EQ(opt.create_status(), DION_SUCCESS) << opt.create_error();
  HostTensor t({256, 128}, Dtype::kF32);
  std::mt19937_64 rng(2);
  t.set_param(randn(rng, t.numel(), 0.1, Dtype::kF32));
  DION_ASSERT_OK(opt, opt.add_group(make_group_options(Algo::kDion, Hyper()), {&t}, nullptr));
  StateBuffer q;
  DION_ASSERT_OK(opt, opt.read_state(0, "Q", &q));
  ASSERT_EQ(q.shape, (std::vector<int64_t>{128, 128}));
  double sum = 0, sum2 = 0;
  for (double v : q.values) {
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sum2 += v * v;
  }
  const double n = static_cast<double>(q.values.size());
  // 16384 samples of N(0,1): the mean has sd 1/128, the variance sd ~0.011.
  EXPECT_NEAR(sum / n, 0.0, 0.05);
  EXPECT_NEAR(sum2 / n, 1.0, 0.08);
}

// ---------------------------------------------------------------------------
// Scale, mixed precision, batching, seeds
// ---------------------------------------------------------------------------

// adjust_lr does not apply to Dion: the scale is always lr sqrt(m/n) (spec §1.1).
TEST(Dion_Scale, AdjustLrIsIgnored) {
  for (AdjustLr mode : {AdjustLr::kRmsNorm, AdjustLr::kNone}) {
    for (const auto& sh : std::vector<std::vector<int64_t>>{{48, 20}, {20, 48}}) {
      CaseSpec s = to_spec(DionCase{sh, Dtype::kF32, 0.5});
      s.hyper.adjust_lr = mode;  // the reference ignores it too
      SCOPED_TRACE(mode == AdjustLr::kRmsNorm ? "adjust_lr rms_norm" : "adjust_lr none");
      run_case(s);
    }
  }
}

// Mixed precision (spec §9): states in a dtype other than the parameter's.
TEST(Dion_MixedPrecision, Bf16ParamFp32States) {
  CaseSpec s = to_spec(DionCase{{48, 20}, Dtype::kBF16, 0.5});
  s.knobs.momentum_dtype = DION_DTYPE_FP32;
  s.knobs.q_dtype = DION_DTYPE_FP32;
  run_case(s);
}

TEST(Dion_MixedPrecision, Fp32ParamBf16MomentumAndQ) {
  CaseSpec s = to_spec(DionCase{{20, 48}, Dtype::kF32, 0.5});
  s.knobs.momentum_dtype = DION_DTYPE_BF16;
  s.knobs.q_dtype = DION_DTYPE_BF16;
  s.tol = default_tolerance(Algo::kDion, Dtype::kBF16);  // the states carry bf16 rounding
  run_case(s);
}

// Several tensors of one group (same and different shapes): each must follow
// its own reference, whatever batching the library does.
TEST(Dion_Group, SeveralTensors) {
  CaseSpec s = to_spec(DionCase{{48, 20}, Dtype::kF32, 0.5});
  s.shapes = {{48, 20}, {48, 20}, {20, 48}, {32, 32}, {48, 20}};
  run_case(s);
}

// The phased group step (src/algo/dion.cpp, step_group) against the
// bucket-by-bucket step (DION_PHASED=0): each tensor follows its float64
// reference (run_case), and the two give the same parameters and Q bit for
// bit, since the host's batched factorizations work matrix by matrix. That
// the phased step ran is seen in the workspace it reserves: more than the
// bucket-by-bucket step's.
void expect_phased_equals_bucket_by_bucket(const CaseSpec& s) {
  run_case(s);
  std::vector<std::vector<double>> params[2], qs[2];
  uint64_t ws[2] = {0, 0};
  for (int off = 0; off < 2; ++off) {
    std::optional<ScopedEnv> phased;
    if (off) phased.emplace("DION_PHASED", "0");
    CaseRunner runner(s);
    runner.run();
    phased.reset();
    ASSERT_FALSE(::testing::Test::HasFailure());
    uint64_t state_bytes = 0;
    ASSERT_EQ(dion_get_memory_usage(runner.optimizer().get(), &state_bytes, &ws[off]), DION_SUCCESS);
    for (size_t t = 0; t < s.shapes.size(); ++t) {
      params[off].push_back(runner.tensor(t).param());
      StateBuffer q;
      ASSERT_EQ(runner.optimizer().read_state(static_cast<int32_t>(t), "Q", &q), DION_SUCCESS);
      qs[off].push_back(q.values);
    }
  }
  EXPECT_GT(ws[0], ws[1]) << "the phased step's workspace was not reserved";
  for (size_t t = 0; t < s.shapes.size(); ++t) {
    EXPECT_TRUE(params[0][t] == params[1][t]) << "tensor " << t << ": phased and bucket-by-bucket parameters differ";
    EXPECT_TRUE(qs[0][t] == qs[1][t]) << "tensor " << t << ": phased and bucket-by-bucket Q differ";
  }
}

// A group whose buckets share r and k (here r = 10 and k = 128 for four
// shapes, five tensors) steps in phases that factor all buckets' matrices in
// one call per kind. For RCQR, CQR, and CQR after a two-step RCQR warm-up.
TEST(Dion_Phased, GroupOfSharedRankMatchesReferenceAndBucketByBucketBits) {
  struct M {
    dion_qr_method_t qr;
    int warmup;
  };
  for (const M m : {M{DION_QR_RCQR, 150}, M{DION_QR_CQR, 0}, M{DION_QR_CQR, 2}}) {
    SCOPED_TRACE(qr_name(m.qr, m.warmup));
    CaseSpec s = to_spec(DionCase{{48, 20}, Dtype::kF32, 0.5, 1, m.qr, m.warmup});
    s.shapes = {{48, 20}, {20, 48}, {64, 20}, {48, 20}, {20, 40}};
    expect_phased_equals_bucket_by_bucket(s);
  }
}

// At full rank a square bucket (20 x 20, r = 20: P square, Householder QR)
// takes no part in the phases: it is stepped on its own, and the other
// buckets (r = 20, k = 128) are still phased, before and after it in the
// list of shapes. With a single other bucket nothing is phased (the
// workspaces then equal: the check fails), so two are kept.
TEST(Dion_Phased, SquareBucketSteppedAloneTheOthersPhased) {
  for (const dion_qr_method_t qr : {DION_QR_RCQR, DION_QR_CQR}) {
    SCOPED_TRACE(qr_name(qr, 0));
    CaseSpec s = to_spec(DionCase{{48, 20}, Dtype::kF32, 1.0, 1, qr, 0});
    s.shapes = {{20, 20}, {48, 20}, {20, 48}, {20, 20}, {64, 20}};
    expect_phased_equals_bucket_by_bucket(s);
  }
}

// RCQR with a larger oversampling (k = 128 ceil(oversample r / 128)): the
// sketch size does not change the Q factor.
TEST(Dion_Oversample, LargerSketchSameResult) {
  for (double os : {2.0, 4.0}) {
    CaseSpec s = to_spec(DionCase{{200, 150}, Dtype::kF32, 0.5});
    s.knobs.oversample = os;
    SCOPED_TRACE("oversample " + std::to_string(os));
    run_case(s);
  }
}

// Another generator seed gives another initial Q, and the update still matches.
TEST(Dion_Seed, OtherSeedStillMatches) {
  CaseSpec s = to_spec(DionCase{{32, 32}, Dtype::kF32, 0.25});
  s.lib_seed = 12345;
  run_case(s);
}

// Longer run: error feedback over many steps does not drift from the reference.
TEST(Dion_LongRun, TwelveSteps) {
  CaseSpec s = to_spec(DionCase{{48, 20}, Dtype::kF32, 0.25});
  s.steps = 12;
  run_case(s);
}

// At full rank (r = min(m, n)) the error feedback M - (1 - mu) P R^T is
// exactly mu M (src/algo/dion.cpp, full_rank_ef): P P^T B = B. One step from
// M = 0 with G = U diag(sigma) V^T, sigma from 1 down to 1e-6 (cond(G) 1e6),
// on a tall (RCQR), a square (Householder) and a wide (transposed) shape:
// the library's momentum against the float64 reference's M - (1 - mu) P R^T
// (which equals mu G to about 1e-16 cond(G Q)), held to what the decay can
// differ by: one fp32 rounding (2^-24 relative) and the library's fp32 mu
// (float(0.95) differs from 0.95 by 1.3e-8 relative), plus 1e-9 for the
// reference's own rounding. DION_FULL_RANK_EF=0 (the product) is printed
// for comparison, and must leave the parameters' bits as they are: the
// update reads P and Q, which the error feedback does not touch.
TEST(Dion_FullRank, ErrorFeedbackIsTheDecayOnAnIllConditionedMomentum) {
  const double mu = 0.95;
  const double mu_f = static_cast<float>(mu);
  const double bound = std::ldexp(1.0, -24) + std::abs(mu_f - mu) / mu + 1e-9;
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{96, 32}, {32, 32}, {32, 96}}) {
    const int64_t m = shape[0], n = shape[1], k = std::min(m, n);
    SCOPED_TRACE(shape_str(shape));
    // U (m x k), V (n x k) orthonormal (Householder Q of uniform matrices).
    auto orthonormal = [](int64_t rows, int64_t cols, uint64_t seed) {
      std::mt19937_64 rng(seed);
      std::uniform_real_distribution<double> u(-1.0, 1.0);
      dionref::Matrix<double> a(rows, cols);
      for (double& v : a.v) v = u(rng);
      return dionref::householder_q(a);
    };
    const dionref::Matrix<double> U = orthonormal(m, k, 11), V = orthonormal(n, k, 12);
    std::vector<double> g(static_cast<size_t>(m * n));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t l = 0; l < k; ++l)
          acc += U.v[static_cast<size_t>(i * k + l)] * std::pow(10.0, -6.0 * static_cast<double>(l) / (k - 1)) *
                 V.v[static_cast<size_t>(j * k + l)];
        g[static_cast<size_t>(i * n + j)] = static_cast<float>(acc);  // the fp32 gradient both sides see
      }
    std::mt19937_64 rng(7);
    const std::vector<double> x0 = randn(rng, m * n, 0.1, Dtype::kF32);
    dionref::Hyper h;
    h.mu = mu;
    std::vector<double> params[2];
    for (int product = 0; product < 2; ++product) {
      std::optional<ScopedEnv> full_rank_ef;
      if (product) full_rank_ef.emplace("DION_FULL_RANK_EF", "0");
      LibOptimizer opt;
      HostTensor t(shape, Dtype::kF32);
      t.set_param(x0);
      t.set_grad(g);
      int32_t group = -1;
      DION_ASSERT_OK(opt, opt.add_group(make_group_options(Algo::kDion, h), {&t}, &group));
      StateBuffer q;
      DION_ASSERT_OK(opt, opt.read_state(0, "Q", &q));
      dionref::Matrix<double> q0(k, k);
      q0.v = q.values;
      dionref::TensorReference<double> ref(Algo::kDion, h, shape, resolve_dtypes(Dtype::kF32, LibKnobs()), x0, q0);
      DION_ASSERT_OK(opt, opt.step());
      full_rank_ef.reset();
      ref.step(g);
      StateBuffer mom;
      DION_ASSERT_OK(opt, opt.read_state(0, "momentum", &mom));
      const double err = rel_error(mom.values, ref.state().momentum);
      std::printf("  %s, %s: momentum relative error %.3g (decay bound %.3g)\n", shape_str(shape).c_str(),
                  product ? "product (DION_FULL_RANK_EF=0)" : "decay", err, bound);
      if (!product) EXPECT_LE(err, bound) << "the full-rank error feedback is not mu M";
      params[product] = t.param();
    }
    EXPECT_TRUE(params[0] == params[1]) << "the error feedback's form changed the parameters";
  }
}

}  // namespace
}  // namespace dion_algo_test

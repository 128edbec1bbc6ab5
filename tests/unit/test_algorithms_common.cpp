// SPDX-License-Identifier: MIT
//
// Behaviour shared by every algorithm, checked against the float64 references
// on the HOST backend: a zero gradient applies weight decay only; a non-finite
// gradient skips the whole step (no parameter, state or counter changes) and
// the run then continues as if the step never happened; hyperparameters set
// with dion_group_set_hparam take effect at the next step; COL_MAJOR tensors
// give the row-major results; a run resumed from exported states continues
// bit-identically; tensors without a gradient are left alone; several groups
// step together with one counter each.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "reference/algorithm_testbed.h"

namespace dion_algo_test {
namespace {

const Algo kAllAlgos[] = {Algo::kDion,     Algo::kDion2, Algo::kMuon, Algo::kNorMuon,
                          Algo::kNorDion2, Algo::kAdamW, Algo::kLion};

struct AlgoShape {
  Algo algo;
  std::vector<int64_t> shape;
};

std::vector<AlgoShape> all_algos_2d() {
  std::vector<AlgoShape> out;
  for (Algo a : kAllAlgos)
    for (const auto& sh : std::vector<std::vector<int64_t>>{{24, 16}, {16, 24}}) out.push_back({a, sh});
  return out;
}

std::string algo_shape_name(const ::testing::TestParamInfo<AlgoShape>& i) {
  return sanitize(std::string(dionref::algo_name(i.param.algo)) + "_Shape_" + shape_str(i.param.shape));
}

// Readable parameters in gtest messages.
void PrintTo(const AlgoShape& p, std::ostream* os) { *os << dionref::algo_name(p.algo) << " " << shape_str(p.shape); }

CaseSpec base_spec(const AlgoShape& p) {
  CaseSpec s;
  s.algo = p.algo;
  s.shapes = {p.shape};
  s.hyper.rank_fraction = 0.5;
  s.hyper.fraction = 0.5;
  s.steps = 4;
  return s;
}

// ---------------------------------------------------------------------------
// Zero gradient: weight decay only
// ---------------------------------------------------------------------------

// With G = 0 from zero state every algorithm's update vanishes (Dion: §2.8,
// P = 0 and Q := colnorm(Q); Muon family: Orth(0) = 0; AdamW: 0/(0+eps);
// Lion: sign(0) = 0), so X_t = (1 - lr wd)^t X_0. lr*wd = 0.05 makes the decay
// the whole, well-resolved change; each step may round X once in fp32.
class ZeroGradient_WeightDecayOnly : public ::testing::TestWithParam<AlgoShape> {};

TEST_P(ZeroGradient_WeightDecayOnly, ThreeSteps) {
  CaseSpec s = base_spec(GetParam());
  s.zero_grad = true;
  s.steps = 3;
  s.hyper.lr = 0.1;
  s.hyper.weight_decay = 0.5;
  CaseRunner runner(s);
  runner.run();  // also compares against the reference (Dion: Q = colnorm(Q_0), momentum 0)
  if (HasFatalFailure()) return;
  const std::vector<double> x = runner.tensor(0).param();
  const std::vector<double>& x0 = runner.x0(0);
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = x0[i] * std::pow(1.0 - 0.05, 3);
    // 3 steps, each rounding the factor (1 - lr wd) and the product once in fp32:
    // <= 6 half-ulps of error; 8 ulps (2^-24 relative each) of slack.
    EXPECT_NEAR(x[i], want, 8 * std::ldexp(std::abs(want), -24)) << "element " << i;
  }
  StateBuffer m;
  DION_ASSERT_OK(runner.optimizer(), runner.optimizer().read_state(0, "momentum", &m));
  for (double v : m.values) ASSERT_EQ(v, 0.0) << "momentum must stay exactly zero";
  if (s.algo == Algo::kDion) {  // Q = colnorm(Q_0): unit columns
    StateBuffer q;
    DION_ASSERT_OK(runner.optimizer(), runner.optimizer().read_state(0, "Q", &q));
    const int64_t rows = q.shape[0], cols = q.shape[1];
    for (int64_t j = 0; j < cols; ++j) {
      double ss = 0;
      for (int64_t i = 0; i < rows; ++i)
        ss += q.values[static_cast<size_t>(i * cols + j)] * q.values[static_cast<size_t>(i * cols + j)];
      EXPECT_NEAR(std::sqrt(ss), 1.0, 1e-6) << "column " << j << " of Q";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllAlgorithms, ZeroGradient_WeightDecayOnly, ::testing::ValuesIn(all_algos_2d()),
                         algo_shape_name);

// ---------------------------------------------------------------------------
// Non-finite gradients
// ---------------------------------------------------------------------------

// Calls 2 (NaN) and 4 (+Inf) and 5 (-Inf) are skipped: nothing changes
// (bit-for-bit), the counter stays, dion_get_skipped_steps counts them; the
// other calls must match a reference that never saw the bad steps (AdamW's
// bias correction uses the step counter, so a counted skip would show).
class NonFinite_StepIsSkipped : public ::testing::TestWithParam<AlgoShape> {};

TEST_P(NonFinite_StepIsSkipped, NanAndInf) {
  CaseSpec s = base_spec(GetParam());
  s.steps = 7;
  s.nonfinite_steps = {
      {2, std::nan("")}, {4, std::numeric_limits<double>::infinity()}, {5, -std::numeric_limits<double>::infinity()}};
  CaseRunner runner(s);
  runner.run();
  if (HasFatalFailure()) return;
  int64_t skipped = -1;
  int32_t last = -1;
  runner.optimizer().skipped(&skipped, &last);
  EXPECT_EQ(skipped, 3);
  EXPECT_EQ(last, 0) << "the last call (7) had finite gradients";
  EXPECT_EQ(runner.optimizer().group_step(runner.group()), 4);
}

INSTANTIATE_TEST_SUITE_P(AllAlgorithms, NonFinite_StepIsSkipped, ::testing::ValuesIn(all_algos_2d()), algo_shape_name);

// A NaN in one group's gradient skips the step for EVERY group.
TEST(NonFinite_StepIsSkipped, AcrossGroups) {
  LibOptimizer opt;
  ASSERT_EQ(opt.create_status(), DION_SUCCESS);
  std::mt19937_64 rng(11);
  HostTensor a({24, 16}, Dtype::kF32), b({16, 24}, Dtype::kF32), c({37}, Dtype::kF32);
  for (HostTensor* t : {&a, &b, &c}) {
    t->set_param(randn(rng, t->numel(), 0.1, Dtype::kF32));
    t->set_grad(randn(rng, t->numel(), 1.0, Dtype::kF32));
  }
  int32_t ga = -1, gb = -1, gc = -1;
  DION_ASSERT_OK(opt, opt.add_group(make_group_options(Algo::kDion, Hyper()), {&a}, &ga));
  DION_ASSERT_OK(opt, opt.add_group(make_group_options(Algo::kMuon, Hyper()), {&b}, &gb));
  DION_ASSERT_OK(opt, opt.add_group(make_group_options(Algo::kAdamW, Hyper()), {&c}, &gc));
  DION_ASSERT_OK(opt, opt.step());
  const auto pa = a.param_bytes(), pb = b.param_bytes(), pc = c.param_bytes();
  c.poke_grad(5, std::nan(""));
  DION_ASSERT_OK(opt, opt.step());
  EXPECT_TRUE(pa == a.param_bytes()) << "Dion group changed by a step with a NaN in the AdamW group";
  EXPECT_TRUE(pb == b.param_bytes()) << "Muon group changed by a step with a NaN in the AdamW group";
  EXPECT_TRUE(pc == c.param_bytes()) << "AdamW group changed by its own NaN step";
  for (int32_t g : {ga, gb, gc}) EXPECT_EQ(opt.group_step(g), 1) << "group " << g;
}

// ---------------------------------------------------------------------------
// Hyperparameter changes take effect at the next step
// ---------------------------------------------------------------------------

// Before call 3 the learning rate triples, before call 4 weight decay becomes
// 0.5 and the algorithm's own factor changes (Dion/Muon/NorMuon/NorDion2: mu;
// Dion2: ef_decay; AdamW/Lion: beta1 and beta2; NorMuon/NorDion2 also
// muon_beta2). The reference changes at the same points; get_hparam reads back.
class Hparams_TakeEffectNextStep : public ::testing::TestWithParam<AlgoShape> {};

void set_both(LibOptimizer& opt, int32_t group, std::vector<Hyper*>& refs, dion_hparam_t which, double v,
              double Hyper::*field) {
  DION_ASSERT_OK(opt, dion_group_set_hparam(opt.get(), group, which, v));
  double back = -1;
  DION_ASSERT_OK(opt, dion_group_get_hparam(opt.get(), group, which, &back));
  EXPECT_EQ(back, v) << "get_hparam after set_hparam (" << which << ")";
  for (Hyper* h : refs) h->*field = v;
}

TEST_P(Hparams_TakeEffectNextStep, LrWdAndMomentumFactors) {
  CaseSpec s = base_spec(GetParam());
  s.steps = 5;
  const Algo algo = s.algo;
  s.before_step = [algo](int call, LibOptimizer& opt, int32_t group, std::vector<Hyper*>& refs) {
    if (call == 3) set_both(opt, group, refs, DION_HPARAM_LR, 0.03, &Hyper::lr);
    if (call == 4) {
      set_both(opt, group, refs, DION_HPARAM_WEIGHT_DECAY, 0.5, &Hyper::weight_decay);
      switch (algo) {
        case Algo::kDion:
        case Algo::kMuon:
          set_both(opt, group, refs, DION_HPARAM_MU, 0.6, &Hyper::mu);
          break;
        case Algo::kNorMuon:
        case Algo::kNorDion2:
          set_both(opt, group, refs, DION_HPARAM_MU, 0.6, &Hyper::mu);
          set_both(opt, group, refs, DION_HPARAM_MUON_BETA2, 0.7, &Hyper::muon_beta2);
          break;
        case Algo::kDion2:
          set_both(opt, group, refs, DION_HPARAM_EF_DECAY, 0.6, &Hyper::ef_decay);
          break;
        case Algo::kAdamW:
        case Algo::kLion:
          set_both(opt, group, refs, DION_HPARAM_BETA1, 0.8, &Hyper::beta1);
          set_both(opt, group, refs, DION_HPARAM_BETA2, 0.99, &Hyper::beta2);
          break;
      }
    }
    if (call == 5) set_both(opt, group, refs, DION_HPARAM_LR, 0.005, &Hyper::lr);
  };
  run_case(s);
}

INSTANTIATE_TEST_SUITE_P(AllAlgorithms, Hparams_TakeEffectNextStep, ::testing::ValuesIn(all_algos_2d()),
                         algo_shape_name);

// ---------------------------------------------------------------------------
// Column-major tensors
// ---------------------------------------------------------------------------

// A COL_MAJOR buffer holds the logical m x n matrix column-major: the results
// (parameter and states, read back in logical order) must match the reference
// AND the library's own row-major run on the same logical data.
class ColMajor_MatchesRowMajor : public ::testing::TestWithParam<AlgoShape> {};

TEST_P(ColMajor_MatchesRowMajor, FourSteps) {
  CaseSpec col = base_spec(GetParam());
  col.layout = DION_LAYOUT_COL_MAJOR;
  CaseRunner rc(col);
  rc.run();  // against the reference
  if (HasFatalFailure()) return;
  CaseSpec row = col;
  row.layout = DION_LAYOUT_ROW_MAJOR;
  CaseRunner rr(row);
  rr.run();
  if (HasFatalFailure()) return;
  // Same data seed, same library seed: the two runs differ only in layout.
  const double err = rel_change_error(rc.tensor(0).param(), rr.tensor(0).param(), rr.x0(0));
  EXPECT_LE(err, 2 * default_tolerance(col.algo, Dtype::kF32).floor) << "col-major vs row-major library runs";
}

std::vector<AlgoShape> colmajor_cases() {
  std::vector<AlgoShape> out = all_algos_2d();
  for (Algo a : kAllAlgos) out.push_back({a, {2, 3}});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllAlgorithms, ColMajor_MatchesRowMajor, ::testing::ValuesIn(colmajor_cases()),
                         algo_shape_name);

// ---------------------------------------------------------------------------
// Gradient dtype and matmul precision
// ---------------------------------------------------------------------------

// bf16 parameters with fp32 gradients (grad_dtype != param_dtype): the
// gradient enters the fp32 arithmetic unrounded.
class GradDtype_Fp32GradsBf16Params : public ::testing::TestWithParam<AlgoShape> {};

TEST_P(GradDtype_Fp32GradsBf16Params, FourSteps) {
  CaseSpec s = base_spec(GetParam());
  s.dtype = Dtype::kBF16;
  s.fp32_grads = true;
  s.x_scale = 0.01;  // the update must be many bf16 ulps of X
  s.hyper.lr = 0.02;
  run_case(s);
}

INSTANTIATE_TEST_SUITE_P(AllAlgorithms, GradDtype_Fp32GradsBf16Params, ::testing::ValuesIn(all_algos_2d()),
                         algo_shape_name);

// matmul_precision TF32 / BF16 are documented as FP32 on the host: the results
// must be bit-identical to the FP32 run.
class MatmulPrecision_HostIsFp32 : public ::testing::TestWithParam<AlgoShape> {};

TEST_P(MatmulPrecision_HostIsFp32, BitIdentical) {
  std::vector<std::vector<unsigned char>> results;
  for (dion_matmul_precision_t prec : {DION_MATMUL_FP32, DION_MATMUL_TF32, DION_MATMUL_BF16}) {
    CaseSpec s = base_spec(GetParam());
    s.knobs.matmul_precision = prec;
    CaseRunner r(s);
    r.run();
    if (HasFatalFailure()) return;
    results.push_back(r.tensor(0).param_bytes());
  }
  EXPECT_TRUE(results[1] == results[0]) << "TF32 differs from FP32 on the host";
  EXPECT_TRUE(results[2] == results[0]) << "BF16 differs from FP32 on the host";
}

std::vector<AlgoShape> matrix_algos() {
  std::vector<AlgoShape> out;
  for (Algo a : {Algo::kDion, Algo::kDion2, Algo::kMuon, Algo::kNorMuon, Algo::kNorDion2}) out.push_back({a, {24, 16}});
  return out;
}

INSTANTIATE_TEST_SUITE_P(MatrixAlgorithms, MatmulPrecision_HostIsFp32, ::testing::ValuesIn(matrix_algos()),
                         algo_shape_name);

// ---------------------------------------------------------------------------
// State round trip (STYLE.md §D.17)
// ---------------------------------------------------------------------------

// After 2 steps every state of optimizer A is copied into a fresh optimizer B
// (dion_state_read / dion_state_write, dion_group_set_step) holding a copy of
// A's parameter. Both then take 3 more identical steps: B must stay
// bit-identical to A (the state API captures everything, including Dion's Q
// and AdamW's step counter; RCQR sketches are keyed by seed, tensor and step),
// and both must keep matching the reference.
class StateRoundTrip_ResumeIsExact : public ::testing::TestWithParam<AlgoShape> {};

TEST_P(StateRoundTrip_ResumeIsExact, ThreeStepsAfterResume) {
  const AlgoShape& p = GetParam();
  Hyper h;
  h.rank_fraction = 0.5;
  h.fraction = 0.5;
  std::mt19937_64 rng(41);
  LibOptimizer a;
  ASSERT_EQ(a.create_status(), DION_SUCCESS);
  HostTensor ta(p.shape, Dtype::kF32);
  const std::vector<double> x0 = randn(rng, ta.numel(), 0.1, Dtype::kF32);
  ta.set_param(x0);
  int32_t ga = -1, gb = -1;
  DION_ASSERT_OK(a, a.add_group(make_group_options(p.algo, h), {&ta}, &ga));
  dionref::Matrix<double> q0;
  if (p.algo == Algo::kDion) {
    StateBuffer q;
    DION_ASSERT_OK(a, a.read_state(0, "Q", &q));
    q0 = dionref::Matrix<double>(q.shape[0], q.shape[1]);
    q0.v = q.values;
  }
  dionref::TensorReference<double> ref(p.algo, h, p.shape, Dtypes::all(Dtype::kF32), x0, q0);
  std::vector<std::vector<double>> grads;
  for (int i = 0; i < 5; ++i) grads.push_back(randn(rng, ta.numel(), 1.0, Dtype::kF32));
  for (int i = 0; i < 2; ++i) {
    ta.set_grad(grads[static_cast<size_t>(i)]);
    DION_ASSERT_OK(a, a.step());
    ref.step(grads[static_cast<size_t>(i)]);
  }

  LibOptimizer b(/*seed=*/0);
  ASSERT_EQ(b.create_status(), DION_SUCCESS);
  HostTensor tb(p.shape, Dtype::kF32);
  tb.set_param(ta.param());
  DION_ASSERT_OK(b, b.add_group(make_group_options(p.algo, h), {&tb}, &gb));
  int32_t na = 0, nb = 0;
  DION_ASSERT_OK(a, dion_state_count(a.get(), &na));
  DION_ASSERT_OK(b, dion_state_count(b.get(), &nb));
  ASSERT_EQ(na, nb);
  for (int32_t i = 0; i < na; ++i) {
    dion_state_info_t ia{}, ib{};
    ia.struct_size = ib.struct_size = sizeof(dion_state_info_t);
    DION_ASSERT_OK(a, dion_state_info(a.get(), i, &ia));
    DION_ASSERT_OK(b, dion_state_info(b.get(), i, &ib));
    ASSERT_STREQ(ia.name, ib.name);
    ASSERT_EQ(ia.local_bytes, ib.local_bytes);
    std::vector<unsigned char> buf(static_cast<size_t>(ia.local_bytes));
    DION_ASSERT_OK(a, dion_state_read(a.get(), i, buf.data(), ia.local_bytes, nullptr));
    DION_ASSERT_OK(b, dion_state_write(b.get(), i, buf.data(), ia.local_bytes, nullptr));
  }
  DION_ASSERT_OK(b, dion_group_set_step(b.get(), gb, a.group_step(ga)));
  EXPECT_EQ(b.group_step(gb), 2);

  for (int i = 2; i < 5; ++i) {
    ta.set_grad(grads[static_cast<size_t>(i)]);
    tb.set_grad(grads[static_cast<size_t>(i)]);
    DION_ASSERT_OK(a, a.step());
    DION_ASSERT_OK(b, b.step());
    ref.step(grads[static_cast<size_t>(i)]);
    EXPECT_TRUE(ta.param_bytes() == tb.param_bytes())
        << "resumed optimizer is not bit-identical to the original after step " << i + 1;
    EXPECT_LE(rel_change_error(tb.param(), ref.state().x, x0),
              case_tolerance(p.algo, Dtype::kF32, h, {p.shape}).bound(0))
        << "resumed optimizer vs reference after step " << i + 1;
  }
  for (const std::string& name : state_names(p.algo)) {
    StateBuffer sa, sb;
    DION_ASSERT_OK(a, a.read_state(0, name.c_str(), &sa));
    DION_ASSERT_OK(b, b.read_state(0, name.c_str(), &sb));
    EXPECT_TRUE(sa.values == sb.values) << "state " << name << " differs after resume";
  }
}

std::vector<AlgoShape> roundtrip_cases() {
  std::vector<AlgoShape> out = all_algos_2d();
  for (Algo a : {Algo::kMuon, Algo::kNorMuon, Algo::kDion2, Algo::kNorDion2, Algo::kAdamW, Algo::kLion})
    out.push_back({a, {2, 8, 12}});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllAlgorithms, StateRoundTrip_ResumeIsExact, ::testing::ValuesIn(roundtrip_cases()),
                         algo_shape_name);

// ---------------------------------------------------------------------------
// Groups and missing gradients
// ---------------------------------------------------------------------------

// A tensor added with grad = NULL is skipped: not even decayed; the other
// tensors of its group follow their references. Rebinding a gradient later
// brings it back.
TEST(NullGrad, TensorIsSkipped) {
  for (Algo algo : kAllAlgos) {
    SCOPED_TRACE(dionref::algo_name(algo));
    LibOptimizer opt;
    ASSERT_EQ(opt.create_status(), DION_SUCCESS);
    std::mt19937_64 rng(21);
    HostTensor live({24, 16}, Dtype::kF32), idle({24, 16}, Dtype::kF32);
    const std::vector<double> x0 = randn(rng, live.numel(), 0.1, Dtype::kF32);
    live.set_param(x0);
    idle.set_param(randn(rng, idle.numel(), 0.1, Dtype::kF32));
    idle.set_grad(randn(rng, idle.numel(), 1.0, Dtype::kF32));  // present in memory but not given
    Hyper h;
    h.rank_fraction = 0.5;
    h.fraction = 0.5;
    DION_ASSERT_OK(opt, opt.add_group(make_group_options(algo, h), {&live, &idle}, nullptr, {true, false}));
    dionref::Matrix<double> q0;
    if (algo == Algo::kDion) {
      StateBuffer q;
      DION_ASSERT_OK(opt, opt.read_state(0, "Q", &q));
      q0 = dionref::Matrix<double>(q.shape[0], q.shape[1]);
      q0.v = q.values;
    }
    dionref::TensorReference<double> ref(algo, h, {24, 16}, Dtypes::all(Dtype::kF32), x0, q0);
    const auto idle_before = idle.param_bytes();
    for (int step = 0; step < 3; ++step) {
      const std::vector<double> g = randn(rng, live.numel(), 1.0, Dtype::kF32);
      live.set_grad(g);
      DION_ASSERT_OK(opt, opt.step());
      ref.step(g);
    }
    EXPECT_TRUE(idle_before == idle.param_bytes()) << "a tensor without gradient was modified";
    EXPECT_LE(rel_change_error(live.param(), ref.state().x, x0), default_tolerance(algo, Dtype::kF32).bound(0));
  }
}

// Several groups of different algorithms in one optimizer: each tensor follows
// its own reference; every group's counter advances once per dion_step.
TEST(MultiGroup, EachGroupFollowsItsReference) {
  LibOptimizer opt;
  ASSERT_EQ(opt.create_status(), DION_SUCCESS);
  std::mt19937_64 rng(31);
  struct Item {
    Algo algo;
    std::vector<int64_t> shape;
  };
  const std::vector<Item> items = {{Algo::kDion, {24, 16}},  {Algo::kMuon, {16, 24}},     {Algo::kNorMuon, {2, 8, 12}},
                                   {Algo::kDion2, {24, 16}}, {Algo::kNorDion2, {16, 24}}, {Algo::kAdamW, {37}},
                                   {Algo::kLion, {5, 7}}};
  std::vector<std::unique_ptr<HostTensor>> tensors;
  std::vector<std::unique_ptr<dionref::TensorReference<double>>> refs;
  std::vector<std::vector<double>> x0s;
  std::vector<int32_t> groups;
  Hyper h;
  h.rank_fraction = 0.5;
  for (size_t i = 0; i < items.size(); ++i) {
    tensors.emplace_back(new HostTensor(items[i].shape, Dtype::kF32));
    x0s.push_back(randn(rng, tensors.back()->numel(), 0.1, Dtype::kF32));
    tensors.back()->set_param(x0s.back());
    int32_t g = -1;
    DION_ASSERT_OK(opt, opt.add_group(make_group_options(items[i].algo, h), {tensors.back().get()}, &g));
    EXPECT_EQ(g, static_cast<int32_t>(i));
    groups.push_back(g);
    dionref::Matrix<double> q0;
    if (items[i].algo == Algo::kDion) {
      StateBuffer q;
      DION_ASSERT_OK(opt, opt.read_state(static_cast<int32_t>(i), "Q", &q));
      q0 = dionref::Matrix<double>(q.shape[0], q.shape[1]);
      q0.v = q.values;
    }
    refs.emplace_back(new dionref::TensorReference<double>(items[i].algo, h, items[i].shape, Dtypes::all(Dtype::kF32),
                                                           x0s.back(), q0));
  }
  for (int step = 1; step <= 4; ++step) {
    for (size_t i = 0; i < items.size(); ++i) {
      const std::vector<double> g = randn(rng, tensors[i]->numel(), 1.0, Dtype::kF32);
      tensors[i]->set_grad(g);
      refs[i]->step(g);
    }
    DION_ASSERT_OK(opt, opt.step());
    for (size_t i = 0; i < items.size(); ++i) {
      EXPECT_EQ(opt.group_step(groups[i]), step);
      EXPECT_LE(rel_change_error(tensors[i]->param(), refs[i]->state().x, x0s[i]),
                default_tolerance(items[i].algo, Dtype::kF32).bound(0))
          << dionref::algo_name(items[i].algo) << " after step " << step;
    }
  }
}

}  // namespace
}  // namespace dion_algo_test

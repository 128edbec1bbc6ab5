// SPDX-License-Identifier: MIT
// Per-group matmul precision on the CUDA backend (DION_MATMUL_TF32, _BF16).
// Property: one step at reduced precision gives the fp32 host backend's
// update up to the precision's rounding. Reference: the host backend (plain
// fp32), same seed, parameters and gradient.
//
// Tolerances, relative Frobenius error of the update X1 - X0:
//  - TF32 (10 explicit significand bits, unit roundoff 2^-11 ~ 4.9e-4): a
//    product of K terms has a relative error of a few roundoffs (the inputs
//    are rounded once, accumulation is fp32); the Muon polynomial chains
//    15 products, Dion 4 large ones plus the small factorizations in fp32:
//    bound 20 * 2^-11 ~ 1e-2.
//  - BF16 (7 explicit bits, roundoff 2^-8 ~ 3.9e-3; the Muon family also
//    stores every iterate in bf16): bound 20 * 2^-8 ~ 7.8e-2.
// The same tests also assert the error is not tiny for BF16 Muon and for
// BF16 Dion with a bf16 momentum (> 2^-12): the reduced precision is really
// used (a silently-fp32 path would pass the bound but not this). Dion with a
// bf16 momentum (the CUDA backend's bf16 products of M, src/algo/dion.cpp)
// runs three steps, so that the error feedback stored in the momentum
// reaches the update (with one power iteration, and with two: the second
// starts from a bf16 copy of R); its host reference keeps the bf16 momentum too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.h"

namespace {

using namespace dion_gpu_test;

struct Case {
  dion_algorithm_t algo;
  dion_matmul_precision_t prec;
  dion_dtype_t momentum = DION_DTYPE_UNSET;
  int steps = 1;
  int power_iters = 1;  // Dion
};

std::vector<float> run(dion_backend_t backend, const Case& c, const std::vector<float>& x0,
                       const std::vector<float>& g, int64_t m, int64_t n) {
  Optimizer opt;
  dion_options_t o = options(backend, 7);
  if (opt.create(o) != DION_SUCCESS) return {};
  dion_group_options_t go = group_options(c.algo);
  go.lr = 0.01;
  go.weight_decay = 0.0;
  go.matmul_precision = c.prec;
  if (c.algo == DION_ALGO_DION) go.rank_fraction = 0.25;
  go.momentum_dtype = c.momentum;
  if (c.algo == DION_ALGO_DION) go.power_iters = c.power_iters;
  std::vector<float> x = x0;
  const size_t bytes = x.size() * sizeof(float);
  DeviceBuffer dx, dg;
  void* pp = x.data();
  const void* gp = g.data();
  if (backend == DION_BACKEND_CUDA) {
    EXPECT_EQ(dx.allocate(bytes), cudaSuccess);
    EXPECT_EQ(dg.allocate(bytes), cudaSuccess);
    EXPECT_EQ(dx.upload(x.data(), bytes), cudaSuccess);
    EXPECT_EQ(dg.upload(g.data(), bytes), cudaSuccess);
    pp = dx.get();
    gp = dg.get();
  }
  dion_tensor_t t = descriptor("w", pp, gp, DION_DTYPE_FP32, {m, n});
  EXPECT_EQ(dion_add_group(opt, &go, &t, 1, nullptr), DION_SUCCESS) << dion_last_error(opt);
  for (int k = 0; k < c.steps; ++k) EXPECT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  if (backend == DION_BACKEND_CUDA) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(dx.download(x.data(), bytes), cudaSuccess);
  }
  return x;
}

class Precision : public ::testing::TestWithParam<Case> {};

TEST_P(Precision, UpdateMatchesFp32HostWithinThePrecisionsRounding) {
  DION_REQUIRE_GPU();
  const Case c = GetParam();
  const int64_t m = 256, n = 512;
  std::vector<float> x0(static_cast<size_t>(m * n)), g(x0.size());
  for (size_t i = 0; i < x0.size(); ++i) {
    x0[i] = 0.05f * hash_uniform(1, i);
    g[i] = hash_uniform(2, i);
  }
  const std::vector<float> xh = run(DION_BACKEND_HOST, Case{c.algo, DION_MATMUL_FP32, c.momentum, c.steps, c.power_iters}, x0, g, m, n);
  const std::vector<float> xd = run(DION_BACKEND_CUDA, c, x0, g, m, n);
  ASSERT_EQ(xh.size(), x0.size());
  ASSERT_EQ(xd.size(), x0.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < x0.size(); ++i) {
    const double uh = static_cast<double>(xh[i]) - x0[i], ud = static_cast<double>(xd[i]) - x0[i];
    num += (uh - ud) * (uh - ud);
    den += uh * uh;
  }
  ASSERT_GT(den, 0.0);
  const double err = std::sqrt(num / den);
  const double bound = c.prec == DION_MATMUL_TF32 ? 20 * std::ldexp(1.0, -11) : 20 * std::ldexp(1.0, -8);
  EXPECT_LT(err, bound) << algo_name(c.algo) << " precision " << c.prec;
  if (c.prec == DION_MATMUL_BF16 && (c.algo == DION_ALGO_MUON || c.momentum == DION_DTYPE_BF16))
    EXPECT_GT(err, std::ldexp(1.0, -12)) << "a BF16 step equal to fp32 to 2^-12: is bf16 used at all?";
  RecordProperty("relative_error", std::to_string(err));
}

INSTANTIATE_TEST_SUITE_P(
    All, Precision,
    ::testing::Values(Case{DION_ALGO_MUON, DION_MATMUL_TF32}, Case{DION_ALGO_MUON, DION_MATMUL_BF16},
                      Case{DION_ALGO_NORMUON, DION_MATMUL_BF16}, Case{DION_ALGO_DION2, DION_MATMUL_BF16},
                      Case{DION_ALGO_NORDION2, DION_MATMUL_BF16}, Case{DION_ALGO_DION, DION_MATMUL_TF32},
                      Case{DION_ALGO_DION, DION_MATMUL_BF16},
                      Case{DION_ALGO_DION, DION_MATMUL_BF16, DION_DTYPE_BF16, 3},
                      Case{DION_ALGO_DION, DION_MATMUL_BF16, DION_DTYPE_BF16, 3, 2}),
    [](const ::testing::TestParamInfo<Case>& i) {
      return std::string(algo_name(i.param.algo)) + (i.param.prec == DION_MATMUL_TF32 ? "_tf32" : "_bf16") +
             (i.param.momentum == DION_DTYPE_BF16 ? "_bf16_momentum_3_steps" : "") +
             (i.param.power_iters > 1 ? "_2_power_iters" : "");
    });

double rel_update_diff(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& x0) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x0.size(); ++i) {
    const double ua = static_cast<double>(a[i]) - x0[i], ub = static_cast<double>(b[i]) - x0[i];
    num += (ua - ub) * (ua - ub);
    den += ua * ua;
  }
  return den > 0 ? std::sqrt(num / den) : INFINITY;
}

// One A/B of a switch the CUDA backend reads (DION_... = 0 turns a path
// off): from the same x0 and g (hash seeds sx, sg), three steps of the fp32
// host and of the CUDA backend at BF16 matmuls with the switch on (default)
// and off (env set to "0"); the relative update differences of each against
// the host and between the two. NaN where a run failed (the size assertions say which).
struct SwitchAb {
  double on = NAN, off = NAN, between = NAN;
};
SwitchAb switch_ab(dion_algorithm_t algo, const char* env, int64_t m, int64_t n, uint64_t sx, uint64_t sg) {
  SwitchAb r;
  std::vector<float> x0(static_cast<size_t>(m * n)), g(x0.size());
  // Dion2 and NorDion2 select the quarter of the slices along the shorter
  // side with the largest L1 norms of the momentum: the host and the device
  // sum those norms in different orders (fp32, relative error up to about
  // long-side x 2^-24 ~ 3e-5 at 512), and with g uniform the 64th and 65th
  // norms come within that of each other at some step for some seeds (1 in
  // 3 pairs here; 2.8e-7 apart at 256 x 512 with seeds 7 and 8 at the third
  // step), when the two runs update different slices. Every fourth slice's
  // gradient is doubled, so the same quarter is selected at every step with
  // its norms about 1.6 x the others': the runs compare the iteration, not
  // the order of a sum.
  const bool selects = algo == DION_ALGO_DION2 || algo == DION_ALGO_NORDION2;
  for (size_t i = 0; i < x0.size(); ++i) {
    const int64_t e = static_cast<int64_t>(i), slice = m <= n ? e / n : e % n;
    x0[i] = 0.05f * hash_uniform(sx, i);
    g[i] = (selects && slice % 4 == 0 ? 2.0f : 1.0f) * hash_uniform(sg, i);
  }
  const Case c{algo, DION_MATMUL_BF16, DION_DTYPE_UNSET, 3};
  const std::vector<float> xh = run(DION_BACKEND_HOST, Case{algo, DION_MATMUL_FP32, DION_DTYPE_UNSET, 3}, x0, g, m, n);
  const std::vector<float> xon = run(DION_BACKEND_CUDA, c, x0, g, m, n);
  const std::vector<float> xoff = [&] {
    ScopedEnv off(env, "0");
    return run(DION_BACKEND_CUDA, c, x0, g, m, n);
  }();
  EXPECT_EQ(xh.size(), x0.size());
  EXPECT_EQ(xon.size(), x0.size());
  EXPECT_EQ(xoff.size(), x0.size());
  if (xh.size() != x0.size() || xon.size() != x0.size() || xoff.size() != x0.size()) return r;
  r.on = rel_update_diff(xh, xon, x0);
  r.off = rel_update_diff(xh, xoff, x0);
  r.between = rel_update_diff(xoff, xon, x0);
  return r;
}

const double kBf16Bound = 20 * std::ldexp(1.0, -8);  // the BF16 bound at the top

// The bf16 iteration from an unnormalised start (src/algo/orthogonalize.cpp,
// orthogonalize_bf16_unnormalised): Dion2 with BF16 matmuls selects its
// slices straight into bf16, Muon writes U in bf16, each with its sums of
// squares, and the iteration scales its first step's small Gram matrices
// instead of normalising the start (DION_DION2_BF16_SLICES=0 and
// DION_MUON_BF16_START=0 keep the fp32 start, normalised in a pass of its
// own). Both are the bf16 iteration up to where the start is rounded: each
// within the BF16 bound above of the fp32 host, and of each other; and not
// the same bits (the switch changes the path). Wide and tall parameters
// (Dion2: rows, and columns, selected), three steps.
void bf16_start_matches_the_normalised_start(dion_algorithm_t algo, const char* env) {
  for (const auto& [m, n] : std::initializer_list<std::pair<int64_t, int64_t>>{{256, 512}, {512, 256}}) {
    SCOPED_TRACE(::testing::Message() << m << " x " << n);
    const SwitchAb d = switch_ab(algo, env, m, n, 3, 4);
    EXPECT_LT(d.on, kBf16Bound);
    EXPECT_LT(d.off, kBf16Bound);
    EXPECT_LT(d.between, kBf16Bound);
    EXPECT_GT(d.between, 0.0) << "the switch changed nothing: is the bf16 start used?";
    std::printf("  %s %lld x %lld: vs fp32 host %.3g (bf16 start), %.3g (fp32 start); between %.3g\n",
                algo_name(algo), static_cast<long long>(m), static_cast<long long>(n), d.on, d.off, d.between);
  }
}

TEST(Bf16Start, Dion2SlicesMatchFp32SlicesWithinBf16Rounding) {
  DION_REQUIRE_GPU();
  bf16_start_matches_the_normalised_start(DION_ALGO_DION2, "DION_DION2_BF16_SLICES");
}

// NorDion2 reads its bf16 result where it lies: neuron_scales takes the
// selected rows' statistics from it and the update normalises the rows as
// it reads them (decay_add_slices_multi's scales), with its slices selected
// straight into bf16 as Dion2's; DION_NORDION2_SCALES=0 keeps the widened
// fp32 result, normalised in a pass of its own, and the fp32 slices.
TEST(Bf16Start, NorDion2ScalesMatchTheWidenedResultWithinBf16Rounding) {
  DION_REQUIRE_GPU();
  bf16_start_matches_the_normalised_start(DION_ALGO_NORDION2, "DION_NORDION2_SCALES");
}

TEST(Bf16Start, MuonMatchesFp32StartWithinBf16Rounding) {
  DION_REQUIRE_GPU();
  bf16_start_matches_the_normalised_start(DION_ALGO_MUON, "DION_MUON_BF16_START");
}

// NorMuon takes Muon's bf16 start; its neuron normalisation reads the
// result widened to fp32.
TEST(Bf16Start, NorMuonMatchesFp32StartWithinBf16Rounding) {
  DION_REQUIRE_GPU();
  bf16_start_matches_the_normalised_start(DION_ALGO_NORMUON, "DION_MUON_BF16_START");
}

// The iteration's Gram matrix and A A by blocks (Backend::gemm_bf16_lower and
// mirror_bf16: 4 x 4 blocks at s = 1024 and 1152; the ops test checks the
// ops themselves): Muon and NorMuon with them and with the full products
// (DION_SYM_PRODUCTS=0, read at dion_create) are each within the BF16 bound
// above of the fp32 host, over three steps, wide and tall.
TEST(SymProducts, MuonFamilyMatchesFullProductsWithinBf16Rounding) {
  DION_REQUIRE_GPU();
  for (dion_algorithm_t algo : {DION_ALGO_MUON, DION_ALGO_NORMUON})
    for (const auto& [m, n] : std::initializer_list<std::pair<int64_t, int64_t>>{{1024, 2048}, {2048, 1024}, {1152, 1152}}) {
      SCOPED_TRACE(::testing::Message() << algo_name(algo) << " " << m << " x " << n);
      const SwitchAb d = switch_ab(algo, "DION_SYM_PRODUCTS", m, n, 5, 6);
      EXPECT_LT(d.on, kBf16Bound);
      EXPECT_LT(d.off, kBf16Bound);
      std::printf("  %s %lld x %lld: vs fp32 host %.3g (blocks), %.3g (full); between %.3g\n", algo_name(algo),
                  static_cast<long long>(m), static_cast<long long>(n), d.on, d.off, d.between);
    }
}

// The Gram form of the bf16 iteration (src/algo/ns_bf16.hpp; the default,
// DION_NS_GRAM=0 the classic form; taken where the long side is at least
// twice the short): Muon (bf16 start, and with DION_MUON_BF16_START=0 the
// fp32 start normalised into bf16), NorMuon and Dion2 (its selected slices,
// a quarter of one side, so the long side is at least twice the short here
// too) with it are within the BF16 bound above of the fp32 host and of the
// classic form, over three steps, wide and tall, with the Gram matrix by
// blocks (s = 1024) and whole; not the classic form's bits (the Gram form
// ran); and, the project's rule for a half-precision path against the plain
// one, at most 2 x the classic form's distance to the fp32 host.
// tests/unit/test_ns_bf16.cpp checks both forms against float64 through the
// host backend's bf16 ops.
TEST(NsGram, MuonFamilyMatchesTheClassicFormWithinBf16Rounding) {
  DION_REQUIRE_GPU();
  struct Run {
    dion_algorithm_t algo;
    bool fp32_start;
  };
  for (const Run& run : {Run{DION_ALGO_MUON, false}, Run{DION_ALGO_MUON, true}, Run{DION_ALGO_NORMUON, false},
                         Run{DION_ALGO_DION2, false}})
    for (const auto& [m, n] :
         std::initializer_list<std::pair<int64_t, int64_t>>{{256, 512}, {512, 256}, {1024, 2048}, {2048, 1024}}) {
      if (run.algo == DION_ALGO_DION2 && m > 512) continue;
      SCOPED_TRACE(::testing::Message() << algo_name(run.algo) << (run.fp32_start ? " (fp32 start) " : " ") << m
                                        << " x " << n);
      std::optional<ScopedEnv> fp32_start;
      if (run.fp32_start) fp32_start.emplace("DION_MUON_BF16_START", "0");
      const SwitchAb d = switch_ab(run.algo, "DION_NS_GRAM", m, n, 7, 8);
      fp32_start.reset();
      EXPECT_LT(d.on, kBf16Bound);
      EXPECT_LT(d.off, kBf16Bound);
      EXPECT_LT(d.between, kBf16Bound);
      EXPECT_LE(d.on, 2 * d.off) << "the Gram form more than 2 x the classic form's distance to the fp32 host";
      EXPECT_GT(d.between, 0.0) << "DION_NS_GRAM=0 changed nothing: did the Gram form run?";
      std::printf("  %s%s %lld x %lld: vs fp32 host %.3g (Gram), %.3g (classic); between %.3g\n", algo_name(run.algo),
                  run.fp32_start ? " (fp32 start)" : "", static_cast<long long>(m), static_cast<long long>(n), d.on,
                  d.off, d.between);
    }
}

// The lockstep group step (src/algo/muon.cpp; DION_NS_LOCKSTEP=0 steps bucket
// by bucket): a group's buckets whose matrices take the Gram form at one short
// side s < 1024 run their bf16 iterations as one, their s x s products over
// all of their matrices at once. Muon and NorMuon over one group of five
// shapes, two tensors each: three at s = 256 in the Gram form (768 x 256 and
// 512 x 256 tall, 256 x 1024 wide: they run together), a square 256 x 256
// (the classic form) and 128 x 512 (another s), both stepped on their own.
// Three steps with the lockstep and without are each within the BF16 bound
// above of the fp32 host, tensor by tensor, and of each other; and the
// lockstep's workspace (dion_get_memory_usage) is the larger: its buckets'
// buffers are alive at once, so it was planned.
std::vector<std::vector<float>> run_group(dion_backend_t backend, dion_algorithm_t algo, dion_matmul_precision_t prec,
                                          const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                          const std::vector<std::vector<float>>& x0,
                                          const std::vector<std::vector<float>>& g, uint64_t* ws_bytes,
                                          dion_dtype_t momentum = DION_DTYPE_UNSET, int steps = 3,
                                          uint64_t* ws_planned = nullptr) {
  Optimizer opt;
  if (opt.create(options(backend, 7)) != DION_SUCCESS) return {};
  dion_group_options_t go = group_options(algo);
  go.lr = 0.01;
  go.weight_decay = 0.0;
  go.matmul_precision = prec;
  go.momentum_dtype = momentum;
  if (algo == DION_ALGO_DION) go.rank_fraction = 0.25;
  std::vector<std::vector<float>> x = x0;
  std::vector<DeviceBuffer> dx(x.size()), dg(x.size());
  std::vector<dion_tensor_t> ts;
  std::vector<std::string> names;
  for (size_t i = 0; i < x.size(); ++i) names.push_back("w" + std::to_string(i));
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t bytes = x[i].size() * sizeof(float);
    void* pp = x[i].data();
    const void* gp = g[i].data();
    if (backend == DION_BACKEND_CUDA) {
      EXPECT_EQ(dx[i].allocate(bytes), cudaSuccess);
      EXPECT_EQ(dg[i].allocate(bytes), cudaSuccess);
      EXPECT_EQ(dx[i].upload(x[i].data(), bytes), cudaSuccess);
      EXPECT_EQ(dg[i].upload(g[i].data(), bytes), cudaSuccess);
      pp = dx[i].get();
      gp = dg[i].get();
    }
    const auto& [m, n] = shapes[i];
    ts.push_back(descriptor(names[i].c_str(), pp, gp, DION_DTYPE_FP32, {m, n}));
  }
  EXPECT_EQ(dion_add_group(opt, &go, ts.data(), static_cast<int32_t>(ts.size()), nullptr), DION_SUCCESS)
      << dion_last_error(opt);
  uint64_t state = 0;
  if (ws_planned) EXPECT_EQ(dion_get_memory_usage(opt, &state, ws_planned), DION_SUCCESS);  // before any step
  for (int k = 0; k < steps; ++k) EXPECT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  *ws_bytes = 0;
  EXPECT_EQ(dion_get_memory_usage(opt, &state, ws_bytes), DION_SUCCESS);
  if (backend == DION_BACKEND_CUDA) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_EQ(dx[i].download(x[i].data(), x[i].size() * sizeof(float)), cudaSuccess);
  }
  return x;
}

// x0 and g of a group's tensors (hash_uniform, seeds 20 + i and 40 + i).
void group_inputs(const std::vector<std::pair<int64_t, int64_t>>& shapes, std::vector<std::vector<float>>& x0,
                  std::vector<std::vector<float>>& g) {
  for (size_t i = 0; i < shapes.size(); ++i) {
    const size_t e = static_cast<size_t>(shapes[i].first * shapes[i].second);
    x0.emplace_back(e);
    g.emplace_back(e);
    for (size_t j = 0; j < e; ++j) {
      x0[i][j] = 0.05f * hash_uniform(20 + i, j);
      g[i][j] = hash_uniform(40 + i, j);
    }
  }
}

// One A/B of a switch over a group (run_group, three steps): the fp32 host
// and the CUDA backend at BF16 matmuls with `env` unset (on) and set to "0"
// (off), each tensor's relative update distances within the BF16 bound
// (and, with at_most_twice, on at most 2 x off, the rule for a half-precision
// path against the one it replaces); out: the largest over the tensors and
// the two runs' workspaces.
struct GroupAb {
  double on = 0, off = 0, between = 0;
  uint64_t ws_on = 0, ws_off = 0;
};
void group_switch_ab(dion_algorithm_t algo, const char* env, const std::vector<std::pair<int64_t, int64_t>>& shapes,
                     dion_dtype_t momentum, bool at_most_twice, GroupAb* out) {
  std::vector<std::vector<float>> x0, g;
  group_inputs(shapes, x0, g);
  uint64_t ws_host = 0;
  const auto xh = run_group(DION_BACKEND_HOST, algo, DION_MATMUL_FP32, shapes, x0, g, &ws_host, momentum);
  const auto xon = run_group(DION_BACKEND_CUDA, algo, DION_MATMUL_BF16, shapes, x0, g, &out->ws_on, momentum);
  const auto xoff = [&] {
    ScopedEnv off(env, "0");
    return run_group(DION_BACKEND_CUDA, algo, DION_MATMUL_BF16, shapes, x0, g, &out->ws_off, momentum);
  }();
  ASSERT_EQ(xh.size(), shapes.size());
  ASSERT_EQ(xon.size(), shapes.size());
  ASSERT_EQ(xoff.size(), shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "tensor " << i << ", " << shapes[i].first << " x " << shapes[i].second);
    const double on = rel_update_diff(xh[i], xon[i], x0[i]), off = rel_update_diff(xh[i], xoff[i], x0[i]);
    const double between = rel_update_diff(xoff[i], xon[i], x0[i]);
    EXPECT_LT(on, kBf16Bound);
    EXPECT_LT(off, kBf16Bound);
    EXPECT_LT(between, kBf16Bound);
    if (at_most_twice) EXPECT_LE(on, 2 * off) << env << " on: more than 2 x the distance to the fp32 host of off";
    out->on = std::max(out->on, on);
    out->off = std::max(out->off, off);
    out->between = std::max(out->between, between);
  }
}

TEST(NsLockstep, MuonFamilyGroupMatchesBucketByBucketWithinBf16Rounding) {
  DION_REQUIRE_GPU();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (const auto& sh : std::initializer_list<std::pair<int64_t, int64_t>>{
           {768, 256}, {256, 1024}, {512, 256}, {256, 256}, {128, 512}})
    for (int k = 0; k < 2; ++k) shapes.push_back(sh);
  for (dion_algorithm_t algo : {DION_ALGO_MUON, DION_ALGO_NORMUON}) {
    SCOPED_TRACE(algo_name(algo));
    GroupAb d;
    group_switch_ab(algo, "DION_NS_LOCKSTEP", shapes, DION_DTYPE_UNSET, false, &d);
    EXPECT_GT(d.ws_on, d.ws_off) << "the lockstep's workspace was not reserved: was it planned?";
    std::printf("  %s: vs fp32 host at most %.3g (lockstep), %.3g (bucket by bucket); between %.3g; workspace %.1f / "
                "%.1f MiB\n",
                algo_name(algo), d.on, d.off, d.between, d.ws_on / 1048576.0, d.ws_off / 1048576.0);
  }
}

// Dion's phased step on one GPU with P in bf16 (src/algo/dion.cpp,
// p16_local: P = B Q written in bf16, the sketch and RCQR's first solve read
// it there, the orthonormal P finished into its bf16 copy once;
// DION_P_BF16_LOCAL=0 keeps P in fp32). A group of three shapes with one
// short side (so one rank r and one sketch size k: its buckets are phased),
// two tensors each, tall and wide, bf16 momentum, BF16 matmuls, three steps
// (the error feedback reaches the update). With and without, each within the
// BF16 bound of the fp32 host (bf16 momentum too), tensor by tensor, and of
// each other; not the same bits (the switch changed the path); and at most
// 2 x the fp32 P's distance to the host.
TEST(DionP16, PhasedGroupMatchesFp32PWithinBf16Rounding) {
  DION_REQUIRE_GPU();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (const auto& sh : std::initializer_list<std::pair<int64_t, int64_t>>{{1024, 256}, {256, 768}, {512, 256}})
    for (int k = 0; k < 2; ++k) shapes.push_back(sh);
  GroupAb d;
  group_switch_ab(DION_ALGO_DION, "DION_P_BF16_LOCAL", shapes, DION_DTYPE_BF16, true, &d);
  EXPECT_GT(d.between, 0.0) << "DION_P_BF16_LOCAL=0 changed nothing: was P in bf16?";
  std::printf("  dion: vs fp32 host at most %.3g (bf16 P), %.3g (fp32 P); between %.3g; workspace %.2f / %.2f MiB\n",
              d.on, d.off, d.between, d.ws_on / 1048576.0, d.ws_off / 1048576.0);
}

// With P in bf16 on one GPU the phased step has no fp32 P (src/algo/dion.cpp,
// fp32_p_planned): the workspace planned at dion_add_group lacks exactly
// one fp32 a x r P per bucket against DION_P_BF16_LOCAL=0, where a, B's row
// count, is one of the matrix's sides (the orientation is Dion's choice):
// between sum min(m, n) r and sum max(m, n) r floats. Eight single-tensor
// buckets of one short side (256: r = 64, tall and wide), so the phased
// step's sum over buckets, not one bucket's own step, sizes the workspace;
// one step each way runs (the bf16 path within the smaller workspace).
TEST(DionP16, PhasedWorkspaceHasNoFp32P) {
  DION_REQUIRE_GPU();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int64_t l = 512; l <= 2304; l += 256) shapes.push_back(l % 512 ? std::make_pair(int64_t(256), l)
                                                                       : std::make_pair(l, int64_t(256)));
  std::vector<std::vector<float>> x0, g;
  group_inputs(shapes, x0, g);
  uint64_t on = 0, off = 0, after = 0;
  run_group(DION_BACKEND_CUDA, DION_ALGO_DION, DION_MATMUL_BF16, shapes, x0, g, &after, DION_DTYPE_BF16, 1, &on);
  {
    ScopedEnv p_local("DION_P_BF16_LOCAL", "0");
    run_group(DION_BACKEND_CUDA, DION_ALGO_DION, DION_MATMUL_BF16, shapes, x0, g, &after, DION_DTYPE_BF16, 1, &off);
  }
  uint64_t lo = 0, hi = 0;
  for (const auto& [m, n] : shapes) {
    const int64_t r = 64;  // rank_fraction 0.25 of 256
    lo += sizeof(float) * static_cast<uint64_t>(std::min(m, n) * r);
    hi += sizeof(float) * static_cast<uint64_t>(std::max(m, n) * r + 15);  // ws_floats' rounding
  }
  ASSERT_GT(off, on) << "the fp32 P was planned with P in bf16";
  EXPECT_GE(off - on, lo);
  EXPECT_LE(off - on, hi);
  std::printf("  dion: workspace planned %.2f MiB with P in bf16, %.2f without (one fp32 P per bucket: %.2f to %.2f)\n",
              on / 1048576.0, off / 1048576.0, lo / 1048576.0, hi / 1048576.0);
}

// RCQR's sketch at matmul precision FP32 on the GPU (src/algo/dion.cpp,
// sketch_product): a bf16 S times P split into two bf16 parts, two bf16
// products with fp32 accumulation, where the host keeps the fp32 SGEMM
// (DION_SKETCH_SPLIT=0 keeps it on the GPU too). The sketch only
// preconditions: the result is P's orthonormal factor whatever R1 is, so
// what the split could cost is P1 = P R1^-1's conditioning, which grows by
// the product's relative error (up to 2^-16 from the split, plus the fp32
// accumulation) times cond(P), and Cholesky QR loses about cond(P1)^2 eps
// of orthogonality. The property is asserted on an ill-conditioned P: the
// first step's momentum is a rank-r matrix with singular values from 1 down
// to 1e-6, so cond(P = M Q0) is about 1e6 times that of the random r x r
// V^T Q0. With wd = 0, X0 = 0 and lr sqrt(m/n) = c, the step is
// X1 = -c P Q^T with Q (b x r) the "Q" state it leaves, so
// X1^T X1 = c^2 Q (P^T P) Q^T must be c^2 Q Q^T. The bound, 1e-5 relative
// (Frobenius), is set by the sketch's precision: on the host (fp32 SGEMM
// sketch, S rounded to bf16), this input gave 2.5e-7 with P exact, 3.3e-7
// with P replaced by its two bf16 parts' sum (the split), and with P
// rounded to 16 significant bits 1.4e-6, to 15 bits 3.8e-6; with S in fp32
// and P rounded to TF32's 11 bits 2.9e-3, to 9 bits 1.1e-2. So a split
// that lost its low part (a single bf16 product), or whose two parts did
// not sum to S P, fails it. Asserted on the host, on both GPU paths,
// for one tensor (orth()), a group of two buckets (the phased step) and one
// tensor of rank 63 and 515 rows (a r odd: the low part's offset rounded up
// to 16 bytes); and the switch changes the GPU's result (the split path is
// the one taken).
namespace sketch_split {

struct Result {
  std::vector<std::vector<float>> x, q;  // per tensor: X1, Q after the step
};

// The orthonormal factor of a random rows x cols matrix (the reference's
// Householder QR, in double), rounded to float.
std::vector<float> orthonormal_columns(int64_t rows, int64_t cols, uint64_t seed) {
  dionref::Matrix<double> a(rows, cols);
  for (size_t i = 0; i < a.v.size(); ++i) a.v[i] = hash_uniform(seed, i);
  const dionref::Matrix<double> q = dionref::householder_q(a);
  return std::vector<float>(q.v.begin(), q.v.end());
}

// G = U diag(sigma) V^T, U m x r and V n x r orthonormal, sigma_i = 10^(-6 i / (r - 1)).
std::vector<float> graded_gradient(int64_t m, int64_t n, int64_t r, uint64_t seed) {
  const std::vector<float> u = orthonormal_columns(m, r, seed), v = orthonormal_columns(n, r, seed + 1);
  std::vector<float> g(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < r; ++k)
        acc += std::pow(10.0, -6.0 * k / static_cast<double>(r - 1)) * u[i * r + k] * v[j * r + k];
      g[static_cast<size_t>(i * n + j)] = static_cast<float>(acc);
    }
  return g;
}

Result run(dion_backend_t backend, const std::vector<int64_t>& rows, int64_t n,
           const std::vector<std::vector<float>>& g, int64_t r) {
  Result res;
  Optimizer opt;
  if (opt.create(options(backend, 11)) != DION_SUCCESS) return res;
  dion_group_options_t go = group_options(DION_ALGO_DION);
  go.lr = 0.01;
  go.weight_decay = 0.0;
  go.matmul_precision = DION_MATMUL_FP32;
  go.rank_fraction = static_cast<double>(r) / static_cast<double>(n);
  const size_t T = rows.size();
  std::vector<DeviceBuffer> dx(T), dg(T);
  std::vector<dion_tensor_t> ts;
  res.x.resize(T);
  for (size_t t = 0; t < T; ++t) {
    res.x[t].assign(static_cast<size_t>(rows[t] * n), 0.0f);
    void* pp = res.x[t].data();
    const void* gp = g[t].data();
    const size_t bytes = res.x[t].size() * sizeof(float);
    if (backend == DION_BACKEND_CUDA) {
      EXPECT_EQ(dx[t].allocate(bytes), cudaSuccess);
      EXPECT_EQ(dg[t].allocate(bytes), cudaSuccess);
      EXPECT_EQ(dx[t].upload(res.x[t].data(), bytes), cudaSuccess);
      EXPECT_EQ(dg[t].upload(g[t].data(), bytes), cudaSuccess);
      pp = dx[t].get();
      gp = dg[t].get();
    }
    ts.push_back(descriptor("w", pp, gp, DION_DTYPE_FP32, {rows[t], n}));
  }
  EXPECT_EQ(dion_add_group(opt, &go, ts.data(), static_cast<int32_t>(T), nullptr), DION_SUCCESS)
      << dion_last_error(opt);
  EXPECT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  res.q.resize(T);
  for (size_t t = 0; t < T; ++t) {
    if (backend == DION_BACKEND_CUDA) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(dx[t].download(res.x[t].data(), res.x[t].size() * sizeof(float)), cudaSuccess);
    }
    int32_t qi = -1;
    EXPECT_EQ(dion_state_find(opt, static_cast<int32_t>(t), "Q", &qi), DION_SUCCESS) << dion_last_error(opt);
    res.q[t].assign(static_cast<size_t>(n * r), 0.0f);
    EXPECT_EQ(dion_state_read(opt, qi, res.q[t].data(), res.q[t].size() * sizeof(float), nullptr), DION_SUCCESS)
        << dion_last_error(opt);
  }
  return res;
}

// || X^T X - c^2 Q Q^T ||_F / || c^2 Q Q^T ||_F for X m x n, Q n x r.
double orth_error(const std::vector<float>& x, const std::vector<float>& q, int64_t m, int64_t n, int64_t r) {
  const double c2 = 0.01 * 0.01 * static_cast<double>(m) / static_cast<double>(n);
  double err = 0, ref = 0;
  for (int64_t a = 0; a < n; ++a)
    for (int64_t b = 0; b <= a; ++b) {
      double xx = 0, qq = 0;
      for (int64_t i = 0; i < m; ++i) xx += static_cast<double>(x[i * n + a]) * x[i * n + b];
      for (int64_t k = 0; k < r; ++k) qq += static_cast<double>(q[a * r + k]) * q[b * r + k];
      qq *= c2;
      const double w = a == b ? 1.0 : 2.0;
      err += w * (xx - qq) * (xx - qq);
      ref += w * qq * qq;
    }
  return std::sqrt(err / ref);
}

}  // namespace sketch_split

TEST(SketchSplit, Fp32SketchKeepsAnIllConditionedPOrthonormal) {
  const int64_t n = 256;
  const double bound = 1e-5;
  struct Config {
    std::vector<int64_t> rows;
    int64_t r;
  };
  const std::vector<Config> configs = {{{512}, 64}, {{512, 768}, 64}, {{515}, 63}};
  std::vector<std::vector<std::vector<float>>> grads;
  for (const Config& c : configs) {
    SCOPED_TRACE(::testing::Message() << c.rows.size() << " bucket(s), rank " << c.r << ", host");
    grads.emplace_back();
    for (size_t t = 0; t < c.rows.size(); ++t)
      grads.back().push_back(sketch_split::graded_gradient(c.rows[t], n, c.r, 40 + 2 * t));
    const sketch_split::Result h = sketch_split::run(DION_BACKEND_HOST, c.rows, n, grads.back(), c.r);
    ASSERT_EQ(h.x.size(), c.rows.size());
    for (size_t t = 0; t < c.rows.size(); ++t) {
      const double e = sketch_split::orth_error(h.x[t], h.q[t], c.rows[t], n, c.r);
      EXPECT_LT(e, bound) << "tensor " << t;
      std::printf("  host, %zu bucket(s), tensor %zu (%lld x %lld, rank %lld): %.3g\n", c.rows.size(), t,
                  static_cast<long long>(c.rows[t]), static_cast<long long>(n), static_cast<long long>(c.r), e);
    }
  }
  DION_REQUIRE_GPU();
  for (size_t ci = 0; ci < configs.size(); ++ci) {
    const Config& c = configs[ci];
    SCOPED_TRACE(::testing::Message() << c.rows.size() << " bucket(s), rank " << c.r << ", cuda");
    const sketch_split::Result on = sketch_split::run(DION_BACKEND_CUDA, c.rows, n, grads[ci], c.r);
    const sketch_split::Result off = [&] {
      ScopedEnv split("DION_SKETCH_SPLIT", "0");
      return sketch_split::run(DION_BACKEND_CUDA, c.rows, n, grads[ci], c.r);
    }();
    ASSERT_EQ(on.x.size(), c.rows.size());
    ASSERT_EQ(off.x.size(), c.rows.size());
    for (size_t t = 0; t < c.rows.size(); ++t) {
      const double eon = sketch_split::orth_error(on.x[t], on.q[t], c.rows[t], n, c.r);
      const double eoff = sketch_split::orth_error(off.x[t], off.q[t], c.rows[t], n, c.r);
      EXPECT_LT(eon, bound) << "split sketch, tensor " << t;
      EXPECT_LT(eoff, bound) << "SGEMM sketch, tensor " << t;
      EXPECT_NE(on.x[t], off.x[t]) << "DION_SKETCH_SPLIT=0 changed nothing: was the split sketch used?";
      std::printf("  cuda, %zu bucket(s), rank %lld, tensor %zu: split %.3g, SGEMM %.3g\n", c.rows.size(),
                  static_cast<long long>(c.r), t, eon, eoff);
    }
  }
}

}  // namespace

// SPDX-License-Identifier: MIT
// The shard-mesh harness shared by tests/mpi/test_mpi_shard.cpp (host
// backend, MPI communicators) and tests/nccl/test_nccl_shard.cpp (CUDA
// backend, NCCL communicators): the same layouts, tensors, references and
// tolerances on both (see test_mpi_shard.cpp for what is asserted and why).
// The including file defines g_rank, g_size and g_env (ShardEnv, in
// shard_env.hpp, with the grid and helpers shared with megabatch_harness.hpp)
// and fills g_env in main, before the tests run.
#pragma once
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "dion_mpi.h"
#include "../scoped_env.h"
#include "shard_env.hpp"

namespace {

// The gradient replica w sees at step s for tensor k, global element i.
float grad_of(int w, int s, int k, int64_t i) {
  return hash_uniform(1000 + 37 * w + 7919 * s + 104729 * k, static_cast<uint64_t>(i));
}
float init_of(int k, int64_t i) { return 0.1f * hash_uniform(5 + k, static_cast<uint64_t>(i)); }

// One tensor of the test group: global m x n, and which logical dim each
// shard mesh splits (-1: none).
struct Spec {
  int64_t m, n;
  int outer_dim, inner_dim;
};

struct Config {
  const char* name;
  double rank_fraction;
  dion_qr_method_t qr;
  int power_iters;
  // A bf16 momentum at matmul precision BF16: on the CUDA backend, Dion's
  // large products then read the bf16 momentum and bf16 copies of P, R and Q
  // (src/algo/dion.cpp). See bf16_tolerance for the bound.
  bool bf16_products = false;
  double weight_decay = 0.01;
};

// The bound for the bf16 configuration, per tensor and quantity. The sums
// over the meshes are fp32 in another order than the reference's, so a bf16
// value rounded from them (the momentum, the copies of P, R and Q) may land
// one bf16 ulp (at most 2^-7 of it) away from the reference's; under
// compressed sync each replica rounds its own momentum, and
// dion_sync_for_checkpoint rounds their average once more. Two such
// roundings give 2 x 2^-7 = 2^-6 for a quantity that does not amplify them.
// The orthogonalization does: Q spans the r leading right singular vectors
// of the momentum, whose perturbation grows as the momentum's norm over the
// gap after the r-th singular value (on 4 ranks, w4's Q, r = 4 of 16,
// differed from the reference's by 0.0161). That amplification is measured,
// not guessed: both bf16 runs approximate the same run without bf16
// roundings (fp32 momentum and products), the reference within d of it and
// the distributed run, whose roundings are of the same size but more of them
// (the replicas'), within 2 d; by the triangle inequality they differ by at
// most 3 d.
double bf16_tolerance(double d_ref_to_fp32) { return std::max(std::ldexp(1.0, -6), 3.0 * d_ref_to_fp32); }

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

struct Local {
  int64_t off[2] = {0, 0}, ext[2] = {0, 0};  // per logical dim
  std::vector<float> x, g;
  float *dx = nullptr, *dg = nullptr;  // device copies (CUDA backend)
  int64_t numel() const { return ext[0] * ext[1]; }
  // index of local element (a, b) in the global row-major m x n matrix
  int64_t global(int64_t a, int64_t b, int64_t n) const { return (off[0] + a) * n + off[1] + b; }
};

using OptRun = OptRunOf<Local>;

const std::vector<Spec>& specs() {
  // 18 x 12 over 8 outer ranks: chunks of 3 rows, the last two empty. Two
  // tensors of each sharded shape make batches of two; the five outer-only
  // 10 x 24 and the three unsharded 8 x 6 make batches that the meshes split
  // unevenly (spec §2.6 paths 1 and 2: some ranks orthogonalize two
  // matrices, some one, some none, with the reduce-scatter's padding).
  static const std::vector<Spec> s = {
      {18, 12, 0, 1},  {18, 12, 0, 1},  {12, 20, 1, 0},  {12, 20, 1, 0},  {16, 16, -1, 0}, {24, 10, 1, 0},
      {10, 24, 0, -1}, {10, 24, 0, -1}, {10, 24, 0, -1}, {10, 24, 0, -1}, {10, 24, 0, -1}, {8, 6, -1, -1},
      {8, 6, -1, -1},  {8, 6, -1, -1},
  };
  return s;
}

void build(OptRun& run, const Grid& G, const Config& c, bool distributed, const std::vector<Spec>& S = specs()) {
  dion_options_t o = mesh_options(G);
  o.seed = 7;
  if (!distributed) {
    o.replicate_comm = nullptr;
    // Dion's working orientation follows the shard dims (spec §2.2), so the
    // reference declares the same dims, whole, over 1-rank meshes.
    o.outer_comm = G.self[0];
    o.inner_comm = G.self[1];
  }
  ASSERT_EQ(dion_create(&run.opt, &o), DION_SUCCESS) << dion_last_error(nullptr);
  run.loc.resize(S.size());
  std::vector<dion_tensor_t> ts(S.size());
  std::vector<std::string> names(S.size());
  for (size_t k = 0; k < S.size(); ++k) {
    const Spec& sp = S[k];
    Local& l = run.loc[k];
    l.ext[0] = sp.m;
    l.ext[1] = sp.n;
    dion_tensor_t& t = ts[k];
    dion_tensor_init(&t);
    names[k] = "w" + std::to_string(k);
    t.name = names[k].c_str();
    t.param_dtype = DION_DTYPE_FP32;
    t.ndim = 2;
    t.shape[0] = sp.m;
    t.shape[1] = sp.n;
    if (G.L.O > 1 && sp.outer_dim >= 0) {
      const int d = sp.outer_dim;
      if (distributed) outer_shard(d ? sp.n : sp.m, G.L.O, G.o, &l.off[d], &l.ext[d]);
      t.outer_shard_dim = d;
      t.outer_offset = l.off[d];
      t.outer_extent = l.ext[d];
    }
    if (G.L.I > 1 && sp.inner_dim >= 0) {
      const int d = sp.inner_dim;
      if (distributed) inner_shard(d ? sp.n : sp.m, G.L.I, G.i, &l.off[d], &l.ext[d]);
      t.inner_shard_dim = d;
      t.inner_offset = l.off[d];
      t.inner_extent = l.ext[d];
    }
    l.x.resize(static_cast<size_t>(std::max<int64_t>(l.numel(), 1)));
    l.g.resize(l.x.size());
    for (int64_t a = 0; a < l.ext[0]; ++a)
      for (int64_t b = 0; b < l.ext[1]; ++b)
        l.x[static_cast<size_t>(a * l.ext[1] + b)] = init_of(static_cast<int>(k), l.global(a, b, sp.n));
    t.param = l.x.data();
    t.grad = l.g.data();
    if (g_env.alloc) {
      l.dx = static_cast<float*>(g_env.alloc(sizeof(float) * l.x.size()));
      l.dg = static_cast<float*>(g_env.alloc(sizeof(float) * l.g.size()));
      g_env.h2d(l.dx, l.x.data(), sizeof(float) * l.x.size());
      t.param = l.dx;
      t.grad = l.dg;
    }
  }
  dion_group_options_t go;
  dion_group_options_init(&go, DION_ALGO_DION);
  go.lr = 0.02;
  go.weight_decay = c.weight_decay;
  go.rank_fraction = c.rank_fraction;
  go.qr_method = c.qr;
  go.cqr_warmup_steps = 0;
  go.power_iters = c.power_iters;
  if (c.bf16_products) {
    go.momentum_dtype = DION_DTYPE_BF16;
    go.matmul_precision = DION_MATMUL_BF16;
  }
  ASSERT_EQ(dion_add_group(run.opt, &go, ts.data(), ts.size(), nullptr), DION_SUCCESS) << dion_last_error(run.opt);
}

void fill_grads(OptRun& dist, OptRun& ref, const Grid& G, int step, const std::vector<Spec>& S = specs()) {
  for (size_t k = 0; k < S.size(); ++k) {
    Local& l = dist.loc[k];
    for (int64_t a = 0; a < l.ext[0]; ++a)
      for (int64_t b = 0; b < l.ext[1]; ++b)
        l.g[static_cast<size_t>(a * l.ext[1] + b)] = grad_of(G.r, step, static_cast<int>(k), l.global(a, b, S[k].n));
    Local& f = ref.loc[k];
    for (int64_t i = 0; i < S[k].m * S[k].n; ++i) {
      double avg = 0;
      for (int w = 0; w < G.L.R; ++w) avg += grad_of(w, step, static_cast<int>(k), i);
      f.g[static_cast<size_t>(i)] = static_cast<float>(avg / G.L.R);
    }
  }
}

// The local window [off, off + ext) of a 2-D global row-major state.
std::vector<double> window(const std::vector<float>& global, int64_t gcols, const int64_t* off, const int64_t* ext) {
  std::vector<double> w;
  for (int64_t a = 0; a < ext[0]; ++a)
    for (int64_t b = 0; b < ext[1]; ++b) w.push_back(global[static_cast<size_t>((off[0] + a) * gcols + off[1] + b)]);
  return w;
}

std::vector<Layout> layouts() {
  std::vector<Layout> out;
  for (int R = 1; R <= g_size; R *= 2)
    for (int O = 1; O * R <= g_size; O *= 2) {
      const int I = g_size / (R * O);
      if (R * O * I != g_size || (O == 1 && I == 1)) continue;
      out.push_back({R, O, I});
    }
  return out;
}

class Shard : public ::testing::TestWithParam<Config> {};

TEST_P(Shard, EqualsSingleProcessOnTheGlobalMatrices) {
  const Config c = GetParam();
  const auto& S = specs();
  for (const Layout& L : layouts()) {
    SCOPED_TRACE("layout R=" + std::to_string(L.R) + " O=" + std::to_string(L.O) + " I=" + std::to_string(L.I));
    Grid G(L);
    // exact: for the bf16 configuration, the reference without its bf16
    // roundings (bf16_tolerance).
    OptRun dist, ref, exact;
    const bool rounded = c.bf16_products;
    build(dist, G, c, true);
    build(ref, G, c, false);
    if (rounded) {
      Config ce = c;
      ce.bf16_products = false;
      build(exact, G, ce, false);
    }
    if (HasFatalFailure()) return;
    std::vector<std::vector<float>> x0(S.size());
    for (size_t k = 0; k < S.size(); ++k) x0[k] = dist.loc[k].x;
    for (int s = 0; s < 3; ++s) {
      fill_grads(dist, ref, G, s);
      ASSERT_EQ(dist.step(), DION_SUCCESS) << dion_last_error(dist.opt);
      ASSERT_EQ(ref.step(), DION_SUCCESS) << dion_last_error(ref.opt);
      if (rounded) {
        for (size_t k = 0; k < S.size(); ++k) exact.loc[k].g = ref.loc[k].g;
        ASSERT_EQ(exact.step(), DION_SUCCESS) << dion_last_error(exact.opt);
      }
    }
    // The bound for one quantity: want is the reference's, want_exact the
    // exact run's (bf16 configuration only).
    auto bound = [&](const std::vector<double>& want, const std::vector<double>& want_exact) {
      return rounded ? bf16_tolerance(rel_diff(want, want_exact)) : 1e-4;
    };
    // Traffic: compressed replicate sync moves P and R, not the gradients.
    uint64_t rep_bytes = 0, outer_bytes = 0, inner_bytes = 0;
    ASSERT_EQ(dion_get_comm_bytes(dist.opt, DION_MESH_REPLICATE, &rep_bytes, nullptr), DION_SUCCESS);
    ASSERT_EQ(dion_get_comm_bytes(dist.opt, DION_MESH_OUTER, &outer_bytes, nullptr), DION_SUCCESS);
    ASSERT_EQ(dion_get_comm_bytes(dist.opt, DION_MESH_INNER, &inner_bytes, nullptr), DION_SUCCESS);
    if (L.O > 1) {
      EXPECT_GT(outer_bytes, 0u);
    }
    if (L.I > 1) {
      EXPECT_GT(inner_bytes, 0u);
    }
    if (L.R > 1) {
      uint64_t grad_bytes = 0;
      for (const Local& l : dist.loc) grad_bytes += 4u * static_cast<uint64_t>(l.numel());
      // rank_fraction 1 never compresses; at 1/4 every tensor here does.
      if (c.rank_fraction <= 0.25) {
        EXPECT_LT(rep_bytes, grad_bytes) << "compressed sync should move less than the gradients";
      }
      if (c.rank_fraction == 1.0) {
        EXPECT_GE(rep_bytes, grad_bytes) << "uncompressed sync averages the gradients";
      }
    }
    ASSERT_EQ(dion_sync_for_checkpoint(dist.opt, nullptr), DION_SUCCESS) << dion_last_error(dist.opt);
    double worst = 0;
    for (size_t k = 0; k < S.size(); ++k) {
      SCOPED_TRACE("tensor w" + std::to_string(k));
      const Local& l = dist.loc[k];
      // parameters: the update, shard vs the reference's window
      std::vector<double> du, dr;
      const std::vector<double> r1 = window(ref.loc[k].x, S[k].n, l.off, l.ext);
      for (int64_t e = 0; e < l.numel(); ++e) du.push_back(static_cast<double>(l.x[static_cast<size_t>(e)]) - x0[k][static_cast<size_t>(e)]);
      std::vector<double> ref_x0;
      for (int64_t a = 0; a < l.ext[0]; ++a)
        for (int64_t b = 0; b < l.ext[1]; ++b) ref_x0.push_back(init_of(static_cast<int>(k), l.global(a, b, S[k].n)));
      for (size_t e = 0; e < r1.size(); ++e) dr.push_back(r1[e] - ref_x0[e]);
      std::vector<double> de;
      if (rounded) {
        const std::vector<double> e1 = window(exact.loc[k].x, S[k].n, l.off, l.ext);
        for (size_t e = 0; e < e1.size(); ++e) de.push_back(e1[e] - ref_x0[e]);
      }
      if (l.numel() > 0) {
        const double d = rel_diff(du, dr);
        worst = std::max(worst, d);
        EXPECT_LT(d, bound(dr, de)) << "parameter update";
      }
      // states: momentum is the parameter's window; Q's rows follow B's columns
      for (const char* name : {"momentum", "Q"}) {
        dion_state_info_t di, ri;
        const std::vector<float> ds = read_state(dist.opt, static_cast<int32_t>(k), name, &di);
        const std::vector<float> rs = read_state(ref.opt, static_cast<int32_t>(k), name, &ri);
        ASSERT_EQ(di.global_shape[0], ri.global_shape[0]);
        ASSERT_EQ(di.global_shape[1], ri.global_shape[1]);
        const int64_t n_loc = di.local_shape[0] * di.local_shape[1];
        if (n_loc == 0) continue;
        const std::vector<double> want = window(rs, ri.global_shape[1], di.local_offset, di.local_shape);
        std::vector<double> want_exact;
        if (rounded) {
          dion_state_info_t ei;
          const std::vector<float> es = read_state(exact.opt, static_cast<int32_t>(k), name, &ei);
          want_exact = window(es, ei.global_shape[1], di.local_offset, di.local_shape);
        }
        std::vector<double> got(ds.begin(), ds.begin() + n_loc);
        const double d = rel_diff(got, want);
        worst = std::max(worst, d);
        EXPECT_LT(d, bound(want, want_exact)) << name;
      }
    }
    if (g_rank == 0) RecordProperty("worst_rel_diff_R" + std::to_string(L.R) + "O" + std::to_string(L.O) + "I" + std::to_string(L.I), std::to_string(worst));
  }
}

const Config kConfigs[] = {
    {"rcqr_full_rank", 1.0, DION_QR_RCQR, 1},
    {"rcqr_half_rank", 0.5, DION_QR_RCQR, 1},
    {"rcqr_quarter_rank", 0.25, DION_QR_RCQR, 1},
    {"cqr_quarter_rank", 0.25, DION_QR_CQR, 1},
    {"householder_half_rank", 0.5, DION_QR_QR, 1},
    {"rcqr_two_power_iters", 0.5, DION_QR_RCQR, 2},
    {"rcqr_quarter_rank_bf16_momentum_products", 0.25, DION_QR_RCQR, 1, true},
};

INSTANTIATE_TEST_SUITE_P(All, Shard, ::testing::ValuesIn(kConfigs),
                         [](const ::testing::TestParamInfo<Config>& i) { return std::string(i.param.name); });

// Keeps the distributed run's shards in x0, then takes two steps of both
// runs on the same gradients.
void two_steps(OptRun& dist, OptRun& ref, const Grid& G, const std::vector<Spec>& S,
               std::vector<std::vector<float>>* x0) {
  x0->clear();
  for (const Local& l : dist.loc) x0->push_back(l.x);
  for (int s = 0; s < 2; ++s) {
    fill_grads(dist, ref, G, s, S);
    ASSERT_EQ(dist.step(), DION_SUCCESS) << dion_last_error(dist.opt);
    ASSERT_EQ(ref.step(), DION_SUCCESS) << dion_last_error(ref.opt);
  }
}

// The updates of the distributed run (each rank's shards, from x0) equal
// those of the single-process run on the same windows of its global
// matrices (every tensor n columns wide), within 1e-4 relative.
void expect_same_updates(const OptRun& dist, const OptRun& ref, const std::vector<std::vector<float>>& x0, int64_t n) {
  for (size_t k = 0; k < dist.loc.size(); ++k) {
    const Local& l = dist.loc[k];
    if (l.numel() == 0) continue;
    const std::vector<double> r1 = window(ref.loc[k].x, n, l.off, l.ext);
    std::vector<double> du, dr;
    for (int64_t e = 0; e < l.numel(); ++e) {
      const size_t i = static_cast<size_t>(e);
      du.push_back(static_cast<double>(l.x[i]) - x0[k][i]);
      dr.push_back(r1[i] - x0[k][i]);
    }
    EXPECT_LT(rel_diff(du, dr), 1e-4) << "tensor " << k;
  }
}

// Rank q's slots of a batch of T split over W ranks (src/algo/dion.cpp,
// split_over): [q B, min(T, (q + 1) B)), B = ceil(T / W).
uint64_t owned_slots(int64_t T, int W, int q) {
  const int64_t B = (T + W - 1) / W, first = std::min<int64_t>(T, q * B);
  return static_cast<uint64_t>(std::min<int64_t>(T, first + B) - first);
}

// The fp32 bytes rank q hands over when a batch of T e-float matrices is
// reduced over a W-rank mesh (a batch of one all-reduced; else the
// reduce-scatter of the batch padded to W B slots while that at most doubles
// it, otherwise an all-reduce) and then the gather of its owned slots'
// results (g floats each; none for a batch of one).
uint64_t split_bytes(int64_t T, int W, int q, uint64_t e, uint64_t g) {
  const uint64_t T4 = 4u * static_cast<uint64_t>(T);
  if (T == 1) return T4 * e;
  const uint64_t B = static_cast<uint64_t>((T + W - 1) / W), padded = W * B;
  const uint64_t reduce = padded <= 2u * static_cast<uint64_t>(T) ? 4u * padded * e : T4 * e;
  return reduce + 4u * owned_slots(T, W, q) * g;
}

// Spec §2.6 paths 1 and 2: each matrix of a batch of T is orthogonalized on
// one rank of its mesh (the outer mesh for outer-sharded matrices, the
// replicate mesh for matrices no shard mesh splits), which then all-gathers
// it. Path 3 (P row-sharded over the inner mesh) splits the small
// factorizations of its distributed RCQR the same way over the inner mesh:
// S P and the Gram matrix are reduce-scattered, each rank factors its slots,
// and the r x r factors are all-gathered. Rank q of a W-rank mesh owns slots
// [q B, min(T, (q + 1) B)), B = ceil(T / W); a batch of one is not split. No
// counter sees a factorization, so the split is read off the exact per-rank
// byte counters (what this rank hands to each collective): a rank hands the
// all-gather only the matrices it factored, so ranks owning different
// numbers of slots count different bytes. Every rank factoring every matrix
// (an all-reduce and no gather) fails the equalities on the ranks that own
// slots, for every T >= 2. The updates must still equal the single-process
// run's.
//
// One group of T m x n matrices, B = M (m >= n; the outer mesh splits the
// columns n, FSDP chunks), r = rank_fraction n, one power iteration, RCQR.
// Two kinds of matrices: (paths 1, 2) the inner mesh splits nothing, a = m;
// (path 3, layouts with an inner mesh) the inner mesh also splits the rows
// m evenly, a = m / I the local rows. b is the local columns. Per step, on
// each multi-rank mesh, 4 bytes of the non-finite flag (skip_nonfinite),
// then (a r floats = one matrix of P; c this rank's slot count there):
//  outer (W = O): paths 1, 2: P = B Q is a partial sum over outer. T = 1:
//    all-reduce of T a r. T >= 2: a reduce-scatter of the batch padded to
//    W B slots (W B a r) when the padding at most doubles the batch
//    (W B <= 2 T), otherwise an all-reduce of T a r; then the all-gather
//    of this rank's c a r. Path 3: the all-reduce of T a r (P stays
//    row-sharded over inner and is not split over outer). Then the int32
//    all-zero flags (T) and the column sums of squares of R (T r doubles).
//  replicate, compressed ((m + n) r < m n, rank_fraction 1/2): path 2 (an
//    outer mesh): the average of this rank's c matrices of P (all T when
//    T = 1); path 1: the reduce-scatter (same rule, W = R) or all-reduce,
//    then the all-gather of c a r; path 3: the average of T a r. Then R =
//    B^T P (T b r) and the all-zero flags (T).
//  replicate, uncompressed (rank_fraction 1): the gradients (T a b); in
//    path 1 (no shard mesh) and T >= 2, the replicas' P are equal and only
//    the all-gather of this rank's c a r follows (no reduction, no padding).
//  inner (W = I): paths 1, 2: the flag only. Path 3: the RCQR's partial
//    sums, S P (k x r per matrix, k = 128 ceil(1.25 r / 128) = 128 with
//    the default oversampling) and the Gram matrix P1^T P1 (r x r): T = 1:
//    all-reduces of T k r and T r r. T >= 2: each reduced like P above (the
//    reduce-scatter of W B matrices, or the all-reduce of T), each followed
//    by the all-gather of this rank's c factors (R1, R2: c r r), and the
//    int32 Cholesky flags summed (T) so that every rank knows every
//    matrix's. On a device backend, where reading the flags would wait for
//    the step, the Householder fallback's input P0 is gathered whatever
//    the flags: one all-gather of this rank's rows (T a r).
//    Then R = B^T P, a partial sum over inner (T b r), and the all-zero
//    flags (T).
TEST(ShardSplit, EachRankOrthogonalizesOnlyItsSlots) {
  const int64_t m = 24, n = 16;
  for (int path3 = 0; path3 < 2; ++path3)
    for (int R = 1; R <= g_size; R *= 2)
      for (int O = 1; O * R <= g_size; O *= 2) {
        const int I = g_size / (R * O);
        if (R * O * I != g_size) continue;
        if (path3 ? I == 1 : (R == 1 && O == 1)) continue;  // no mesh to split over
        const Layout L{R, O, I};
        Grid G(L);
        for (int64_t T : {1, 2, 3, 5})
          for (double frac : {0.5, 1.0}) {
            SCOPED_TRACE(std::string(path3 ? "inner-sharded" : "not inner-sharded") + " layout R=" +
                         std::to_string(R) + " O=" + std::to_string(O) + " I=" + std::to_string(I) +
                         " T=" + std::to_string(T) + " rank_fraction=" + std::to_string(frac));
            const std::vector<Spec> S(static_cast<size_t>(T), Spec{m, n, 1, path3 ? 0 : -1});
            const Config c{"split", frac, DION_QR_RCQR, 1};
            OptRun dist, ref;
            build(dist, G, c, true, S);
            build(ref, G, c, false, S);
            if (HasFatalFailure()) return;
            std::vector<std::vector<float>> x0;
            two_steps(dist, ref, G, S, &x0);
            if (HasFatalFailure()) return;
            const uint64_t a = static_cast<uint64_t>(dist.loc[0].ext[0]), r = static_cast<uint64_t>(frac * n),
                           b = static_cast<uint64_t>(dist.loc[0].ext[1]), ar = a * r, T4 = 4u * T, sk = 128;
            const bool compressed = R > 1 && (m + n) * static_cast<int64_t>(r) < m * n;
            uint64_t want[3] = {0, 0, 0};  // replicate, outer, inner
            if (O > 1) want[1] = 4 + (path3 ? T4 * ar : split_bytes(T, O, G.o, ar, ar)) + T4 + 2 * T4 * r;
            if (R > 1) {
              want[0] = 4;
              if (compressed) {
                if (path3)
                  want[0] += T4 * ar;
                else if (O > 1)
                  want[0] += 4u * (T == 1 ? 1u : owned_slots(T, O, G.o)) * ar;
                else
                  want[0] += split_bytes(T, R, G.r, ar, ar);
                want[0] += T4 * b * r + T4;
              } else {
                want[0] += T4 * a * b;
                if (!path3 && O == 1 && T >= 2) want[0] += 4u * owned_slots(T, R, G.r) * ar;
              }
            }
            if (I > 1) {
              want[2] = 4;
              if (path3) {
                want[2] += split_bytes(T, I, G.i, sk * r, r * r) + split_bytes(T, I, G.i, r * r, r * r);
                if (T >= 2) want[2] += T4;
                if (g_env.backend == DION_BACKEND_CUDA) want[2] += T4 * ar;
                want[2] += T4 * b * r + T4;
              }
            }
            const dion_mesh_t meshes[3] = {DION_MESH_REPLICATE, DION_MESH_OUTER, DION_MESH_INNER};
            for (int k = 0; k < 3; ++k) {
              uint64_t last = 0;
              ASSERT_EQ(dion_get_comm_bytes(dist.opt, meshes[k], &last, nullptr), DION_SUCCESS);
              EXPECT_EQ(last, want[k]) << "mesh " << k << " (0 replicate, 1 outer, 2 inner)";
            }
            // The same updates as one process on the global matrices.
            expect_same_updates(dist, ref, x0, n);
          }
      }
}

// A class of matrices too large for one batch is cut into batches whose
// sizes are whole multiples of the mesh that splits them
// (src/core/batching.hpp), so each rank owns the same number of slots and
// no reduce-scatter pads a batch. DION_BATCH_MAX = O + 1 caps a class of 2 O
// outer-sharded matrices at O + 1 per batch: the cut is O + O, each batch
// reduce-scattered without padding (O a r floats) and each rank gathering
// one matrix (a r), where O + 1 and O - 1 would pad the first batch to 2 O
// slots. Exact byte counts as in EachRankOrthogonalizesOnlyItsSlots, and the
// same updates as one process.
TEST(ShardSplit, BatchesCutOverTheOuterMeshAreWholeMultiplesOfIt) {
  const int O = g_size;
  if (O < 2) GTEST_SKIP() << "needs an outer mesh of two or more ranks";
  const int64_t m = 24, n = 16, T = 2 * O;
  const Layout L{1, O, 1};
  Grid G(L);
  const std::vector<Spec> S(static_cast<size_t>(T), Spec{m, n, 1, -1});
  const Config c{"cut", 0.5, DION_QR_RCQR, 1};
  OptRun dist, ref;
  {
    ScopedEnv batch_max("DION_BATCH_MAX", std::to_string(O + 1).c_str());
    build(dist, G, c, true, S);
  }
  build(ref, G, c, false, S);
  if (HasFatalFailure()) return;
  std::vector<std::vector<float>> x0;
  two_steps(dist, ref, G, S, &x0);
  if (HasFatalFailure()) return;
  const uint64_t a = static_cast<uint64_t>(m), r = static_cast<uint64_t>(n / 2), ar = a * r, Ob = 4u * O;
  // The non-finite flag, then per batch of O: the reduce-scatter of O a r,
  // the gather of this rank's one matrix, the all-zero flags (O int32) and
  // the column sums of squares of R (O r doubles).
  const uint64_t want = 4 + 2 * (Ob * ar + 4u * ar + Ob + 2 * Ob * r);
  uint64_t last = 0;
  ASSERT_EQ(dion_get_comm_bytes(dist.opt, DION_MESH_OUTER, &last, nullptr), DION_SUCCESS);
  EXPECT_EQ(last, want);
  expect_same_updates(dist, ref, x0, n);
}

// The phased step against one process and against the bucket-by-bucket
// step, every layout: S0 the group's tensors without an inner mesh, S1 with
// one, at rank_fraction frac, for each QR method of qrs.
void expect_phased_matches(double frac, const std::vector<Spec>& S0, const std::vector<Spec>& S1,
                           const std::vector<dion_qr_method_t>& qrs) {
  for (const Layout& L : layouts()) {
    const std::vector<Spec>& S = L.I > 1 ? S1 : S0;
    for (const dion_qr_method_t qr : qrs) {
      SCOPED_TRACE("layout R=" + std::to_string(L.R) + " O=" + std::to_string(L.O) +
                   (qr == DION_QR_RCQR ? " RCQR" : " CQR"));
      Grid G(L);
      const Config c{"phased", frac, qr, 1};
      OptRun dist[2], ref[2];
      std::vector<std::vector<float>> x0[2];
      uint64_t ws[2] = {0, 0};
      for (int off = 0; off < 2; ++off) {
        {
          std::optional<ScopedEnv> phased;
          if (off) phased.emplace("DION_PHASED", "0");
          build(dist[off], G, c, true, S);
          build(ref[off], G, c, false, S);
          if (!::testing::Test::HasFatalFailure()) two_steps(dist[off], ref[off], G, S, &x0[off]);
        }
        if (::testing::Test::HasFatalFailure()) return;
        uint64_t state_bytes = 0;
        ASSERT_EQ(dion_get_memory_usage(dist[off].opt, &state_bytes, &ws[off]), DION_SUCCESS);
        for (size_t k = 0; k < S.size(); ++k) {
          SCOPED_TRACE(std::string(off ? "bucket by bucket" : "phased") + ", tensor " + std::to_string(k));
          const Local& l = dist[off].loc[k];
          if (l.numel() == 0) continue;
          const std::vector<double> r1 = window(ref[off].loc[k].x, S[k].n, l.off, l.ext);
          std::vector<double> du, dr;
          for (int64_t e = 0; e < l.numel(); ++e) {
            const size_t i = static_cast<size_t>(e);
            du.push_back(static_cast<double>(l.x[i]) - x0[off][k][i]);
            dr.push_back(r1[i] - x0[off][k][i]);
          }
          EXPECT_LT(rel_diff(du, dr), 1e-4);
        }
      }
      EXPECT_GT(ws[0], ws[1]) << "the phased step's workspace was not reserved";
      if (g_env.backend != DION_BACKEND_HOST) continue;
      for (size_t k = 0; k < S.size(); ++k) {
        EXPECT_TRUE(dist[0].loc[k].x == dist[1].loc[k].x) << "tensor " << k << ": phased and bucket-by-bucket parameters differ";
        dion_state_info_t i0, i1;
        EXPECT_TRUE(read_state(dist[0].opt, static_cast<int32_t>(k), "Q", &i0) ==
                    read_state(dist[1].opt, static_cast<int32_t>(k), "Q", &i1))
            << "tensor " << k << ": phased and bucket-by-bucket Q differ";
      }
    }
  }
}

// Dion's phased group step over the outer and replicate meshes
// (src/algo/dion.cpp, step_group): the buckets of a group that share r and k
// (here r = 8, k = 128) are stepped in phases, each rank factoring its slots
// of every bucket in one call per kind. Shapes: three 24 x 16 and two 40 x 16
// with their columns sharded over outer (split over it: on 4 outer ranks some
// own one slot of a bucket, some none), one 16 x 48 sharded by rows (a batch
// of one: all-reduced, factored on every rank) and two unsharded 32 x 16
// (split over the replicate mesh, or factored on every rank without one).
// rank_fraction 1/2 makes the replicate sync compressed for every tensor, so
// that on the CUDA backend, where a replicate mesh's gradient sync is
// pipelined with the buckets (DION_OVERLAP), the pipeline steps the group as
// one (no gradient of it is averaged). With an inner mesh, the same shapes
// with B's rows sharded over it (spec §2.6 path 3: S P and the Gram
// matrices summed over the inner mesh, each slot factored by one inner
// rank; with an outer mesh, P reduced to its slots' owners over outer
// first). For RCQR and CQR, on every layout: the same updates as one process, and
// the same parameters and Q as the bucket-by-bucket step (DION_PHASED=0),
// bit for bit on the host backend (its batched factorizations work matrix
// by matrix; on the GPU, batches of other sizes may take other kernels).
// That the phased step ran is seen in the workspace it reserves (more than
// the bucket-by-bucket step's), as in tests/unit/test_algorithms_dion.cpp.
TEST(ShardPhased, GroupFactoredOncePerKindEqualsBucketByBucket) {
  // With an inner mesh every tensor's B rows are sharded over it (path 3;
  // the phased step takes a group whose buckets are all path 3 or none):
  // the same shapes, the rows of B (m, or n for the 16 x 48, whose B is
  // X^T) over inner, the other dim over outer where the layout has one.
  expect_phased_matches(0.5,
                        {{24, 16, 1, -1}, {24, 16, 1, -1}, {24, 16, 1, -1}, {40, 16, 1, -1}, {40, 16, 1, -1},
                         {16, 48, 0, -1}, {32, 16, -1, -1}, {32, 16, -1, -1}},
                        {{24, 16, 1, 0}, {24, 16, 1, 0}, {24, 16, 1, 0}, {40, 16, 1, 0}, {40, 16, 1, 0},
                         {16, 48, 0, 1}, {32, 16, -1, 0}, {32, 16, -1, 0}},
                        {DION_QR_RCQR, DION_QR_CQR});
}

// At full rank the square tensors (16 x 16: P square, Householder QR, over
// the meshes as step() does it) are stepped on their own and the other
// buckets phased (src/algo/dion.cpp, phased_member): one square sharded by
// columns over outer (by rows over inner with an inner mesh), one
// unsharded. At rank_fraction 1 the replicate sync averages the gradients,
// so on the CUDA backend with a replicate mesh the overlapped pipeline
// steps the buckets one by one (DION_OVERLAP); the workspace is reserved
// either way. RCQR only: at full rank CQR's Gram matrix P^T P squares P's
// condition number, and its updates differ from one process's by up to 5e-4
// here (32 x 16 at r = 16), in the bucket-by-bucket step as much as in the
// phased one, beyond the 1e-4 this comparison holds rank 1/2 to.
TEST(ShardPhased, SquareBucketsSteppedAloneTheOthersPhased) {
  expect_phased_matches(1.0,
                        {{16, 16, 1, -1}, {24, 16, 1, -1}, {24, 16, 1, -1}, {40, 16, 1, -1}, {16, 16, -1, -1},
                         {16, 48, 0, -1}, {32, 16, -1, -1}},
                        {{16, 16, 1, 0}, {24, 16, 1, 0}, {24, 16, 1, 0}, {40, 16, 1, 0}, {16, 16, -1, 0},
                         {16, 48, 0, 1}, {32, 16, -1, 0}},
                        {DION_QR_RCQR});
}

// The bf16 communication of P (src/algo/dion.cpp, bf16_comm): on the CUDA
// backend, with a bf16 momentum and BF16 products, the buckets split over a
// mesh that reduces P reduce it in bf16 and gather the orthonormal slots as
// the bf16 copy the products read, in the phased step and in the
// bucket-by-bucket one (DION_PHASED=0: step() through orth_split_bf16). The
// shapes of GroupFactoredOncePerKindEqualsBucketByBucket, every layout
// without an inner mesh, 3 steps, phased and not:
//  - the updates and Q equal the single-process bf16 run's within the bf16
//    configuration's bound (bf16_tolerance: P's bf16 sums are roundings of
//    the same size as the momentum's, amplified the same way);
//  - bytes: without a replicate mesh, the outer mesh moves exactly half of
//    what an fp32-momentum run moves for the split buckets' P (their
//    reduce-scatter and gather, split_bytes) and the same for the rest; on
//    the host backend (no bf16 products) the two runs move the same bytes.
TEST(ShardPhased, Bf16MomentumCommunicatesPInBf16) {
  const std::vector<Spec> S = {{24, 16, 1, -1}, {24, 16, 1, -1}, {24, 16, 1, -1}, {40, 16, 1, -1},
                               {40, 16, 1, -1}, {16, 48, 0, -1}, {32, 16, -1, -1}, {32, 16, -1, -1}};
  for (const Layout& L : layouts()) {
    if (L.I > 1) continue;
    for (const bool phased : {true, false}) {
      SCOPED_TRACE("layout R=" + std::to_string(L.R) + " O=" + std::to_string(L.O) +
                   (phased ? " phased" : " bucket by bucket"));
      std::optional<ScopedEnv> bucket_by_bucket;
      if (!phased) bucket_by_bucket.emplace("DION_PHASED", "0");
      Grid G(L);
      Config c16{"phased16", 0.5, DION_QR_RCQR, 1, true};
      Config c32 = c16;
      c32.bf16_products = false;
      OptRun dist16, ref16, dist32, exact;
      build(dist16, G, c16, true, S);
      build(ref16, G, c16, false, S);
      build(dist32, G, c32, true, S);
      build(exact, G, c32, false, S);
      if (HasFatalFailure()) return;
      std::vector<std::vector<float>> x0;
      for (const Local& l : dist16.loc) x0.push_back(l.x);
      for (int step = 0; step < 3; ++step) {
        fill_grads(dist16, ref16, G, step, S);
        for (size_t k = 0; k < S.size(); ++k) {
          dist32.loc[k].g = dist16.loc[k].g;
          exact.loc[k].g = ref16.loc[k].g;
        }
        for (OptRun* run : {&dist16, &ref16, &dist32, &exact}) ASSERT_EQ(run->step(), DION_SUCCESS) << dion_last_error(run->opt);
      }
      for (size_t k = 0; k < S.size(); ++k) {
        SCOPED_TRACE("tensor " + std::to_string(k));
        const Local& l = dist16.loc[k];
        if (l.numel() == 0) continue;
        const std::vector<double> r1 = window(ref16.loc[k].x, S[k].n, l.off, l.ext),
                                  e1 = window(exact.loc[k].x, S[k].n, l.off, l.ext);
        std::vector<double> du, dr, de;
        for (int64_t e = 0; e < l.numel(); ++e) {
          const size_t i = static_cast<size_t>(e);
          du.push_back(static_cast<double>(l.x[i]) - x0[k][i]);
          dr.push_back(r1[i] - x0[k][i]);
          de.push_back(e1[i] - x0[k][i]);
        }
        EXPECT_LT(rel_diff(du, dr), bf16_tolerance(rel_diff(dr, de))) << "parameter update";
        dion_state_info_t di, ri, ei;
        const std::vector<float> dq = read_state(dist16.opt, static_cast<int32_t>(k), "Q", &di);
        const std::vector<float> rq = read_state(ref16.opt, static_cast<int32_t>(k), "Q", &ri);
        const std::vector<float> eq = read_state(exact.opt, static_cast<int32_t>(k), "Q", &ei);
        const int64_t n_loc = di.local_shape[0] * di.local_shape[1];
        if (n_loc == 0) continue;
        const std::vector<double> want = window(rq, ri.global_shape[1], di.local_offset, di.local_shape),
                                  want_exact = window(eq, ei.global_shape[1], di.local_offset, di.local_shape);
        EXPECT_LT(rel_diff(std::vector<double>(dq.begin(), dq.begin() + n_loc), want),
                  bf16_tolerance(rel_diff(want, want_exact)))
            << "Q";
      }
      if (L.R > 1) continue;
      uint64_t b16 = 0, b32 = 0;
      ASSERT_EQ(dion_get_comm_bytes(dist16.opt, DION_MESH_OUTER, &b16, nullptr), DION_SUCCESS);
      ASSERT_EQ(dion_get_comm_bytes(dist32.opt, DION_MESH_OUTER, &b32, nullptr), DION_SUCCESS);
      if (g_env.backend == DION_BACKEND_HOST) {
        EXPECT_EQ(b16, b32) << "the host backend has no bf16 products";
        continue;
      }
      // The outer-sharded buckets of two or more (split over outer): 3 of
      // 24 x 16 and 2 of 40 x 16, B = M (a = m), r = 8.
      const uint64_t p32 = split_bytes(3, L.O, G.o, 24 * 8, 24 * 8) + split_bytes(2, L.O, G.o, 40 * 8, 40 * 8);
      EXPECT_EQ(b16, b32 - p32 / 2) << "fp32 run " << b32 << " bytes, its split P " << p32;
    }
  }
}

// A rank whose shard leaves a gap fails add_group on every rank of every
// mesh; so does a rank that shards another dim.
TEST(ShardErrors, BadTilingAndMismatchedMetadataFailEverywhere) {
  for (const Layout& L : layouts()) {
    if (L.O < 2) continue;
    Grid G(L);
    {
      OptRun run;
      dion_options_t o = mesh_options(G);
      ASSERT_EQ(dion_create(&run.opt, &o), DION_SUCCESS);
      // 12 x 20 sharded on dim 1 over the outer mesh: outer rank 0 (on every
      // replica and inner rank, so the replicas agree) claims one column too
      // few.
      const int64_t m = 12, n = 20;
      int64_t off = 0, ext = 0;
      outer_shard(n, L.O, G.o, &off, &ext);
      if (G.o == 0) ext -= 1;
      Buf x(m * ext), g(m * ext);
      dion_tensor_t t;
      dion_tensor_init(&t);
      t.name = "gappy";
      t.param = x.ptr();
      t.grad = g.ptr();
      t.ndim = 2;
      t.shape[0] = m;
      t.shape[1] = n;
      t.outer_shard_dim = 1;
      t.outer_offset = off;
      t.outer_extent = ext;
      dion_group_options_t go;
      dion_group_options_init(&go, DION_ALGO_DION);
      EXPECT_EQ(dion_add_group(run.opt, &go, &t, 1, nullptr), DION_ERROR_INVALID_ARGUMENT);
      const std::string msg = dion_last_error(run.opt);
      EXPECT_NE(msg.find("do not tile"), std::string::npos) << msg;
      EXPECT_NE(msg.find("gappy"), std::string::npos) << msg;
      int32_t count = -1;
      EXPECT_EQ(dion_tensor_count(run.opt, &count), DION_SUCCESS);
      EXPECT_EQ(count, 0);
      // The optimizer is still usable: a consistent group goes in.
      t.outer_extent = ext + (G.o == 0 ? 1 : 0);
      Buf x2(m * t.outer_extent), g2(m * t.outer_extent);
      t.param = x2.ptr();
      t.grad = g2.ptr();
      EXPECT_EQ(dion_add_group(run.opt, &go, &t, 1, nullptr), DION_SUCCESS) << dion_last_error(run.opt);
      EXPECT_EQ(dion_step(run.opt, nullptr), DION_SUCCESS) << dion_last_error(run.opt);
    }
    {
      OptRun run;
      dion_options_t o = mesh_options(G);
      ASSERT_EQ(dion_create(&run.opt, &o), DION_SUCCESS);
      // The last world rank gives a different global shape.
      const int64_t m = 16, n = g_rank == g_size - 1 ? 17 : 16;
      int64_t off = 0, ext = 0;
      outer_shard(m, L.O, G.o, &off, &ext);
      Buf x(n * ext), g(n * ext);
      dion_tensor_t t;
      dion_tensor_init(&t);
      t.name = "odd";
      t.param = x.ptr();
      t.grad = g.ptr();
      t.ndim = 2;
      t.shape[0] = m;
      t.shape[1] = n;
      t.outer_shard_dim = 0;
      t.outer_offset = off;
      t.outer_extent = ext;
      dion_group_options_t go;
      dion_group_options_init(&go, DION_ALGO_DION);
      EXPECT_EQ(dion_add_group(run.opt, &go, &t, 1, nullptr), DION_ERROR_INVALID_ARGUMENT);
      const std::string msg = dion_last_error(run.opt);
      EXPECT_TRUE(msg.find("differ between the ranks") != std::string::npos ||
                  msg.find("another rank") != std::string::npos)
          << msg;
    }
  }
}

// Dion's Cholesky fallback with B's rows sharded over the inner mesh (spec
// §2.6 path 3): on a rank-1 momentum with rank_fraction 1, P = B Q is
// rank-1, the Cholesky of the Gram matrix summed over the mesh fails, and
// the failed matrices are re-orthonormalised from the gathered P0 (the
// single-process test of this is ReliabilityNumerics.
// DionCholeskyFailureFallsBackToAnOrthonormalBasis). With wd = 0 the update
// is dX = -c P Q^T (c = lr sqrt(m / n), Q the "Q" state the step leaves,
// whole on every rank here), so the distributed P's orthonormality shows in
// the rows each rank holds: the sum over the mesh of dX_q^T dX_q must equal
// c^2 Q Q^T (1e-3 relative, as there). A P whose rows came back from the
// wrong matrix or rank, or a factor of the singular Gram matrix let
// through, breaks it. A batch of two, the rank-1 matrix and one of full
// rank whose Cholesky succeeds (the factorizations split over the mesh; the
// fallback must leave the second matrix's rows as they are), and the rank-1
// matrix alone; CQR and RCQR; two steps.
TEST(ShardFallback, RankOneMomentumOnTheInnerMeshFallsBackToAnOrthonormalP) {
  if (g_size < 2) GTEST_SKIP() << "needs an inner mesh";
  const Layout L{1, 1, g_size};
  Grid G(L);
  const int64_t m = 24, n = 16;
  for (dion_qr_method_t qr : {DION_QR_CQR, DION_QR_RCQR})
    for (size_t T : {size_t(2), size_t(1)}) {
      SCOPED_TRACE(std::string(qr == DION_QR_CQR ? "CQR" : "RCQR") + " T=" + std::to_string(T));
      const std::vector<Spec> S(T, Spec{m, n, -1, 0});
      Config c{"fallback", 1.0, qr, 1};
      c.weight_decay = 0.0;
      OptRun dist;
      build(dist, G, c, true, S);
      if (HasFatalFailure()) return;
      const double cs = 0.02 * std::sqrt(static_cast<double>(m) / n);
      for (int step = 0; step < 2; ++step) {
        std::vector<std::vector<float>> before;
        for (size_t k = 0; k < T; ++k) {
          Local& l = dist.loc[k];
          before.push_back(l.x);
          for (int64_t a = 0; a < l.ext[0]; ++a)
            for (int64_t b = 0; b < l.ext[1]; ++b) {
              const int64_t i = l.off[0] + a, j = l.off[1] + b;
              l.g[static_cast<size_t>(a * l.ext[1] + b)] =
                  k == 0 ? (1.5f + hash_uniform(11, static_cast<uint64_t>(i))) * hash_uniform(13, static_cast<uint64_t>(j))
                         : grad_of(0, step, 1, i * n + j);
            }
        }
        ASSERT_EQ(dist.step(), DION_SUCCESS) << dion_last_error(dist.opt);
        for (size_t k = 0; k < T; ++k) {
          const Local& l = dist.loc[k];
          ASSERT_EQ(l.ext[1], n);
          std::vector<double> g(static_cast<size_t>(n * n), 0.0);  // this rank's dX^T dX
          for (int64_t a = 0; a < l.ext[0]; ++a)
            for (int64_t p = 0; p < n; ++p)
              for (int64_t q = 0; q < n; ++q) {
                const size_t e = static_cast<size_t>(a * n);
                const double dp = static_cast<double>(l.x[e + p]) - before[k][e + p];
                const double dq = static_cast<double>(l.x[e + q]) - before[k][e + q];
                g[static_cast<size_t>(p * n + q)] += dp * dq;
              }
          MPI_Allreduce(MPI_IN_PLACE, g.data(), static_cast<int>(g.size()), MPI_DOUBLE, MPI_SUM, G.mc[2]);
          dion_state_info_t qi;
          const std::vector<float> Q = read_state(dist.opt, static_cast<int32_t>(k), "Q", &qi);
          ASSERT_EQ(qi.local_shape[0], n);
          const int64_t r = qi.local_shape[1];
          ASSERT_EQ(r, n);
          double err = 0, ref = 0;
          for (int64_t p = 0; p < n; ++p)
            for (int64_t q = 0; q < n; ++q) {
              double h = 0;
              for (int64_t t = 0; t < r; ++t) h += static_cast<double>(Q[p * r + t]) * Q[q * r + t];
              h *= cs * cs;
              const double d = g[static_cast<size_t>(p * n + q)] - h;
              err += d * d;
              ref += h * h;
            }
          EXPECT_LE(std::sqrt(err), 1e-3 * std::sqrt(ref))
              << "step " << step << ", tensor " << k << ": the rows of P over the mesh are not orthonormal";
          // Not vacuously (a zero P makes R, Q and dX zero): Q's columns are
          // R's normalised, unit wherever R = B^T P is not zero, so all of
          // them for the full-rank matrix and the first at least for the
          // rank-1 one.
          int unit = 0;
          for (int64_t t = 0; t < r; ++t) {
            double q2 = 0;
            for (int64_t p = 0; p < n; ++p) q2 += static_cast<double>(Q[p * r + t]) * Q[p * r + t];
            unit += std::fabs(std::sqrt(q2) - 1.0) < 1e-4;
          }
          if (k == 0)
            EXPECT_GE(unit, 1) << "step " << step << ": Q of the rank-1 matrix is zero";
          else
            EXPECT_EQ(unit, r) << "step " << step << ": Q of the full-rank matrix is not column-normalised";
          for (float v : l.x) ASSERT_TRUE(std::isfinite(v));
        }
      }
    }
}

// A NaN in one element of one rank's gradient shard makes every rank of
// every mesh skip the step, and nothing moves.
TEST(ShardErrors, NonFiniteOnOneRankSkipsEverywhere) {
  for (const Layout& L : layouts()) {
    Grid G(L);
    Config c{"x", 0.5, DION_QR_RCQR, 1};
    OptRun dist, ref;
    build(dist, G, c, true);
    build(ref, G, c, false);
    if (HasFatalFailure()) return;
    fill_grads(dist, ref, G, 0);
    ASSERT_EQ(dist.step(), DION_SUCCESS) << dion_last_error(dist.opt);
    std::vector<std::vector<float>> before;
    for (const Local& l : dist.loc) before.push_back(l.x);
    fill_grads(dist, ref, G, 1);
    if (g_rank == g_size - 1) {
      for (Local& l : dist.loc)
        if (l.numel() > 0) {
          l.g[0] = std::nanf("");
          break;
        }
    }
    ASSERT_EQ(dist.step(), DION_SUCCESS) << dion_last_error(dist.opt);
    int64_t skipped = 0;
    int32_t last = 0;
    ASSERT_EQ(dion_get_skipped_steps(dist.opt, &skipped, &last, nullptr), DION_SUCCESS);
    EXPECT_EQ(last, 1);
    EXPECT_EQ(skipped, 1);
    for (size_t k = 0; k < dist.loc.size(); ++k)
      EXPECT_EQ(std::memcmp(before[k].data(), dist.loc[k].x.data(), sizeof(float) * before[k].size()), 0);
  }
}

}  // namespace

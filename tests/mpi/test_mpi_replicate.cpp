// SPDX-License-Identifier: MIT
// The replicate mesh (DDP) over MPI on the host backend (run with 2 and 4
// ranks). Each rank gets its own gradient G_w; with replicate_grad_sync the
// run must equal a single-process run driven by the averaged gradient
// avg_w G_w (spec §2.6): for compressed Dion by linearity (P and R averaged
// instead of G), for the others by averaging G. Properties asserted:
//  - every rank's parameters are bit-identical to rank 0's;
//  - they match the single-process reference within fp32 reassociation
//    error (the average is summed in another order than the reference's
//    double-precision average: ~1e-7 relative per element, amplified by the
//    orthogonalizations to well under 1e-4);
//  - after dion_sync_for_checkpoint every state matches the reference's
//    (Dion's decoupled momenta average to the synchronized momentum);
//  - the replicate byte counter shows compressed Dion moving (m + n) r
//    elements per matrix per step (plus the 4-byte non-finite flag)
//    instead of m n;
//  - a NaN in one rank's gradient makes every rank skip the step.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "dion_mpi.h"
#include "rank_printer.hpp"
#include "../hash_uniform.h"

namespace {

int g_rank = 0, g_size = 1;

struct Case {
  const char* name;
  dion_algorithm_t algo;
  int64_t m, n;
  double rank_fraction;  // Dion
  bool compressed;       // expected for Dion
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// The gradient rank w sees at step s, element i.
float grad_of(int w, int s, int64_t i) { return hash_uniform(1000 + 37 * w + 7919 * s, static_cast<uint64_t>(i)); }

struct OptRun {
  dion_optimizer_t opt = nullptr;
  dion_comm_t comm = nullptr;
  std::vector<float> x, g;
  ~OptRun() {
    dion_destroy(opt);
    if (comm) dion_comm_destroy(comm);
  }
};

void build(OptRun& r, const Case& c, bool distributed) {
  dion_options_t o;
  dion_options_init(&o);
  o.seed = 99;
  if (distributed) {
    ASSERT_EQ(dion_comm_from_mpi(&r.comm, MPI_COMM_WORLD), DION_SUCCESS) << dion_last_error(nullptr);
    o.replicate_comm = r.comm;
  }
  ASSERT_EQ(dion_create(&r.opt, &o), DION_SUCCESS) << dion_last_error(nullptr);
  const int64_t n = c.m * c.n;
  r.x.resize(static_cast<size_t>(n));
  r.g.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r.x[static_cast<size_t>(i)] = 0.1f * hash_uniform(5, static_cast<uint64_t>(i));
  dion_tensor_t t;
  dion_tensor_init(&t);
  t.name = "w";
  t.param = r.x.data();
  t.grad = r.g.data();
  t.param_dtype = DION_DTYPE_FP32;
  t.ndim = c.n > 1 ? 2 : 1;
  t.shape[0] = c.m;
  t.shape[1] = c.n;
  dion_group_options_t go;
  dion_group_options_init(&go, c.algo);
  go.lr = 0.02;
  go.weight_decay = 0.01;
  if (c.algo == DION_ALGO_DION) go.rank_fraction = c.rank_fraction;
  ASSERT_EQ(dion_add_group(r.opt, &go, &t, 1, nullptr), DION_SUCCESS) << dion_last_error(r.opt);
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<std::vector<float>> states(dion_optimizer_t opt) {
  int32_t n = 0;
  EXPECT_EQ(dion_state_count(opt, &n), DION_SUCCESS);
  std::vector<std::vector<float>> out;
  for (int32_t i = 0; i < n; ++i) {
    dion_state_info_t info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    EXPECT_EQ(dion_state_info(opt, i, &info), DION_SUCCESS);
    std::vector<float> b(info.local_bytes / sizeof(float));
    EXPECT_EQ(dion_state_read(opt, i, b.data(), info.local_bytes, nullptr), DION_SUCCESS);
    out.push_back(std::move(b));
  }
  return out;
}

class Replicate : public ::testing::TestWithParam<Case> {};

TEST_P(Replicate, EqualsSingleProcessWithTheAveragedGradient) {
  const Case c = GetParam();
  OptRun dist, ref;
  build(dist, c, true);
  build(ref, c, false);
  if (HasFatalFailure()) return;
  const int64_t n = c.m * c.n;
  for (int s = 0; s < 3; ++s) {
    for (int64_t i = 0; i < n; ++i) {
      dist.g[static_cast<size_t>(i)] = grad_of(g_rank, s, i);
      double avg = 0;
      for (int w = 0; w < g_size; ++w) avg += grad_of(w, s, i);
      ref.g[static_cast<size_t>(i)] = static_cast<float>(avg / g_size);
    }
    ASSERT_EQ(dion_step(dist.opt, nullptr), DION_SUCCESS) << dion_last_error(dist.opt);
    ASSERT_EQ(dion_step(ref.opt, nullptr), DION_SUCCESS) << dion_last_error(ref.opt);
    uint64_t last = 0;
    ASSERT_EQ(dion_get_comm_bytes(dist.opt, DION_MESH_REPLICATE, &last, nullptr), DION_SUCCESS);
    if (c.algo == DION_ALGO_DION) {
      const int64_t mn = std::min(c.m, c.n);
      const int64_t r = std::min<int64_t>(mn, static_cast<int64_t>(std::ceil(c.rank_fraction * mn)));
      // compressed: P and R, the matrix's all-zero flag and the skip flag
      const uint64_t expect = c.compressed ? 4u * static_cast<uint64_t>((c.m + c.n) * r) + 4u + 4u
                                           : 4u * static_cast<uint64_t>(n) + 4u;
      EXPECT_EQ(last, expect) << "step " << s;
      if (c.compressed) EXPECT_LT(last, 4u * static_cast<uint64_t>(n));
    } else {
      EXPECT_EQ(last, 4u * static_cast<uint64_t>(n) + 4u) << "the gradient average plus the skip flag";
    }
  }
  // Every rank holds the same parameters as rank 0, bit for bit.
  std::vector<float> x0 = dist.x;
  MPI_Bcast(x0.data(), static_cast<int>(x0.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  EXPECT_EQ(std::memcmp(x0.data(), dist.x.data(), sizeof(float) * x0.size()), 0) << "rank " << g_rank;
  EXPECT_LT(rel_diff(dist.x, ref.x), 1e-4) << c.name;
  // After the checkpoint sync the states are the synchronized ones.
  ASSERT_EQ(dion_sync_for_checkpoint(dist.opt, nullptr), DION_SUCCESS) << dion_last_error(dist.opt);
  const auto sd = states(dist.opt), sr = states(ref.opt);
  ASSERT_EQ(sd.size(), sr.size());
  for (size_t k = 0; k < sd.size(); ++k) {
    if (c.algo == DION_ALGO_DION && k == 1) {
      // Q: its columns' signs are free (the update does not depend on them).
      std::vector<float> a = sd[k], b = sr[k];
      for (auto& v : a) v = std::fabs(v);
      for (auto& v : b) v = std::fabs(v);
      EXPECT_LT(rel_diff(a, b), 1e-3) << "state " << k;
      continue;
    }
    EXPECT_LT(rel_diff(sd[k], sr[k]), 1e-4) << "state " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, Replicate,
    ::testing::Values(Case{"Dion_compressed", DION_ALGO_DION, 64, 48, 0.25, true},
                      Case{"Dion_full_rank_uncompressed", DION_ALGO_DION, 24, 16, 1.0, false},
                      Case{"Muon", DION_ALGO_MUON, 32, 24, 0, false},
                      Case{"NorMuon", DION_ALGO_NORMUON, 24, 40, 0, false},
                      Case{"Dion2", DION_ALGO_DION2, 24, 32, 0, false},
                      Case{"NorDion2", DION_ALGO_NORDION2, 32, 24, 0, false},
                      Case{"AdamW", DION_ALGO_ADAMW, 40, 1, 0, false},
                      Case{"Lion", DION_ALGO_LION, 12, 5, 0, false}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(ReplicateGuard, NonFiniteOnOneRankSkipsEveryRank) {
  Case c{"Dion", DION_ALGO_DION, 64, 48, 0.25, true};
  OptRun dist;
  build(dist, c, true);
  if (HasFatalFailure()) return;
  for (size_t i = 0; i < dist.g.size(); ++i) dist.g[i] = grad_of(g_rank, 0, static_cast<int64_t>(i));
  if (g_rank == g_size - 1) dist.g[5] = NAN;
  const std::vector<float> before = dist.x;
  ASSERT_EQ(dion_step(dist.opt, nullptr), DION_SUCCESS) << dion_last_error(dist.opt);
  EXPECT_EQ(std::memcmp(before.data(), dist.x.data(), sizeof(float) * before.size()), 0);
  int64_t skipped = 0;
  int32_t last = 0;
  ASSERT_EQ(dion_get_skipped_steps(dist.opt, &skipped, &last, nullptr), DION_SUCCESS);
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(last, 1);
}

// Metadata that differs between replicas (here the learning rate on the last
// rank, then a shape) and arguments that fail on one rank only are refused by
// dion_add_group on every rank, with nothing added, instead of hanging or
// diverging later; a consistent call afterwards works.
TEST(ReplicateGuard, MismatchedGroupIsRefusedOnEveryRank) {
  dion_comm_t comm = nullptr;
  ASSERT_EQ(dion_comm_from_mpi(&comm, MPI_COMM_WORLD), DION_SUCCESS);
  dion_options_t o;
  dion_options_init(&o);
  o.replicate_comm = comm;
  dion_optimizer_t opt = nullptr;
  ASSERT_EQ(dion_create(&opt, &o), DION_SUCCESS) << dion_last_error(nullptr);
  std::vector<float> x(64 * 48, 0.1f), g(64 * 48, 0.0f);
  dion_tensor_t t;
  dion_tensor_init(&t);
  t.param = x.data();
  t.grad = g.data();
  t.ndim = 2;
  t.shape[0] = 64;
  t.shape[1] = 48;
  dion_group_options_t go;
  dion_group_options_init(&go, DION_ALGO_DION);
  go.lr = g_rank == g_size - 1 ? 0.03 : 0.02;
  EXPECT_EQ(dion_add_group(opt, &go, &t, 1, nullptr), DION_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion_last_error(opt)).find("differ between the ranks"), std::string::npos)
      << dion_last_error(opt);
  go.lr = 0.02;
  t.shape[0] = g_rank == 0 ? 32 : 64;
  EXPECT_EQ(dion_add_group(opt, &go, &t, 1, nullptr), DION_ERROR_INVALID_ARGUMENT);
  int32_t groups = -1;
  EXPECT_EQ(dion_group_count(opt, &groups), DION_SUCCESS);
  EXPECT_EQ(groups, 0);
  // An argument that fails validation on one rank only (a NULL param on
  // rank 0): rank 0 gets its own error, the others a "failed on another
  // rank" one; nobody waits.
  t.shape[0] = 64;
  t.param = g_rank == 0 ? nullptr : x.data();
  EXPECT_EQ(dion_add_group(opt, &go, &t, 1, nullptr), DION_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion_last_error(opt)).find(g_rank == 0 ? "param is NULL" : "failed on another rank"),
            std::string::npos)
      << dion_last_error(opt);
  t.param = x.data();
  EXPECT_EQ(dion_add_group(opt, &go, &t, 1, nullptr), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
  dion_destroy(opt);
  dion_comm_destroy(comm);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  print_failures_only_unless_rank0(g_rank);
  int rc = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}

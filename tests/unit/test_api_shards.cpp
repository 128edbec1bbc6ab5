// SPDX-License-Identifier: MIT
// API contract, shard metadata on one process: with size-1 MPI communicators
// (MPI_COMM_SELF) as the outer and inner meshes, dion_add_group checks the
// shard dims, offsets and extents (they must tile the global tensor), and the
// one-rank "sharded" run equals the unsharded one. Needs a libdion built with
// MPI; skipped otherwise.
#if defined(__has_include)
#if __has_include(<mpi.h>)
#define DION_TEST_HAVE_MPI 1
#endif
#endif

#ifdef DION_TEST_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only (no libmpi_cxx)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include "dion_mpi.h"
#endif

#include "test_api_common.h"

using namespace dion_test;

namespace {

#ifdef DION_TEST_HAVE_MPI

// MPI is initialised once for the binary (singleton init, no mpirun).
class MpiEnv : public ::testing::Environment {
 public:
  void SetUp() override {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) {
      MPI_Init(nullptr, nullptr);
      owned_ = true;
    }
  }
  void TearDown() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (owned_ && !fin) MPI_Finalize();
  }

 private:
  bool owned_ = false;
};
::testing::Environment* const g_mpi = ::testing::AddGlobalTestEnvironment(new MpiEnv);

class ApiShards : public ::testing::Test {
 protected:
  void SetUp() override {
    dion_status_t s = dion_comm_from_mpi(&outer_, MPI_COMM_SELF);
    if (s == DION_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "libdion was built without MPI";
    ASSERT_EQ(s, DION_SUCCESS) << dion_last_error(nullptr);
    ASSERT_EQ(dion_comm_from_mpi(&inner_, MPI_COMM_SELF), DION_SUCCESS) << dion_last_error(nullptr);
    int32_t n = 0, r = -1;
    ASSERT_EQ(dion_comm_size(outer_, &n), DION_SUCCESS);
    ASSERT_EQ(dion_comm_rank(outer_, &r), DION_SUCCESS);
    EXPECT_EQ(n, 1);
    EXPECT_EQ(r, 0);
    o_ = default_options();
    o_.outer_comm = outer_;
    o_.inner_comm = inner_;
    o_.seed = 21;
    dion_status_t c = dion_create(&opt_, &o_);
    ASSERT_EQ(c, DION_SUCCESS) << dion_last_error(nullptr);
    base_.add_tensor("shard.base", DION_DTYPE_FP32, {6, 4}, 2);
    base_.add_group(group_opts(DION_ALGO_MUON), {0});
    ASSERT_TRUE(build(opt_, base_));
    base_.new_grads(1, 0);
    step(opt_);
    before_ = snapshot(opt_, base_);
  }
  void TearDown() override {
    dion_destroy(opt_);
    EXPECT_EQ(dion_comm_destroy(outer_), DION_SUCCESS);
    EXPECT_EQ(dion_comm_destroy(inner_), DION_SUCCESS);
  }

  dion_comm_t outer_ = nullptr, inner_ = nullptr;
  dion_options_t o_;
  dion_optimizer_t opt_ = nullptr;
  Model base_;
  Snapshot before_;
};

struct ShardCase {
  const char* id;
  dion_algorithm_t algo;
  std::vector<int64_t> shape;
  int32_t outer_dim, inner_dim;
  int64_t outer_off, outer_ext, inner_off, inner_ext;
};

TEST_F(ApiShards, BadShardMetadataIsRejected) {
  const ShardCase cases[] = {
      // both meshes on one dim
      {"same_dim", DION_ALGO_MUON, {8, 6}, 0, 0, 0, 8, 0, 8},
      {"same_dim_1", DION_ALGO_DION, {8, 6}, 1, 1, 0, 6, 0, 6},
      // outside the global shape
      {"outer_beyond", DION_ALGO_MUON, {8, 6}, 0, -1, 4, 8, 0, 0},
      {"outer_offset_past_end", DION_ALGO_DION, {8, 6}, 1, -1, 7, 1, 0, 0},
      {"inner_beyond", DION_ALGO_DION, {8, 6}, -1, 1, 0, 0, 0, 7},
      {"outer_offset_negative", DION_ALGO_MUON, {8, 6}, 0, -1, -1, 8, 0, 0},
      {"inner_extent_negative", DION_ALGO_ADAMW, {8, 6}, -1, 0, 0, 0, 0, -8},
      // within the shape but not tiling it: one rank must hold the whole dim
      {"outer_short", DION_ALGO_MUON, {8, 6}, 0, -1, 0, 7, 0, 0},
      {"outer_offset_not_zero", DION_ALGO_DION, {8, 6}, 0, -1, 2, 6, 0, 0},
      {"inner_empty", DION_ALGO_ADAMW, {8, 6}, -1, 1, 0, 0, 0, 0},
      // dim out of range
      {"outer_dim_2", DION_ALGO_MUON, {8, 6}, 2, -1, 0, 1, 0, 0},
      {"inner_dim_1_of_1d", DION_ALGO_ADAMW, {8}, -1, 1, 0, 0, 0, 1},
  };
  for (const ShardCase& c : cases) {
    SCOPED_TRACE(c.id);
    Model m;
    const std::string name = std::string("shard.") + c.id;
    Tensor& t = m.add_tensor(name, DION_DTYPE_FP32, c.shape, 3);
    t.param.resize(4096, 0);
    t.grad.resize(4096, 0);
    dion_tensor_t d = t.desc();
    d.outer_shard_dim = c.outer_dim;
    d.inner_shard_dim = c.inner_dim;
    d.outer_offset = c.outer_off;
    d.outer_extent = c.outer_ext;
    d.inner_offset = c.inner_off;
    d.inner_extent = c.inner_ext;
    dion_group_options_t g = group_opts(c.algo);
    EXPECT_TRUE(is_error(dion_add_group(opt_, &g, &d, 1, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_add_group", name}));
    expect_unchanged(before_, snapshot(opt_, base_), c.id);
  }
}

// A one-rank shard holding the whole dim is the unsharded tensor: same
// results, same states, and the state info reports the full local shape.
TEST_F(ApiShards, OneRankShardEqualsUnsharded) {
  for (dion_algorithm_t a : all_algorithms()) {
    SCOPED_TRACE(algo_name(a));
    Model sharded, plain;
    sharded.add_tensor("oneshard.w", DION_DTYPE_FP32, {10, 6}, 4);
    plain.add_tensor("oneshard.w", DION_DTYPE_FP32, {10, 6}, 4);
    dion_group_options_t g = group_opts(a);
    g.rank_fraction = 0.5;
    dion_optimizer_t s = nullptr;
    ASSERT_EQ(dion_create(&s, &o_), DION_SUCCESS) << dion_last_error(nullptr);
    dion_options_t po = default_options();
    po.seed = o_.seed;
    Optimizer p(&po);
    // Shard dims that keep the unsharded orientation: Dion transposes a
    // matrix whose outer-sharded dim is 0 (spec §2.2), so it gets outer = 1,
    // inner = 0; the Muon family gets the row (outer) mesh only.
    dion_tensor_t d = sharded.tensors[0].desc();
    const int32_t od = a == DION_ALGO_DION ? 1 : 0;
    d.outer_shard_dim = od;
    d.outer_offset = 0;
    d.outer_extent = d.shape[od];
    if (a == DION_ALGO_DION || !is_matrix_algo(a)) {
      d.inner_shard_dim = 1 - od;
      d.inner_offset = 0;
      d.inner_extent = d.shape[1 - od];
    }
    const dion_status_t added = dion_add_group(s, &g, &d, 1, nullptr);
    if (added == DION_ERROR_NOT_SUPPORTED) {
      std::printf("    note: %s\n", dion_last_error(s));
      dion_destroy(s);
      continue;
    }
    ASSERT_EQ(added, DION_SUCCESS) << dion_last_error(s);
    ASSERT_EQ(add_group(p, g, {&plain.tensors[0]}), DION_SUCCESS) << dion_last_error(p);
    for (int k = 0; k < 3; ++k) {
      sharded.new_grads(7, k);
      plain.new_grads(7, k);
      ASSERT_EQ(dion_step(s, nullptr), DION_SUCCESS) << dion_last_error(s);
      step(p);
    }
    EXPECT_TRUE(same_bits(sharded.tensors[0].param, plain.tensors[0].param));
    const auto ss = read_states(s), ps = read_states(p);
    expect_same_states(ps, ss, "one-rank shard vs plain");
    for (const StateEntry& e : ss)
      for (int k = 0; k < e.info.ndim; ++k) {
        EXPECT_EQ(e.info.local_shape[k], e.info.global_shape[k]) << e.name << " dim " << k;
        EXPECT_EQ(e.info.local_offset[k], 0) << e.name << " dim " << k;
      }
    uint64_t last = 1, total = 1;
    for (dion_mesh_t mesh : {DION_MESH_REPLICATE, DION_MESH_OUTER, DION_MESH_INNER}) {
      ASSERT_EQ(dion_get_comm_bytes(s, mesh, &last, &total), DION_SUCCESS);
      EXPECT_EQ(total, 0u) << "a one-rank mesh moves no bytes (mesh " << mesh << ")";
    }
    dion_destroy(s);
  }
}

TEST_F(ApiShards, SameCommunicatorTwiceIsRejected) {
  dion_options_t o = default_options();
  o.outer_comm = outer_;
  o.inner_comm = outer_;
  dion_optimizer_t h = reinterpret_cast<dion_optimizer_t>(static_cast<uintptr_t>(0x8));
  EXPECT_TRUE(is_error(dion_create(&h, &o), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_create", "outer_comm", "inner_comm"}));
  EXPECT_EQ(h, nullptr);
  o.inner_comm = nullptr;
  o.replicate_comm = outer_;
  EXPECT_TRUE(is_error(dion_create(&h, &o), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_create", "replicate_comm", "outer_comm"}));
  EXPECT_EQ(h, nullptr);
}

#else

TEST(ApiShards, NeedsMpi) { GTEST_SKIP() << "mpi.h is not on the include path: libdion was built without MPI"; }

#endif

}  // namespace

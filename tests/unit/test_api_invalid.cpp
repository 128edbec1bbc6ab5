// SPDX-License-Identifier: MIT
// API contract, invariant 7 (DESIGN.md §7): bad input returns the right
// status and a message naming the function and the offending argument or
// tensor, and changes nothing — parameters, states, counts, steps and
// hyperparameters are compared bit for bit before and after.
#include "test_api_common.h"

using namespace dion_test;

namespace {

// An optimizer that already holds three groups with non-zero state.
class ApiInvalid : public ::testing::Test {
 protected:
  void SetUp() override {
    o_ = default_options();
    o_.seed = 5;
    ASSERT_EQ(opt_.create(&o_), DION_SUCCESS);
    base_.add_tensor("base.proj", DION_DTYPE_FP32, {10, 4}, 11);
    base_.add_tensor("base.bias", DION_DTYPE_FP32, {6}, 12);
    base_.add_tensor("base.weight", DION_DTYPE_BF16, {8, 6}, 13);
    base_.add_group(group_opts(DION_ALGO_DION), {0});
    base_.add_group(group_opts(DION_ALGO_ADAMW), {1});
    base_.add_group(group_opts(DION_ALGO_MUON), {2});
    ASSERT_TRUE(build(opt_, base_));
    for (int s = 0; s < 2; ++s) {
      base_.new_grads(3, s);
      ASSERT_EQ(step(opt_), DION_SUCCESS);
    }
    before_ = snapshot(opt_, base_);
    ASSERT_EQ(before_.groups, 3);
    ASSERT_EQ(before_.tensors, 3);
    ASSERT_EQ(before_.states.size(), 5u);  // Dion {momentum, Q}, AdamW {momentum, variance}, Muon {momentum}
  }
  void expect_nothing_changed(const std::string& what) { expect_unchanged(before_, snapshot(opt_, base_), what); }
  const char* err() { return dion_last_error(opt_); }

  dion_options_t o_;
  Optimizer opt_;
  Model base_;
  Snapshot before_;
};

// ------------------------------------------------------------ add_group --

using Mutator = void (*)(dion_group_options_t&, dion_tensor_t&);

struct BadGroupCase {
  const char* id;                // test name suffix; the bad tensor is called "probe.<id>"
  dion_algorithm_t algorithm;
  std::vector<int64_t> shape;    // shape of the bad tensor (the 2nd of the group)
  Mutator mutate;                // applied to the options and the bad tensor
  std::vector<std::string> needles;  // "@" stands for the bad tensor's name
  dion_status_t want = DION_ERROR_INVALID_ARGUMENT;
};
void PrintTo(const BadGroupCase& c, std::ostream* os) { *os << c.id; }

void nop(dion_group_options_t&, dion_tensor_t&) {}

std::vector<BadGroupCase> bad_group_cases() {
  const std::vector<int64_t> M = {8, 6};
  using G = dion_group_options_t;
  using T = dion_tensor_t;
  return {
      // struct headers
      {"group_struct_size_0", DION_ALGO_MUON, M, [](G& o, T&) { o.struct_size = 0; }, {"struct_size"}},
      {"group_struct_size_huge", DION_ALGO_MUON, M, [](G& o, T&) { o.struct_size = size_t(1) << 20; }, {"struct_size"}},
      {"group_struct_size_garbage", DION_ALGO_ADAMW, M, [](G& o, T&) { o.struct_size = size_t(0xDEADBEEF); },
       {"struct_size"}},
      {"group_abi_0", DION_ALGO_MUON, M, [](G& o, T&) { o.abi_version = 0; }, {"abi_version"}},
      {"group_abi_next", DION_ALGO_MUON, M, [](G& o, T&) { o.abi_version = DION_ABI_VERSION + 1; }, {"abi_version"}},
      {"tensor_struct_size_0", DION_ALGO_MUON, M, [](G&, T& t) { t.struct_size = 0; }, {"struct_size"}},
      {"tensor_struct_size_huge", DION_ALGO_MUON, M, [](G&, T& t) { t.struct_size = size_t(1) << 20; },
       {"struct_size"}},
      // algorithm and tensor rank
      {"algorithm_7", DION_ALGO_MUON, M, [](G& o, T&) { o.algorithm = 7; }, {"algorithm"}},
      {"algorithm_negative", DION_ALGO_MUON, M, [](G& o, T&) { o.algorithm = -1; }, {"algorithm"}},
      {"dion_1d", DION_ALGO_DION, {8}, nop, {"@"}},
      {"dion_3d", DION_ALGO_DION, {2, 4, 6}, nop, {"@"}},
      {"dion_0d", DION_ALGO_DION, {}, nop, {"@"}},
      {"dion2_1d", DION_ALGO_DION2, {8}, nop, {"@"}},
      {"muon_1d", DION_ALGO_MUON, {8}, nop, {"@"}},
      {"muon_0d", DION_ALGO_MUON, {}, nop, {"@"}},
      {"normuon_1d", DION_ALGO_NORMUON, {8}, nop, {"@"}},
      {"nordion2_1d", DION_ALGO_NORDION2, {8}, nop, {"@"}},
      // scalar hyperparameters
      {"lr_negative_muon", DION_ALGO_MUON, M, [](G& o, T&) { o.lr = -1e-3; }, {"lr"}},
      {"lr_negative_adamw", DION_ALGO_ADAMW, M, [](G& o, T&) { o.lr = -1e-3; }, {"lr"}},
      {"lr_negative_lion", DION_ALGO_LION, M, [](G& o, T&) { o.lr = -0.5; }, {"lr"}},
      {"lr_negative_dion", DION_ALGO_DION, M, [](G& o, T&) { o.lr = -0.01; }, {"lr"}},
      {"lr_nan", DION_ALGO_DION2, M, [](G& o, T&) { o.lr = std::nan(""); }, {"lr"}},
      {"lr_inf", DION_ALGO_ADAMW, M, [](G& o, T&) { o.lr = std::numeric_limits<double>::infinity(); }, {"lr"}},
      {"weight_decay_negative", DION_ALGO_NORMUON, M, [](G& o, T&) { o.weight_decay = -0.1; }, {"weight_decay"}},
      {"weight_decay_negative_adamw", DION_ALGO_ADAMW, M, [](G& o, T&) { o.weight_decay = -1e-9; },
       {"weight_decay"}},
      {"mu_negative_dion", DION_ALGO_DION, M, [](G& o, T&) { o.mu = -0.5; }, {"mu"}},
      {"mu_negative_muon", DION_ALGO_MUON, M, [](G& o, T&) { o.mu = -0.5; }, {"mu"}},
      {"mu_negative_nordion2", DION_ALGO_NORDION2, M, [](G& o, T&) { o.mu = -0.5; }, {"mu"}},
      // Dion
      {"rank_fraction_0", DION_ALGO_DION, M, [](G& o, T&) { o.rank_fraction = 0.0; }, {"rank_fraction"}},
      {"rank_fraction_negative", DION_ALGO_DION, M, [](G& o, T&) { o.rank_fraction = -1.0; }, {"rank_fraction"}},
      {"rank_fraction_1_5", DION_ALGO_DION, M, [](G& o, T&) { o.rank_fraction = 1.5; }, {"rank_fraction"}},
      {"rank_fraction_nan", DION_ALGO_DION, M, [](G& o, T&) { o.rank_fraction = std::nan(""); }, {"rank_fraction"}},
      {"rank_multiple_of_0", DION_ALGO_DION, M, [](G& o, T&) { o.rank_multiple_of = 0; }, {"rank_multiple_of"}},
      // rank_fraction * min(m, n) / rank_multiple_of underflows to 0: rank 0
      // (found by the API fuzzer: the step's QR of a 0 x 0 sketch failed)
      {"rank_underflows_to_0", DION_ALGO_DION, M,
       [](G& o, T&) {
         o.rank_fraction = 4.9e-324;
         o.rank_multiple_of = 64;
       },
       {"rank_fraction", "gives rank 0 < 1"}},  // the group's first tensor fails first (both ranks are 0)
      {"rank_multiple_of_negative", DION_ALGO_DION, M, [](G& o, T&) { o.rank_multiple_of = -4; },
       {"rank_multiple_of"}},
      {"power_iters_0", DION_ALGO_DION, M, [](G& o, T&) { o.power_iters = 0; }, {"power_iters"}},
      {"oversample_0_5", DION_ALGO_DION, M, [](G& o, T&) { o.oversample = 0.5; }, {"oversample"}},
      {"oversample_0", DION_ALGO_DION, M, [](G& o, T&) { o.oversample = 0.0; }, {"oversample"}},
      {"qr_method_3", DION_ALGO_DION, M, [](G& o, T&) { o.qr_method = 3; }, {"qr_method"}},
      {"qr_method_negative", DION_ALGO_DION, M, [](G& o, T&) { o.qr_method = -1; }, {"qr_method"}},
      // Dion2 / NorDion2
      {"fraction_0_dion2", DION_ALGO_DION2, M, [](G& o, T&) { o.fraction = 0.0; }, {"fraction"}},
      {"fraction_1_5_dion2", DION_ALGO_DION2, M, [](G& o, T&) { o.fraction = 1.5; }, {"fraction"}},
      {"fraction_0_nordion2", DION_ALGO_NORDION2, M, [](G& o, T&) { o.fraction = 0.0; }, {"fraction"}},
      {"fraction_1_5_nordion2", DION_ALGO_NORDION2, M, [](G& o, T&) { o.fraction = 1.5; }, {"fraction"}},
      {"selection_scope_2", DION_ALGO_DION2, M, [](G& o, T&) { o.selection_scope = 2; }, {"selection_scope"}},
      // Muon family
      {"orthogonalizer_2", DION_ALGO_MUON, M, [](G& o, T&) { o.orthogonalizer = 2; }, {"orthogonalizer"}},
      {"orthogonalizer_negative_normuon", DION_ALGO_NORMUON, M, [](G& o, T&) { o.orthogonalizer = -1; },
       {"orthogonalizer"}},
      {"adjust_lr_3", DION_ALGO_MUON, M, [](G& o, T&) { o.adjust_lr = 3; }, {"adjust_lr"}},
      {"adjust_lr_negative_dion2", DION_ALGO_DION2, M, [](G& o, T&) { o.adjust_lr = -1; }, {"adjust_lr"}},
      {"matmul_precision_3", DION_ALGO_MUON, M, [](G& o, T&) { o.matmul_precision = 3; }, {"matmul_precision"}},
      // dtypes
      {"momentum_dtype_3", DION_ALGO_MUON, M, [](G& o, T&) { o.momentum_dtype = 3; }, {"momentum_dtype"}},
      {"momentum_dtype_negative_adamw", DION_ALGO_ADAMW, M, [](G& o, T&) { o.momentum_dtype = -5; },
       {"momentum_dtype"}},
      {"q_dtype_3", DION_ALGO_DION, M, [](G& o, T&) { o.q_dtype = 3; }, {"q_dtype"}},
      {"variance_dtype_3", DION_ALGO_ADAMW, M, [](G& o, T&) { o.variance_dtype = 3; }, {"variance_dtype"}},
      {"param_dtype_3", DION_ALGO_MUON, M, [](G&, T& t) { t.param_dtype = 3; }, {"@"}},
      {"param_dtype_unset", DION_ALGO_ADAMW, M, [](G&, T& t) { t.param_dtype = DION_DTYPE_UNSET; }, {"@"}},
      {"grad_dtype_3", DION_ALGO_MUON, M, [](G&, T& t) { t.grad_dtype = 3; }, {"@"}},
      // layout and shape
      {"layout_2", DION_ALGO_MUON, M, [](G&, T& t) { t.layout = 2; }, {"@"}},
      {"col_major_3d", DION_ALGO_ADAMW, {2, 3, 4}, [](G&, T& t) { t.layout = DION_LAYOUT_COL_MAJOR; }, {"@"}},
      {"col_major_1d", DION_ALGO_LION, {6}, [](G&, T& t) { t.layout = DION_LAYOUT_COL_MAJOR; }, {"@"}},
      {"ndim_too_big", DION_ALGO_ADAMW, M, [](G&, T& t) { t.ndim = DION_MAX_DIMS + 1; }, {"@"}},
      {"ndim_negative", DION_ALGO_ADAMW, M, [](G&, T& t) { t.ndim = -1; }, {"@"}},
      {"shape_zero_muon", DION_ALGO_MUON, M, [](G&, T& t) { t.shape[1] = 0; }, {"@"}},
      {"shape_zero_dion", DION_ALGO_DION, M, [](G&, T& t) { t.shape[0] = 0; }, {"@"}},
      {"shape_negative_adamw", DION_ALGO_ADAMW, M, [](G&, T& t) { t.shape[1] = -3; }, {"@"}},
      {"shape_negative_muon", DION_ALGO_MUON, M, [](G&, T& t) { t.shape[0] = -8; }, {"@"}},
      {"param_null", DION_ALGO_MUON, M, [](G&, T& t) { t.param = nullptr; }, {"@"}},
      {"param_null_adamw", DION_ALGO_ADAMW, M, [](G&, T& t) { t.param = nullptr; }, {"@"}},
      // shard metadata
      {"outer_shard_dim_2", DION_ALGO_MUON, M,
       [](G&, T& t) {
         t.outer_shard_dim = 2;
         t.outer_offset = 0;
         t.outer_extent = 1;
       },
       {"@"}},
      {"outer_shard_dim_negative", DION_ALGO_MUON, M, [](G&, T& t) { t.outer_shard_dim = -2; }, {"@"}},
      {"inner_shard_dim_5", DION_ALGO_DION, M,
       [](G&, T& t) {
         t.inner_shard_dim = 5;
         t.inner_offset = 0;
         t.inner_extent = 1;
       },
       {"@"}},
      {"shard_dims_equal", DION_ALGO_MUON, M,
       [](G&, T& t) {
         t.outer_shard_dim = 0;
         t.outer_offset = 0;
         t.outer_extent = t.shape[0];
         t.inner_shard_dim = 0;
         t.inner_offset = 0;
         t.inner_extent = t.shape[0];
       },
       {"@"}},
      {"outer_extent_beyond_shape", DION_ALGO_MUON, M,
       [](G&, T& t) {
         t.outer_shard_dim = 0;
         t.outer_offset = 4;
         t.outer_extent = 8;
       },
       {"@"}},
      {"outer_offset_negative", DION_ALGO_DION, M,
       [](G&, T& t) {
         t.outer_shard_dim = 1;
         t.outer_offset = -1;
         t.outer_extent = 6;
       },
       {"@"}},
      {"inner_extent_beyond_shape", DION_ALGO_DION, M,
       [](G&, T& t) {
         t.inner_shard_dim = 1;
         t.inner_offset = 0;
         t.inner_extent = 7;
       },
       {"@"}},
      {"inner_extent_negative", DION_ALGO_MUON, M,
       [](G&, T& t) {
         t.inner_shard_dim = 0;
         t.inner_offset = 0;
         t.inner_extent = -8;
       },
       {"@"}},
      {"outer_shard_adamw_beyond", DION_ALGO_ADAMW, {12},
       [](G&, T& t) {
         t.outer_shard_dim = 0;
         t.outer_offset = 10;
         t.outer_extent = 4;
       },
       {"@"}},
  };
}

class ApiInvalidAddGroup : public ApiInvalid, public ::testing::WithParamInterface<BadGroupCase> {};

TEST_P(ApiInvalidAddGroup, RejectedAndNothingChanges) {
  const BadGroupCase& c = GetParam();
  const std::string bad_name = std::string("probe.") + c.id;
  // The group: one valid tensor, then the bad one.
  Model extra;
  Tensor& ok = extra.add_tensor("probe.ok", DION_DTYPE_FP32, {6, 4}, 21);
  std::vector<int64_t> alloc_shape;
  for (int64_t s : c.shape) alloc_shape.push_back(s > 0 ? s : 1);
  Tensor& bad = extra.add_tensor(bad_name, DION_DTYPE_FP32, alloc_shape, 22);
  // Generous buffers, so that a library reading a wrongly-accepted shape cannot fault.
  bad.param.resize(4096, 0);
  bad.grad.resize(4096, 0);
  std::vector<dion_tensor_t> d = {ok.desc(), bad.desc()};
  d[1].ndim = static_cast<int32_t>(c.shape.size());
  for (size_t i = 0; i < c.shape.size(); ++i) d[1].shape[i] = c.shape[i];
  dion_group_options_t o = group_opts(c.algorithm);
  c.mutate(o, d[1]);
  const std::vector<unsigned char> ok_param = ok.param, bad_param = bad.param;

  int32_t gi = 77;
  dion_status_t s = dion_add_group(opt_, &o, d.data(), d.size(), &gi);
  std::string msg = err();
  std::vector<std::string> needles = {"dion_add_group"};
  for (const std::string& n : c.needles) needles.push_back(n == "@" ? bad_name : n);
  EXPECT_TRUE(is_error_msg(s, c.want, msg.c_str(), needles));
  EXPECT_TRUE(same_bits(ok.param, ok_param));
  EXPECT_TRUE(same_bits(bad.param, bad_param));
  expect_nothing_changed(c.id);

  // The optimizer still works and numbers the next group 3.
  dion_group_options_t good = group_opts(DION_ALGO_ADAMW);
  ASSERT_EQ(add_group(opt_, good, {&ok}, &gi), DION_SUCCESS) << err();
  EXPECT_EQ(gi, 3);
  int32_t nt = -1;
  EXPECT_EQ(dion_tensor_count(opt_, &nt), DION_SUCCESS);
  EXPECT_EQ(nt, 4);
  EXPECT_EQ(dion_step(opt_, nullptr), DION_SUCCESS) << err();
}

INSTANTIATE_TEST_SUITE_P(Cases, ApiInvalidAddGroup, ::testing::ValuesIn(bad_group_cases()),
                         [](const ::testing::TestParamInfo<BadGroupCase>& i) { return std::string(i.param.id); });

TEST_F(ApiInvalid, AddGroupNullPointers) {
  Model extra;
  Tensor& t = extra.add_tensor("probe.nullptrs", DION_DTYPE_FP32, {6, 4});
  dion_tensor_t d = t.desc();
  dion_group_options_t o = group_opts(DION_ALGO_MUON);
  EXPECT_TRUE(is_error(dion_add_group(opt_, nullptr, &d, 1, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_add_group", "options"}));
  expect_nothing_changed("options NULL");
  EXPECT_TRUE(is_error(dion_add_group(opt_, &o, nullptr, 1, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_add_group", "tensors"}));
  expect_nothing_changed("tensors NULL, count 1");
  EXPECT_TRUE(is_error(dion_add_group(opt_, &o, nullptr, 3, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_add_group", "tensors"}));
  expect_nothing_changed("tensors NULL, count 3");
}

TEST_F(ApiInvalid, AddGroupFirstTensorStructSizeAndUnnamedTensor) {
  Model extra;
  Tensor& t = extra.add_tensor("probe.first", DION_DTYPE_FP32, {6, 4});
  dion_group_options_t o = group_opts(DION_ALGO_MUON);
  dion_tensor_t d = t.desc();
  d.struct_size = 0;
  EXPECT_TRUE(is_error(dion_add_group(opt_, &o, &d, 1, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_add_group", "struct_size"}));
  expect_nothing_changed("tensors[0].struct_size = 0");
  d = t.desc();
  d.struct_size = size_t(1) << 30;
  EXPECT_TRUE(is_error(dion_add_group(opt_, &o, &d, 1, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_add_group", "struct_size"}));
  expect_nothing_changed("tensors[0].struct_size huge");
  // The name is optional: an unnamed bad tensor still gets a message.
  d = t.desc();
  d.name = nullptr;
  d.ndim = 1;
  EXPECT_TRUE(is_error(dion_add_group(opt_, &o, &d, 1, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_add_group", "ndim"}));
  expect_nothing_changed("unnamed 1-D tensor in a Muon group");
  // An unnamed valid tensor is fine.
  d = t.desc();
  d.name = nullptr;
  int32_t gi = -1;
  EXPECT_EQ(dion_add_group(opt_, &o, &d, 1, &gi), DION_SUCCESS) << err();
  EXPECT_EQ(gi, 3);
}

// A failed dion_add_group on an empty optimizer leaves it empty: the next
// valid group is group 0 and its tensors are numbered from 0.
TEST(ApiInvalidFresh, FailedAddGroupAddsNothing) {
  dion_options_t o = default_options();
  Optimizer opt(&o);
  Model m;
  m.add_tensor("fresh.a", DION_DTYPE_FP32, {8, 6});
  m.add_tensor("fresh.b", DION_DTYPE_FP32, {6, 6});
  m.add_tensor("fresh.c_vector", DION_DTYPE_FP32, {6});  // a 1-D tensor in a Muon group: invalid
  dion_group_options_t g = group_opts(DION_ALGO_MUON);
  dion_status_t s = add_group(opt, g, {&m.tensors[0], &m.tensors[1], &m.tensors[2]});
  EXPECT_TRUE(is_error(s, DION_ERROR_INVALID_ARGUMENT, opt, {"dion_add_group", "fresh.c_vector"}));
  int32_t n = -1;
  EXPECT_EQ(dion_group_count(opt, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(dion_tensor_count(opt, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(dion_state_count(opt, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
  uint64_t sb = 1, wb = 0;
  EXPECT_EQ(dion_get_memory_usage(opt, &sb, &wb), DION_SUCCESS);
  EXPECT_EQ(sb, 0u);

  // A second failure after an option error, then a valid group.
  g.lr = -1;
  EXPECT_NE(add_group(opt, g, {&m.tensors[0]}), DION_SUCCESS);
  g.lr = 0.01;
  int32_t gi = -1;
  ASSERT_EQ(add_group(opt, g, {&m.tensors[1], &m.tensors[0]}, &gi), DION_SUCCESS) << dion_last_error(opt);
  EXPECT_EQ(gi, 0);
  EXPECT_EQ(dion_group_count(opt, &n), DION_SUCCESS);
  EXPECT_EQ(n, 1);
  EXPECT_EQ(dion_tensor_count(opt, &n), DION_SUCCESS);
  EXPECT_EQ(n, 2);
  // Tensor 0 is fresh.b (6x6), tensor 1 is fresh.a (8x6).
  int32_t i0 = find_state(opt, 0, "momentum"), i1 = find_state(opt, 1, "momentum");
  dion_state_info_t a = state_info(opt, i0), b = state_info(opt, i1);
  EXPECT_EQ(a.tensor, 0);
  EXPECT_EQ(a.group, 0);
  EXPECT_EQ(a.global_shape[0], 6);
  EXPECT_EQ(b.tensor, 1);
  EXPECT_EQ(b.group, 0);
  EXPECT_EQ(b.global_shape[0], 8);
  int32_t idx = -1;
  EXPECT_NE(dion_state_find(opt, 2, "momentum", &idx), DION_SUCCESS) << "there is no tensor 2";
  step(opt);
}

// ------------------------------------------------------------- dion_create --

TEST(ApiInvalidCreate, BadOptions) {
  struct Case {
    const char* what;
    void (*mutate)(dion_options_t&);
    const char* needle;
  };
  const Case cases[] = {
      {"struct_size 0", [](dion_options_t& o) { o.struct_size = 0; }, "struct_size"},
      {"struct_size huge", [](dion_options_t& o) { o.struct_size = size_t(1) << 20; }, "struct_size"},
      {"struct_size garbage", [](dion_options_t& o) { o.struct_size = size_t(0xDEADBEEFull); }, "struct_size"},
      {"abi_version 0", [](dion_options_t& o) { o.abi_version = 0; }, "abi_version"},
      {"abi_version next", [](dion_options_t& o) { o.abi_version = DION_ABI_VERSION + 1; }, "abi_version"},
      {"backend 2", [](dion_options_t& o) { o.backend = 2; }, "backend"},
      {"backend -1", [](dion_options_t& o) { o.backend = -1; }, "backend"},
      {"reserved0 1", [](dion_options_t& o) { o.reserved0 = 1; }, "reserved0"},
  };
  for (const Case& c : cases) {
    dion_options_t o = default_options();
    c.mutate(o);
    dion_optimizer_t h = reinterpret_cast<dion_optimizer_t>(static_cast<uintptr_t>(0x10));
    dion_status_t s = dion_create(&h, &o);
    EXPECT_TRUE(is_error(s, DION_ERROR_INVALID_ARGUMENT, nullptr, {"dion_create", c.needle}))
        << c.what;
    EXPECT_EQ(h, nullptr) << c.what << ": *optimizer must be NULL after a failure";
    if (s == DION_SUCCESS) dion_destroy(h);
  }
}

TEST(ApiInvalidCreate, NullOptimizerPointer) {
  dion_options_t o = default_options();
  EXPECT_TRUE(is_error(dion_create(nullptr, &o), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_create", "optimizer"}));
  EXPECT_TRUE(is_error(dion_create(nullptr, nullptr), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_create", "optimizer"}));
}

// ------------------------------------------------------------ NULL handle --

TEST(ApiInvalidHandle, NullHandleEverywhere) {
  dion_group_options_t g = group_opts(DION_ALGO_MUON);
  int32_t i32 = 0;
  int64_t i64 = 0;
  double d = 0;
  uint64_t u1 = 0, u2 = 0;
  dion_status_t st = 0;
  float buf[4] = {0, 0, 0, 0};
  dion_state_info_t info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  struct Call {
    const char* fn;
    dion_status_t status;
  };
  const Call calls[] = {
      {"dion_add_group", dion_add_group(nullptr, &g, nullptr, 0, nullptr)},
      {"dion_group_count", dion_group_count(nullptr, &i32)},
      {"dion_tensor_count", dion_tensor_count(nullptr, &i32)},
      {"dion_group_set_hparam", dion_group_set_hparam(nullptr, 0, DION_HPARAM_LR, 0.1)},
      {"dion_group_get_hparam", dion_group_get_hparam(nullptr, 0, DION_HPARAM_LR, &d)},
      {"dion_group_get_step", dion_group_get_step(nullptr, 0, &i64)},
      {"dion_group_set_step", dion_group_set_step(nullptr, 0, 1)},
      {"dion_tensor_rebind", dion_tensor_rebind(nullptr, 0, buf, buf)},
      {"dion_step", dion_step(nullptr, nullptr)},
      {"dion_sync_for_checkpoint", dion_sync_for_checkpoint(nullptr, nullptr)},
      {"dion_get_skipped_steps", dion_get_skipped_steps(nullptr, &i64, &i32, nullptr)},
      {"dion_get_async_error", dion_get_async_error(nullptr, &st)},
      {"dion_get_comm_bytes", dion_get_comm_bytes(nullptr, DION_MESH_REPLICATE, &u1, &u2)},
      {"dion_get_memory_usage", dion_get_memory_usage(nullptr, &u1, &u2)},
      {"dion_state_count", dion_state_count(nullptr, &i32)},
      {"dion_state_info", dion_state_info(nullptr, 0, &info)},
      {"dion_state_find", dion_state_find(nullptr, 0, "momentum", &i32)},
      {"dion_state_read", dion_state_read(nullptr, 0, buf, sizeof buf, nullptr)},
      {"dion_state_write", dion_state_write(nullptr, 0, buf, sizeof buf, nullptr)},
  };
  // Each call was evaluated in order above; re-run each one to read its own message.
  for (const Call& c : calls) EXPECT_EQ(c.status, DION_ERROR_INVALID_ARGUMENT) << c.fn;
  // Messages: call again one at a time.
  EXPECT_TRUE(is_error(dion_step(nullptr, nullptr), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_step", "optimizer"}));
  EXPECT_TRUE(is_error(dion_add_group(nullptr, &g, nullptr, 0, nullptr), DION_ERROR_INVALID_ARGUMENT,
                       nullptr, {"dion_add_group", "optimizer"}));
  EXPECT_TRUE(is_error(dion_group_set_hparam(nullptr, 0, DION_HPARAM_LR, 0.1), DION_ERROR_INVALID_ARGUMENT,
                       nullptr, {"dion_group_set_hparam", "optimizer"}));
  EXPECT_TRUE(is_error(dion_state_read(nullptr, 0, buf, sizeof buf, nullptr), DION_ERROR_INVALID_ARGUMENT,
                       nullptr, {"dion_state_read", "optimizer"}));
  EXPECT_TRUE(is_error(dion_tensor_rebind(nullptr, 0, buf, buf), DION_ERROR_INVALID_ARGUMENT,
                       nullptr, {"dion_tensor_rebind", "optimizer"}));
  EXPECT_TRUE(is_error(dion_get_memory_usage(nullptr, &u1, &u2), DION_ERROR_INVALID_ARGUMENT,
                       nullptr, {"dion_get_memory_usage", "optimizer"}));
}

// ------------------------------------------------------- output pointers --

TEST_F(ApiInvalid, NullOutputPointers) {
  EXPECT_TRUE(is_error(dion_group_count(opt_, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_, {"dion_group_count"}));
  EXPECT_TRUE(is_error(dion_tensor_count(opt_, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_, {"dion_tensor_count"}));
  EXPECT_TRUE(is_error(dion_state_count(opt_, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_, {"dion_state_count"}));
  EXPECT_TRUE(is_error(dion_group_get_hparam(opt_, 0, DION_HPARAM_LR, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_group_get_hparam", "value"}));
  EXPECT_TRUE(is_error(dion_group_get_step(opt_, 0, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_group_get_step", "step"}));
  EXPECT_TRUE(is_error(dion_get_async_error(opt_, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_get_async_error", "status"}));
  expect_nothing_changed("NULL outputs");
}

// --------------------------------------------------------- hyperparameters --

TEST_F(ApiInvalid, HparamBadGroupIsInvalidUsage) {
  double v = 0;
  int64_t s = 0;
  for (int32_t g : {-1, 3, 1000}) {
    SCOPED_TRACE(g);
    EXPECT_TRUE(is_error(dion_group_set_hparam(opt_, g, DION_HPARAM_LR, 0.5), DION_ERROR_INVALID_USAGE, opt_,
                         {"dion_group_set_hparam", "group"}));
    EXPECT_TRUE(is_error(dion_group_get_hparam(opt_, g, DION_HPARAM_LR, &v), DION_ERROR_INVALID_USAGE, opt_,
                         {"dion_group_get_hparam", "group"}));
    EXPECT_TRUE(
        is_error(dion_group_get_step(opt_, g, &s), DION_ERROR_INVALID_USAGE, opt_, {"dion_group_get_step", "group"}));
    EXPECT_TRUE(
        is_error(dion_group_set_step(opt_, g, 9), DION_ERROR_INVALID_USAGE, opt_, {"dion_group_set_step", "group"}));
  }
  expect_nothing_changed("bad group index");
}

TEST_F(ApiInvalid, HparamBadIdOrValue) {
  double v = 0;
  for (dion_hparam_t h : {8, -1, 99}) {
    EXPECT_TRUE(is_error(dion_group_set_hparam(opt_, 1, h, 0.5), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_group_set_hparam", "hparam"}))
        << "hparam " << h;
    EXPECT_TRUE(is_error(dion_group_get_hparam(opt_, 1, h, &v), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_group_get_hparam", "hparam"}))
        << "hparam " << h;
  }
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  struct Bad {
    int32_t group;
    dion_hparam_t h;
    double value;
    const char* needle;
  };
  const Bad bad[] = {
      {0, DION_HPARAM_LR, -0.01, "lr"},           {1, DION_HPARAM_LR, -1.0, "lr"},
      {2, DION_HPARAM_LR, nan, "lr"},             {2, DION_HPARAM_LR, inf, "lr"},
      {1, DION_HPARAM_WEIGHT_DECAY, -0.5, "weight_decay"}, {0, DION_HPARAM_WEIGHT_DECAY, nan, "weight_decay"},
      {0, DION_HPARAM_MU, -0.1, "mu"},            {2, DION_HPARAM_MU, nan, "mu"},
      {1, DION_HPARAM_BETA1, nan, "beta1"},       {1, DION_HPARAM_BETA2, inf, "beta2"},
      {1, DION_HPARAM_EPSILON, nan, "epsilon"},
  };
  for (const Bad& b : bad) {
    EXPECT_TRUE(is_error(dion_group_set_hparam(opt_, b.group, b.h, b.value), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_group_set_hparam", b.needle}))
        << "group " << b.group << " hparam " << b.h << " value " << b.value;
  }
  expect_nothing_changed("bad hparam");
}

// ---------------------------------------------------------------- rebind --

TEST_F(ApiInvalid, RebindBadIndexOrNullParam) {
  float other[64] = {0};
  for (int32_t t : {-1, 3, 1 << 20}) {
    EXPECT_TRUE(is_error_any(dion_tensor_rebind(opt_, t, other, other),
                             {DION_ERROR_INVALID_ARGUMENT, DION_ERROR_INVALID_USAGE}, opt_,
                             {"dion_tensor_rebind", "tensor"}))
        << "tensor " << t;
  }
  EXPECT_TRUE(is_error(dion_tensor_rebind(opt_, 1, nullptr, other), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_tensor_rebind", "param"}));
  EXPECT_TRUE(is_error(dion_tensor_rebind(opt_, 0, nullptr, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_tensor_rebind", "param"}));
  expect_nothing_changed("bad rebind");
  // The failed rebinds left the bindings alone: a step updates base_'s buffers.
  ASSERT_EQ(step(opt_), DION_SUCCESS);
  for (size_t i = 0; i < base_.tensors.size(); ++i)
    EXPECT_FALSE(same_bits(base_.tensors[i].param, before_.params[i])) << "tensor " << i << " did not move";
  for (float f : other) EXPECT_EQ(f, 0.0f);
}

// ----------------------------------------------------------------- states --

TEST_F(ApiInvalid, StateInfoErrors) {
  int32_t n = static_cast<int32_t>(before_.states.size());
  dion_state_info_t info;
  for (int32_t i : {-1, n, n + 100}) {
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    EXPECT_TRUE(is_error_any(dion_state_info(opt_, i, &info), {DION_ERROR_INVALID_ARGUMENT, DION_ERROR_INVALID_USAGE},
                             opt_, {"dion_state_info", "index"}))
        << "index " << i;
  }
  EXPECT_TRUE(is_error(dion_state_info(opt_, 0, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_state_info", "info"}));
  std::memset(&info, 0, sizeof info);
  info.struct_size = 0;
  EXPECT_TRUE(is_error(dion_state_info(opt_, 0, &info), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_state_info", "struct_size"}));
  expect_nothing_changed("state_info");
}

TEST_F(ApiInvalid, StateReadErrors) {
  int32_t n = static_cast<int32_t>(before_.states.size());
  for (int32_t i = 0; i < n; ++i) {
    const uint64_t need = before_.states[static_cast<size_t>(i)].info.local_bytes;
    std::vector<unsigned char> dst(static_cast<size_t>(need) + 16, 0xEE);
    const std::vector<unsigned char> sentinel = dst;
    EXPECT_TRUE(is_error(dion_state_read(opt_, i, dst.data(), need - 1, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_state_read", "bytes"}))
        << "state " << i;
    EXPECT_TRUE(is_error(dion_state_read(opt_, i, dst.data(), 0, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_state_read", "bytes"}))
        << "state " << i;
    EXPECT_TRUE(same_bits(dst, sentinel)) << "a failed read wrote into the buffer";
    EXPECT_TRUE(is_error(dion_state_read(opt_, i, nullptr, need, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_state_read", "dst"}));
    // More room than needed is fine and writes exactly local_bytes.
    ASSERT_EQ(dion_state_read(opt_, i, dst.data(), dst.size(), nullptr), DION_SUCCESS) << err();
    for (size_t k = static_cast<size_t>(need); k < dst.size(); ++k) ASSERT_EQ(dst[k], 0xEE) << "wrote past local_bytes";
  }
  std::vector<unsigned char> buf(4096);
  for (int32_t i : {-1, n, n + 7})
    EXPECT_TRUE(is_error_any(dion_state_read(opt_, i, buf.data(), buf.size(), nullptr),
                             {DION_ERROR_INVALID_ARGUMENT, DION_ERROR_INVALID_USAGE}, opt_,
                             {"dion_state_read", "index"}))
        << "index " << i;
  expect_nothing_changed("state_read");
}

TEST_F(ApiInvalid, StateWriteErrors) {
  int32_t n = static_cast<int32_t>(before_.states.size());
  for (int32_t i = 0; i < n; ++i) {
    const uint64_t need = before_.states[static_cast<size_t>(i)].info.local_bytes;
    std::vector<unsigned char> src(static_cast<size_t>(need), 0x3C);  // a valid, different payload
    EXPECT_TRUE(is_error(dion_state_write(opt_, i, src.data(), need - 1, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_state_write", "bytes"}))
        << "state " << i;
    EXPECT_TRUE(is_error(dion_state_write(opt_, i, src.data(), 0, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_state_write", "bytes"}));
    EXPECT_TRUE(is_error(dion_state_write(opt_, i, nullptr, need, nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_state_write", "src"}));
  }
  std::vector<unsigned char> buf(4096, 0x3C);
  for (int32_t i : {-1, n, n + 7})
    EXPECT_TRUE(is_error_any(dion_state_write(opt_, i, buf.data(), buf.size(), nullptr),
                             {DION_ERROR_INVALID_ARGUMENT, DION_ERROR_INVALID_USAGE}, opt_,
                             {"dion_state_write", "index"}))
        << "index " << i;
  expect_nothing_changed("state_write");
}

TEST_F(ApiInvalid, StateFindErrors) {
  int32_t idx = 12345;
  EXPECT_TRUE(is_error(dion_state_find(opt_, 1, "velocity", &idx), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_state_find", "base.bias", "velocity"}));
  EXPECT_EQ(idx, 12345) << "a failed find must not write *index";
  // "Q" exists for the Dion tensor but not for the AdamW one.
  EXPECT_TRUE(is_error(dion_state_find(opt_, 1, "Q", &idx), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_state_find", "base.bias", "Q"}));
  EXPECT_TRUE(is_error(dion_state_find(opt_, 2, "variance", &idx), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_state_find", "base.weight", "variance"}));
  // Names are exact: no case folding, no prefixes.
  EXPECT_NE(dion_state_find(opt_, 0, "q", &idx), DION_SUCCESS);
  EXPECT_NE(dion_state_find(opt_, 0, "moment", &idx), DION_SUCCESS);
  EXPECT_NE(dion_state_find(opt_, 0, "", &idx), DION_SUCCESS);
  EXPECT_TRUE(is_error(dion_state_find(opt_, 0, nullptr, &idx), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_state_find", "name"}));
  EXPECT_TRUE(is_error(dion_state_find(opt_, 0, "momentum", nullptr), DION_ERROR_INVALID_ARGUMENT, opt_,
                       {"dion_state_find", "index"}));
  for (int32_t t : {-1, 3, 99})
    EXPECT_TRUE(is_error_any(dion_state_find(opt_, t, "momentum", &idx),
                             {DION_ERROR_INVALID_ARGUMENT, DION_ERROR_INVALID_USAGE}, opt_,
                             {"dion_state_find", "tensor"}))
        << "tensor " << t;
  EXPECT_EQ(dion_state_find(opt_, 0, "Q", &idx), DION_SUCCESS) << err();
  EXPECT_EQ(dion_state_find(opt_, 1, "variance", &idx), DION_SUCCESS) << err();
  expect_nothing_changed("state_find");
}

TEST_F(ApiInvalid, CommBytesBadMesh) {
  uint64_t a = 0, b = 0;
  for (dion_mesh_t m : {3, -1})
    EXPECT_TRUE(is_error(dion_get_comm_bytes(opt_, m, &a, &b), DION_ERROR_INVALID_ARGUMENT, opt_,
                         {"dion_get_comm_bytes", "mesh"}))
        << "mesh " << m;
  expect_nothing_changed("comm bytes");
}

}  // namespace

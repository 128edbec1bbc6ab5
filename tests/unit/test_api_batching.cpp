// SPDX-License-Identifier: MIT
// Batching (DESIGN.md §5): tensors of one group with the same shape and dtypes
// are stepped together. The property: a group of several tensors gives
// bit-identical results to the same tensors each in a group of its own (same
// tensor indices, so the same random numbers), including when the set of
// tensors with a gradient changes between steps and when buffers are rebound.
// On the host backend every batched operation loops over the same per-matrix
// BLAS/LAPACK calls, so exact equality is the expected result.
#include "test_api_common.h"

#include <optional>

#include "../scoped_env.h"

namespace {

using namespace dion_test;

struct Case {
  const char* name;
  dion_algorithm_t algo;
  dion_dtype_t dtype;
  int qr;  // Dion only
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string case_name(const testing::TestParamInfo<Case>& i) { return i.param.name; }

class Batching : public testing::TestWithParam<Case> {};

struct Shape2 {
  int64_t m, n;
};

// Five tensors: three 24x40, two 40x24, one 3-D 2x16x24 (Muon family only).
std::vector<Shape2> shapes() { return {{24, 40}, {40, 24}, {24, 40}, {40, 24}, {24, 40}}; }

struct OptRun {
  dion_optimizer_t opt = nullptr;
  std::vector<std::vector<unsigned char>> params, grads;
  ~OptRun() { dion_destroy(opt); }
};

void build(OptRun& r, const Case& c, bool one_group_per_tensor, const std::vector<Shape2>& sh = shapes()) {
  dion_options_t o;
  dion_options_init(&o);
  o.seed = 1234;
  ASSERT_EQ(dion_create(&r.opt, &o), DION_SUCCESS);
  const size_t es = elem_size(c.dtype);
  r.params.resize(sh.size());
  r.grads.resize(sh.size());
  std::vector<dion_tensor_t> ts(sh.size());
  for (size_t i = 0; i < sh.size(); ++i) {
    const int64_t n = sh[i].m * sh[i].n;
    r.params[i].resize(static_cast<size_t>(n) * es);
    r.grads[i].resize(static_cast<size_t>(n) * es);
    for (int64_t j = 0; j < n; ++j) store(r.params[i], c.dtype, j, 0.1f * hash_uniform(100 + i, j));
    dion_tensor_init(&ts[i]);
    ts[i].ndim = 2;
    ts[i].shape[0] = sh[i].m;
    ts[i].shape[1] = sh[i].n;
    ts[i].param_dtype = c.dtype;
    ts[i].param = r.params[i].data();
    ts[i].grad = r.grads[i].data();
  }
  dion_group_options_t g;
  dion_group_options_init(&g, c.algo);
  g.lr = 0.02;
  g.weight_decay = 0.1;
  if (c.algo == DION_ALGO_DION) {
    g.rank_fraction = 0.5;
    g.qr_method = static_cast<dion_qr_method_t>(c.qr);
  }
  if (one_group_per_tensor) {
    for (size_t i = 0; i < ts.size(); ++i) ASSERT_EQ(dion_add_group(r.opt, &g, &ts[i], 1, nullptr), DION_SUCCESS);
  } else {
    ASSERT_EQ(dion_add_group(r.opt, &g, ts.data(), ts.size(), nullptr), DION_SUCCESS);
  }
}

void fill_grads(OptRun& r, dion_dtype_t dt, int step) {
  for (size_t i = 0; i < r.grads.size(); ++i) {
    const int64_t n = static_cast<int64_t>(r.grads[i].size() / elem_size(dt));
    for (int64_t j = 0; j < n; ++j) store(r.grads[i], dt, j, hash_uniform(1000 * (step + 1) + i, j));
  }
}

std::vector<std::vector<unsigned char>> all_states(dion_optimizer_t opt) {
  int32_t n = 0;
  EXPECT_EQ(dion_state_count(opt, &n), DION_SUCCESS);
  std::vector<std::vector<unsigned char>> out;
  for (int32_t i = 0; i < n; ++i) {
    dion_state_info_t info;
    std::memset(&info, 0, sizeof(info));
    info.struct_size = sizeof(info);
    EXPECT_EQ(dion_state_info(opt, i, &info), DION_SUCCESS);
    std::vector<unsigned char> b(info.local_bytes);
    EXPECT_EQ(dion_state_read(opt, i, b.data(), b.size(), nullptr), DION_SUCCESS);
    out.push_back(std::move(b));
  }
  return out;
}

TEST_P(Batching, OneGroupEqualsOneGroupPerTensor) {
  const Case c = GetParam();
  OptRun a, b;
  build(a, c, false);
  build(b, c, true);
  if (HasFatalFailure()) return;
  for (int step = 0; step < 4; ++step) {
    fill_grads(a, c.dtype, step);
    fill_grads(b, c.dtype, step);
    if (step == 2) {
      // Tensor 1 has no gradient this step (a smaller active set), and
      // tensor 3's gradient moves to a new buffer (the table is rewritten).
      for (OptRun* r : {&a, &b}) {
        ASSERT_EQ(dion_tensor_rebind(r->opt, 1, r->params[1].data(), nullptr), DION_SUCCESS);
        std::vector<unsigned char> moved = r->grads[3];
        r->grads[3].swap(moved);
        ASSERT_EQ(dion_tensor_rebind(r->opt, 3, r->params[3].data(), r->grads[3].data()), DION_SUCCESS);
      }
    }
    if (step == 3)
      for (OptRun* r : {&a, &b}) ASSERT_EQ(dion_tensor_rebind(r->opt, 1, r->params[1].data(), r->grads[1].data()), DION_SUCCESS);
    ASSERT_EQ(dion_step(a.opt, nullptr), DION_SUCCESS) << dion_last_error(a.opt);
    ASSERT_EQ(dion_step(b.opt, nullptr), DION_SUCCESS) << dion_last_error(b.opt);
  }
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_EQ(a.params[i], b.params[i]) << "param " << i;
  EXPECT_EQ(all_states(a.opt), all_states(b.opt));
  uint64_t ws = 0;
  ASSERT_EQ(dion_get_memory_usage(a.opt, nullptr, &ws), DION_SUCCESS);
  EXPECT_GT(ws, 0u);
}

// DION_BATCH_MAX=2 cuts the group's three 24 x 40 tensors into batches of 2
// and 1 (src/core/batching.hpp): the same results bit for bit, and a smaller
// workspace (sized for the largest batch) shows the cut was made. Dion's
// phased step keeps every batch's P alive at once (src/algo/dion.cpp), so
// a cut does not shrink its workspace: the sizes are compared with the
// phased step off (DION_PHASED=0), the results with it on.
TEST_P(Batching, BatchesCutByDionBatchMaxEqualOneGroupPerTensor) {
  const Case c = GetParam();
  OptRun whole, cut, each, cut_sized;
  {
    std::optional<ScopedEnv> phased;
    if (c.algo == DION_ALGO_DION) phased.emplace("DION_PHASED", "0");
    build(whole, c, false);
    ScopedEnv batch_max("DION_BATCH_MAX", "2");
    build(cut_sized, c, false);
    phased.reset();
    build(cut, c, false);
  }
  build(each, c, true);
  if (HasFatalFailure()) return;
  for (int step = 0; step < 3; ++step)
    for (OptRun* r : {&cut, &each}) {
      fill_grads(*r, c.dtype, step);
      ASSERT_EQ(dion_step(r->opt, nullptr), DION_SUCCESS) << dion_last_error(r->opt);
    }
  for (size_t i = 0; i < cut.params.size(); ++i) EXPECT_EQ(cut.params[i], each.params[i]) << "param " << i;
  EXPECT_EQ(all_states(cut.opt), all_states(each.opt));
  uint64_t ws_whole = 0, ws_cut = 0;
  ASSERT_EQ(dion_get_memory_usage(whole.opt, nullptr, &ws_whole), DION_SUCCESS);
  ASSERT_EQ(dion_get_memory_usage(cut_sized.opt, nullptr, &ws_cut), DION_SUCCESS);
  if (c.algo != DION_ALGO_ADAMW && c.algo != DION_ALGO_LION)  // element-wise: one batch for the whole group
    EXPECT_LT(ws_cut, ws_whole);
}

// A DION_BATCH_MAX that is not a positive integer is ignored (with a
// warning): the batches, hence the workspace, are those of no cap.
TEST(BatchingEnv, InvalidDionBatchMaxIsIgnored) {
  const Case c{"", DION_ALGO_DION, DION_DTYPE_FP32, DION_QR_RCQR};
  OptRun whole;
  build(whole, c, false);
  uint64_t ws_whole = 0;
  ASSERT_EQ(dion_get_memory_usage(whole.opt, nullptr, &ws_whole), DION_SUCCESS);
  for (const char* v : {"0", "-3", "two", "2x", ""}) {
    SCOPED_TRACE(std::string("DION_BATCH_MAX=\"") + v + "\"");
    OptRun r;
    {
      ScopedEnv batch_max("DION_BATCH_MAX", v);
      build(r, c, false);
    }
    uint64_t ws = 0;
    ASSERT_EQ(dion_get_memory_usage(r.opt, nullptr, &ws), DION_SUCCESS);
    EXPECT_EQ(ws, ws_whole);
  }
}

// DION_BATCH_WORKSPACE_MIB sets the workspace cap of a batch (default 1 GiB):
// three 256 x 256 Dion matrices take about 1.3 MiB of workspace each, so a
// 1 MiB cap puts each in a batch of its own (a smaller workspace), and the
// results stay those of one group per tensor, bit for bit.
TEST(BatchingEnv, DionBatchWorkspaceMibCapsTheBatches) {
  const Case c{"", DION_ALGO_DION, DION_DTYPE_FP32, DION_QR_RCQR};
  const std::vector<Shape2> sh = {{256, 256}, {256, 256}, {256, 256}};
  OptRun whole, cut, each;
  build(whole, c, false, sh);
  {
    ScopedEnv cap("DION_BATCH_WORKSPACE_MIB", "1");
    build(cut, c, false, sh);
  }
  build(each, c, true, sh);
  if (HasFatalFailure()) return;
  uint64_t ws_whole = 0, ws_cut = 0;
  ASSERT_EQ(dion_get_memory_usage(whole.opt, nullptr, &ws_whole), DION_SUCCESS);
  ASSERT_EQ(dion_get_memory_usage(cut.opt, nullptr, &ws_cut), DION_SUCCESS);
  EXPECT_LT(ws_cut, ws_whole);
  EXPECT_GT(ws_whole, uint64_t(3) << 20) << "the three matrices should need more than 3 MiB together";
  for (int step = 0; step < 2; ++step)
    for (OptRun* r : {&cut, &each}) {
      fill_grads(*r, c.dtype, step);
      ASSERT_EQ(dion_step(r->opt, nullptr), DION_SUCCESS) << dion_last_error(r->opt);
    }
  for (size_t i = 0; i < cut.params.size(); ++i) EXPECT_EQ(cut.params[i], each.params[i]) << "param " << i;
  // Out of range: ignored.
  for (const char* v : {"0", "1048577", "1.5"}) {
    OptRun r;
    {
      ScopedEnv cap("DION_BATCH_WORKSPACE_MIB", v);
      build(r, c, false, sh);
    }
    uint64_t ws = 0;
    ASSERT_EQ(dion_get_memory_usage(r.opt, nullptr, &ws), DION_SUCCESS);
    EXPECT_EQ(ws, ws_whole) << "DION_BATCH_WORKSPACE_MIB=" << v;
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, Batching,
    testing::Values(Case{"Dion_rcqr_fp32", DION_ALGO_DION, DION_DTYPE_FP32, DION_QR_RCQR},
                    Case{"Dion_cqr_bf16", DION_ALGO_DION, DION_DTYPE_BF16, DION_QR_CQR},
                    Case{"Dion_qr_fp16", DION_ALGO_DION, DION_DTYPE_FP16, DION_QR_QR},
                    Case{"Muon_fp32", DION_ALGO_MUON, DION_DTYPE_FP32, 0},
                    Case{"NorMuon_bf16", DION_ALGO_NORMUON, DION_DTYPE_BF16, 0},
                    Case{"Dion2_fp32", DION_ALGO_DION2, DION_DTYPE_FP32, 0},
                    Case{"NorDion2_fp16", DION_ALGO_NORDION2, DION_DTYPE_FP16, 0},
                    Case{"AdamW_bf16", DION_ALGO_ADAMW, DION_DTYPE_BF16, 0},
                    Case{"Lion_fp32", DION_ALGO_LION, DION_DTYPE_FP32, 0}),
    case_name);

// Dion2's pre-pass (src/algo/dion2.cpp, dion2_family_prepass): without
// meshes the selection's norms are taken where the gradients are checked for
// NaN/Inf. The step must equal the one without it (DION_DION2_PREPASS=0) bit
// for bit, with a tensor left out of a step, and a NaN gradient must still
// skip the whole step (parameters and state unchanged). The pre-pass's
// buffers count in the workspace, which shows it is on.
TEST(Dion2Prepass, EqualsTheStepWithoutIt) {
  for (const Case& c : {Case{"", DION_ALGO_DION2, DION_DTYPE_FP32, 0}, Case{"", DION_ALGO_DION2, DION_DTYPE_BF16, 0},
                        Case{"", DION_ALGO_NORDION2, DION_DTYPE_FP16, 0}}) {
    SCOPED_TRACE(c.algo == DION_ALGO_DION2 ? "dion2" : "nordion2");
    OptRun a, b;
    build(a, c, false);
    {
      ScopedEnv prepass("DION_DION2_PREPASS", "0");
      build(b, c, false);
    }
    if (HasFatalFailure()) return;
    uint64_t wa = 0, wb = 0;
    ASSERT_EQ(dion_get_memory_usage(a.opt, nullptr, &wa), DION_SUCCESS);
    ASSERT_EQ(dion_get_memory_usage(b.opt, nullptr, &wb), DION_SUCCESS);
    EXPECT_GT(wa, wb) << "the pre-pass's norms live in their own buffers";
    for (int step = 0; step < 5; ++step) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      for (OptRun* r : {&a, &b}) {
        fill_grads(*r, c.dtype, step);
        if (step == 1) ASSERT_EQ(dion_tensor_rebind(r->opt, 1, r->params[1].data(), nullptr), DION_SUCCESS);
        if (step == 2) {
          ASSERT_EQ(dion_tensor_rebind(r->opt, 1, r->params[1].data(), r->grads[1].data()), DION_SUCCESS);
          store(r->grads[3], c.dtype, 7, std::nanf(""));
        }
      }
      const auto params_before = a.params;
      const auto states_before = all_states(a.opt);
      ASSERT_EQ(dion_step(a.opt, nullptr), DION_SUCCESS) << dion_last_error(a.opt);
      ASSERT_EQ(dion_step(b.opt, nullptr), DION_SUCCESS) << dion_last_error(b.opt);
      for (size_t i = 0; i < a.params.size(); ++i) EXPECT_EQ(a.params[i], b.params[i]) << "param " << i;
      EXPECT_EQ(all_states(a.opt), all_states(b.opt));
      int64_t skipped = -1;
      ASSERT_EQ(dion_get_skipped_steps(a.opt, &skipped, nullptr, nullptr), DION_SUCCESS);
      EXPECT_EQ(skipped, step >= 2 ? 1 : 0);
      if (step == 2) {
        EXPECT_EQ(a.params, params_before) << "a NaN gradient skips the step";
        EXPECT_EQ(all_states(a.opt), states_before);
      } else {
        EXPECT_NE(a.params[0], params_before[0]);
      }
    }
  }
}

// A tensor without a gradient in the step keeps its parameter and state:
// the batched path must not touch entries that are not in the active table.
TEST(BatchingSkip, TensorWithoutGradIsUntouched) {
  Case c{"", DION_ALGO_DION, DION_DTYPE_FP32, DION_QR_RCQR};
  OptRun a;
  build(a, c, false);
  if (HasFatalFailure()) return;
  fill_grads(a, c.dtype, 0);
  ASSERT_EQ(dion_step(a.opt, nullptr), DION_SUCCESS);
  const auto before = a.params[2];
  const auto states_before = all_states(a.opt);
  ASSERT_EQ(dion_tensor_rebind(a.opt, 2, a.params[2].data(), nullptr), DION_SUCCESS);
  fill_grads(a, c.dtype, 1);
  ASSERT_EQ(dion_step(a.opt, nullptr), DION_SUCCESS);
  EXPECT_EQ(a.params[2], before);
  const auto states_after = all_states(a.opt);
  // tensor 2's states are states 4 and 5 (momentum, Q), in creation order
  EXPECT_EQ(states_after[4], states_before[4]);
  EXPECT_EQ(states_after[5], states_before[5]);
  EXPECT_NE(states_after[0], states_before[0]);  // the others moved
}

}  // namespace

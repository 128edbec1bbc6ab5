// SPDX-License-Identifier: MIT
// API contract, how buffers are described: COL_MAJOR tensors (Fortran
// callers) give the row-major results in transposed storage, and their
// same-shaped states are column-major too; a gradient dtype different from
// the parameter dtype is honoured; the stream argument is ignored on the host
// backend; DION_UNSET_INT in an integer option means "the default".
#include "test_api_common.h"

using namespace dion_test;

namespace {

std::string algo_param_name(const ::testing::TestParamInfo<dion_algorithm_t>& i) { return algo_name(i.param); }

// Row-major (m, n) storage -> column-major storage of the same matrix.
std::vector<unsigned char> to_col_major(const std::vector<unsigned char>& in, size_t esize, int64_t m, int64_t n) {
  std::vector<unsigned char> out(in.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(&out[static_cast<size_t>(j * m + i) * esize], &in[static_cast<size_t>(i * n + j) * esize], esize);
  return out;
}

// max |a(i,j) - b(i,j)| where a is row-major and b column-major storage of (m, n).
double max_diff_transposed(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, dion_dtype_t dt,
                           int64_t m, int64_t n) {
  double worst = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const double x = load(a, dt, i * n + j), y = load(b, dt, j * m + i);
      const double d = std::isnan(x) || std::isnan(y) ? HUGE_VAL : std::fabs(x - y);
      worst = std::max(worst, d);
    }
  return worst;
}

double max_diff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, dion_dtype_t dt) {
  double worst = 0;
  const int64_t n = static_cast<int64_t>(a.size() / elem_size(dt));
  for (int64_t i = 0; i < n; ++i) {
    const double x = load(a, dt, i), y = load(b, dt, i);
    worst = std::max(worst, std::isnan(x) || std::isnan(y) ? HUGE_VAL : std::fabs(x - y));
  }
  return worst;
}

class ApiLayout : public ::testing::TestWithParam<dion_algorithm_t> {};

TEST_P(ApiLayout, ColMajorIsTheTransposedRowMajorRun) {
  const dion_algorithm_t a = GetParam();
  const std::vector<std::vector<int64_t>> shapes = {{12, 8}, {6, 10}};
  Model row, col;
  for (size_t k = 0; k < shapes.size(); ++k) {
    row.add_tensor("layout.row" + std::to_string(k), DION_DTYPE_FP32, shapes[k], 81 + k);
    Tensor& c = col.add_tensor("layout.col" + std::to_string(k), DION_DTYPE_FP32, shapes[k], 81 + k);
    c.layout = DION_LAYOUT_COL_MAJOR;
    c.param = to_col_major(row.tensors[k].param, 4, shapes[k][0], shapes[k][1]);
  }
  dion_group_options_t g = group_opts(a);
  g.rank_fraction = 0.5;
  row.add_group(g, {0, 1});
  col.add_group(g, {0, 1});
  dion_options_t o = default_options();
  o.seed = 17;
  Optimizer R(&o), C(&o);
  ASSERT_TRUE(build(R, row));
  ASSERT_TRUE(build(C, col));
  for (int s = 0; s < 3; ++s) {
    row.new_grads(33, s);
    for (size_t k = 0; k < shapes.size(); ++k)
      col.tensors[k].grad = to_col_major(row.tensors[k].grad, 4, shapes[k][0], shapes[k][1]);
    // The grad vectors were reassigned (same size, maybe a new buffer): rebind.
    for (size_t k = 0; k < shapes.size(); ++k)
      ASSERT_EQ(dion_tensor_rebind(C, static_cast<int32_t>(k), col.tensors[k].param.data(), col.tensors[k].grad.data()),
                DION_SUCCESS);
    step(R);
    step(C);
  }
  // Element-wise algorithms must agree exactly; the matrix ones up to fp32
  // rounding of differently ordered products.
  const double tol = is_matrix_algo(a) ? 2e-5 : 0.0;
  for (size_t k = 0; k < shapes.size(); ++k)
    EXPECT_LE(max_diff_transposed(row.tensors[k].param, col.tensors[k].param, DION_DTYPE_FP32, shapes[k][0], shapes[k][1]),
              tol)
        << "param " << k;
  const std::vector<StateEntry> rs = read_states(R), cs = read_states(C);
  ASSERT_EQ(rs.size(), cs.size());
  for (const StateEntry& r : rs) {
    const int32_t idx = find_state(C, r.info.tensor, r.name.c_str());
    ASSERT_GE(idx, 0);
    const StateEntry& c = cs[static_cast<size_t>(idx)];
    SCOPED_TRACE(r.name + " of tensor " + std::to_string(r.info.tensor));
    ASSERT_EQ(c.info.ndim, r.info.ndim);
    for (int d = 0; d < r.info.ndim; ++d) EXPECT_EQ(c.info.global_shape[d], r.info.global_shape[d]) << "dim " << d;
    EXPECT_EQ(r.info.layout, DION_LAYOUT_ROW_MAJOR);
    const bool same_shaped = r.name == "momentum" || r.name == "variance";
    EXPECT_EQ(c.info.layout, same_shaped ? DION_LAYOUT_COL_MAJOR : DION_LAYOUT_ROW_MAJOR)
        << "states shaped like a COL_MAJOR parameter are column-major, the others row-major";
    const double stol = is_matrix_algo(a) ? 1e-4 : 0.0;
    if (same_shaped && c.info.layout == DION_LAYOUT_COL_MAJOR) {
      EXPECT_LE(max_diff_transposed(r.data, c.data, r.info.dtype, r.info.global_shape[0], r.info.global_shape[1]), stol);
    } else if (!same_shaped) {
      EXPECT_LE(max_diff(r.data, c.data, r.info.dtype), stol);
    }
  }
}

// bf16 parameters with fp32 gradients holding bf16 values behave exactly like
// bf16 gradients; fp32 parameters with bf16 gradients like fp32 gradients
// holding the same values.
TEST_P(ApiLayout, GradDtypeIsHonoured) {
  const dion_algorithm_t a = GetParam();
  struct Pair {
    dion_dtype_t param, grad;
  };
  for (Pair p : {Pair{DION_DTYPE_BF16, DION_DTYPE_FP32}, Pair{DION_DTYPE_FP32, DION_DTYPE_BF16},
                 Pair{DION_DTYPE_FP16, DION_DTYPE_FP32}}) {
    SCOPED_TRACE(std::to_string(p.param) + "/" + std::to_string(p.grad));
    Model same, mixed;
    same.add_tensor("gd.same", p.param, {10, 6}, 91, DION_DTYPE_UNSET);
    mixed.add_tensor("gd.mixed", p.param, {10, 6}, 91, p.grad);
    dion_group_options_t g = group_opts(a);
    same.add_group(g, {0});
    mixed.add_group(g, {0});
    dion_options_t o = default_options();
    Optimizer S(&o), M(&o);
    ASSERT_TRUE(build(S, same));
    ASSERT_TRUE(build(M, mixed));
    // Gradient values representable in both dtypes (bf16 and fp16 values are
    // exact in fp32; bf16 -> fp32 is exact; fp16 grads use fp16 values).
    const dion_dtype_t narrow = p.param == DION_DTYPE_FP32 ? p.grad : p.param;
    for (int s = 0; s < 3; ++s) {
      Tensor& ts = same.tensors[0];
      Tensor& tm = mixed.tensors[0];
      for (int64_t i = 0; i < ts.numel(); ++i) {
        std::vector<unsigned char> tmp(2);
        store(tmp, narrow, 0, hash_uniform(1000 + s, static_cast<uint64_t>(i)));
        const float v = load(tmp, narrow, 0);
        store(ts.grad, ts.gdtype(), i, v);
        store(tm.grad, tm.gdtype(), i, v);
      }
      step(S);
      step(M);
    }
    EXPECT_TRUE(same_bits(same.tensors[0].param, mixed.tensors[0].param));
    expect_same_states(read_states(S), read_states(M), "same vs mixed grad dtype");
  }
}

// The stream argument is ignored on the host backend.
TEST_P(ApiLayout, HostIgnoresTheStream) {
  const dion_algorithm_t a = GetParam();
  dion_stream_t junk = reinterpret_cast<dion_stream_t>(static_cast<uintptr_t>(0xdeadbeef));
  Model m1, m2;
  m1.add_tensor("stream.w", DION_DTYPE_FP32, {8, 6}, 5);
  m2.add_tensor("stream.w", DION_DTYPE_FP32, {8, 6}, 5);
  m1.add_group(group_opts(a), {0});
  m2.add_group(group_opts(a), {0});
  dion_options_t o = default_options();
  Optimizer A(&o), B(&o);
  ASSERT_TRUE(build(A, m1));
  ASSERT_TRUE(build(B, m2));
  for (int s = 0; s < 2; ++s) {
    m1.new_grads(2, s);
    m2.new_grads(2, s);
    ASSERT_EQ(dion_step(A, nullptr), DION_SUCCESS);
    ASSERT_EQ(dion_step(B, junk), DION_SUCCESS) << dion_last_error(B);
  }
  ASSERT_EQ(dion_sync_for_checkpoint(B, junk), DION_SUCCESS) << dion_last_error(B);
  int64_t n = -1;
  int32_t last = -1;
  ASSERT_EQ(dion_get_skipped_steps(B, &n, &last, junk), DION_SUCCESS) << dion_last_error(B);
  EXPECT_TRUE(same_bits(m1.tensors[0].param, m2.tensors[0].param));
  const int32_t idx = find_state(B, 0, "momentum");
  dion_state_info_t info = state_info(B, idx);
  std::vector<unsigned char> buf(static_cast<size_t>(info.local_bytes));
  ASSERT_EQ(dion_state_read(B, idx, buf.data(), buf.size(), junk), DION_SUCCESS) << dion_last_error(B);
  ASSERT_EQ(dion_state_write(B, idx, buf.data(), buf.size(), junk), DION_SUCCESS) << dion_last_error(B);
  expect_same_states(read_states(A), read_states(B), "NULL vs junk stream");
}

// DION_UNSET_INT in the plain integer fields of the group options means the
// default: results are bit-identical to those of the initialised options.
TEST_P(ApiLayout, UnsetIntMeansDefault) {
  const dion_algorithm_t a = GetParam();
  Model m1, m2;
  m1.add_tensor("unset.w", DION_DTYPE_FP32, {8, 6}, 6);
  m2.add_tensor("unset.w", DION_DTYPE_FP32, {8, 6}, 6);
  dion_group_options_t d = group_opts(a), u = group_opts(a);
  u.rank_multiple_of = DION_UNSET_INT;
  u.power_iters = DION_UNSET_INT;
  u.cqr_warmup_steps = DION_UNSET_INT;
  u.ortho_steps = DION_UNSET_INT;
  u.nesterov = DION_UNSET_INT;
  u.cautious_wd = DION_UNSET_INT;
  u.flatten = DION_UNSET_INT;
  m1.add_group(d, {0});
  m2.add_group(u, {0});
  dion_options_t o = default_options();
  Optimizer A(&o), B(&o);
  ASSERT_TRUE(build(A, m1));
  ASSERT_TRUE(build(B, m2));
  for (int s = 0; s < 2; ++s) {
    m1.new_grads(4, s);
    m2.new_grads(4, s);
    step(A);
    step(B);
  }
  EXPECT_TRUE(same_bits(m1.tensors[0].param, m2.tensors[0].param));
  expect_same_states(read_states(A), read_states(B), "defaults vs DION_UNSET_INT");
}

INSTANTIATE_TEST_SUITE_P(All, ApiLayout, ::testing::ValuesIn(all_algorithms()), algo_param_name);

// The same for the optimizer options' integer flags (replicate_grad_sync,
// skip_nonfinite default to 1).
TEST(ApiLayoutOptions, UnsetIntFlagsMeanDefault) {
  dion_options_t o = default_options();
  o.replicate_grad_sync = DION_UNSET_INT;
  o.skip_nonfinite = DION_UNSET_INT;
  dion_optimizer_t h = nullptr;
  ASSERT_EQ(dion_create(&h, &o), DION_SUCCESS) << dion_last_error(nullptr);
  Model m;
  m.add_tensor("unsetflags.b", DION_DTYPE_FP32, {5});
  m.add_group(group_opts(DION_ALGO_ADAMW), {0});
  ASSERT_TRUE(build(h, m));
  const auto p0 = m.params();
  store(m.tensors[0].grad, DION_DTYPE_FP32, 2, std::numeric_limits<float>::quiet_NaN());
  ASSERT_EQ(dion_step(h, nullptr), DION_SUCCESS) << dion_last_error(h);
  int64_t n = -1;
  int32_t last = -1;
  ASSERT_EQ(dion_get_skipped_steps(h, &n, &last, nullptr), DION_SUCCESS);
  EXPECT_EQ(n, 1) << "skip_nonfinite = DION_UNSET_INT should mean the default, 1";
  EXPECT_TRUE(same_bits(p0[0], m.tensors[0].param));
  dion_destroy(h);
}

}  // namespace

// SPDX-License-Identifier: MIT
// Reliability, API hardening (docs/reliability.md): size arithmetic on
// caller-supplied shapes never overflows silently, and the deterministic
// reproducers of what tests/fuzz/fuzz_api found (fixed bugs: each test
// states the property it asserts and what used to happen).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dion.h"

namespace {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

struct Opt {
  dion_optimizer_t h = nullptr;
  Opt() { EXPECT_EQ(dion_create(&h, nullptr), DION_SUCCESS) << dion_last_error(nullptr); }
  ~Opt() { dion_destroy(h); }
};

dion_group_options_t group(dion_algorithm_t a) {
  dion_group_options_t o;
  EXPECT_EQ(dion_group_options_init(&o, a), DION_SUCCESS);
  return o;
}

dion_tensor_t desc(void* param, const void* grad, std::vector<int64_t> shape) {
  dion_tensor_t t;
  EXPECT_EQ(dion_tensor_init(&t), DION_SUCCESS);
  t.param = param;
  t.grad = grad;
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) t.shape[d] = shape[d];
  return t;
}

// ------------------------------------------------------------ shape sizes --

struct SizeCase {
  const char* name;
  dion_algorithm_t algo;
  std::vector<int64_t> shape;
  const char* needle;  // what the message must say
};

void PrintTo(const SizeCase& c, std::ostream* os) { *os << c.name; }

class ReliabilitySizes : public ::testing::TestWithParam<SizeCase> {};

// A descriptor whose element count does not fit in int64, or is beyond the
// supported 2^40, is refused with INVALID_ARGUMENT naming the tensor, before
// the library sizes any buffer from it: nothing is added and the 16-byte
// buffers passed as param/grad are never touched (ASan would see an access
// past them in tools/sanitize.sh asan).
TEST_P(ReliabilitySizes, HugeElementCountsAreRefusedBeforeAnyAllocation) {
  const SizeCase& c = GetParam();
  Opt o;
  float param[4] = {1, 2, 3, 4}, grad[4] = {1, 1, 1, 1};
  dion_tensor_t t = desc(param, grad, c.shape);
  t.name = "huge";
  const dion_group_options_t g = group(c.algo);
  const dion_status_t st = dion_add_group(o.h, &g, &t, 1, nullptr);
  EXPECT_EQ(st, DION_ERROR_INVALID_ARGUMENT) << dion_last_error(o.h);
  const std::string msg = dion_last_error(o.h);
  EXPECT_NE(msg.find("huge"), std::string::npos) << msg;
  EXPECT_NE(msg.find(c.needle), std::string::npos) << msg;
  int32_t n = -1;
  ASSERT_EQ(dion_tensor_count(o.h, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
  ASSERT_EQ(dion_state_count(o.h, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(param[0], 1.0f);
  EXPECT_EQ(param[3], 4.0f);
}

INSTANTIATE_TEST_SUITE_P(
    Reliability, ReliabilitySizes,
    ::testing::Values(
        // 3037000500^2 > INT64_MAX: the smallest square whose count overflows.
        SizeCase{"Square3037000500", DION_ALGO_MUON, {3037000500LL, 3037000500LL}, "overflow"},
        SizeCase{"DionSquare3037000500", DION_ALGO_DION, {3037000500LL, 3037000500LL}, "overflow"},
        SizeCase{"FourDims2pow32", DION_ALGO_ADAMW, {int64_t(1) << 32, int64_t(1) << 32, int64_t(1) << 32, 2},
                 "overflow"},
        SizeCase{"Int64MaxTimesTwo", DION_ALGO_LION, {kI64Max, 2}, "overflow"},
        SizeCase{"Int64MaxVector", DION_ALGO_ADAMW, {kI64Max}, "supported"},
        SizeCase{"TwoPow62", DION_ALGO_NORMUON, {int64_t(1) << 31, int64_t(1) << 31}, "supported"},
        SizeCase{"JustPast2pow40", DION_ALGO_ADAMW, {(int64_t(1) << 40) + 1}, "supported"}),
    [](const ::testing::TestParamInfo<SizeCase>& i) { return std::string(i.param.name); });

// ------------------------------------------------------------ found by fuzzing --

// Found by the fuzzer, fixed (set_step now refuses steps above 2^53). Was:
// dion_group_set_step refused only negative steps, so set_step(g, INT64_MAX) succeeds and the next dion_step
// executes `++gs->step` on INT64_MAX: signed overflow (UB; UBSan aborts in
// tools/sanitize.sh). Without UBSan the counter wraps to INT64_MIN and
// dion_group_get_step returns a negative step (AdamW's bias corrections
// pow(beta, step) then overflow to +Inf). Property asserted: either set_step
// refuses a step the counter cannot advance from (INVALID_ARGUMENT), or after
// it a step leaves the counter non-negative and the parameter finite.
TEST(Reliability, SetStepNearInt64MaxThenStep) {
  Opt o;
  std::vector<float> x(8, 0.5f), g(8, 0.25f);
  dion_tensor_t t = desc(x.data(), g.data(), {8});
  const dion_group_options_t go = group(DION_ALGO_ADAMW);
  ASSERT_EQ(dion_add_group(o.h, &go, &t, 1, nullptr), DION_SUCCESS) << dion_last_error(o.h);
  const dion_status_t st = dion_group_set_step(o.h, 0, kI64Max);
  if (st != DION_SUCCESS) {
    EXPECT_EQ(st, DION_ERROR_INVALID_ARGUMENT);
    return;
  }
  ASSERT_EQ(dion_step(o.h, nullptr), DION_SUCCESS) << dion_last_error(o.h);
  int64_t step = -1;
  ASSERT_EQ(dion_group_get_step(o.h, 0, &step), DION_SUCCESS);
  EXPECT_GE(step, 0) << "the step counter wrapped";
  for (float v : x) EXPECT_TRUE(std::isfinite(v)) << "parameter " << v << " after the step";
}

// Found by the fuzzer, fixed (add_group refuses such a struct_size). Was: the array stride is tensors[0].struct_size, which
// is validated to lie in [sizeof(dion_tensor_t), 4096] but not to be a
// multiple of alignof(dion_tensor_t) (8). With a stride of 124 and 2 tensors,
// add_group reads `dp->struct_size` of tensors[1] through a dion_tensor_t
// pointer at byte offset 124: a misaligned member access (UB; UBSan aborts in
// tools/sanitize.sh). No C array can have that stride, so the value is a
// corrupt struct_size the library should refuse. Property asserted:
// INVALID_ARGUMENT naming struct_size, and nothing added.
TEST(Reliability, TensorStrideNotAMultipleOfItsAlignmentIsRefused) {
  Opt o;
  std::vector<float> x(4, 0.5f), g(4, 0.25f);
  const size_t stride = sizeof(dion_tensor_t) + 4;
  alignas(16) unsigned char block[2 * (sizeof(dion_tensor_t) + 4)] = {};
  for (int i = 0; i < 2; ++i) {
    dion_tensor_t t = desc(x.data(), g.data(), {4});
    t.struct_size = stride;
    std::memcpy(block + i * stride, &t, sizeof t);
  }
  const dion_group_options_t go = group(DION_ALGO_ADAMW);
  const dion_status_t st =
      dion_add_group(o.h, &go, reinterpret_cast<const dion_tensor_t*>(block), 2, nullptr);
  EXPECT_EQ(st, DION_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion_last_error(o.h)).find("struct_size"), std::string::npos) << dion_last_error(o.h);
  int32_t n = -1;
  ASSERT_EQ(dion_tensor_count(o.h, &n), DION_SUCCESS);
  EXPECT_EQ(n, 0);
}

}  // namespace

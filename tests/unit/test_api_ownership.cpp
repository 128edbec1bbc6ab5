// SPDX-License-Identifier: MIT
// API contract, ownership (dion.h preamble): the library copies what it is
// given (options, group options, tensor descriptors, names) and keeps no
// pointer into caller structs other than the param/grad buffers; messages
// returned by dion_last_error stay valid until the next call on the same
// handle. Run under -fsanitize=address these tests turn a kept pointer into a
// use-after-free report.
#include <memory>

#include "test_api_common.h"

using namespace dion_test;

namespace {

// Descriptors, options and names live in heap blocks freed right after the
// calls; the optimizer then steps exactly like one given long-lived structs.
TEST(ApiOwnership, StructsAndNamesAreCopied) {
  Model ref, m;
  for (Model* x : {&ref, &m}) {
    x->add_tensor("own.w", DION_DTYPE_FP32, {10, 6}, 3);
    x->add_tensor("own.b", DION_DTYPE_FP32, {6}, 4);
  }
  ref.add_group(group_opts(DION_ALGO_DION), {0});
  ref.add_group(group_opts(DION_ALGO_ADAMW), {1});
  dion_options_t o = default_options();
  o.seed = 8;
  Optimizer R(&o);
  ASSERT_TRUE(build(R, ref));

  dion_optimizer_t h = nullptr;
  {
    std::unique_ptr<dion_options_t> heap_o(new dion_options_t(o));
    ASSERT_EQ(dion_create(&h, heap_o.get()), DION_SUCCESS);
    std::memset(heap_o.get(), 0xAB, sizeof(dion_options_t));
  }
  for (int g = 0; g < 2; ++g) {
    std::unique_ptr<dion_group_options_t> go(new dion_group_options_t(group_opts(g == 0 ? DION_ALGO_DION : DION_ALGO_ADAMW)));
    std::unique_ptr<dion_tensor_t[]> d(new dion_tensor_t[1]);
    d[0] = m.tensors[static_cast<size_t>(g)].desc();
    std::unique_ptr<char[]> name(new char[32]);
    std::snprintf(name.get(), 32, "%s", g == 0 ? "own.weight.copied" : "own.bias.copied");
    d[0].name = name.get();
    ASSERT_EQ(dion_add_group(h, go.get(), d.get(), 1, nullptr), DION_SUCCESS) << dion_last_error(h);
    std::memset(go.get(), 0xCD, sizeof(dion_group_options_t));
    std::memset(d.get(), 0xEF, sizeof(dion_tensor_t));
    std::memset(name.get(), 'X', 31);
  }
  for (int s = 0; s < 3; ++s) {
    ref.new_grads(6, s);
    m.new_grads(6, s);
    step(R);
    ASSERT_EQ(dion_step(h, nullptr), DION_SUCCESS) << dion_last_error(h);
  }
  for (size_t i = 0; i < ref.tensors.size(); ++i) EXPECT_TRUE(same_bits(ref.tensors[i].param, m.tensors[i].param));
  expect_same_states(read_states(R), read_states(h), "long-lived vs freed structs");
  // The copied name is the one in messages.
  int32_t idx = -1;
  EXPECT_TRUE(is_error(dion_state_find(h, 1, "nope", &idx), DION_ERROR_INVALID_ARGUMENT, h,
                       {"own.bias.copied", "nope"}));
  dion_destroy(h);
}

// A message stays valid (same text, same storage alive) while other handles
// and the thread-local slot get new errors.
TEST(ApiOwnership, LastErrorIsPerHandle) {
  dion_options_t o = default_options();
  Optimizer A(&o), B(&o);
  double v = 0;
  ASSERT_NE(dion_group_get_hparam(A, 5, DION_HPARAM_LR, &v), DION_SUCCESS);
  const char* pa = dion_last_error(A);
  ASSERT_NE(pa, nullptr);
  const std::string copy = pa;
  EXPECT_NE(copy.find("dion_group_get_hparam"), std::string::npos) << copy;
  // Errors elsewhere: another handle, the thread slot.
  ASSERT_NE(dion_group_set_step(B, 9, 1), DION_SUCCESS);
  dion_optimizer_t none = nullptr;
  dion_options_t bad = default_options();
  bad.abi_version = 99;
  ASSERT_NE(dion_create(&none, &bad), DION_SUCCESS);
  EXPECT_EQ(std::string(pa), copy) << "another handle's error changed this handle's message";
  EXPECT_EQ(std::string(dion_last_error(A)), copy);
  EXPECT_NE(std::string(dion_last_error(B)), copy);
  EXPECT_NE(std::string(dion_last_error(B)).find("dion_group_set_step"), std::string::npos);
  EXPECT_NE(std::string(dion_last_error(nullptr)).find("abi_version"), std::string::npos);
}

// Destroying one optimizer leaves the buffers it was given (the caller's) and
// other optimizers over the same buffers alone.
TEST(ApiOwnership, DestroyLeavesCallerBuffers) {
  Model m;
  m.add_tensor("shared.w", DION_DTYPE_FP32, {8, 8}, 12);
  m.add_group(group_opts(DION_ALGO_MUON), {0});
  dion_options_t o = default_options();
  dion_optimizer_t a = nullptr, b = nullptr;
  ASSERT_EQ(dion_create(&a, &o), DION_SUCCESS);
  ASSERT_EQ(dion_create(&b, &o), DION_SUCCESS);
  ASSERT_TRUE(build(a, m));
  ASSERT_TRUE(build(b, m));
  step(a);
  const auto after_a = m.params();
  ASSERT_EQ(dion_destroy(a), DION_SUCCESS);
  EXPECT_TRUE(same_bits(after_a[0], m.tensors[0].param)) << "dion_destroy wrote the parameter";
  step(b);
  EXPECT_FALSE(same_bits(after_a[0], m.tensors[0].param));
  ASSERT_EQ(dion_destroy(b), DION_SUCCESS);
}

}  // namespace

// SPDX-License-Identifier: MIT
// API contract, defensive handles (STYLE.md §A.6): a pointer that is not an
// optimizer made by dion_create is rejected with INVALID_ARGUMENT and a
// message in dion_last_error(NULL), not a crash. Kept in its own executable:
// if the library faults here, the other suites still run.
#include <memory>

#include "test_api_common.h"

using namespace dion_test;

TEST(ApiHandleGuard, ForeignPointerIsRejected) {
  // Large, zeroed and aligned, so that checking magic words at either end of
  // the library's struct reads only memory we own.
  const size_t bytes = size_t(1) << 20;
  std::unique_ptr<uint64_t[]> storage(new uint64_t[bytes / 8]());
  dion_optimizer_t fake = reinterpret_cast<dion_optimizer_t>(storage.get());
  int32_t n = -1;
  EXPECT_TRUE(is_error(dion_step(fake, nullptr), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_step"}));
  EXPECT_TRUE(is_error(dion_group_count(fake, &n), DION_ERROR_INVALID_ARGUMENT, nullptr,
                       {"dion_group_count"}));
  EXPECT_EQ(n, -1);
  dion_group_options_t g = group_opts(DION_ALGO_MUON);
  EXPECT_TRUE(is_error(dion_add_group(fake, &g, nullptr, 0, nullptr), DION_ERROR_INVALID_ARGUMENT,
                       nullptr, {"dion_add_group"}));
  for (size_t i = 0; i < bytes / 8; ++i) ASSERT_EQ(storage[i], 0u) << "the library wrote into a foreign object";
}

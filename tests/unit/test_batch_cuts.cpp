// SPDX-License-Identifier: MIT
// cut_batches (src/core/batching.hpp): how a class of same-shape matrices
// that does not fit one batch is cut. Checked against its definition over a
// range of sizes, caps and mesh sizes, and on the case that motivated it.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "core/batching.hpp"

namespace {

TEST(CutBatches, FewestEvenBatchesAlignedToTheMesh) {
  for (int64_t n = 0; n <= 70; ++n)
    for (int64_t cap = 1; cap <= 24; ++cap)
      for (int64_t g = 1; g <= 8; ++g) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " cap=" << cap << " granule=" << g);
        const std::vector<int64_t> s = dion::cut_batches(n, cap, g);
        // Every matrix in exactly one batch, in order, none empty, none over the cap.
        ASSERT_EQ(std::accumulate(s.begin(), s.end(), int64_t(0)), n);
        for (int64_t x : s) {
          EXPECT_GE(x, 1);
          EXPECT_LE(x, cap);
        }
        // The fewest batches the cap allows.
        ASSERT_EQ(static_cast<int64_t>(s.size()), n == 0 ? 0 : (n + cap - 1) / cap);
        if (s.size() < 2) continue;
        const int64_t per = (n + static_cast<int64_t>(s.size()) - 1) / static_cast<int64_t>(s.size());
        const int64_t aligned = (per + g - 1) / g * g;
        if (g > 1 && aligned <= cap) {
          // All but the last batch a whole multiple of the mesh, and equal.
          for (size_t i = 0; i + 1 < s.size(); ++i) EXPECT_EQ(s[i], aligned) << "batch " << i;
        } else {
          const auto [lo, hi] = std::minmax_element(s.begin(), s.end());
          EXPECT_LE(*hi - *lo, 1) << "sizes differ by more than one";
        }
      }
}

TEST(CutBatches, TwentyFourAtACapOfFourteenOverFourRanks) {
  // gpt-1.3b's fc2 matrices FSDP-sharded over 4 GPUs: 14 + 10 would leave
  // ranks 4, 4, 4, 2 and 3, 3, 3, 1 slots; 12 + 12 gives every rank 3 and 3.
  EXPECT_EQ(dion::cut_batches(24, 14, 4), (std::vector<int64_t>{12, 12}));
  EXPECT_EQ(dion::cut_batches(30, 14, 4), (std::vector<int64_t>{12, 12, 6}));
  EXPECT_EQ(dion::cut_batches(7, 3, 1), (std::vector<int64_t>{3, 2, 2}));
  // The multiple of 8 (16) would not fit a cap of 14: even sizes instead.
  EXPECT_EQ(dion::cut_batches(24, 14, 8), (std::vector<int64_t>{12, 12}));
  EXPECT_EQ(dion::cut_batches(10, 14, 4), (std::vector<int64_t>{10}));
}

}  // namespace

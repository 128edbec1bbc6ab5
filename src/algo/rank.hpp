// SPDX-License-Identifier: MIT
// Dion's rank r of an m x n matrix (spec §2.2), shared by the algorithm and
// dion_add_group's validation.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dion.h"

namespace dion {

// r = min(m, n, q * ceil(rank_fraction * min(m, n) / q)), in IEEE double as the
// reference computes it (0.07 * 100 = 7.000000000000001 gives 8). A
// rank_fraction so small that the quotient underflows gives 0, which
// dion_add_group refuses (the reference's simple variant refuses rank < 1).
inline int64_t dion_rank(const dion_group_options_t& o, int64_t m, int64_t n) {
  const int64_t mn = std::min(m, n);
  const double q = static_cast<double>(o.rank_multiple_of);
  const double r = q * std::ceil(o.rank_fraction * static_cast<double>(mn) / q);
  return std::min<int64_t>(mn, static_cast<int64_t>(r));
}

}  // namespace dion

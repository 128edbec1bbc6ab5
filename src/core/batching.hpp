// SPDX-License-Identifier: MIT
// How a class of same-shape matrices is cut into batches (plan_buckets).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace dion {

// The sizes of the batches that n matrices of one class are cut into when at
// most `cap` fit in one: the fewest batches (ceil(n / cap)), as even as
// possible, and, when a batch is split over a mesh of `granule` ranks, each
// but the last a multiple of `granule` if that still fits in `cap` (then no
// rank of the mesh owns fewer of a batch's slots than another and no
// reduce-scatter pads it). Cutting a class of 24 at a cap of 14 over 4 ranks
// gives 12 + 12 (3 slots per rank each), where 14 + 10 would give ranks 4, 4,
// 4, 2 and 3, 3, 3, 1 slots and 4 padding slots.
inline std::vector<int64_t> cut_batches(int64_t n, int64_t cap, int64_t granule) {
  std::vector<int64_t> sizes;
  if (n <= 0) return sizes;
  cap = std::max<int64_t>(cap, 1);
  const int64_t nb = (n + cap - 1) / cap, per = (n + nb - 1) / nb;
  if (granule > 1 && nb > 1) {
    // pg >= per keeps the count at nb; pg <= cap keeps each batch within its workspace.
    const int64_t pg = (per + granule - 1) / granule * granule;
    if (pg <= cap) {
      for (int64_t i = 0; i < n; i += pg) sizes.push_back(std::min(pg, n - i));
      return sizes;
    }
  }
  // nb batches whose sizes differ by at most one.
  for (int64_t j = 0; j < nb; ++j) sizes.push_back(n / nb + (j < n % nb ? 1 : 0));
  return sizes;
}

}  // namespace dion

// SPDX-License-Identifier: MIT
// The algorithm table: dion_algorithm_t -> the hooks of src/algo/<algo>.cpp.
#include "common.hpp"

namespace dion {

extern const Algorithm kDion, kDion2, kMuon, kNorMuon, kNorDion2, kAdamW, kLion;

const Algorithm& algorithm_for(dion_algorithm_t a) {
  switch (a) {
    case DION_ALGO_DION: return kDion;
    case DION_ALGO_DION2: return kDion2;
    case DION_ALGO_MUON: return kMuon;
    case DION_ALGO_NORMUON: return kNorMuon;
    case DION_ALGO_NORDION2: return kNorDion2;
    case DION_ALGO_ADAMW: return kAdamW;
    case DION_ALGO_LION: return kLion;
    default: fail(DION_ERROR_INVALID_ARGUMENT, "unknown algorithm %d", a);
  }
}

}  // namespace dion

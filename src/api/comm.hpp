// SPDX-License-Identifier: MIT
// The communicator object behind dion_comm_t.
#pragma once
#include <atomic>
#include <cstdint>

namespace dion {

constexpr uint64_t kCommMagic = 0x44494f4e434f4d4dull;  // "DIONCOMM"

enum class CommKind : int32_t { kNcclOwned = 1, kNcclAdopted = 2, kMpi = 3 };

}  // namespace dion

struct dion_comm_s {
  uint64_t magic = dion::kCommMagic;
  dion::CommKind kind = dion::CommKind::kMpi;
  int32_t size = 1;
  int32_t rank = 0;
  void* handle = nullptr;  // ncclComm_t, or a heap MPI_Comm
  std::atomic<bool> aborted{false};  // may be set from a watchdog thread
};

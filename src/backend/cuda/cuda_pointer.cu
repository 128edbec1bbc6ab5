// SPDX-License-Identifier: MIT
// Validation of caller-supplied device pointers (dion_add_group, re-binding):
// a host pointer, a pointer into another GPU's memory, a misaligned pointer
// or a buffer shorter than the tensor would otherwise fail later, far from
// the cause, or corrupt memory.
//
// The allocation's extent comes from the driver's cuMemGetAddressRange,
// reached through the runtime's driver entry-point lookup: libdion links the
// runtime only, never libcuda, so it still loads on a machine without a driver.
#include <cuda.h>  // types and the entry point's signature only
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_check.hpp"
#include "core/backend.hpp"
#include "core/error.hpp"

namespace dion {

namespace {

using AddressRangeFn = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

// The driver's cuMemGetAddressRange, or nullptr where it cannot be had.
AddressRangeFn address_range_fn() {
  static const AddressRangeFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    // Version 12000: the signature above (the _v2 entry point, current since CUDA 3.2).
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<AddressRangeFn>(f);
  }();
  return fn;
}

}  // namespace

void cuda_check_pointer(const void* p, int device, size_t bytes, size_t align, const char* what) {
  DION_REQUIRE(p != nullptr, DION_ERROR_INVALID_ARGUMENT, "%s is NULL", what);
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    // Older runtimes answer cudaErrorInvalidValue for memory CUDA does not
    // know; anything else (no device, no driver) is a CUDA failure.
    (void)cudaGetLastError();
    if (e != cudaErrorInvalidValue) cuda::check(e, "cudaPointerGetAttributes");
    attr.type = cudaMemoryTypeUnregistered;
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      DION_REQUIRE(attr.device == device, DION_ERROR_INVALID_ARGUMENT, "%s is on CUDA device %d, expected %d", what,
                   attr.device, device);
      break;
    case cudaMemoryTypeManaged:  // reachable from every device: accepted
      break;
    default:  // cudaMemoryTypeHost (pinned) and cudaMemoryTypeUnregistered
      fail(DION_ERROR_INVALID_ARGUMENT, "%s is host memory, expected device memory of CUDA device %d", what, device);
  }
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  DION_REQUIRE(align <= 1 || addr % align == 0, DION_ERROR_INVALID_ARGUMENT,
               "%s (address %p) is not aligned to %zu bytes", what, p, align);
  if (AddressRangeFn range = address_range_fn()) {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (range(&base, &size, static_cast<CUdeviceptr>(addr)) == CUDA_SUCCESS) {
      const size_t avail = static_cast<size_t>(base + size - addr);
      DION_REQUIRE(bytes <= avail, DION_ERROR_INVALID_ARGUMENT,
                   "%s: %zu bytes needed but the allocation holds only %zu bytes from this address", what, bytes,
                   avail);
    }
    // Otherwise (memory the driver cannot range, e.g. some imported
    // allocations) the size simply goes unchecked.
  }
}

}  // namespace dion

// SPDX-License-Identifier: MIT
// Status checks of the CUDA backend. Every CUDA runtime, cuBLAS and cuSOLVER
// return code goes through one of these; a failure becomes a dion::Error
// (DION_ERROR_CUDA / _CUBLAS / _CUSOLVER, or DION_ERROR_OUT_OF_MEMORY for an
// allocation) whose message names the call, so the C API can hand it to the
// caller. Nothing here prints, exits or aborts.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <cstddef>

namespace dion::cuda {

[[noreturn]] void throw_cuda(cudaError_t e, const char* what);
[[noreturn]] void throw_cublas(cublasStatus_t s, const char* what);
[[noreturn]] void throw_cusolver(cusolverStatus_t s, const char* what);

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw_cuda(e, what);
}
inline void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw_cublas(s, what);
}
inline void check(cusolverStatus_t s, const char* what) {
  if (s != CUSOLVER_STATUS_SUCCESS) throw_cusolver(s, what);
}

// After a kernel launch: reports a bad launch configuration (or an earlier
// asynchronous failure that is still pending) under the kernel's name.
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

// cudaMalloc that reports cudaErrorMemoryAllocation as DION_ERROR_OUT_OF_MEMORY
// with the byte count.
void* device_malloc(size_t bytes, int device, const char* what);

}  // namespace dion::cuda

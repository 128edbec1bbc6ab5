// SPDX-License-Identifier: MIT
#include "backend/cuda/cuda_check.hpp"

#include "core/error.hpp"

namespace dion::cuda {

namespace {

// cuSOLVER has no status-to-text function.
const char* cusolver_status_string(cusolverStatus_t s) {
  switch (s) {
    case CUSOLVER_STATUS_SUCCESS: return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE: return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_MAPPING_ERROR: return "CUSOLVER_STATUS_MAPPING_ERROR";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED: return "CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED";
    case CUSOLVER_STATUS_NOT_SUPPORTED: return "CUSOLVER_STATUS_NOT_SUPPORTED";
    case CUSOLVER_STATUS_INVALID_LICENSE: return "CUSOLVER_STATUS_INVALID_LICENSE";
    case CUSOLVER_STATUS_INVALID_WORKSPACE: return "CUSOLVER_STATUS_INVALID_WORKSPACE";
    default: return "unknown cuSOLVER status";
  }
}

}  // namespace

void throw_cuda(cudaError_t e, const char* what) {
  // Clear a non-sticky error so that the next call does not report it again.
  (void)cudaGetLastError();
  const dion_status_t st = e == cudaErrorMemoryAllocation ? DION_ERROR_OUT_OF_MEMORY : DION_ERROR_CUDA;
  fail(st, "cuda backend: %s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

void throw_cublas(cublasStatus_t s, const char* what) {
  fail(DION_ERROR_CUBLAS, "cuda backend: %s failed: %s", what, cublasGetStatusString(s));
}

void throw_cusolver(cusolverStatus_t s, const char* what) {
  fail(DION_ERROR_CUSOLVER, "cuda backend: %s failed: %s", what, cusolver_status_string(s));
}

void* device_malloc(size_t bytes, int device, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    fail(DION_ERROR_OUT_OF_MEMORY, "cuda backend: %s: cannot allocate %zu bytes on CUDA device %d", what, bytes,
         device);
  }
  check(e, what);
  return p;
}

}  // namespace dion::cuda

// SPDX-License-Identifier: MIT
//
// Compile-only check that include/dion.h is clean C++ (C++11 and later):
//   g++ -std=c++17 -Wall -Wextra -pedantic -Werror -Wold-style-cast -Wshadow
//       -Iinclude -c tests/abi/abi_cxx.cpp -o abi_cxx.o
// (also -std=c++11). It pins every prototype with std::is_same, checks that
// the structs are standard-layout trivial aggregates a C caller can share, and
// that the declarations sit in an extern "C" block (a C++ declaration with a
// different signature would not collide with them; redeclaring one with C
// linkage below must agree). Nothing here runs.
#include "dion.h"
#include "dion.h"  // the include guard holds

#include <cstddef>
#include <cstdint>
#include <type_traits>

// Redeclaring with C linkage compiles only if the header declared them extern "C"
// with the same signature.
extern "C" {
DION_API int32_t dion_version(void);
DION_API dion_status_t dion_create(dion_optimizer_t* optimizer, const dion_options_t* options);
DION_API dion_status_t dion_step(dion_optimizer_t optimizer, dion_stream_t stream);
}

#define DION_SIG(fn, ...) static_assert(std::is_same<decltype(&fn), __VA_ARGS__>::value, #fn " changed signature")

DION_SIG(dion_version, int32_t (*)());
DION_SIG(dion_status_string, const char* (*)(dion_status_t));
DION_SIG(dion_nccl_get_unique_id, dion_status_t (*)(dion_nccl_unique_id_t*));
DION_SIG(dion_comm_init_nccl,
         dion_status_t (*)(dion_comm_t*, const dion_nccl_unique_id_t*, int32_t, int32_t, int32_t));
DION_SIG(dion_comm_adopt_nccl, dion_status_t (*)(dion_comm_t*, ncclComm*));
DION_SIG(dion_comm_from_mpi_fint, dion_status_t (*)(dion_comm_t*, int32_t));
DION_SIG(dion_comm_size, dion_status_t (*)(dion_comm_t, int32_t*));
DION_SIG(dion_comm_rank, dion_status_t (*)(dion_comm_t, int32_t*));
DION_SIG(dion_comm_abort, dion_status_t (*)(dion_comm_t));
DION_SIG(dion_comm_destroy, dion_status_t (*)(dion_comm_t));
DION_SIG(dion_options_init, dion_status_t (*)(dion_options_t*));
DION_SIG(dion_options_sizeof, size_t (*)());
DION_SIG(dion_create, dion_status_t (*)(dion_optimizer_t*, const dion_options_t*));
DION_SIG(dion_destroy, dion_status_t (*)(dion_optimizer_t));
DION_SIG(dion_last_error, const char* (*)(dion_optimizer_t));
DION_SIG(dion_tensor_init, dion_status_t (*)(dion_tensor_t*));
DION_SIG(dion_tensor_sizeof, size_t (*)());
DION_SIG(dion_group_options_init, dion_status_t (*)(dion_group_options_t*, dion_algorithm_t));
DION_SIG(dion_group_options_sizeof, size_t (*)());
DION_SIG(dion_add_group,
         dion_status_t (*)(dion_optimizer_t, const dion_group_options_t*, const dion_tensor_t*, size_t, int32_t*));
DION_SIG(dion_group_count, dion_status_t (*)(dion_optimizer_t, int32_t*));
DION_SIG(dion_tensor_count, dion_status_t (*)(dion_optimizer_t, int32_t*));
DION_SIG(dion_group_set_hparam, dion_status_t (*)(dion_optimizer_t, int32_t, dion_hparam_t, double));
DION_SIG(dion_group_get_hparam, dion_status_t (*)(dion_optimizer_t, int32_t, dion_hparam_t, double*));
DION_SIG(dion_group_get_step, dion_status_t (*)(dion_optimizer_t, int32_t, int64_t*));
DION_SIG(dion_group_set_step, dion_status_t (*)(dion_optimizer_t, int32_t, int64_t));
DION_SIG(dion_tensor_rebind, dion_status_t (*)(dion_optimizer_t, int32_t, void*, const void*));
DION_SIG(dion_step, dion_status_t (*)(dion_optimizer_t, dion_stream_t));
DION_SIG(dion_sync_for_checkpoint, dion_status_t (*)(dion_optimizer_t, dion_stream_t));
DION_SIG(dion_get_skipped_steps, dion_status_t (*)(dion_optimizer_t, int64_t*, int32_t*, dion_stream_t));
DION_SIG(dion_get_async_error, dion_status_t (*)(dion_optimizer_t, dion_status_t*));
DION_SIG(dion_get_comm_bytes, dion_status_t (*)(dion_optimizer_t, dion_mesh_t, uint64_t*, uint64_t*));
DION_SIG(dion_get_memory_usage, dion_status_t (*)(dion_optimizer_t, uint64_t*, uint64_t*));
DION_SIG(dion_state_count, dion_status_t (*)(dion_optimizer_t, int32_t*));
DION_SIG(dion_state_info, dion_status_t (*)(dion_optimizer_t, int32_t, dion_state_info_t*));
DION_SIG(dion_state_find, dion_status_t (*)(dion_optimizer_t, int32_t, const char*, int32_t*));
DION_SIG(dion_state_read, dion_status_t (*)(dion_optimizer_t, int32_t, void*, uint64_t, dion_stream_t));
DION_SIG(dion_state_write, dion_status_t (*)(dion_optimizer_t, int32_t, const void*, uint64_t, dion_stream_t));

// Types a C caller shares with the library.
template <typename T>
constexpr bool c_compatible() {
  return std::is_standard_layout<T>::value && std::is_trivial<T>::value;
}
static_assert(c_compatible<dion_options_t>(), "dion_options_t");
static_assert(c_compatible<dion_tensor_t>(), "dion_tensor_t");
static_assert(c_compatible<dion_group_options_t>(), "dion_group_options_t");
static_assert(c_compatible<dion_state_info_t>(), "dion_state_info_t");
static_assert(c_compatible<dion_nccl_unique_id_t>(), "dion_nccl_unique_id_t");
static_assert(std::is_same<dion_status_t, int32_t>::value, "status is int32_t");
static_assert(std::is_same<dion_dtype_t, int32_t>::value && std::is_same<dion_algorithm_t, int32_t>::value &&
                  std::is_same<dion_hparam_t, int32_t>::value && std::is_same<dion_mesh_t, int32_t>::value,
              "enumerations are int32_t fields");
static_assert(std::is_same<dion_stream_t, CUstream_st*>::value, "streams are cudaStream_t");
static_assert(std::is_pointer<dion_optimizer_t>::value && std::is_pointer<dion_comm_t>::value, "opaque handles");

// Struct headers: struct_size first, abi_version right after.
static_assert(offsetof(dion_options_t, struct_size) == 0, "");
static_assert(offsetof(dion_options_t, abi_version) == sizeof(size_t), "");
static_assert(offsetof(dion_group_options_t, struct_size) == 0, "");
static_assert(offsetof(dion_group_options_t, abi_version) == sizeof(size_t), "");
static_assert(offsetof(dion_tensor_t, struct_size) == 0, "");
static_assert(offsetof(dion_state_info_t, struct_size) == 0, "");
static_assert(std::is_same<decltype(dion_options_t::struct_size), size_t>::value, "");
static_assert(std::is_same<decltype(dion_options_t::abi_version), uint32_t>::value, "");
static_assert(sizeof(dion_tensor_t::shape) == DION_MAX_DIMS * sizeof(int64_t), "");
static_assert(sizeof(dion_nccl_unique_id_t) == DION_NCCL_UNIQUE_ID_BYTES, "");

// Version macros are usable in constant expressions; status codes are fixed.
static_assert(DION_VERSION_CODE == DION_VERSION(DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH), "");
static_assert(DION_VERSION(0, 1, 0) == 100, "");
static_assert(DION_SUCCESS == 0 && DION_ERROR_INVALID_ARGUMENT == 1 && DION_ERROR_INVALID_USAGE == 2 &&
                  DION_ERROR_NOT_SUPPORTED == 3 && DION_ERROR_OUT_OF_MEMORY == 4 && DION_ERROR_CUDA == 5 &&
                  DION_ERROR_CUBLAS == 6 && DION_ERROR_CUSOLVER == 7 && DION_ERROR_NCCL == 8 &&
                  DION_ERROR_MPI == 9 && DION_ERROR_NUMERICAL == 10 && DION_ERROR_INTERNAL == 11,
              "status values are fixed");
static_assert(DION_UNSET_INT == INT32_MIN, "");
static_assert(DION_ALGO_DION3 == DION_ALGO_NORDION2, "");

// Value-initialisation zeroes everything, as C's = {0} does.
int dion_abi_cxx_check();
int dion_abi_cxx_check() {
  dion_options_t o{};
  dion_tensor_t t{};
  dion_group_options_t g{};
  dion_state_info_t info{};
  o.struct_size = sizeof o;
  t.struct_size = sizeof t;
  g.struct_size = sizeof g;
  info.struct_size = sizeof info;
  return static_cast<int>(o.struct_size + t.struct_size + g.struct_size + info.struct_size);
}

/* SPDX-License-Identifier: MIT
 *
 * Compile-only check that include/dion.h is self-contained, pedantic C99:
 *   gcc -std=c99 -Wall -Wextra -pedantic -Werror -Wstrict-prototypes \
 *       -Wmissing-prototypes -Iinclude -c tests/abi/abi_c99.c -o abi_c99.o
 * It fixes the values the ABI promises (status codes, enumerations, version
 * encoding, struct headers) and every prototype: a changed signature makes an
 * assignment below an incompatible-pointer error. Nothing here runs.
 */
#include "dion.h"
#include "dion.h" /* the include guard holds */

/* C99 has no _Static_assert: a negative array size fails the build. */
#define DION_ABI_CHECK(name, cond) typedef char dion_abi_check_##name[(cond) ? 1 : -1]

/* versions */
DION_ABI_CHECK(version_encoding, DION_VERSION(1, 2, 3) == 10203);
DION_ABI_CHECK(version_code,
               DION_VERSION_CODE == DION_VERSION_MAJOR * 10000 + DION_VERSION_MINOR * 100 + DION_VERSION_PATCH);
DION_ABI_CHECK(abi_version, DION_ABI_VERSION >= 1);

/* status codes: fixed values, only appended */
DION_ABI_CHECK(st0, DION_SUCCESS == 0);
DION_ABI_CHECK(st1, DION_ERROR_INVALID_ARGUMENT == 1);
DION_ABI_CHECK(st2, DION_ERROR_INVALID_USAGE == 2);
DION_ABI_CHECK(st3, DION_ERROR_NOT_SUPPORTED == 3);
DION_ABI_CHECK(st4, DION_ERROR_OUT_OF_MEMORY == 4);
DION_ABI_CHECK(st5, DION_ERROR_CUDA == 5);
DION_ABI_CHECK(st6, DION_ERROR_CUBLAS == 6);
DION_ABI_CHECK(st7, DION_ERROR_CUSOLVER == 7);
DION_ABI_CHECK(st8, DION_ERROR_NCCL == 8);
DION_ABI_CHECK(st9, DION_ERROR_MPI == 9);
DION_ABI_CHECK(st10, DION_ERROR_NUMERICAL == 10);
DION_ABI_CHECK(st11, DION_ERROR_INTERNAL == 11);

/* enumerations */
DION_ABI_CHECK(dtype, DION_DTYPE_UNSET == -1 && DION_DTYPE_FP32 == 0 && DION_DTYPE_BF16 == 1 && DION_DTYPE_FP16 == 2);
DION_ABI_CHECK(backend, DION_BACKEND_HOST == 0 && DION_BACKEND_CUDA == 1);
DION_ABI_CHECK(algo, DION_ALGO_DION == 0 && DION_ALGO_DION2 == 1 && DION_ALGO_MUON == 2 && DION_ALGO_NORMUON == 3 &&
                         DION_ALGO_NORDION2 == 4 && DION_ALGO_DION3 == 4 && DION_ALGO_ADAMW == 5 && DION_ALGO_LION == 6);
DION_ABI_CHECK(qr, DION_QR_RCQR == 0 && DION_QR_QR == 1 && DION_QR_CQR == 2);
DION_ABI_CHECK(ortho, DION_ORTHO_POLAR_EXPRESS == 0 && DION_ORTHO_NEWTON_SCHULZ == 1);
DION_ABI_CHECK(adjust, DION_ADJUST_LR_SPECTRAL_NORM == 0 && DION_ADJUST_LR_RMS_NORM == 1 && DION_ADJUST_LR_NONE == 2);
DION_ABI_CHECK(scope, DION_SELECTION_LOCAL == 0 && DION_SELECTION_GLOBAL == 1);
DION_ABI_CHECK(matmul, DION_MATMUL_FP32 == 0 && DION_MATMUL_TF32 == 1 && DION_MATMUL_BF16 == 2);
DION_ABI_CHECK(layout, DION_LAYOUT_ROW_MAJOR == 0 && DION_LAYOUT_COL_MAJOR == 1);
DION_ABI_CHECK(mesh, DION_MESH_REPLICATE == 0 && DION_MESH_OUTER == 1 && DION_MESH_INNER == 2);
DION_ABI_CHECK(hparam, DION_HPARAM_LR == 0 && DION_HPARAM_WEIGHT_DECAY == 1 && DION_HPARAM_MU == 2 &&
                           DION_HPARAM_BETA1 == 3 && DION_HPARAM_BETA2 == 4 && DION_HPARAM_EPSILON == 5 &&
                           DION_HPARAM_EF_DECAY == 6 && DION_HPARAM_MUON_BETA2 == 7);
DION_ABI_CHECK(unset_int, DION_UNSET_INT == INT32_MIN);
DION_ABI_CHECK(max_dims, DION_MAX_DIMS == 4);

/* fixed-width typedefs */
DION_ABI_CHECK(status_size, sizeof(dion_status_t) == 4);
DION_ABI_CHECK(enum_size, sizeof(dion_dtype_t) == 4 && sizeof(dion_algorithm_t) == 4 && sizeof(dion_hparam_t) == 4);
DION_ABI_CHECK(unique_id_size, sizeof(dion_nccl_unique_id_t) == DION_NCCL_UNIQUE_ID_BYTES &&
                                   DION_NCCL_UNIQUE_ID_BYTES == 128);

/* every options struct starts with size_t struct_size (and abi_version after it) */
DION_ABI_CHECK(options_head, offsetof(dion_options_t, struct_size) == 0 &&
                                 offsetof(dion_options_t, abi_version) == sizeof(size_t));
DION_ABI_CHECK(group_head, offsetof(dion_group_options_t, struct_size) == 0 &&
                               offsetof(dion_group_options_t, abi_version) == sizeof(size_t));
DION_ABI_CHECK(tensor_head, offsetof(dion_tensor_t, struct_size) == 0);
DION_ABI_CHECK(info_head, offsetof(dion_state_info_t, struct_size) == 0);
DION_ABI_CHECK(shape_len, sizeof(((dion_tensor_t*)0)->shape) == DION_MAX_DIMS * sizeof(int64_t));

/* Every prototype, by assignment to a pointer of the documented type. */
int dion_abi_c99_check(void);
int dion_abi_c99_check(void) {
  int32_t (*p_version)(void) = dion_version;
  const char* (*p_status_string)(dion_status_t) = dion_status_string;
  dion_status_t (*p_nccl_uid)(dion_nccl_unique_id_t*) = dion_nccl_get_unique_id;
  dion_status_t (*p_comm_init_nccl)(dion_comm_t*, const dion_nccl_unique_id_t*, int32_t, int32_t, int32_t) =
      dion_comm_init_nccl;
  dion_status_t (*p_comm_adopt_nccl)(dion_comm_t*, struct ncclComm*) = dion_comm_adopt_nccl;
  dion_status_t (*p_comm_from_mpi_fint)(dion_comm_t*, int32_t) = dion_comm_from_mpi_fint;
  dion_status_t (*p_comm_size)(dion_comm_t, int32_t*) = dion_comm_size;
  dion_status_t (*p_comm_rank)(dion_comm_t, int32_t*) = dion_comm_rank;
  dion_status_t (*p_comm_abort)(dion_comm_t) = dion_comm_abort;
  dion_status_t (*p_comm_destroy)(dion_comm_t) = dion_comm_destroy;
  dion_status_t (*p_options_init)(dion_options_t*) = dion_options_init;
  size_t (*p_options_sizeof)(void) = dion_options_sizeof;
  dion_status_t (*p_create)(dion_optimizer_t*, const dion_options_t*) = dion_create;
  dion_status_t (*p_destroy)(dion_optimizer_t) = dion_destroy;
  const char* (*p_last_error)(dion_optimizer_t) = dion_last_error;
  dion_status_t (*p_tensor_init)(dion_tensor_t*) = dion_tensor_init;
  size_t (*p_tensor_sizeof)(void) = dion_tensor_sizeof;
  dion_status_t (*p_group_options_init)(dion_group_options_t*, dion_algorithm_t) = dion_group_options_init;
  size_t (*p_group_options_sizeof)(void) = dion_group_options_sizeof;
  dion_status_t (*p_add_group)(dion_optimizer_t, const dion_group_options_t*, const dion_tensor_t*, size_t,
                               int32_t*) = dion_add_group;
  dion_status_t (*p_group_count)(dion_optimizer_t, int32_t*) = dion_group_count;
  dion_status_t (*p_tensor_count)(dion_optimizer_t, int32_t*) = dion_tensor_count;
  dion_status_t (*p_set_hparam)(dion_optimizer_t, int32_t, dion_hparam_t, double) = dion_group_set_hparam;
  dion_status_t (*p_get_hparam)(dion_optimizer_t, int32_t, dion_hparam_t, double*) = dion_group_get_hparam;
  dion_status_t (*p_get_step)(dion_optimizer_t, int32_t, int64_t*) = dion_group_get_step;
  dion_status_t (*p_set_step)(dion_optimizer_t, int32_t, int64_t) = dion_group_set_step;
  dion_status_t (*p_rebind)(dion_optimizer_t, int32_t, void*, const void*) = dion_tensor_rebind;
  dion_status_t (*p_step)(dion_optimizer_t, dion_stream_t) = dion_step;
  dion_status_t (*p_sync)(dion_optimizer_t, dion_stream_t) = dion_sync_for_checkpoint;
  dion_status_t (*p_skipped)(dion_optimizer_t, int64_t*, int32_t*, dion_stream_t) = dion_get_skipped_steps;
  dion_status_t (*p_async)(dion_optimizer_t, dion_status_t*) = dion_get_async_error;
  dion_status_t (*p_comm_bytes)(dion_optimizer_t, dion_mesh_t, uint64_t*, uint64_t*) = dion_get_comm_bytes;
  dion_status_t (*p_memory)(dion_optimizer_t, uint64_t*, uint64_t*) = dion_get_memory_usage;
  dion_status_t (*p_state_count)(dion_optimizer_t, int32_t*) = dion_state_count;
  dion_status_t (*p_state_info)(dion_optimizer_t, int32_t, dion_state_info_t*) = dion_state_info;
  dion_status_t (*p_state_find)(dion_optimizer_t, int32_t, const char*, int32_t*) = dion_state_find;
  dion_status_t (*p_state_read)(dion_optimizer_t, int32_t, void*, uint64_t, dion_stream_t) = dion_state_read;
  dion_status_t (*p_state_write)(dion_optimizer_t, int32_t, const void*, uint64_t, dion_stream_t) = dion_state_write;

  /* The structs are plain C aggregates that C99 can initialise by designator. */
  dion_tensor_t t = {0};
  dion_state_info_t info = {0};
  dion_options_t o = {.struct_size = sizeof(dion_options_t),
                      .abi_version = DION_ABI_VERSION,
                      .backend = DION_BACKEND_HOST};
  dion_group_options_t g = {0};
  dion_nccl_unique_id_t uid = {{0}};
  t.struct_size = sizeof t;
  t.shape[DION_MAX_DIMS - 1] = 1;
  info.struct_size = sizeof info;
  g.struct_size = sizeof g;

  return (p_version != 0) + (p_status_string != 0) + (p_nccl_uid != 0) + (p_comm_init_nccl != 0) +
         (p_comm_adopt_nccl != 0) + (p_comm_from_mpi_fint != 0) + (p_comm_size != 0) + (p_comm_rank != 0) +
         (p_comm_abort != 0) + (p_comm_destroy != 0) + (p_options_init != 0) + (p_options_sizeof != 0) +
         (p_create != 0) + (p_destroy != 0) + (p_last_error != 0) + (p_tensor_init != 0) + (p_tensor_sizeof != 0) +
         (p_group_options_init != 0) + (p_group_options_sizeof != 0) + (p_add_group != 0) + (p_group_count != 0) +
         (p_tensor_count != 0) + (p_set_hparam != 0) + (p_get_hparam != 0) + (p_get_step != 0) +
         (p_set_step != 0) + (p_rebind != 0) + (p_step != 0) + (p_sync != 0) + (p_skipped != 0) + (p_async != 0) +
         (p_comm_bytes != 0) + (p_memory != 0) + (p_state_count != 0) + (p_state_info != 0) +
         (p_state_find != 0) + (p_state_read != 0) + (p_state_write != 0) + (int)t.struct_size +
         (int)info.struct_size + (int)o.struct_size + (int)g.struct_size + uid.internal[0];
}

/* SPDX-License-Identifier: MIT
 *
 * layout.c — prints what the C compiler makes of include/dion.h, one "KEY VALUE" line per fact:
 * every struct's size, alignment and field offsets, every typedef's size and signedness, every
 * constant. tests/abi_layout.rs compiles and runs it and compares each line with src/sys.rs; a key
 * present on one side only is a failure too, so a field added here must be added there.
 */
#include <dion.h>

#include <stddef.h>
#include <stdio.h>

#define ALIGNOF(T) offsetof(struct { char c; T t; }, t)
#define STRUCT(T) printf("size %s %zu\nalign %s %zu\n", #T, sizeof(T), #T, (size_t)ALIGNOF(T))
#define FIELD(T, f) printf("offset %s.%s %zu\nfsize %s.%s %zu\n", #T, #f, offsetof(T, f), #T, #f, sizeof(((T*)0)->f))
/* size and signedness (an unsigned type's -1 is positive) of an integer typedef */
#define INT_TYPE(T) printf("size %s %zu\nsigned %s %d\n", #T, sizeof(T), #T, (T)-1 < (T)0)
#define PTR_TYPE(T) printf("size %s %zu\n", #T, sizeof(T))
#define CONST(c) printf("const %s %lld\n", #c, (long long)(c))

int main(void) {
  /* versions */
  CONST(DION_VERSION_MAJOR);
  CONST(DION_VERSION_MINOR);
  CONST(DION_VERSION_PATCH);
  CONST(DION_VERSION_CODE);
  CONST(DION_VERSION(1, 2, 3));
  CONST(DION_ABI_VERSION);

  /* status codes */
  INT_TYPE(dion_status_t);
  CONST(DION_SUCCESS);
  CONST(DION_ERROR_INVALID_ARGUMENT);
  CONST(DION_ERROR_INVALID_USAGE);
  CONST(DION_ERROR_NOT_SUPPORTED);
  CONST(DION_ERROR_OUT_OF_MEMORY);
  CONST(DION_ERROR_CUDA);
  CONST(DION_ERROR_CUBLAS);
  CONST(DION_ERROR_CUSOLVER);
  CONST(DION_ERROR_NCCL);
  CONST(DION_ERROR_MPI);
  CONST(DION_ERROR_NUMERICAL);
  CONST(DION_ERROR_INTERNAL);

  /* enumerations */
  INT_TYPE(dion_dtype_t);
  CONST(DION_DTYPE_UNSET);
  CONST(DION_DTYPE_FP32);
  CONST(DION_DTYPE_BF16);
  CONST(DION_DTYPE_FP16);
  INT_TYPE(dion_backend_t);
  CONST(DION_BACKEND_HOST);
  CONST(DION_BACKEND_CUDA);
  INT_TYPE(dion_algorithm_t);
  CONST(DION_ALGO_DION);
  CONST(DION_ALGO_DION2);
  CONST(DION_ALGO_MUON);
  CONST(DION_ALGO_NORMUON);
  CONST(DION_ALGO_NORDION2);
  CONST(DION_ALGO_DION3);
  CONST(DION_ALGO_ADAMW);
  CONST(DION_ALGO_LION);
  INT_TYPE(dion_qr_method_t);
  CONST(DION_QR_RCQR);
  CONST(DION_QR_QR);
  CONST(DION_QR_CQR);
  INT_TYPE(dion_orthogonalizer_t);
  CONST(DION_ORTHO_POLAR_EXPRESS);
  CONST(DION_ORTHO_NEWTON_SCHULZ);
  INT_TYPE(dion_adjust_lr_t);
  CONST(DION_ADJUST_LR_SPECTRAL_NORM);
  CONST(DION_ADJUST_LR_RMS_NORM);
  CONST(DION_ADJUST_LR_NONE);
  INT_TYPE(dion_selection_scope_t);
  CONST(DION_SELECTION_LOCAL);
  CONST(DION_SELECTION_GLOBAL);
  INT_TYPE(dion_matmul_precision_t);
  CONST(DION_MATMUL_FP32);
  CONST(DION_MATMUL_TF32);
  CONST(DION_MATMUL_BF16);
  INT_TYPE(dion_layout_t);
  CONST(DION_LAYOUT_ROW_MAJOR);
  CONST(DION_LAYOUT_COL_MAJOR);
  INT_TYPE(dion_mesh_t);
  CONST(DION_MESH_REPLICATE);
  CONST(DION_MESH_OUTER);
  CONST(DION_MESH_INNER);
  INT_TYPE(dion_hparam_t);
  CONST(DION_HPARAM_LR);
  CONST(DION_HPARAM_WEIGHT_DECAY);
  CONST(DION_HPARAM_MU);
  CONST(DION_HPARAM_BETA1);
  CONST(DION_HPARAM_BETA2);
  CONST(DION_HPARAM_EPSILON);
  CONST(DION_HPARAM_EF_DECAY);
  CONST(DION_HPARAM_MUON_BETA2);
  CONST(DION_UNSET_INT);

  /* handles */
  PTR_TYPE(dion_comm_t);
  PTR_TYPE(dion_stream_t);
  PTR_TYPE(dion_optimizer_t);

  /* communicators */
  CONST(DION_NCCL_UNIQUE_ID_BYTES);
  STRUCT(dion_nccl_unique_id_t);
  FIELD(dion_nccl_unique_id_t, internal);

  /* options */
  STRUCT(dion_options_t);
  FIELD(dion_options_t, struct_size);
  FIELD(dion_options_t, abi_version);
  FIELD(dion_options_t, backend);
  FIELD(dion_options_t, device);
  FIELD(dion_options_t, replicate_grad_sync);
  FIELD(dion_options_t, skip_nonfinite);
  FIELD(dion_options_t, reserved0);
  FIELD(dion_options_t, seed);
  FIELD(dion_options_t, replicate_comm);
  FIELD(dion_options_t, outer_comm);
  FIELD(dion_options_t, inner_comm);

  /* tensors */
  CONST(DION_MAX_DIMS);
  STRUCT(dion_tensor_t);
  FIELD(dion_tensor_t, struct_size);
  FIELD(dion_tensor_t, name);
  FIELD(dion_tensor_t, param);
  FIELD(dion_tensor_t, grad);
  FIELD(dion_tensor_t, param_dtype);
  FIELD(dion_tensor_t, grad_dtype);
  FIELD(dion_tensor_t, layout);
  FIELD(dion_tensor_t, ndim);
  FIELD(dion_tensor_t, shape);
  FIELD(dion_tensor_t, outer_shard_dim);
  FIELD(dion_tensor_t, inner_shard_dim);
  FIELD(dion_tensor_t, outer_offset);
  FIELD(dion_tensor_t, outer_extent);
  FIELD(dion_tensor_t, inner_offset);
  FIELD(dion_tensor_t, inner_extent);

  /* group options */
  STRUCT(dion_group_options_t);
  FIELD(dion_group_options_t, struct_size);
  FIELD(dion_group_options_t, abi_version);
  FIELD(dion_group_options_t, algorithm);
  FIELD(dion_group_options_t, lr);
  FIELD(dion_group_options_t, weight_decay);
  FIELD(dion_group_options_t, mu);
  FIELD(dion_group_options_t, beta1);
  FIELD(dion_group_options_t, beta2);
  FIELD(dion_group_options_t, epsilon);
  FIELD(dion_group_options_t, rank_fraction);
  FIELD(dion_group_options_t, rank_multiple_of);
  FIELD(dion_group_options_t, power_iters);
  FIELD(dion_group_options_t, qr_method);
  FIELD(dion_group_options_t, cqr_warmup_steps);
  FIELD(dion_group_options_t, oversample);
  FIELD(dion_group_options_t, orthogonalizer);
  FIELD(dion_group_options_t, ortho_steps);
  FIELD(dion_group_options_t, nesterov);
  FIELD(dion_group_options_t, adjust_lr);
  FIELD(dion_group_options_t, cautious_wd);
  FIELD(dion_group_options_t, fraction);
  FIELD(dion_group_options_t, ef_decay);
  FIELD(dion_group_options_t, selection_scope);
  FIELD(dion_group_options_t, muon_beta2);
  FIELD(dion_group_options_t, flatten);
  FIELD(dion_group_options_t, momentum_dtype);
  FIELD(dion_group_options_t, q_dtype);
  FIELD(dion_group_options_t, variance_dtype);
  FIELD(dion_group_options_t, matmul_precision);

  /* state info */
  STRUCT(dion_state_info_t);
  FIELD(dion_state_info_t, struct_size);
  FIELD(dion_state_info_t, tensor);
  FIELD(dion_state_info_t, group);
  FIELD(dion_state_info_t, name);
  FIELD(dion_state_info_t, dtype);
  FIELD(dion_state_info_t, layout);
  FIELD(dion_state_info_t, ndim);
  FIELD(dion_state_info_t, global_shape);
  FIELD(dion_state_info_t, local_shape);
  FIELD(dion_state_info_t, local_offset);
  FIELD(dion_state_info_t, local_bytes);
  return 0;
}

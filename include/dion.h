/* SPDX-License-Identifier: MIT
 *
 * libdion — the Dion family of orthonormal optimizers behind a stable C ABI.
 *
 * This header is the whole public surface of the library and its manual. It is
 * self-contained C (C99 and C++; it includes only <stddef.h> and <stdint.h>):
 * CUDA streams and NCCL communicators are named through the incomplete struct
 * types that cudaStream_t and ncclComm_t point to, so callers and bindings need
 * neither CUDA nor NCCL headers. Entry points taking an MPI_Comm live in
 * dion_mpi.h.
 *
 * Conventions that hold for every function below:
 *
 *  - Every function returns a dion_status_t (DION_SUCCESS = 0) unless said
 *    otherwise. On failure, dion_last_error(handle) gives a message that names
 *    the function and the offending argument or tensor. A failed call changes
 *    no parameter and no optimizer state.
 *  - Option structs begin with `struct_size` and `abi_version`. Fill them with
 *    the matching *_init() function and then change the fields you need. The library reads only the first
 *    struct_size bytes, so a caller compiled against an older header keeps
 *    working after fields are appended.
 *  - Ownership: the caller owns every buffer (parameters, gradients, state
 *    read/write buffers) and every communicator it creates or adopts. The
 *    library owns the optimizer state and workspace it allocates, and frees them
 *    in dion_destroy.
 *  - Threading: one optimizer handle must not be used by two threads at the same
 *    time; distinct handles are fully independent and may be used concurrently.
 *  - Streams: every call that enqueues work takes the caller's stream as its
 *    last argument (NULL = the legacy default stream on the CUDA backend; the
 *    argument is ignored on the host backend, where calls complete before they
 *    return). Work on internal streams is joined back into the caller's stream
 *    before the call returns.
 *  - Collective calls (marked "Collective") must be made by every rank of every
 *    mesh the optimizer was given, in the same order.
 *  - Debugging: set DION_DEBUG=WARN (or INFO) in the environment to have the
 *    library log to stderr (DION_DEBUG_FILE=path redirects it).
 */
#ifndef DION_H_
#define DION_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define DION_API
#else
#define DION_API __attribute__((visibility("default")))
#endif

/* ------------------------------------------------------------------------ */
/* Versions                                                                 */
/* ------------------------------------------------------------------------ */

#define DION_VERSION_MAJOR 0
#define DION_VERSION_MINOR 1
#define DION_VERSION_PATCH 0
/* One encoding, forever: MAJOR*10000 + MINOR*100 + PATCH. */
#define DION_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))
#define DION_VERSION_CODE DION_VERSION(DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH)
/* Bumped only on an incompatible change of the ABI (never for appended fields). */
#define DION_ABI_VERSION 1

/* The version of the library actually loaded, encoded as DION_VERSION_CODE.
 * Bindings compare DION_VERSION_MAJOR with dion_version() / 10000 at load. */
DION_API int32_t dion_version(void);

/* ------------------------------------------------------------------------ */
/* Status codes (values are fixed; new codes are only appended)             */
/* ------------------------------------------------------------------------ */

typedef int32_t dion_status_t;
enum {
  DION_SUCCESS = 0,
  DION_ERROR_INVALID_ARGUMENT = 1, /* a NULL, out-of-range or inconsistent argument */
  DION_ERROR_INVALID_USAGE = 2,    /* a valid argument at the wrong time (e.g. a bad group index) */
  DION_ERROR_NOT_SUPPORTED = 3,    /* a valid request this build/backend cannot serve */
  DION_ERROR_OUT_OF_MEMORY = 4,
  DION_ERROR_CUDA = 5,
  DION_ERROR_CUBLAS = 6,
  DION_ERROR_CUSOLVER = 7,
  DION_ERROR_NCCL = 8,
  DION_ERROR_MPI = 9,
  DION_ERROR_NUMERICAL = 10,       /* reserved for numerical failures reported as errors */
  DION_ERROR_INTERNAL = 11         /* a bug in libdion: please report it */
};

/* Static text for a status ("invalid argument (set DION_DEBUG=WARN for details)").
 * Never NULL; unknown codes give "unknown status". Thread-safe. */
DION_API const char* dion_status_string(dion_status_t status);

/* ------------------------------------------------------------------------ */
/* Enumerations (int32_t fields; the names below are their values)          */
/* ------------------------------------------------------------------------ */

typedef int32_t dion_dtype_t;
enum {
  DION_DTYPE_UNSET = -1, /* "same as the parameter" where a dtype option allows it */
  DION_DTYPE_FP32 = 0,
  DION_DTYPE_BF16 = 1,
  DION_DTYPE_FP16 = 2
};

typedef int32_t dion_backend_t;
enum {
  DION_BACKEND_HOST = 0, /* CPU: BLAS/LAPACK; buffers are host memory */
  DION_BACKEND_CUDA = 1  /* one CUDA device; buffers are device memory of that device */
};

typedef int32_t dion_algorithm_t;
enum {
  DION_ALGO_DION = 0,     /* low-rank Dion (matrices) */
  DION_ALGO_DION2 = 1,    /* Dion2: orthogonalize a selected fraction of rows/columns */
  DION_ALGO_MUON = 2,     /* Muon: momentum then Polar Express / Newton-Schulz */
  DION_ALGO_NORMUON = 3,  /* Muon with neuron-wise normalization */
  DION_ALGO_NORDION2 = 4, /* Dion2 with neuron-wise normalization (alias: Dion3) */
  DION_ALGO_DION3 = 4,
  DION_ALGO_ADAMW = 5,    /* element-wise, any shape */
  DION_ALGO_LION = 6      /* element-wise, any shape */
};

typedef int32_t dion_qr_method_t;
enum {
  DION_QR_RCQR = 0, /* randomized Cholesky QR (default) */
  DION_QR_QR = 1,   /* Householder QR */
  DION_QR_CQR = 2   /* Cholesky QR, falling back to RCQR when the Cholesky fails */
};

typedef int32_t dion_orthogonalizer_t;
enum {
  DION_ORTHO_POLAR_EXPRESS = 0, /* Polar Express, 5 tuned polynomials (default) */
  DION_ORTHO_NEWTON_SCHULZ = 1  /* quintic Newton-Schulz, 5 tuned iterations */
};

typedef int32_t dion_adjust_lr_t;
enum {
  DION_ADJUST_LR_SPECTRAL_NORM = 0, /* lr * sqrt(fan_out / fan_in) (default) */
  DION_ADJUST_LR_RMS_NORM = 1,      /* lr * 0.2 * sqrt(max(fan_out, fan_in)) */
  DION_ADJUST_LR_NONE = 2
};

typedef int32_t dion_selection_scope_t;
enum {
  DION_SELECTION_LOCAL = 0, /* Dion2/NorDion2 select within each rank's shard (default) */
  DION_SELECTION_GLOBAL = 1 /* select over the whole (unsharded) matrix */
};

typedef int32_t dion_matmul_precision_t;
enum {
  DION_MATMUL_FP32 = 0, /* exact fp32 products (default; on CUDA, RCQR's sketch, which only
                          preconditions, is two bf16 products of P's two bf16 parts, and on
                          Hopper Dion's products P = M Q, R = M^T P and its error feedback
                          and update are three TF32 products of split parts summed in fp32,
                          as exact as SGEMM: docs/ENV.md) */
  DION_MATMUL_TF32 = 1, /* tensor-core tf32 (CUDA); same as FP32 on the host */
  DION_MATMUL_BF16 = 2  /* bf16 operands, fp32 accumulation (CUDA); same as FP32 on the host */
};

typedef int32_t dion_layout_t;
enum {
  DION_LAYOUT_ROW_MAJOR = 0, /* C order: the last dim is contiguous */
  DION_LAYOUT_COL_MAJOR = 1  /* Fortran order for 2-D tensors: the first dim is contiguous */
};

typedef int32_t dion_mesh_t;
enum {
  DION_MESH_REPLICATE = 0, /* data-parallel replicas (DDP / HSDP replicate dim) */
  DION_MESH_OUTER = 1,     /* outer shard (FSDP) */
  DION_MESH_INNER = 2      /* inner shard (tensor parallel) */
};

typedef int32_t dion_hparam_t;
enum {
  DION_HPARAM_LR = 0,
  DION_HPARAM_WEIGHT_DECAY = 1,
  DION_HPARAM_MU = 2,         /* Dion error-feedback keep factor; Muon/NorMuon momentum; NorDion2 ef decay */
  DION_HPARAM_BETA1 = 3,      /* AdamW / Lion */
  DION_HPARAM_BETA2 = 4,      /* AdamW / Lion */
  DION_HPARAM_EPSILON = 5,
  DION_HPARAM_EF_DECAY = 6,   /* Dion2 */
  DION_HPARAM_MUON_BETA2 = 7  /* NorMuon / NorDion2 */
};

/* Sentinel for the int32_t fields of dion_options_t and dion_group_options_t
 * (algorithm excepted) meaning "use the documented default". */
#define DION_UNSET_INT (-2147483647 - 1)

/* ------------------------------------------------------------------------ */
/* Communicators                                                            */
/* ------------------------------------------------------------------------ */

/* A mesh communicator: a group of ranks over NCCL (CUDA backend) or MPI (host
 * backend). A NULL dion_comm_t means "this mesh is absent" (size 1). The
 * optimizer does not take ownership: destroy a communicator with
 * dion_comm_destroy after every optimizer using it has been destroyed. */
typedef struct dion_comm_s* dion_comm_t;

struct ncclComm;   /* ncclComm_t is `struct ncclComm*` */
struct CUstream_st; /* cudaStream_t is `struct CUstream_st*` */
typedef struct CUstream_st* dion_stream_t;

/* Opaque copy of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128). Send its bytes
 * to every rank with any transport (MPI_Bcast, torch.distributed, a file). */
#define DION_NCCL_UNIQUE_ID_BYTES 128
typedef struct dion_nccl_unique_id {
  char internal[DION_NCCL_UNIQUE_ID_BYTES];
} dion_nccl_unique_id_t;

/* Generates a fresh NCCL unique id (ncclGetUniqueId). Call on one rank.
 * NOT_SUPPORTED in builds without NCCL. */
DION_API dion_status_t dion_nccl_get_unique_id(dion_nccl_unique_id_t* id);

/* Creates a NCCL communicator of `nranks` ranks on CUDA device `device`
 * (ncclCommInitRank). Collective over the nranks processes. The communicator
 * is owned by the returned dion_comm_t and destroyed with it. */
DION_API dion_status_t dion_comm_init_nccl(dion_comm_t* comm, const dion_nccl_unique_id_t* id, int32_t nranks,
                                           int32_t rank, int32_t device);

/* Wraps a caller-created ncclComm_t (passed as `struct ncclComm*`). The NCCL
 * communicator stays the caller's: dion_comm_destroy frees only the wrapper. */
DION_API dion_status_t dion_comm_adopt_nccl(dion_comm_t* comm, struct ncclComm* nccl_comm);

/* Wraps an MPI communicator given by its Fortran handle (MPI_Comm_c2f of a C
 * MPI_Comm, or an `integer` communicator from Fortran). The library duplicates
 * it, so the caller's communicator is untouched. NOT_SUPPORTED without MPI.
 * dion_mpi.h has dion_comm_from_mpi taking an MPI_Comm directly. */
DION_API dion_status_t dion_comm_from_mpi_fint(dion_comm_t* comm, int32_t fortran_comm);

/* Size and rank of this process in the communicator. */
DION_API dion_status_t dion_comm_size(dion_comm_t comm, int32_t* size);
DION_API dion_status_t dion_comm_rank(dion_comm_t comm, int32_t* rank);

/* Waits on a mesh are bounded: the environment variable DION_COMM_TIMEOUT
 * (seconds, default 600; 0 waits forever) limits how long a collective (MPI)
 * or a blocking call waiting for the device (NCCL) may wait for the other
 * ranks. Past it the call returns DION_ERROR_MPI / DION_ERROR_NCCL, the step
 * in flight writes nothing more, and the communicator is marked failed
 * (libdion's own NCCL communicators are aborted).
 *
 * Aborts the communicator (ncclCommAbort for a communicator libdion created;
 * for an adopted or MPI communicator it only marks it failed). Any later
 * collective through it, and any dion_step of an optimizer using it, returns
 * DION_ERROR_NCCL / DION_ERROR_MPI instead of hanging. */
DION_API dion_status_t dion_comm_abort(dion_comm_t comm);

/* Frees the wrapper (and the NCCL communicator if libdion created it).
 * NULL is accepted and ignored. */
DION_API dion_status_t dion_comm_destroy(dion_comm_t comm);

/* ------------------------------------------------------------------------ */
/* Optimizer options                                                        */
/* ------------------------------------------------------------------------ */

typedef struct dion_options_v1 {
  size_t struct_size;           /* sizeof(dion_options_t) as the caller compiled it */
  uint32_t abi_version;         /* DION_ABI_VERSION */
  dion_backend_t backend;       /* default DION_BACKEND_HOST */
  int32_t device;               /* CUDA device ordinal for DION_BACKEND_CUDA; default 0 */
  int32_t replicate_grad_sync;  /* 1 (default): the optimizer averages gradients (or Dion's compressed
                                   P and R) over the replicate mesh itself; 0: gradients arrive synchronized */
  int32_t skip_nonfinite;       /* 1 (default): a step whose gradients hold NaN/Inf changes nothing */
  int32_t reserved0;            /* must be 0 */
  uint64_t seed;                /* seed of the counter-based generator (initial Q; RCQR's sketches, one
                                   Gaussian matrix per matrix shape and step); default 0 */
  dion_comm_t replicate_comm;   /* NULL: no replicate mesh */
  dion_comm_t outer_comm;       /* NULL: no outer-shard (FSDP) mesh */
  dion_comm_t inner_comm;       /* NULL: no inner-shard (TP) mesh */
} dion_options_t;

/* Fills `options` with the defaults above (struct_size and abi_version too). */
DION_API dion_status_t dion_options_init(dion_options_t* options);
/* sizeof(dion_options_t) as this library was compiled: bindings assert on it. */
DION_API size_t dion_options_sizeof(void);

/* ------------------------------------------------------------------------ */
/* Optimizer lifetime                                                       */
/* ------------------------------------------------------------------------ */

typedef struct dion_optimizer_s* dion_optimizer_t;

/* Creates an optimizer with no groups. `options` may be NULL (all defaults).
 * Collective over the given meshes. On failure *optimizer is set to NULL and
 * dion_last_error(NULL) holds the message. Errors: INVALID_ARGUMENT (NULL
 * optimizer, bad struct_size/abi_version, unknown backend, the same
 * communicator given for two meshes, a multi-rank communicator of the wrong
 * kind: the host backend needs MPI communicators, the CUDA backend NCCL ones),
 * NOT_SUPPORTED (CUDA backend in a build without CUDA). With a multi-rank
 * replicate mesh and replicate_grad_sync = 1, dion_step averages the
 * gradients in place (in their buffers, as DDP does), except for Dion
 * tensors where (m + n) r < m n, whose P and R are averaged instead. On the
 * CUDA backend the NCCL collectives are enqueued on the stream of the call
 * (dion_step's, ...), in order with the optimizer's kernels; a step that
 * averages gradients over a multi-rank replicate mesh runs them on the
 * optimizer's own communication stream instead, forked from and joined back
 * to the call's stream, so that the next batch's average overlaps the
 * current batch's compute (same results; DION_OVERLAP=0 turns it off, see
 * docs/ENV.md). */
DION_API dion_status_t dion_create(dion_optimizer_t* optimizer, const dion_options_t* options);

/* Destroys the optimizer and frees everything libdion allocated for it. Waits
 * for work the optimizer enqueued to finish. Never destroys a communicator.
 * NULL is accepted and ignored. Not collective. */
DION_API dion_status_t dion_destroy(dion_optimizer_t optimizer);

/* The message of the last failed call on this handle (the empty string if
 * none failed yet), or with NULL, the calling thread's last error message
 * (every failure is also recorded there, including those of dion_create and
 * of calls given an invalid handle). Successful calls do not clear it. The
 * pointer stays valid until the next failing call on the same handle or
 * thread. */
DION_API const char* dion_last_error(dion_optimizer_t optimizer);

/* ------------------------------------------------------------------------ */
/* Tensor descriptors and parameter groups                                  */
/* ------------------------------------------------------------------------ */

#define DION_MAX_DIMS 4

/* One parameter as seen by this rank. `shape` is the GLOBAL shape; the local
 * buffers hold this rank's shard: along `outer_shard_dim` (if >= 0) the rows
 * [outer_offset, outer_offset + outer_extent), likewise for the inner mesh.
 * The local buffer is dense in `layout` order. Matrices are the last two
 * dims (fan_out x fan_in, as torch.nn.Linear.weight); leading dims of a
 * megabatch-family tensor are a batch of matrices. */
typedef struct dion_tensor_v1 {
  size_t struct_size;          /* sizeof(dion_tensor_t) as the caller compiled it */
  const char* name;            /* optional, copied; used in error messages */
  void* param;                 /* local shard of the parameter (updated in place) */
  const void* grad;            /* local shard of the gradient; NULL: no gradient (the tensor is skipped) */
  dion_dtype_t param_dtype;    /* FP32, BF16 or FP16 */
  dion_dtype_t grad_dtype;     /* DION_DTYPE_UNSET: same as param_dtype */
  dion_layout_t layout;        /* DION_LAYOUT_ROW_MAJOR (default) or COL_MAJOR (2-D only) */
  int32_t ndim;                /* 0..DION_MAX_DIMS */
  int64_t shape[DION_MAX_DIMS];/* global shape */
  int32_t outer_shard_dim;     /* -1 (default): not sharded over the outer mesh */
  int32_t inner_shard_dim;     /* -1 (default): not sharded over the inner mesh */
  int64_t outer_offset;        /* this rank's first index along outer_shard_dim */
  int64_t outer_extent;        /* this rank's length along outer_shard_dim (may be 0) */
  int64_t inner_offset;
  int64_t inner_extent;
} dion_tensor_t;

DION_API dion_status_t dion_tensor_init(dion_tensor_t* tensor);
DION_API size_t dion_tensor_sizeof(void);

/* Per-group algorithm and hyperparameters. Defaults are those of
 * microsoft/dion (see dion_group_options_init). Fields that do not apply to
 * the chosen algorithm are ignored. */
typedef struct dion_group_options_v1 {
  size_t struct_size;
  uint32_t abi_version;
  dion_algorithm_t algorithm;
  double lr;                 /* 0.01; must be >= 0 */
  double weight_decay;       /* 0.01; decoupled: X *= 1 - lr*weight_decay; must be >= 0 */
  double mu;                 /* 0.95; Dion error feedback, Muon/NorMuon momentum, NorDion2 ef decay */
  double beta1;              /* 0.9  (AdamW, Lion) */
  double beta2;              /* 0.95 (AdamW, Lion) */
  double epsilon;            /* 1e-8 */
  /* Dion */
  double rank_fraction;      /* 1.0; r = min(m, n, q*ceil(rank_fraction*min(m,n)/q)); in (0, 1] */
  int32_t rank_multiple_of;  /* q = 1; >= 1 */
  int32_t power_iters;       /* 1; >= 1 */
  dion_qr_method_t qr_method;/* DION_QR_RCQR */
  int32_t cqr_warmup_steps;  /* 150: with DION_QR_CQR, steps <= this use RCQR */
  double oversample;         /* 1.25: RCQR sketch rows k = 128*ceil(oversample*r/128); >= 1 */
  /* Muon family */
  dion_orthogonalizer_t orthogonalizer; /* DION_ORTHO_POLAR_EXPRESS */
  int32_t ortho_steps;       /* 5; iterations past the tuned ones reuse the last coefficients */
  int32_t nesterov;          /* 0 */
  dion_adjust_lr_t adjust_lr;/* DION_ADJUST_LR_SPECTRAL_NORM */
  int32_t cautious_wd;       /* 0; Muon, NorMuon, AdamW, Lion */
  double fraction;           /* 0.25 (Dion2, NorDion2); in (0, 1] */
  double ef_decay;           /* 0.95 (Dion2) */
  dion_selection_scope_t selection_scope; /* DION_SELECTION_LOCAL */
  double muon_beta2;         /* 0.95 (NorMuon, NorDion2) */
  int32_t flatten;           /* 0; 1: a tensor of ndim >= 3 is one (shape[0], prod(rest)) matrix */
  /* precision */
  dion_dtype_t momentum_dtype; /* DION_DTYPE_UNSET: the parameter dtype */
  dion_dtype_t q_dtype;        /* Dion's Q; UNSET: the parameter dtype */
  dion_dtype_t variance_dtype; /* AdamW variance; UNSET: the parameter dtype */
  dion_matmul_precision_t matmul_precision; /* DION_MATMUL_FP32 */
} dion_group_options_t;

/* Fills `options` with microsoft/dion's defaults for `algorithm`
 * (lr 0.01, weight_decay 0.01, mu 0.95, betas (0.9, 0.95), epsilon 1e-8,
 * rank_fraction 1, RCQR with oversample 1.25, Polar Express with 5 steps,
 * fraction 0.25, ef_decay 0.95, muon_beta2 0.95, all dtypes UNSET). */
DION_API dion_status_t dion_group_options_init(dion_group_options_t* options, dion_algorithm_t algorithm);
DION_API size_t dion_group_options_sizeof(void);

/* Adds a group of `count` tensors (count may be 0) with the given options and
 * allocates and initialises their state (zeros; Dion's Q from the seeded
 * generator). Tensors are numbered across groups in the order they are added
 * (0, 1, ...); that number is the `tensor` argument of the calls below.
 * Collective over the optimizer's meshes (shard metadata is checked to tile
 * the global tensors). On success *group_index (if not NULL) receives the
 * group's number. Errors, each naming the tensor: INVALID_ARGUMENT (NULL
 * pointers with count > 0, unknown algorithm or dtype, a Dion/Muon-family
 * tensor with ndim < 2, Dion with ndim != 2, negative lr/weight_decay/mu,
 * rank_fraction or fraction outside (0, 1], shard extents outside the global
 * shape, COL_MAJOR with ndim != 2, bad struct_size); NOT_SUPPORTED (an
 * option the backend cannot serve). On error nothing is added. */
DION_API dion_status_t dion_add_group(dion_optimizer_t optimizer, const dion_group_options_t* options,
                                      const dion_tensor_t* tensors, size_t count, int32_t* group_index);

/* Number of groups and of tensors added so far. */
DION_API dion_status_t dion_group_count(dion_optimizer_t optimizer, int32_t* count);
DION_API dion_status_t dion_tensor_count(dion_optimizer_t optimizer, int32_t* count);

/* Sets / gets one hyperparameter of a group; a new value takes effect at the
 * next dion_step (learning-rate schedules). On the CUDA backend lr,
 * weight_decay, beta1 and beta2 are kept in device memory, so a captured CUDA
 * graph of dion_step replays with the values set last; the others are read
 * when dion_step is called (capture again after changing them). set_hparam
 * waits for the optimizer's last step first. Errors: INVALID_USAGE for a bad
 * group index, INVALID_ARGUMENT for an unknown hparam or a value out of range
 * (negative lr, non-finite values, ...). */
DION_API dion_status_t dion_group_set_hparam(dion_optimizer_t optimizer, int32_t group, dion_hparam_t hparam,
                                             double value);
DION_API dion_status_t dion_group_get_hparam(dion_optimizer_t optimizer, int32_t group, dion_hparam_t hparam,
                                             double* value);

/* The group's step counter: the number of dion_step calls that were not
 * skipped since creation (or since set_step). Every such call advances every
 * group by one before updating it; AdamW's bias correction uses the advanced
 * value, and Dion's sketches and CQR warm-up are keyed by it. set_step
 * restores it from a checkpoint. On the CUDA backend the counter lives in
 * device memory (these calls wait for the optimizer's last step); Dion's CQR
 * warm-up (cqr_warmup_steps) is decided on the host by the number of
 * dion_step calls, so a CUDA graph captured during the warm-up keeps RCQR:
 * capture after it. */
DION_API dion_status_t dion_group_get_step(dion_optimizer_t optimizer, int32_t group, int64_t* step);
DION_API dion_status_t dion_group_set_step(dion_optimizer_t optimizer, int32_t group, int64_t step);

/* Points tensor `tensor` at new param/grad buffers (frameworks reallocate
 * gradients; set_to_none). `grad` may be NULL: the tensor is skipped by the
 * next steps. `param` must not be NULL. The shapes and dtypes stay those given
 * to dion_add_group. */
DION_API dion_status_t dion_tensor_rebind(dion_optimizer_t optimizer, int32_t tensor, void* param,
                                          const void* grad);

/* ------------------------------------------------------------------------ */
/* Stepping                                                                 */
/* ------------------------------------------------------------------------ */

/* One optimizer step over every group: reads the gradients, updates the
 * parameters and the state in place. Enqueued on `stream` (CUDA backend) and
 * complete on return (host backend). Collective over the meshes. With
 * skip_nonfinite, a step whose gradients hold NaN or Inf anywhere changes no
 * parameter and no state (the step counters do not advance either); see
 * dion_get_skipped_steps. */
DION_API dion_status_t dion_step(dion_optimizer_t optimizer, dion_stream_t stream);

/* Averages the decoupled optimizer states (Dion's momenta, ...) over the
 * replicate mesh, so that every replica holds the same state before a
 * checkpoint is written. A no-op without a replicate mesh or with
 * replicate_grad_sync = 0. Collective. Enqueued on `stream` (CUDA backend);
 * dion_state_read waits for it. */
DION_API dion_status_t dion_sync_for_checkpoint(dion_optimizer_t optimizer, dion_stream_t stream);

/* Number of steps skipped for non-finite gradients since creation, and
 * whether the last step was skipped (0/1). On the CUDA backend this reads a
 * counter kept on the device and waits for the optimizer's last step and for
 * `stream` (which may be NULL). */
DION_API dion_status_t dion_get_skipped_steps(dion_optimizer_t optimizer, int64_t* skipped, int32_t* last_skipped,
                                              dion_stream_t stream);

/* Errors found by work already enqueued (a failed communicator, ...):
 * *status receives DION_SUCCESS or the first such error. */
DION_API dion_status_t dion_get_async_error(dion_optimizer_t optimizer, dion_status_t* status);

/* Bytes communicated over `mesh` by the last step and since creation. */
DION_API dion_status_t dion_get_comm_bytes(dion_optimizer_t optimizer, dion_mesh_t mesh, uint64_t* last_step,
                                           uint64_t* total);

/* Memory libdion holds for this optimizer: optimizer state, and workspace
 * (the step's work buffers, the tensor tables and, on the CUDA backend, the
 * backend's scratch: factorization and reduction buffers, which grow on the
 * first step with larger shapes, and the cuBLAS workspace). */
DION_API dion_status_t dion_get_memory_usage(dion_optimizer_t optimizer, uint64_t* state_bytes,
                                             uint64_t* workspace_bytes);

/* ------------------------------------------------------------------------ */
/* Optimizer state (checkpoints)                                            */
/* ------------------------------------------------------------------------ */

/* Describes one state buffer. Names: "momentum" (all algorithms), "Q" (Dion),
 * "variance" (AdamW), "variance_neuron" (NorMuon, NorDion2). The local shard
 * is dense row-major over local_shape, except for tensors added with
 * DION_LAYOUT_COL_MAJOR, whose same-shaped states ("momentum", "variance")
 * are column-major like the parameter. `name` points into the optimizer and
 * lives as long as it. Every rank enumerates the same states in the same
 * order (rank-symmetric checkpoints). */
typedef struct dion_state_info_v1 {
  size_t struct_size;
  int32_t tensor;                     /* the tensor this state belongs to */
  int32_t group;
  const char* name;
  dion_dtype_t dtype;
  dion_layout_t layout;
  int32_t ndim;
  int64_t global_shape[DION_MAX_DIMS];
  int64_t local_shape[DION_MAX_DIMS];
  int64_t local_offset[DION_MAX_DIMS];/* where the local shard starts in the global state */
  uint64_t local_bytes;
} dion_state_info_t;

/* Number of state buffers of the optimizer. */
DION_API dion_status_t dion_state_count(dion_optimizer_t optimizer, int32_t* count);

/* Describes state buffer `index` (0 <= index < count). info->struct_size must
 * be set by the caller. */
DION_API dion_status_t dion_state_info(dion_optimizer_t optimizer, int32_t index, dion_state_info_t* info);

/* Finds the index of the state called `name` of tensor `tensor`;
 * INVALID_ARGUMENT (naming both) if there is none. */
DION_API dion_status_t dion_state_find(dion_optimizer_t optimizer, int32_t tensor, const char* name,
                                       int32_t* index);

/* Copies the local shard of state `index` into / from a caller buffer of
 * `bytes` bytes (at least local_bytes). On the CUDA backend the buffer may be
 * host or device memory; the copy first waits for the optimizer's last step
 * and for `stream` (which may be NULL), and is complete on return. */
DION_API dion_status_t dion_state_read(dion_optimizer_t optimizer, int32_t index, void* dst, uint64_t bytes,
                                       dion_stream_t stream);
DION_API dion_status_t dion_state_write(dion_optimizer_t optimizer, int32_t index, const void* src, uint64_t bytes,
                                        dion_stream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DION_H_ */

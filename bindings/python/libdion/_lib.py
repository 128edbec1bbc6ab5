# SPDX-License-Identifier: MIT
"""ctypes mirror of include/dion.h and the loader of libdion.so.

Everything here follows the header one to one: the constants keep their C
names, the structs their C field names and order, and ``_FUNCTIONS`` gives
argtypes/restype for every exported function with its C prototype beside it.
Nothing in this module knows an algorithm; ``core.py`` builds the Pythonic
layer on top.

Search order of the loader (``load_library`` / ``get_lib``):

1. ``LIBDION_PATH``: the full path of the shared library (a directory is also
   accepted and means ``<dir>/libdion.so``). When it is set it is the ONLY
   candidate: a failure is reported rather than silently loading another
   build.
2. The package directory (``libdion/libdion.so*``), for wheels that ship the
   library.
3. The build tree: from the package directory up to the repository root (the
   first directory holding ``include/dion.h``), every ``build/`` and
   ``build-*/`` directory met on the way.
4. The system loader: ``ctypes.util.find_library("dion")``, then the soname
   ``libdion.so.0`` (``LD_LIBRARY_PATH``, the ldconfig cache, rpath).

On failure ``DionLibraryError`` lists every candidate tried with the OSError
text and hints. After loading, the major version (dion_version() // 10000)
must equal ``DION_VERSION_MAJOR`` and the struct sizes must match the
library's ``dion_*_sizeof()``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import threading
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_int32, c_int64, c_size_t, c_uint32, c_uint64,
                    c_void_p)

# --------------------------------------------------------------------------
# Versions (the header this binding mirrors)
# --------------------------------------------------------------------------

DION_VERSION_MAJOR = 0
DION_VERSION_MINOR = 1
DION_VERSION_PATCH = 0


def DION_VERSION(x: int, y: int, z: int) -> int:  # noqa: N802 (C macro name)
    """One encoding, forever: MAJOR*10000 + MINOR*100 + PATCH."""
    return x * 10000 + y * 100 + z


DION_VERSION_CODE = DION_VERSION(DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH)
DION_ABI_VERSION = 1


def version_string(code: int) -> str:
    return "%d.%d.%d" % (code // 10000, (code // 100) % 100, code % 100)


# --------------------------------------------------------------------------
# Status codes
# --------------------------------------------------------------------------

DION_SUCCESS = 0
DION_ERROR_INVALID_ARGUMENT = 1
DION_ERROR_INVALID_USAGE = 2
DION_ERROR_NOT_SUPPORTED = 3
DION_ERROR_OUT_OF_MEMORY = 4
DION_ERROR_CUDA = 5
DION_ERROR_CUBLAS = 6
DION_ERROR_CUSOLVER = 7
DION_ERROR_NCCL = 8
DION_ERROR_MPI = 9
DION_ERROR_NUMERICAL = 10
DION_ERROR_INTERNAL = 11

# --------------------------------------------------------------------------
# Enumerations
# --------------------------------------------------------------------------

DION_DTYPE_UNSET = -1
DION_DTYPE_FP32 = 0
DION_DTYPE_BF16 = 1
DION_DTYPE_FP16 = 2

DION_BACKEND_HOST = 0
DION_BACKEND_CUDA = 1

DION_ALGO_DION = 0
DION_ALGO_DION2 = 1
DION_ALGO_MUON = 2
DION_ALGO_NORMUON = 3
DION_ALGO_NORDION2 = 4
DION_ALGO_DION3 = 4
DION_ALGO_ADAMW = 5
DION_ALGO_LION = 6

DION_QR_RCQR = 0
DION_QR_QR = 1
DION_QR_CQR = 2

DION_ORTHO_POLAR_EXPRESS = 0
DION_ORTHO_NEWTON_SCHULZ = 1

DION_ADJUST_LR_SPECTRAL_NORM = 0
DION_ADJUST_LR_RMS_NORM = 1
DION_ADJUST_LR_NONE = 2

DION_SELECTION_LOCAL = 0
DION_SELECTION_GLOBAL = 1

DION_MATMUL_FP32 = 0
DION_MATMUL_TF32 = 1
DION_MATMUL_BF16 = 2

DION_LAYOUT_ROW_MAJOR = 0
DION_LAYOUT_COL_MAJOR = 1

DION_MESH_REPLICATE = 0
DION_MESH_OUTER = 1
DION_MESH_INNER = 2

DION_HPARAM_LR = 0
DION_HPARAM_WEIGHT_DECAY = 1
DION_HPARAM_MU = 2
DION_HPARAM_BETA1 = 3
DION_HPARAM_BETA2 = 4
DION_HPARAM_EPSILON = 5
DION_HPARAM_EF_DECAY = 6
DION_HPARAM_MUON_BETA2 = 7

DION_UNSET_INT = -2147483647 - 1
DION_NCCL_UNIQUE_ID_BYTES = 128
DION_MAX_DIMS = 4

# --------------------------------------------------------------------------
# Handles and structs
# --------------------------------------------------------------------------

# Opaque handles: pointers to incomplete structs.
dion_status_t = c_int32
dion_dtype_t = c_int32
dion_backend_t = c_int32
dion_algorithm_t = c_int32
dion_qr_method_t = c_int32
dion_orthogonalizer_t = c_int32
dion_adjust_lr_t = c_int32
dion_selection_scope_t = c_int32
dion_matmul_precision_t = c_int32
dion_layout_t = c_int32
dion_mesh_t = c_int32
dion_hparam_t = c_int32
dion_comm_t = c_void_p        # struct dion_comm_s*
dion_optimizer_t = c_void_p   # struct dion_optimizer_s*
dion_stream_t = c_void_p      # struct CUstream_st* (cudaStream_t)
nccl_comm_p = c_void_p        # struct ncclComm* (ncclComm_t)


class dion_nccl_unique_id_t(Structure):
    _fields_ = [("internal", c_char * DION_NCCL_UNIQUE_ID_BYTES)]


class dion_options_t(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("abi_version", c_uint32),
        ("backend", dion_backend_t),
        ("device", c_int32),
        ("replicate_grad_sync", c_int32),
        ("skip_nonfinite", c_int32),
        ("reserved0", c_int32),
        ("seed", c_uint64),
        ("replicate_comm", dion_comm_t),
        ("outer_comm", dion_comm_t),
        ("inner_comm", dion_comm_t),
    ]


class dion_tensor_t(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("param", c_void_p),
        ("grad", c_void_p),
        ("param_dtype", dion_dtype_t),
        ("grad_dtype", dion_dtype_t),
        ("layout", dion_layout_t),
        ("ndim", c_int32),
        ("shape", c_int64 * DION_MAX_DIMS),
        ("outer_shard_dim", c_int32),
        ("inner_shard_dim", c_int32),
        ("outer_offset", c_int64),
        ("outer_extent", c_int64),
        ("inner_offset", c_int64),
        ("inner_extent", c_int64),
    ]


class dion_group_options_t(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("abi_version", c_uint32),
        ("algorithm", dion_algorithm_t),
        ("lr", c_double),
        ("weight_decay", c_double),
        ("mu", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("epsilon", c_double),
        # Dion
        ("rank_fraction", c_double),
        ("rank_multiple_of", c_int32),
        ("power_iters", c_int32),
        ("qr_method", dion_qr_method_t),
        ("cqr_warmup_steps", c_int32),
        ("oversample", c_double),
        # Muon family
        ("orthogonalizer", dion_orthogonalizer_t),
        ("ortho_steps", c_int32),
        ("nesterov", c_int32),
        ("adjust_lr", dion_adjust_lr_t),
        ("cautious_wd", c_int32),
        ("fraction", c_double),
        ("ef_decay", c_double),
        ("selection_scope", dion_selection_scope_t),
        ("muon_beta2", c_double),
        ("flatten", c_int32),
        # precision
        ("momentum_dtype", dion_dtype_t),
        ("q_dtype", dion_dtype_t),
        ("variance_dtype", dion_dtype_t),
        ("matmul_precision", dion_matmul_precision_t),
    ]


class dion_state_info_t(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("tensor", c_int32),
        ("group", c_int32),
        ("name", c_char_p),
        ("dtype", dion_dtype_t),
        ("layout", dion_layout_t),
        ("ndim", c_int32),
        ("global_shape", c_int64 * DION_MAX_DIMS),
        ("local_shape", c_int64 * DION_MAX_DIMS),
        ("local_offset", c_int64 * DION_MAX_DIMS),
        ("local_bytes", c_uint64),
    ]


# The structs whose size the library reports, with the function reporting it.
# dion_state_info_t has no *_sizeof(): its layout is pinned by the tests.
SIZEOF_FUNCTIONS = {
    "dion_options_t": ("dion_options_sizeof", dion_options_t),
    "dion_tensor_t": ("dion_tensor_sizeof", dion_tensor_t),
    "dion_group_options_t": ("dion_group_options_sizeof", dion_group_options_t),
}

# --------------------------------------------------------------------------
# Function table: name -> (restype, argtypes), C prototype in the comment.
# --------------------------------------------------------------------------

_P = POINTER
_FUNCTIONS = {
    # int32_t dion_version(void);
    "dion_version": (c_int32, []),
    # const char* dion_status_string(dion_status_t status);
    "dion_status_string": (c_char_p, [dion_status_t]),
    # dion_status_t dion_nccl_get_unique_id(dion_nccl_unique_id_t* id);
    "dion_nccl_get_unique_id": (dion_status_t, [_P(dion_nccl_unique_id_t)]),
    # dion_status_t dion_comm_init_nccl(dion_comm_t* comm, const dion_nccl_unique_id_t* id, int32_t nranks,
    #                                   int32_t rank, int32_t device);
    "dion_comm_init_nccl": (dion_status_t, [_P(dion_comm_t), _P(dion_nccl_unique_id_t), c_int32, c_int32, c_int32]),
    # dion_status_t dion_comm_adopt_nccl(dion_comm_t* comm, struct ncclComm* nccl_comm);
    "dion_comm_adopt_nccl": (dion_status_t, [_P(dion_comm_t), nccl_comm_p]),
    # dion_status_t dion_comm_from_mpi_fint(dion_comm_t* comm, int32_t fortran_comm);
    "dion_comm_from_mpi_fint": (dion_status_t, [_P(dion_comm_t), c_int32]),
    # dion_status_t dion_comm_size(dion_comm_t comm, int32_t* size);
    "dion_comm_size": (dion_status_t, [dion_comm_t, _P(c_int32)]),
    # dion_status_t dion_comm_rank(dion_comm_t comm, int32_t* rank);
    "dion_comm_rank": (dion_status_t, [dion_comm_t, _P(c_int32)]),
    # dion_status_t dion_comm_abort(dion_comm_t comm);
    "dion_comm_abort": (dion_status_t, [dion_comm_t]),
    # dion_status_t dion_comm_destroy(dion_comm_t comm);
    "dion_comm_destroy": (dion_status_t, [dion_comm_t]),
    # dion_status_t dion_options_init(dion_options_t* options);
    "dion_options_init": (dion_status_t, [_P(dion_options_t)]),
    # size_t dion_options_sizeof(void);
    "dion_options_sizeof": (c_size_t, []),
    # dion_status_t dion_create(dion_optimizer_t* optimizer, const dion_options_t* options);
    "dion_create": (dion_status_t, [_P(dion_optimizer_t), _P(dion_options_t)]),
    # dion_status_t dion_destroy(dion_optimizer_t optimizer);
    "dion_destroy": (dion_status_t, [dion_optimizer_t]),
    # const char* dion_last_error(dion_optimizer_t optimizer);
    "dion_last_error": (c_char_p, [dion_optimizer_t]),
    # dion_status_t dion_tensor_init(dion_tensor_t* tensor);
    "dion_tensor_init": (dion_status_t, [_P(dion_tensor_t)]),
    # size_t dion_tensor_sizeof(void);
    "dion_tensor_sizeof": (c_size_t, []),
    # dion_status_t dion_group_options_init(dion_group_options_t* options, dion_algorithm_t algorithm);
    "dion_group_options_init": (dion_status_t, [_P(dion_group_options_t), dion_algorithm_t]),
    # size_t dion_group_options_sizeof(void);
    "dion_group_options_sizeof": (c_size_t, []),
    # dion_status_t dion_add_group(dion_optimizer_t optimizer, const dion_group_options_t* options,
    #                              const dion_tensor_t* tensors, size_t count, int32_t* group_index);
    "dion_add_group": (dion_status_t, [dion_optimizer_t, _P(dion_group_options_t), _P(dion_tensor_t), c_size_t,
                                       _P(c_int32)]),
    # dion_status_t dion_group_count(dion_optimizer_t optimizer, int32_t* count);
    "dion_group_count": (dion_status_t, [dion_optimizer_t, _P(c_int32)]),
    # dion_status_t dion_tensor_count(dion_optimizer_t optimizer, int32_t* count);
    "dion_tensor_count": (dion_status_t, [dion_optimizer_t, _P(c_int32)]),
    # dion_status_t dion_group_set_hparam(dion_optimizer_t optimizer, int32_t group, dion_hparam_t hparam,
    #                                     double value);
    "dion_group_set_hparam": (dion_status_t, [dion_optimizer_t, c_int32, dion_hparam_t, c_double]),
    # dion_status_t dion_group_get_hparam(dion_optimizer_t optimizer, int32_t group, dion_hparam_t hparam,
    #                                     double* value);
    "dion_group_get_hparam": (dion_status_t, [dion_optimizer_t, c_int32, dion_hparam_t, _P(c_double)]),
    # dion_status_t dion_group_get_step(dion_optimizer_t optimizer, int32_t group, int64_t* step);
    "dion_group_get_step": (dion_status_t, [dion_optimizer_t, c_int32, _P(c_int64)]),
    # dion_status_t dion_group_set_step(dion_optimizer_t optimizer, int32_t group, int64_t step);
    "dion_group_set_step": (dion_status_t, [dion_optimizer_t, c_int32, c_int64]),
    # dion_status_t dion_tensor_rebind(dion_optimizer_t optimizer, int32_t tensor, void* param, const void* grad);
    "dion_tensor_rebind": (dion_status_t, [dion_optimizer_t, c_int32, c_void_p, c_void_p]),
    # dion_status_t dion_step(dion_optimizer_t optimizer, dion_stream_t stream);
    "dion_step": (dion_status_t, [dion_optimizer_t, dion_stream_t]),
    # dion_status_t dion_sync_for_checkpoint(dion_optimizer_t optimizer, dion_stream_t stream);
    "dion_sync_for_checkpoint": (dion_status_t, [dion_optimizer_t, dion_stream_t]),
    # dion_status_t dion_get_skipped_steps(dion_optimizer_t optimizer, int64_t* skipped, int32_t* last_skipped,
    #                                      dion_stream_t stream);
    "dion_get_skipped_steps": (dion_status_t, [dion_optimizer_t, _P(c_int64), _P(c_int32), dion_stream_t]),
    # dion_status_t dion_get_async_error(dion_optimizer_t optimizer, dion_status_t* status);
    "dion_get_async_error": (dion_status_t, [dion_optimizer_t, _P(dion_status_t)]),
    # dion_status_t dion_get_comm_bytes(dion_optimizer_t optimizer, dion_mesh_t mesh, uint64_t* last_step,
    #                                   uint64_t* total);
    "dion_get_comm_bytes": (dion_status_t, [dion_optimizer_t, dion_mesh_t, _P(c_uint64), _P(c_uint64)]),
    # dion_status_t dion_get_memory_usage(dion_optimizer_t optimizer, uint64_t* state_bytes,
    #                                     uint64_t* workspace_bytes);
    "dion_get_memory_usage": (dion_status_t, [dion_optimizer_t, _P(c_uint64), _P(c_uint64)]),
    # dion_status_t dion_state_count(dion_optimizer_t optimizer, int32_t* count);
    "dion_state_count": (dion_status_t, [dion_optimizer_t, _P(c_int32)]),
    # dion_status_t dion_state_info(dion_optimizer_t optimizer, int32_t index, dion_state_info_t* info);
    "dion_state_info": (dion_status_t, [dion_optimizer_t, c_int32, _P(dion_state_info_t)]),
    # dion_status_t dion_state_find(dion_optimizer_t optimizer, int32_t tensor, const char* name, int32_t* index);
    "dion_state_find": (dion_status_t, [dion_optimizer_t, c_int32, c_char_p, _P(c_int32)]),
    # dion_status_t dion_state_read(dion_optimizer_t optimizer, int32_t index, void* dst, uint64_t bytes,
    #                               dion_stream_t stream);
    "dion_state_read": (dion_status_t, [dion_optimizer_t, c_int32, c_void_p, c_uint64, dion_stream_t]),
    # dion_status_t dion_state_write(dion_optimizer_t optimizer, int32_t index, const void* src, uint64_t bytes,
    #                                dion_stream_t stream);
    "dion_state_write": (dion_status_t, [dion_optimizer_t, c_int32, c_void_p, c_uint64, dion_stream_t]),
}

# Exported only by builds with MPI (dion_mpi.h). MPI_Comm is an
# implementation-defined handle (a pointer in Open MPI, an int in MPICH); it is
# passed as a pointer-sized value, which the x86-64 and AArch64 calling
# conventions treat alike for both. Prefer dion_comm_from_mpi_fint with
# mpi4py's comm.py2f() from Python.
_OPTIONAL_FUNCTIONS = {
    # dion_status_t dion_comm_from_mpi(dion_comm_t* comm, MPI_Comm mpi_comm);
    "dion_comm_from_mpi": (dion_status_t, [_P(dion_comm_t), c_void_p]),
}


def _setup_ctypes(lib: ctypes.CDLL, path: str) -> None:
    """Sets restype/argtypes of every function; a missing required symbol is an error."""
    missing = []
    for name, (restype, argtypes) in _FUNCTIONS.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    if missing:
        raise DionLibraryError(
            "%s is not a usable libdion: it lacks %s" % (path, ", ".join(missing)),
            tried=[(path, "loaded, but symbols are missing")])
    for name, (restype, argtypes) in _OPTIONAL_FUNCTIONS.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = restype
            fn.argtypes = argtypes


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

class DionLibraryError(OSError):
    """libdion.so could not be found or loaded, or does not match this binding.

    ``tried`` is the list of (candidate, outcome) pairs in search order.
    """

    def __init__(self, message: str, tried=None):
        self.tried = list(tried or [])
        super().__init__(message)

    def __str__(self):
        return self.args[0] if self.args else ""


class DionError(Exception):
    """A libdion call returned a status other than DION_SUCCESS.

    ``status`` is the dion_status_t value, ``message`` the text of
    dion_last_error() (it names the function and the offending argument or
    tensor), ``function`` the C function named at its head when there is one.
    """

    status = None

    def __init__(self, message: str, status=None):
        if status is not None:
            self.status = status
        self.message = message
        m = re.match(r"(dion_[a-z0-9_]+):", message or "")
        self.function = m.group(1) if m else None
        super().__init__(message)

    def __str__(self):
        name = STATUS_NAMES.get(self.status, "status %s" % (self.status,))
        return "[%s] %s" % (name, self.message)


class DionInvalidArgument(DionError, ValueError):
    status = DION_ERROR_INVALID_ARGUMENT


class DionInvalidUsage(DionError, RuntimeError):
    status = DION_ERROR_INVALID_USAGE


class DionNotSupported(DionError, NotImplementedError):
    status = DION_ERROR_NOT_SUPPORTED


class DionOutOfMemory(DionError, MemoryError):
    status = DION_ERROR_OUT_OF_MEMORY


class DionCudaError(DionError):
    status = DION_ERROR_CUDA


class DionCublasError(DionError):
    status = DION_ERROR_CUBLAS


class DionCusolverError(DionError):
    status = DION_ERROR_CUSOLVER


class DionNcclError(DionError):
    status = DION_ERROR_NCCL


class DionMpiError(DionError):
    status = DION_ERROR_MPI


class DionNumericalError(DionError, ArithmeticError):
    status = DION_ERROR_NUMERICAL


class DionInternalError(DionError):
    status = DION_ERROR_INTERNAL


STATUS_NAMES = {
    DION_SUCCESS: "DION_SUCCESS",
    DION_ERROR_INVALID_ARGUMENT: "DION_ERROR_INVALID_ARGUMENT",
    DION_ERROR_INVALID_USAGE: "DION_ERROR_INVALID_USAGE",
    DION_ERROR_NOT_SUPPORTED: "DION_ERROR_NOT_SUPPORTED",
    DION_ERROR_OUT_OF_MEMORY: "DION_ERROR_OUT_OF_MEMORY",
    DION_ERROR_CUDA: "DION_ERROR_CUDA",
    DION_ERROR_CUBLAS: "DION_ERROR_CUBLAS",
    DION_ERROR_CUSOLVER: "DION_ERROR_CUSOLVER",
    DION_ERROR_NCCL: "DION_ERROR_NCCL",
    DION_ERROR_MPI: "DION_ERROR_MPI",
    DION_ERROR_NUMERICAL: "DION_ERROR_NUMERICAL",
    DION_ERROR_INTERNAL: "DION_ERROR_INTERNAL",
}

ERROR_CLASSES = {
    DION_ERROR_INVALID_ARGUMENT: DionInvalidArgument,
    DION_ERROR_INVALID_USAGE: DionInvalidUsage,
    DION_ERROR_NOT_SUPPORTED: DionNotSupported,
    DION_ERROR_OUT_OF_MEMORY: DionOutOfMemory,
    DION_ERROR_CUDA: DionCudaError,
    DION_ERROR_CUBLAS: DionCublasError,
    DION_ERROR_CUSOLVER: DionCusolverError,
    DION_ERROR_NCCL: DionNcclError,
    DION_ERROR_MPI: DionMpiError,
    DION_ERROR_NUMERICAL: DionNumericalError,
    DION_ERROR_INTERNAL: DionInternalError,
}


def error_for(status: int, message: str) -> DionError:
    """The DionError subclass instance for `status` (DionError itself for unknown codes)."""
    cls = ERROR_CLASSES.get(status, DionError)
    return cls(message, status)


def check(status: int, handle=None) -> None:
    """Raises the DionError subclass of `status` unless it is DION_SUCCESS.

    The message is dion_last_error(handle) (the handle's last error, or with
    None the calling thread's), falling back to dion_status_string(status).
    Call it right after the failing call, before any other call on the same
    handle or thread.
    """
    if status == DION_SUCCESS:
        return
    lib = get_lib()
    raw = lib.dion_last_error(handle)
    msg = raw.decode("utf-8", "replace") if raw else ""
    if not msg:
        s = lib.dion_status_string(status)
        msg = s.decode("utf-8", "replace") if s else "status %d" % status
    raise error_for(int(status), msg)


# --------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
LIBRARY_NAMES = ("libdion.so", "libdion.so.%d" % DION_VERSION_MAJOR)
SONAME = "libdion.so.%d" % DION_VERSION_MAJOR


def _repo_build_dirs(start: str):
    """build/ and build-*/ directories from `start` up to the repository root."""
    out = []
    d = os.path.abspath(start)
    while True:
        for b in [os.path.join(d, "build")] + sorted(glob.glob(os.path.join(d, "build-*"))):
            if os.path.isdir(b):
                out.append(b)
        if os.path.isfile(os.path.join(d, "include", "dion.h")):
            break  # the repository root
        parent = os.path.dirname(d)
        if parent == d:
            return []  # not inside a source tree (an installed package): no build tree
        d = parent
    return out


def candidates(env=None):
    """The candidates in search order: list of (kind, path_or_name).

    kind is "env" (LIBDION_PATH), "package", "build" or "system"; a "system"
    entry is a bare name handed to the dynamic loader.
    """
    env = os.environ if env is None else env
    override = env.get("LIBDION_PATH")
    if override:
        p = os.path.expanduser(override)
        if os.path.isdir(p):
            p = os.path.join(p, "libdion.so")
        return [("env", p)]
    out = []
    for name in LIBRARY_NAMES:
        out.append(("package", os.path.join(PACKAGE_DIR, name)))
    for b in _repo_build_dirs(PACKAGE_DIR):
        out.append(("build", os.path.join(b, "libdion.so")))
    found = ctypes.util.find_library("dion")
    if found:
        out.append(("system", found))
    if found != SONAME:
        out.append(("system", SONAME))
    return out


_HINTS = (
    "Hints:\n"
    "  - build it: cmake -S <repo> -B <repo>/build -G Ninja && cmake --build <repo>/build\n"
    "  - point LIBDION_PATH at the file: export LIBDION_PATH=/path/to/libdion.so\n"
    "  - or let the system loader find it: export LD_LIBRARY_PATH=/path/to/dir:$LD_LIBRARY_PATH "
    "(or install it and run ldconfig)\n"
    "  - an OSError naming libcudart/libnccl/libmpi means a dependency of libdion is missing or of another major "
    "version than the one it was built with (check `ldd libdion.so`)\n"
    "  - `python -m libdion` prints this diagnosis")


def _check_loaded(lib: ctypes.CDLL, path: str) -> int:
    """Version and struct-size checks on a freshly loaded library."""
    try:
        lib.dion_version.restype = c_int32
        lib.dion_version.argtypes = []
    except AttributeError:
        raise DionLibraryError("%s was loaded but is not libdion (it has no dion_version)" % path,
                               tried=[(path, "not libdion")])
    code = int(lib.dion_version())
    if code // 10000 != DION_VERSION_MAJOR:
        raise DionLibraryError(
            "%s is libdion %s (major %d) but this binding is for libdion %s (major %d); install the matching "
            "binding or point LIBDION_PATH at a libdion %d.x" %
            (path, version_string(code), code // 10000, version_string(DION_VERSION_CODE), DION_VERSION_MAJOR,
             DION_VERSION_MAJOR),
            tried=[(path, "version mismatch")])
    _setup_ctypes(lib, path)
    for sname, (fname, cls) in SIZEOF_FUNCTIONS.items():
        theirs = int(getattr(lib, fname)())
        ours = ctypes.sizeof(cls)
        # Equal sizes are required, except that a NEWER library may have
        # appended fields (it reads only our struct_size bytes).
        if theirs != ours and not (theirs > ours and code > DION_VERSION_CODE):
            raise DionLibraryError(
                "%s: sizeof(%s) is %d in the library (%s) but %d in this binding (%s): the binding does not match "
                "the header the library was built from" %
                (path, sname, theirs, version_string(code), ours, version_string(DION_VERSION_CODE)),
                tried=[(path, "struct size mismatch")])
    return code


def load_library(env=None):
    """Searches and loads libdion (no caching). Returns (CDLL, path, tried).

    Raises DionLibraryError listing every candidate tried.
    """
    tried = []
    for kind, cand in candidates(env):
        if kind != "system" and not os.path.exists(cand):
            tried.append((cand, "%s: no such file" % kind))
            continue
        try:
            lib = ctypes.CDLL(cand)
        except OSError as e:
            tried.append((cand, "%s: OSError: %s" % (kind, e)))
            continue
        path = _loaded_path(lib, cand)
        try:
            _check_loaded(lib, path)
        except DionLibraryError as e:
            raise DionLibraryError(str(e) + "\n" + _format_tried(tried + [(cand, kind + ": " + e.tried[0][1])]),
                                   tried=tried + e.tried)
        tried.append((cand, "%s: loaded %s" % (kind, path)))
        return lib, path, tried
    head = "libdion could not be loaded."
    if len(tried) == 1 and tried[0][1].startswith("env:"):
        head += (" LIBDION_PATH is set, so it was the only candidate (unset it to search the package directory, "
                 "the build tree and the system loader).")
    raise DionLibraryError(head + "\n" + _format_tried(tried) + "\n" + _HINTS, tried=tried)


def _format_tried(tried) -> str:
    lines = ["Candidates tried, in order (LIBDION_PATH, package dir, build tree, system loader):"]
    for cand, outcome in tried:
        lines.append("  %s -> %s" % (cand, outcome))
    return "\n".join(lines)


def _loaded_path(lib: ctypes.CDLL, fallback: str) -> str:
    """The file the dynamic loader actually mapped for `lib` (via dladdr)."""
    try:
        class _DlInfo(Structure):
            _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p),
                        ("dli_saddr", c_void_p)]

        libdl = ctypes.CDLL(None)
        dladdr = libdl.dladdr
        dladdr.argtypes = [c_void_p, POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        info = _DlInfo()
        addr = ctypes.cast(lib.dion_version, c_void_p).value
        if dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):
        pass
    return os.path.abspath(fallback) if os.path.sep in fallback else fallback


_lock = threading.Lock()
_state = {"lib": None, "path": None, "tried": None, "version": None}


def get_lib() -> ctypes.CDLL:
    """The loaded, checked library (loaded once per process)."""
    lib = _state["lib"]
    if lib is not None:
        return lib
    with _lock:
        if _state["lib"] is None:
            lib, path, tried = load_library()
            _state.update(lib=lib, path=path, tried=tried, version=int(lib.dion_version()))
        return _state["lib"]


def library_path() -> str:
    """The path of the loaded library (loads it if needed)."""
    get_lib()
    return _state["path"]


def library_version() -> int:
    """dion_version() of the loaded library (DION_VERSION_CODE encoding)."""
    get_lib()
    return _state["version"]


def search_log():
    """(candidate, outcome) pairs of the search that loaded the library."""
    get_lib()
    return list(_state["tried"])

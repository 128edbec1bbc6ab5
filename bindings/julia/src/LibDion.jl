# SPDX-License-Identifier: MIT
#
# LibDion: the C API of libdion (include/dion.h) as Julia sees it, one-to-one.
#
# One wrapper per function of dion.h, in header order, each a single `@ccall` whose argument and return types
# follow the C -> Julia table of ../README.md (check_bindings.py verifies every one of them, the structs and the
# constants against the header). Structs are immutable `struct`s with the C layout; fill them through a
# `Ref` and the *_init functions. `check(status, handle)` turns a status into a `DionError`.
#
# The library is found at load time (`__init__`), in this order:
#   1. ENV["LIBDION_PATH"]: the full path of libdion.so (when set, nothing else is tried);
#   2. the repository's build tree: <repo>/build/libdion.so (<repo> is three levels above this file), or
#      ENV["LIBDION_BUILD_DIR"]/libdion.so;
#   3. the system loader: libdion.so.0, then libdion.
# Then the major version of the loaded library is compared with DION_VERSION_MAJOR.
module LibDion

using Libdl

# ---------------------------------------------------------------------------------------------------------
# Constants (dion.h: every value is an int32_t)
# ---------------------------------------------------------------------------------------------------------
const DION_VERSION_MAJOR = Int32(0)
const DION_VERSION_MINOR = Int32(1)
const DION_VERSION_PATCH = Int32(0)
DION_VERSION(x, y, z) = Int32(x * 10000 + y * 100 + z)
const DION_VERSION_CODE = DION_VERSION(DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH)
const DION_ABI_VERSION = Int32(1)

# dion_status_t
const DION_SUCCESS = Int32(0)
const DION_ERROR_INVALID_ARGUMENT = Int32(1)
const DION_ERROR_INVALID_USAGE = Int32(2)
const DION_ERROR_NOT_SUPPORTED = Int32(3)
const DION_ERROR_OUT_OF_MEMORY = Int32(4)
const DION_ERROR_CUDA = Int32(5)
const DION_ERROR_CUBLAS = Int32(6)
const DION_ERROR_CUSOLVER = Int32(7)
const DION_ERROR_NCCL = Int32(8)
const DION_ERROR_MPI = Int32(9)
const DION_ERROR_NUMERICAL = Int32(10)
const DION_ERROR_INTERNAL = Int32(11)

# dion_dtype_t
const DION_DTYPE_UNSET = Int32(-1)
const DION_DTYPE_FP32 = Int32(0)
const DION_DTYPE_BF16 = Int32(1)
const DION_DTYPE_FP16 = Int32(2)

# dion_backend_t
const DION_BACKEND_HOST = Int32(0)
const DION_BACKEND_CUDA = Int32(1)

# dion_algorithm_t
const DION_ALGO_DION = Int32(0)
const DION_ALGO_DION2 = Int32(1)
const DION_ALGO_MUON = Int32(2)
const DION_ALGO_NORMUON = Int32(3)
const DION_ALGO_NORDION2 = Int32(4)
const DION_ALGO_DION3 = Int32(4)
const DION_ALGO_ADAMW = Int32(5)
const DION_ALGO_LION = Int32(6)

# dion_qr_method_t
const DION_QR_RCQR = Int32(0)
const DION_QR_QR = Int32(1)
const DION_QR_CQR = Int32(2)

# dion_orthogonalizer_t
const DION_ORTHO_POLAR_EXPRESS = Int32(0)
const DION_ORTHO_NEWTON_SCHULZ = Int32(1)

# dion_adjust_lr_t
const DION_ADJUST_LR_SPECTRAL_NORM = Int32(0)
const DION_ADJUST_LR_RMS_NORM = Int32(1)
const DION_ADJUST_LR_NONE = Int32(2)

# dion_selection_scope_t
const DION_SELECTION_LOCAL = Int32(0)
const DION_SELECTION_GLOBAL = Int32(1)

# dion_matmul_precision_t
const DION_MATMUL_FP32 = Int32(0)
const DION_MATMUL_TF32 = Int32(1)
const DION_MATMUL_BF16 = Int32(2)

# dion_layout_t
const DION_LAYOUT_ROW_MAJOR = Int32(0)
const DION_LAYOUT_COL_MAJOR = Int32(1)

# dion_mesh_t
const DION_MESH_REPLICATE = Int32(0)
const DION_MESH_OUTER = Int32(1)
const DION_MESH_INNER = Int32(2)

# dion_hparam_t
const DION_HPARAM_LR = Int32(0)
const DION_HPARAM_WEIGHT_DECAY = Int32(1)
const DION_HPARAM_MU = Int32(2)
const DION_HPARAM_BETA1 = Int32(3)
const DION_HPARAM_BETA2 = Int32(4)
const DION_HPARAM_EPSILON = Int32(5)
const DION_HPARAM_EF_DECAY = Int32(6)
const DION_HPARAM_MUON_BETA2 = Int32(7)

const DION_UNSET_INT = typemin(Int32)
const DION_NCCL_UNIQUE_ID_BYTES = Int32(128)
const DION_MAX_DIMS = Int32(4)

# ---------------------------------------------------------------------------------------------------------
# Structs (C layout; runtests.jl checks sizeof against dion_*_sizeof() and the *_init defaults)
# ---------------------------------------------------------------------------------------------------------

# dion_nccl_unique_id_t
struct DionNcclUniqueId
    internal::NTuple{128,UInt8}
end

# dion_options_t (dion_options_v1)
struct DionOptions
    struct_size::Csize_t
    abi_version::UInt32
    backend::Int32
    device::Int32
    replicate_grad_sync::Int32
    skip_nonfinite::Int32
    reserved0::Int32
    seed::UInt64
    replicate_comm::Ptr{Cvoid}
    outer_comm::Ptr{Cvoid}
    inner_comm::Ptr{Cvoid}
end

# dion_tensor_t (dion_tensor_v1); shape[1] is C's shape[0]
struct DionTensor
    struct_size::Csize_t
    name::Ptr{Cchar}
    param::Ptr{Cvoid}
    grad::Ptr{Cvoid}
    param_dtype::Int32
    grad_dtype::Int32
    layout::Int32
    ndim::Int32
    shape::NTuple{4,Int64}
    outer_shard_dim::Int32
    inner_shard_dim::Int32
    outer_offset::Int64
    outer_extent::Int64
    inner_offset::Int64
    inner_extent::Int64
end

# dion_group_options_t (dion_group_options_v1)
struct DionGroupOptions
    struct_size::Csize_t
    abi_version::UInt32
    algorithm::Int32
    lr::Cdouble
    weight_decay::Cdouble
    mu::Cdouble
    beta1::Cdouble
    beta2::Cdouble
    epsilon::Cdouble
    rank_fraction::Cdouble
    rank_multiple_of::Int32
    power_iters::Int32
    qr_method::Int32
    cqr_warmup_steps::Int32
    oversample::Cdouble
    orthogonalizer::Int32
    ortho_steps::Int32
    nesterov::Int32
    adjust_lr::Int32
    cautious_wd::Int32
    fraction::Cdouble
    ef_decay::Cdouble
    selection_scope::Int32
    muon_beta2::Cdouble
    flatten::Int32
    momentum_dtype::Int32
    q_dtype::Int32
    variance_dtype::Int32
    matmul_precision::Int32
end

# dion_state_info_t (dion_state_info_v1); set struct_size before dion_state_info
struct DionStateInfo
    struct_size::Csize_t
    tensor::Int32
    group::Int32
    name::Ptr{Cchar}
    dtype::Int32
    layout::Int32
    ndim::Int32
    global_shape::NTuple{4,Int64}
    local_shape::NTuple{4,Int64}
    local_offset::NTuple{4,Int64}
    local_bytes::UInt64
end

"""
    with(x::T; field = value, ...) -> T

A copy of the immutable struct `x` with the named fields replaced (values are `convert`ed to the field types).
"""
function with(x::T; kw...) where {T}
    for k in keys(kw)
        hasfield(T, k) || throw(ArgumentError("$(T) has no field $(k)"))
    end
    vals = ntuple(fieldcount(T)) do i
        f = fieldname(T, i)
        haskey(kw, f) ? convert(fieldtype(T, i), kw[f]) : getfield(x, i)
    end
    return T(vals...)
end

# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------
const HANDLE = Ref{Ptr{Cvoid}}(C_NULL)
const LIBPATH = Ref{String}("")
# Function pointers, filled once in __init__ (read-only afterwards, so safe from any thread).
const SYMBOLS = Dict{Symbol,Ptr{Cvoid}}()

function library_candidates()
    explicit = get(ENV, "LIBDION_PATH", "")
    isempty(explicit) || return [explicit]
    root = dirname(dirname(dirname(@__DIR__)))
    build = get(ENV, "LIBDION_BUILD_DIR", joinpath(root, "build"))
    return [joinpath(build, "libdion." * Libdl.dlext), "libdion.so.0", "libdion"]
end

function load_library!()
    tried = String[]
    for path in library_candidates()
        h = Libdl.dlopen(path, Libdl.RTLD_LAZY | Libdl.RTLD_LOCAL; throw_error=false)
        if h === nothing || h == C_NULL
            push!(tried, path)
            continue
        end
        HANDLE[] = h
        LIBPATH[] = path
        return h
    end
    error("LibDion: cannot load libdion; tried: " * join(tried, ", ") *
          ". Set ENV[\"LIBDION_PATH\"] to the full path of libdion.so (or build it: " *
          "cmake -S . -B build -G Ninja && cmake --build build), or add its directory to LD_LIBRARY_PATH.")
end

function __init__()
    h = load_library!()
    empty!(SYMBOLS)
    for name in names(@__MODULE__; all=true)
        s = string(name)
        startswith(s, "dion_") || continue
        SYMBOLS[name] = something(Libdl.dlsym(h, name; throw_error=false), C_NULL)
    end
    major = dion_version() ÷ 10000
    major == DION_VERSION_MAJOR || error("LibDion: $(LIBPATH[]) has major version $(major), " *
                                         "these bindings need $(DION_VERSION_MAJOR)")
    return nothing
end

@inline function sym(name::Symbol)
    p = get(SYMBOLS, name, C_NULL)
    p == C_NULL && error("LibDion: $(LIBPATH[]) has no symbol $(name) (an older libdion?)")
    return p
end

# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------
"""
    DionError(code, msg)

A failed libdion call: `code` is the `dion_status_t`, `msg` the library's message (`dion_last_error`), which
names the function and the offending argument or tensor.
"""
struct DionError <: Exception
    code::Int32
    msg::String
end

const STATUS_NAMES = Dict(
    DION_SUCCESS => "DION_SUCCESS", DION_ERROR_INVALID_ARGUMENT => "DION_ERROR_INVALID_ARGUMENT",
    DION_ERROR_INVALID_USAGE => "DION_ERROR_INVALID_USAGE", DION_ERROR_NOT_SUPPORTED => "DION_ERROR_NOT_SUPPORTED",
    DION_ERROR_OUT_OF_MEMORY => "DION_ERROR_OUT_OF_MEMORY", DION_ERROR_CUDA => "DION_ERROR_CUDA",
    DION_ERROR_CUBLAS => "DION_ERROR_CUBLAS", DION_ERROR_CUSOLVER => "DION_ERROR_CUSOLVER",
    DION_ERROR_NCCL => "DION_ERROR_NCCL", DION_ERROR_MPI => "DION_ERROR_MPI",
    DION_ERROR_NUMERICAL => "DION_ERROR_NUMERICAL", DION_ERROR_INTERNAL => "DION_ERROR_INTERNAL")

function Base.showerror(io::IO, e::DionError)
    print(io, "DionError: ", get(STATUS_NAMES, e.code, "status $(e.code)"), " (", e.code, "): ", e.msg)
end

"""
    check(status, handle = C_NULL)

Throws `DionError(status, message)` unless `status == DION_SUCCESS`; the message is `dion_last_error(handle)`
(with `C_NULL`, the calling thread's last error), or the status text when that is empty.
"""
function check(status::Integer, handle::Ptr{Cvoid}=C_NULL)
    status == DION_SUCCESS && return nothing
    msg = unsafe_string(dion_last_error(handle))
    isempty(msg) && (msg = unsafe_string(dion_status_string(status)))
    throw(DionError(Int32(status), msg))
end

# ---------------------------------------------------------------------------------------------------------
# The C API, in header order (types by the table in ../README.md; check_bindings.py verifies them)
# ---------------------------------------------------------------------------------------------------------

# int32_t dion_version(void);
function dion_version()
    @ccall $(sym(:dion_version))()::Int32
end

# const char* dion_status_string(dion_status_t status);
function dion_status_string(status)
    @ccall $(sym(:dion_status_string))(status::Int32)::Cstring
end

# dion_status_t dion_nccl_get_unique_id(dion_nccl_unique_id_t* id);
function dion_nccl_get_unique_id(id)
    @ccall $(sym(:dion_nccl_get_unique_id))(id::Ptr{DionNcclUniqueId})::Int32
end

# dion_status_t dion_comm_init_nccl(dion_comm_t* comm, const dion_nccl_unique_id_t* id, int32_t nranks,
#                                   int32_t rank, int32_t device);
function dion_comm_init_nccl(comm, id, nranks, rank, device)
    @ccall $(sym(:dion_comm_init_nccl))(comm::Ptr{Ptr{Cvoid}}, id::Ptr{DionNcclUniqueId}, nranks::Int32,
                                        rank::Int32, device::Int32)::Int32
end

# dion_status_t dion_comm_adopt_nccl(dion_comm_t* comm, struct ncclComm* nccl_comm);
function dion_comm_adopt_nccl(comm, nccl_comm)
    @ccall $(sym(:dion_comm_adopt_nccl))(comm::Ptr{Ptr{Cvoid}}, nccl_comm::Ptr{Cvoid})::Int32
end

# dion_status_t dion_comm_from_mpi_fint(dion_comm_t* comm, int32_t fortran_comm);
function dion_comm_from_mpi_fint(comm, fortran_comm)
    @ccall $(sym(:dion_comm_from_mpi_fint))(comm::Ptr{Ptr{Cvoid}}, fortran_comm::Int32)::Int32
end

# dion_status_t dion_comm_size(dion_comm_t comm, int32_t* size);
function dion_comm_size(comm, size)
    @ccall $(sym(:dion_comm_size))(comm::Ptr{Cvoid}, size::Ptr{Int32})::Int32
end

# dion_status_t dion_comm_rank(dion_comm_t comm, int32_t* rank);
function dion_comm_rank(comm, rank)
    @ccall $(sym(:dion_comm_rank))(comm::Ptr{Cvoid}, rank::Ptr{Int32})::Int32
end

# dion_status_t dion_comm_abort(dion_comm_t comm);
function dion_comm_abort(comm)
    @ccall $(sym(:dion_comm_abort))(comm::Ptr{Cvoid})::Int32
end

# dion_status_t dion_comm_destroy(dion_comm_t comm);
function dion_comm_destroy(comm)
    @ccall $(sym(:dion_comm_destroy))(comm::Ptr{Cvoid})::Int32
end

# dion_status_t dion_options_init(dion_options_t* options);
function dion_options_init(options)
    @ccall $(sym(:dion_options_init))(options::Ptr{DionOptions})::Int32
end

# size_t dion_options_sizeof(void);
function dion_options_sizeof()
    @ccall $(sym(:dion_options_sizeof))()::Csize_t
end

# dion_status_t dion_create(dion_optimizer_t* optimizer, const dion_options_t* options);
function dion_create(optimizer, options)
    @ccall $(sym(:dion_create))(optimizer::Ptr{Ptr{Cvoid}}, options::Ptr{DionOptions})::Int32
end

# dion_status_t dion_destroy(dion_optimizer_t optimizer);
function dion_destroy(optimizer)
    @ccall $(sym(:dion_destroy))(optimizer::Ptr{Cvoid})::Int32
end

# const char* dion_last_error(dion_optimizer_t optimizer);
function dion_last_error(optimizer)
    @ccall $(sym(:dion_last_error))(optimizer::Ptr{Cvoid})::Cstring
end

# dion_status_t dion_tensor_init(dion_tensor_t* tensor);
function dion_tensor_init(tensor)
    @ccall $(sym(:dion_tensor_init))(tensor::Ptr{DionTensor})::Int32
end

# size_t dion_tensor_sizeof(void);
function dion_tensor_sizeof()
    @ccall $(sym(:dion_tensor_sizeof))()::Csize_t
end

# dion_status_t dion_group_options_init(dion_group_options_t* options, dion_algorithm_t algorithm);
function dion_group_options_init(options, algorithm)
    @ccall $(sym(:dion_group_options_init))(options::Ptr{DionGroupOptions}, algorithm::Int32)::Int32
end

# size_t dion_group_options_sizeof(void);
function dion_group_options_sizeof()
    @ccall $(sym(:dion_group_options_sizeof))()::Csize_t
end

# dion_status_t dion_add_group(dion_optimizer_t optimizer, const dion_group_options_t* options,
#                              const dion_tensor_t* tensors, size_t count, int32_t* group_index);
function dion_add_group(optimizer, options, tensors, count, group_index)
    @ccall $(sym(:dion_add_group))(optimizer::Ptr{Cvoid}, options::Ptr{DionGroupOptions},
                                   tensors::Ptr{DionTensor}, count::Csize_t, group_index::Ptr{Int32})::Int32
end

# dion_status_t dion_group_count(dion_optimizer_t optimizer, int32_t* count);
function dion_group_count(optimizer, count)
    @ccall $(sym(:dion_group_count))(optimizer::Ptr{Cvoid}, count::Ptr{Int32})::Int32
end

# dion_status_t dion_tensor_count(dion_optimizer_t optimizer, int32_t* count);
function dion_tensor_count(optimizer, count)
    @ccall $(sym(:dion_tensor_count))(optimizer::Ptr{Cvoid}, count::Ptr{Int32})::Int32
end

# dion_status_t dion_group_set_hparam(dion_optimizer_t optimizer, int32_t group, dion_hparam_t hparam,
#                                     double value);
function dion_group_set_hparam(optimizer, group, hparam, value)
    @ccall $(sym(:dion_group_set_hparam))(optimizer::Ptr{Cvoid}, group::Int32, hparam::Int32,
                                          value::Cdouble)::Int32
end

# dion_status_t dion_group_get_hparam(dion_optimizer_t optimizer, int32_t group, dion_hparam_t hparam,
#                                     double* value);
function dion_group_get_hparam(optimizer, group, hparam, value)
    @ccall $(sym(:dion_group_get_hparam))(optimizer::Ptr{Cvoid}, group::Int32, hparam::Int32,
                                          value::Ptr{Cdouble})::Int32
end

# dion_status_t dion_group_get_step(dion_optimizer_t optimizer, int32_t group, int64_t* step);
function dion_group_get_step(optimizer, group, step)
    @ccall $(sym(:dion_group_get_step))(optimizer::Ptr{Cvoid}, group::Int32, step::Ptr{Int64})::Int32
end

# dion_status_t dion_group_set_step(dion_optimizer_t optimizer, int32_t group, int64_t step);
function dion_group_set_step(optimizer, group, step)
    @ccall $(sym(:dion_group_set_step))(optimizer::Ptr{Cvoid}, group::Int32, step::Int64)::Int32
end

# dion_status_t dion_tensor_rebind(dion_optimizer_t optimizer, int32_t tensor, void* param, const void* grad);
function dion_tensor_rebind(optimizer, tensor, param, grad)
    @ccall $(sym(:dion_tensor_rebind))(optimizer::Ptr{Cvoid}, tensor::Int32, param::Ptr{Cvoid},
                                       grad::Ptr{Cvoid})::Int32
end

# dion_status_t dion_step(dion_optimizer_t optimizer, dion_stream_t stream);
function dion_step(optimizer, stream)
    @ccall $(sym(:dion_step))(optimizer::Ptr{Cvoid}, stream::Ptr{Cvoid})::Int32
end

# dion_status_t dion_sync_for_checkpoint(dion_optimizer_t optimizer, dion_stream_t stream);
function dion_sync_for_checkpoint(optimizer, stream)
    @ccall $(sym(:dion_sync_for_checkpoint))(optimizer::Ptr{Cvoid}, stream::Ptr{Cvoid})::Int32
end

# dion_status_t dion_get_skipped_steps(dion_optimizer_t optimizer, int64_t* skipped, int32_t* last_skipped,
#                                      dion_stream_t stream);
function dion_get_skipped_steps(optimizer, skipped, last_skipped, stream)
    @ccall $(sym(:dion_get_skipped_steps))(optimizer::Ptr{Cvoid}, skipped::Ptr{Int64}, last_skipped::Ptr{Int32},
                                           stream::Ptr{Cvoid})::Int32
end

# dion_status_t dion_get_async_error(dion_optimizer_t optimizer, dion_status_t* status);
function dion_get_async_error(optimizer, status)
    @ccall $(sym(:dion_get_async_error))(optimizer::Ptr{Cvoid}, status::Ptr{Int32})::Int32
end

# dion_status_t dion_get_comm_bytes(dion_optimizer_t optimizer, dion_mesh_t mesh, uint64_t* last_step,
#                                   uint64_t* total);
function dion_get_comm_bytes(optimizer, mesh, last_step, total)
    @ccall $(sym(:dion_get_comm_bytes))(optimizer::Ptr{Cvoid}, mesh::Int32, last_step::Ptr{UInt64},
                                        total::Ptr{UInt64})::Int32
end

# dion_status_t dion_get_memory_usage(dion_optimizer_t optimizer, uint64_t* state_bytes,
#                                     uint64_t* workspace_bytes);
function dion_get_memory_usage(optimizer, state_bytes, workspace_bytes)
    @ccall $(sym(:dion_get_memory_usage))(optimizer::Ptr{Cvoid}, state_bytes::Ptr{UInt64},
                                          workspace_bytes::Ptr{UInt64})::Int32
end

# dion_status_t dion_state_count(dion_optimizer_t optimizer, int32_t* count);
function dion_state_count(optimizer, count)
    @ccall $(sym(:dion_state_count))(optimizer::Ptr{Cvoid}, count::Ptr{Int32})::Int32
end

# dion_status_t dion_state_info(dion_optimizer_t optimizer, int32_t index, dion_state_info_t* info);
function dion_state_info(optimizer, index, info)
    @ccall $(sym(:dion_state_info))(optimizer::Ptr{Cvoid}, index::Int32, info::Ptr{DionStateInfo})::Int32
end

# dion_status_t dion_state_find(dion_optimizer_t optimizer, int32_t tensor, const char* name, int32_t* index);
function dion_state_find(optimizer, tensor, name, index)
    @ccall $(sym(:dion_state_find))(optimizer::Ptr{Cvoid}, tensor::Int32, name::Cstring, index::Ptr{Int32})::Int32
end

# dion_status_t dion_state_read(dion_optimizer_t optimizer, int32_t index, void* dst, uint64_t bytes,
#                               dion_stream_t stream);
function dion_state_read(optimizer, index, dst, bytes, stream)
    @ccall $(sym(:dion_state_read))(optimizer::Ptr{Cvoid}, index::Int32, dst::Ptr{Cvoid}, bytes::UInt64,
                                    stream::Ptr{Cvoid})::Int32
end

# dion_status_t dion_state_write(dion_optimizer_t optimizer, int32_t index, const void* src, uint64_t bytes,
#                                dion_stream_t stream);
function dion_state_write(optimizer, index, src, bytes, stream)
    @ccall $(sym(:dion_state_write))(optimizer::Ptr{Cvoid}, index::Int32, src::Ptr{Cvoid}, bytes::UInt64,
                                     stream::Ptr{Cvoid})::Int32
end

end # module LibDion

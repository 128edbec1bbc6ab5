# SPDX-License-Identifier: MIT
"""
    Dion

Julia interface of libdion, the Dion family of orthonormal optimizers (Dion, Dion2, Muon, NorMuon, NorDion2)
plus AdamW and Lion, behind libdion's C ABI. `Dion.LibDion` mirrors the C header one-to-one; this module adds
an `Optimizer` that owns a handle, keyword-argument groups, and conversion between Julia arrays (column-major)
and libdion's tensor descriptors.

```julia
using Dion
W, gW = randn(Float32, 64, 32), zeros(Float32, 64, 32)   # (fan_out, fan_in), as torch.nn.Linear.weight
b, gb = zeros(Float32, 64), zeros(Float32, 64)
Optimizer() do opt                                       # destroy! runs at the end of the block
    add_group!(opt, :muon, [W], [gW]; lr = 0.02)
    add_group!(opt, :adamw, [b], [gb]; lr = 3e-3, weight_decay = 0)
    for step in 1:100
        # ... fill gW, gb in place ...
        step!(opt)
    end
end
```

Group, tensor and state numbers are libdion's (0-based, in the order groups and tensors were added): they are
identifiers passed back to the library, not Julia array positions.

# External links
- `include/dion.h` (the C API and its manual), `bindings/julia/README.md`.
"""
module Dion

include("LibDion.jl")
using .LibDion
using .LibDion: DionError, check, with, DionOptions, DionTensor, DionGroupOptions, DionStateInfo

export Optimizer, Tensor, Comm, DionError
export destroy!, step!, add_group!, set_hparam!, get_hparam, get_step, set_step!, rebind!
export group_count, tensor_count, skipped_steps, async_error, comm_bytes, memory_usage, sync_for_checkpoint!
export state_count, state_info, state_infos, find_state, read_state, write_state!, read_state_bytes!, write_state_bytes!
export library_version, library_path, group_options, nccl_unique_id, comm_size, comm_rank, abort!

"""Version of the loaded libdion as `VersionNumber` (decoded from `dion_version()`)."""
function library_version()
    v = LibDion.dion_version()
    return VersionNumber(v ÷ 10000, (v ÷ 100) % 100, v % 100)
end

"""Path (or loader name) libdion was loaded from."""
library_path() = LibDion.LIBPATH[]

# ---------------------------------------------------------------------------------------------------------
# Names <-> codes
# ---------------------------------------------------------------------------------------------------------
const ALGORITHMS = Dict(:dion => LibDion.DION_ALGO_DION, :dion2 => LibDion.DION_ALGO_DION2,
                        :muon => LibDion.DION_ALGO_MUON, :normuon => LibDion.DION_ALGO_NORMUON,
                        :nordion2 => LibDion.DION_ALGO_NORDION2, :dion3 => LibDion.DION_ALGO_DION3,
                        :adamw => LibDion.DION_ALGO_ADAMW, :lion => LibDion.DION_ALGO_LION)
const ELEMENTWISE = (LibDion.DION_ALGO_ADAMW, LibDion.DION_ALGO_LION)
const HPARAMS = Dict(:lr => LibDion.DION_HPARAM_LR, :weight_decay => LibDion.DION_HPARAM_WEIGHT_DECAY,
                     :mu => LibDion.DION_HPARAM_MU, :beta1 => LibDion.DION_HPARAM_BETA1,
                     :beta2 => LibDion.DION_HPARAM_BETA2, :epsilon => LibDion.DION_HPARAM_EPSILON,
                     :ef_decay => LibDion.DION_HPARAM_EF_DECAY, :muon_beta2 => LibDion.DION_HPARAM_MUON_BETA2)
const BACKENDS = Dict(:host => LibDion.DION_BACKEND_HOST, :cuda => LibDion.DION_BACKEND_CUDA)
const MESHES = Dict(:replicate => LibDion.DION_MESH_REPLICATE, :outer => LibDion.DION_MESH_OUTER,
                    :inner => LibDion.DION_MESH_INNER)
const LAYOUTS = Dict(:row_major => LibDion.DION_LAYOUT_ROW_MAJOR, :col_major => LibDion.DION_LAYOUT_COL_MAJOR)
# Enumerated group options given as symbols.
const OPTION_SYMBOLS = Dict(
    :qr_method => Dict(:rcqr => LibDion.DION_QR_RCQR, :qr => LibDion.DION_QR_QR, :cqr => LibDion.DION_QR_CQR),
    :orthogonalizer => Dict(:polar_express => LibDion.DION_ORTHO_POLAR_EXPRESS,
                            :newton_schulz => LibDion.DION_ORTHO_NEWTON_SCHULZ),
    :adjust_lr => Dict(:spectral_norm => LibDion.DION_ADJUST_LR_SPECTRAL_NORM,
                       :rms_norm => LibDion.DION_ADJUST_LR_RMS_NORM, :none => LibDion.DION_ADJUST_LR_NONE),
    :selection_scope => Dict(:local => LibDion.DION_SELECTION_LOCAL, :global => LibDion.DION_SELECTION_GLOBAL),
    :matmul_precision => Dict(:fp32 => LibDion.DION_MATMUL_FP32, :tf32 => LibDion.DION_MATMUL_TF32,
                              :bf16 => LibDion.DION_MATMUL_BF16))
const DTYPE_OPTIONS = (:momentum_dtype, :q_dtype, :variance_dtype)
const FIXED_FIELDS = (:struct_size, :abi_version, :algorithm)

lookup(table, key, what) =
    haskey(table, key) ? table[key] :
    throw(ArgumentError("unknown $(what) $(repr(key)); expected one of $(join(sort!(collect(keys(table))), ", "))"))

code(table, x::Symbol, what) = lookup(table, x, what)
code(table, x::Integer, what) = Int32(x)

"""
    dtype_code(T) -> Int32

libdion's dtype for an element type: `Float32`, `Float16`, a type named `BFloat16` of 2 bytes (BFloat16s.jl,
CUDA.jl — matched by name, so Dion depends on neither), or the symbols `:fp32`, `:fp16`, `:bf16`, `:unset`.
"""
dtype_code(::Type{Float32}) = LibDion.DION_DTYPE_FP32
dtype_code(::Type{Float16}) = LibDion.DION_DTYPE_FP16
function dtype_code(::Type{T}) where {T}
    nameof(T) === :BFloat16 && sizeof(T) == 2 && return LibDion.DION_DTYPE_BF16
    throw(ArgumentError("libdion has no dtype for $(T) (Float32, Float16 or BFloat16)"))
end
dtype_code(s::Symbol) =
    lookup(Dict(:fp32 => LibDion.DION_DTYPE_FP32, :fp16 => LibDion.DION_DTYPE_FP16, :bf16 => LibDion.DION_DTYPE_BF16,
                :unset => LibDion.DION_DTYPE_UNSET), s, "dtype")
dtype_code(x::Integer) = Int32(x)
dtype_code(::Nothing) = LibDion.DION_DTYPE_UNSET

"""Element type libdion's dtype is read into by `read_state` (bf16 as its raw `UInt16` bits)."""
dtype_eltype(d::Integer) = d == LibDion.DION_DTYPE_FP32 ? Float32 : d == LibDion.DION_DTYPE_FP16 ? Float16 :
                           d == LibDion.DION_DTYPE_BF16 ? UInt16 : throw(ArgumentError("unknown dtype $(d)"))

# A stream: C_NULL / nothing (the default stream; ignored on the host backend), a Ptr, or any object with a
# `handle` field holding the CUstream (CUDA.jl's CuStream), so that Dion need not depend on CUDA.jl.
stream_ptr(::Nothing) = C_NULL
stream_ptr(s::Ptr) = convert(Ptr{Cvoid}, s)
stream_ptr(s) = hasproperty(s, :handle) ? stream_ptr(getproperty(s, :handle)) :
                throw(ArgumentError("stream must be a Ptr, nothing, or have a `handle` field (CUDA.jl CuStream)"))

# ---------------------------------------------------------------------------------------------------------
# Communicators
# ---------------------------------------------------------------------------------------------------------
"""
    Comm

A libdion mesh communicator (`dion_comm_t`). Make one with `Comm(:mpi, fortran_comm)` (the Fortran handle of an
MPI communicator, i.e. `MPI_Comm_c2f(comm)`; the library duplicates it; call after MPI is initialised),
`Comm(:nccl_adopt, ptr)` (wrap a caller's `ncclComm_t`) or `Comm(:nccl, unique_id_bytes, nranks, rank, device)`. Destroy it with `destroy!`
after every optimizer using it (the optimizer never destroys a communicator).

# External links
- `dion_comm_from_mpi_fint`, `dion_comm_adopt_nccl`, `dion_comm_init_nccl` in `include/dion.h`.
"""
mutable struct Comm
    handle::Ptr{Cvoid}
    function Comm(handle::Ptr{Cvoid})
        c = new(handle)
        return finalizer(finalize_comm, c)
    end
end

function Comm(kind::Symbol, args...)
    r = Ref{Ptr{Cvoid}}(C_NULL)
    if kind === :mpi
        check(LibDion.dion_comm_from_mpi_fint(r, Int32(args[1])))
    elseif kind === :nccl_adopt
        check(LibDion.dion_comm_adopt_nccl(r, convert(Ptr{Cvoid}, args[1])))
    elseif kind === :nccl
        bytes, nranks, rank, device = args
        length(bytes) == LibDion.DION_NCCL_UNIQUE_ID_BYTES ||
            throw(ArgumentError("an NCCL unique id has $(LibDion.DION_NCCL_UNIQUE_ID_BYTES) bytes"))
        id = Ref(LibDion.DionNcclUniqueId(ntuple(i -> UInt8(bytes[i]), 128)))
        check(LibDion.dion_comm_init_nccl(r, id, nranks, rank, device))
    else
        throw(ArgumentError("Comm kind must be :mpi, :nccl_adopt or :nccl"))
    end
    return Comm(r[])
end

"""`nccl_unique_id()`: a fresh NCCL unique id as 128 bytes, to send to every rank (`dion_nccl_get_unique_id`)."""
function nccl_unique_id()
    r = Ref{LibDion.DionNcclUniqueId}()
    check(LibDion.dion_nccl_get_unique_id(r))
    return collect(r[].internal)
end

Base.unsafe_convert(::Type{Ptr{Cvoid}}, c::Comm) = c.handle
handle_of(c::Comm) = c.handle
handle_of(::Nothing) = C_NULL
handle_of(p::Ptr) = convert(Ptr{Cvoid}, p)

"""`comm_size(c::Comm)` — number of ranks (`dion_comm_size`)."""
function comm_size(c::Comm)
    r = Ref{Int32}(0)
    check(LibDion.dion_comm_size(c.handle, r))
    return Int(r[])
end
"""`comm_rank(c::Comm)` — this process's rank (`dion_comm_rank`)."""
function comm_rank(c::Comm)
    r = Ref{Int32}(0)
    check(LibDion.dion_comm_rank(c.handle, r))
    return Int(r[])
end
"""`abort!(c::Comm)` — later collectives through `c` fail instead of hanging (`dion_comm_abort`)."""
abort!(c::Comm) = check(LibDion.dion_comm_abort(c.handle))

function destroy!(c::Comm)
    h = c.handle
    h == C_NULL && return nothing
    c.handle = C_NULL
    check(LibDion.dion_comm_destroy(h))
    return nothing
end
finalize_comm(c::Comm) = (h = c.handle; c.handle = C_NULL; h == C_NULL || LibDion.dion_comm_destroy(h); nothing)

# ---------------------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------------------
"""
    Optimizer(; backend = :host, device = 0, seed = 0, replicate_grad_sync = true, skip_nonfinite = true,
              replicate_comm = nothing, outer_comm = nothing, inner_comm = nothing)
    Optimizer(f; kwargs...)        # do-block form: f(opt), then destroy!(opt)

An optimizer with no groups (`dion_create`); add parameters with `add_group!`, step with `step!`. Release it
with `destroy!` or use the do-block form: a finalizer destroys a forgotten one, but finalizers run late and on
any thread. The optimizer keeps the Julia arrays given to `add_group!` / `rebind!` alive until it is destroyed.
Communicators are `Comm`s (or raw `dion_comm_t` pointers); the optimizer does not own them.

# External links
- `dion_create`, `dion_options_t` in `include/dion.h`.
"""
mutable struct Optimizer
    handle::Ptr{Cvoid}
    # Julia objects libdion holds pointers into, by tensor number: (param, grad, extra).
    roots::Dict{Int32,Any}
    comms::Vector{Any}
    function Optimizer(handle::Ptr{Cvoid}, comms)
        opt = new(handle, Dict{Int32,Any}(), comms)
        return finalizer(finalize_optimizer, opt)
    end
end

function Optimizer(; backend=:host, device::Integer=0, seed::Integer=0, replicate_grad_sync::Bool=true,
                   skip_nonfinite::Bool=true, replicate_comm=nothing, outer_comm=nothing, inner_comm=nothing)
    r = Ref{DionOptions}()
    check(LibDion.dion_options_init(r))
    r[] = with(r[]; backend=code(BACKENDS, backend, "backend"), device=Int32(device), seed=UInt64(seed),
               replicate_grad_sync=Int32(replicate_grad_sync), skip_nonfinite=Int32(skip_nonfinite),
               replicate_comm=handle_of(replicate_comm), outer_comm=handle_of(outer_comm),
               inner_comm=handle_of(inner_comm))
    h = Ref{Ptr{Cvoid}}(C_NULL)
    check(LibDion.dion_create(h, r))
    return Optimizer(h[], Any[replicate_comm, outer_comm, inner_comm])
end

function Optimizer(f::Function; kwargs...)
    opt = Optimizer(; kwargs...)
    try
        return f(opt)
    finally
        destroy!(opt)
    end
end

Base.unsafe_convert(::Type{Ptr{Cvoid}}, opt::Optimizer) = handle(opt)

function handle(opt::Optimizer)
    opt.handle == C_NULL && throw(ArgumentError("this Optimizer has been destroyed"))
    return opt.handle
end

"""
    destroy!(opt::Optimizer)

Frees the optimizer's state (`dion_destroy`) and lets go of the arrays it pointed into. Idempotent: a second
call, or the finalizer after it, does nothing.
"""
function destroy!(opt::Optimizer)
    h = opt.handle
    h == C_NULL && return nothing
    opt.handle = C_NULL
    status = LibDion.dion_destroy(h)
    empty!(opt.roots)
    check(status)
    return nothing
end

# The finalizer: no exceptions, no I/O, no task switches.
function finalize_optimizer(opt::Optimizer)
    h = opt.handle
    opt.handle = C_NULL
    h == C_NULL || LibDion.dion_destroy(h)
    return nothing
end

function Base.show(io::IO, opt::Optimizer)
    if opt.handle == C_NULL
        print(io, "Dion.Optimizer(destroyed)")
    else
        print(io, "Dion.Optimizer(", group_count(opt), " groups, ", tensor_count(opt), " tensors)")
    end
end

# ---------------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------------
"""
    Tensor(param::Ptr, grad::Union{Ptr,Nothing}, dims; dtype = <from eltype(param)>, layout = :row_major,
           keep = nothing, outer_shard_dim = -1, outer_offset = 0, outer_extent = 0,
           inner_shard_dim = -1, inner_offset = 0, inner_extent = 0)

A parameter given by address: device memory from any source (CUDA.jl: `reinterpret(Ptr{Float32}, pointer(x))`,
as a `CuPtr` is not a `Ptr` and Dion does not depend on CUDA.jl), or memory libdion should see with an explicit
C-order shape (`dims` is the C shape: `dims[1]` is C's `shape[0]`; a 3-D batch of matrices is row-major
(batch, fan_out, fan_in)). `keep` is held by the optimizer as long as it points into the buffers (pass the
`CuArray`s). Shard fields are libdion's (0-based dim; -1: not sharded).
"""
struct Tensor
    param::Ptr{Cvoid}
    grad::Ptr{Cvoid}
    dims::Vector{Int64}
    dtype::Int32
    grad_dtype::Int32
    layout::Int32
    keep::Any
    outer_shard_dim::Int32
    outer_offset::Int64
    outer_extent::Int64
    inner_shard_dim::Int32
    inner_offset::Int64
    inner_extent::Int64
end

function Tensor(param::Ptr{T}, grad::Union{Ptr,Nothing}, dims; dtype=(T === Cvoid ? nothing : T),
                grad_dtype=nothing, layout=:row_major, keep=nothing, outer_shard_dim::Integer=-1,
                outer_offset::Integer=0, outer_extent::Integer=0, inner_shard_dim::Integer=-1,
                inner_offset::Integer=0, inner_extent::Integer=0) where {T}
    dtype === nothing && throw(ArgumentError("Tensor: give dtype (:fp32, :fp16, :bf16 or a type) for a Ptr{Cvoid}"))
    length(dims) <= LibDion.DION_MAX_DIMS || throw(ArgumentError("Tensor: at most $(LibDion.DION_MAX_DIMS) dims"))
    return Tensor(convert(Ptr{Cvoid}, param), grad === nothing ? C_NULL : convert(Ptr{Cvoid}, grad),
                  Int64[d for d in dims], dtype_code(dtype), dtype_code(grad_dtype), code(LAYOUTS, layout, "layout"),
                  keep, outer_shard_dim, outer_offset, outer_extent, inner_shard_dim, inner_offset, inner_extent)
end

# A pointer as libdion's void*: a Ptr, or a pointer type of the same size (CUDA.jl's CuPtr) taken bit for bit,
# so that device arrays work without a dependency on CUDA.jl.
raw_pointer(p::Ptr) = convert(Ptr{Cvoid}, p)
function raw_pointer(p)
    isprimitivetype(typeof(p)) && sizeof(p) == sizeof(Ptr{Cvoid}) && return reinterpret(Ptr{Cvoid}, p)
    throw(ArgumentError("expected a pointer, got $(typeof(p))"))
end

colmajor_strides(sz::Tuple) = ntuple(k -> foldl(*, sz[1:k-1]; init=1), length(sz))

# A dense column-major array (Array, a contiguous view or reshape of one, or a device array such as a CuArray,
# whose `pointer` is a CuPtr): its memory as a void*, never a copy.
function dense_pointer(A::AbstractArray, what)
    A isa DenseArray || (A isa StridedArray && strides(A) == colmajor_strides(size(A))) ||
        throw(ArgumentError("$(what) must be a dense column-major array (got $(typeof(A)))"))
    return raw_pointer(pointer(A))
end

"""
    Tensor(param::AbstractArray, grad = nothing; algorithm = :muon)

The descriptor of a dense Julia array, pointing at its memory (no copy): a host `Array` (or a contiguous view)
for the host backend, or a device array for the CUDA backend (a `CuArray` works as is: its `pointer`, a
`CuPtr`, is taken bit for bit, with no dependency on CUDA.jl). A `Matrix` of size (m, n) is the logical
(fan_out, fan_in) = (m, n) matrix, `DION_LAYOUT_COL_MAJOR`; a `Vector` is a 1-D tensor. Arrays of 3 or more
dims are accepted for element-wise algorithms (AdamW, Lion: the shape does not matter); for matrix algorithms
reshape to a matrix, or give a `Tensor` from pointers with a row-major shape (libdion's COL_MAJOR is 2-D only).
"""
function Tensor(param::AbstractArray{T,N}, grad::Union{AbstractArray,Nothing}=nothing;
                algorithm=:muon) where {T,N}
    p = dense_pointer(param, "param")
    g = C_NULL
    if grad !== nothing
        size(grad) == size(param) ||
            throw(ArgumentError("grad has size $(size(grad)), param has size $(size(param))"))
        g = dense_pointer(grad, "grad")
    end
    gdt = grad === nothing ? dtype_code(T) : dtype_code(eltype(grad))
    algo = code(ALGORITHMS, algorithm, "algorithm")
    if N == 2
        dims, layout = Int64[size(param, 1), size(param, 2)], LibDion.DION_LAYOUT_COL_MAJOR
    elseif N == 1
        dims, layout = Int64[length(param)], LibDion.DION_LAYOUT_ROW_MAJOR
    elseif N <= LibDion.DION_MAX_DIMS && algo in ELEMENTWISE
        # The exact memory description: Julia's (d1, ..., dN) column-major is C's (dN, ..., d1) row-major.
        dims, layout = Int64[size(param, k) for k in N:-1:1], LibDion.DION_LAYOUT_ROW_MAJOR
    else
        throw(ArgumentError("a $(N)-D array for $(algorithm): reshape it to a matrix, or pass a Tensor made " *
                            "from pointers with an explicit row-major shape"))
    end
    return Tensor(p, g, dims, dtype_code(T), gdt, layout, (param, grad), -1, 0, 0, -1, 0, 0)
end

function descriptor(t::Tensor, name::Ptr{Cchar})
    r = Ref{DionTensor}()
    check(LibDion.dion_tensor_init(r))
    shape = ntuple(k -> k <= length(t.dims) ? t.dims[k] : Int64(0), 4)
    return with(r[]; name=name, param=t.param, grad=t.grad, param_dtype=t.dtype, grad_dtype=t.grad_dtype,
                layout=t.layout, ndim=Int32(length(t.dims)), shape=shape, outer_shard_dim=t.outer_shard_dim,
                outer_offset=t.outer_offset, outer_extent=t.outer_extent, inner_shard_dim=t.inner_shard_dim,
                inner_offset=t.inner_offset, inner_extent=t.inner_extent)
end

# ---------------------------------------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------------------------------------
function option_value(k::Symbol, v)
    haskey(OPTION_SYMBOLS, k) && v isa Symbol && return lookup(OPTION_SYMBOLS[k], v, string(k))
    k in DTYPE_OPTIONS && return dtype_code(v)
    v isa Bool && return Int32(v)
    return v
end

"""
    group_options(algorithm; kwargs...) -> DionGroupOptions

libdion's defaults for `algorithm` (`dion_group_options_init`, i.e. microsoft/dion's) with the given fields
replaced. Keywords are the fields of `dion_group_options_t`: `lr`, `weight_decay`, `mu`, `beta1`, `beta2`,
`epsilon`, `rank_fraction`, `rank_multiple_of`, `power_iters`, `qr_method` (:rcqr, :qr, :cqr),
`cqr_warmup_steps`, `oversample`, `orthogonalizer` (:polar_express, :newton_schulz), `ortho_steps`,
`nesterov`, `adjust_lr` (:spectral_norm, :rms_norm, :none), `cautious_wd`, `fraction`, `ef_decay`,
`selection_scope` (:local, :global), `muon_beta2`, `flatten`, `momentum_dtype`, `q_dtype`, `variance_dtype`
(a type or :fp32/:bf16/:fp16/:unset), `matmul_precision` (:fp32, :tf32, :bf16).
"""
function group_options(algorithm; kwargs...)
    r = Ref{DionGroupOptions}()
    check(LibDion.dion_group_options_init(r, code(ALGORITHMS, algorithm, "algorithm")))
    for k in keys(kwargs)
        (hasfield(DionGroupOptions, k) && !(k in FIXED_FIELDS)) ||
            throw(ArgumentError("unknown group option $(k); expected one of " *
                                join(setdiff(fieldnames(DionGroupOptions), FIXED_FIELDS), ", ")))
    end
    return with(r[]; (k => option_value(k, v) for (k, v) in kwargs)...)
end

"""
    add_group!(opt, algorithm, params, grads = nothing; names = nothing, kwargs...) -> group number

Adds a group (`dion_add_group`): `algorithm` is `:dion`, `:dion2`, `:muon`, `:normuon`, `:nordion2`
(`:dion3`), `:adamw` or `:lion`; `params` a vector of Julia arrays or `Tensor`s; `grads` a vector of the same
length (arrays, or `nothing` for "no gradient yet"; ignored for `Tensor`s, which carry their own). `names`
(strings) appear in libdion's error messages. `kwargs` are group options (see `group_options`). Collective
over the optimizer's meshes. Returns the group's number (0-based); tensors are numbered across groups in the
order they are added.

# External links
- `dion_add_group`, `dion_group_options_t`, `dion_tensor_t` in `include/dion.h`.
"""
function add_group!(opt::Optimizer, algorithm, params::AbstractVector, grads=nothing; names=nothing, kwargs...)
    h = handle(opt)
    go = Ref(group_options(algorithm; kwargs...))
    grads === nothing || length(grads) == length(params) ||
        throw(ArgumentError("$(length(params)) params but $(length(grads)) grads"))
    names === nothing || length(names) == length(params) ||
        throw(ArgumentError("$(length(params)) params but $(length(names)) names"))
    tensors = Tensor[p isa Tensor ? p : Tensor(p, grads === nothing ? nothing : grads[i]; algorithm=algorithm)
                     for (i, p) in enumerate(params)]
    cnames = names === nothing ? String[] : String[string(n) for n in names]
    any(n -> occursin('\0', n), cnames) && throw(ArgumentError("tensor names must not contain NUL"))
    first_tensor = tensor_count(opt)
    gi = Ref{Int32}(-1)
    GC.@preserve cnames tensors begin
        descs = DionTensor[descriptor(t, isempty(cnames) ? Ptr{Cchar}(C_NULL) : Ptr{Cchar}(pointer(cnames[i])))
                           for (i, t) in enumerate(tensors)]
        check(LibDion.dion_add_group(h, go, descs, length(descs), gi), h)
    end
    for (i, t) in enumerate(tensors)
        opt.roots[Int32(first_tensor + i - 1)] = t.keep
    end
    return Int(gi[])
end

"""
    step!(opt; stream = nothing)

One optimizer step over every group (`dion_step`): reads the gradients, updates the parameters in place.
`stream` is a `Ptr`, `nothing` (default stream) or a CUDA.jl `CuStream`; it is ignored on the host backend.
Collective over the optimizer's meshes.

# External links
- `dion_step` in `include/dion.h`.
"""
function step!(opt::Optimizer; stream=nothing)
    h = handle(opt)
    check(LibDion.dion_step(h, stream_ptr(stream)), h)
    return opt
end

hparam_code(name) = code(HPARAMS, name, "hparam")

"""
    set_hparam!(opt, group, name, value)

Sets a hyperparameter of a group for the next steps (`dion_group_set_hparam`): `name` is `:lr`,
`:weight_decay`, `:mu`, `:beta1`, `:beta2`, `:epsilon`, `:ef_decay` or `:muon_beta2`.
"""
function set_hparam!(opt::Optimizer, group::Integer, name, value::Real)
    h = handle(opt)
    check(LibDion.dion_group_set_hparam(h, group, hparam_code(name), Float64(value)), h)
    return opt
end

"""`get_hparam(opt, group, name) -> Float64` (`dion_group_get_hparam`)."""
function get_hparam(opt::Optimizer, group::Integer, name)
    h = handle(opt)
    v = Ref{Cdouble}(0)
    check(LibDion.dion_group_get_hparam(h, group, hparam_code(name), v), h)
    return v[]
end

"""`get_step(opt, group) -> Int` — the group's step counter (`dion_group_get_step`)."""
function get_step(opt::Optimizer, group::Integer)
    h = handle(opt)
    s = Ref{Int64}(0)
    check(LibDion.dion_group_get_step(h, group, s), h)
    return Int(s[])
end

"""`set_step!(opt, group, step)` — restores a step counter from a checkpoint (`dion_group_set_step`)."""
function set_step!(opt::Optimizer, group::Integer, step::Integer)
    h = handle(opt)
    check(LibDion.dion_group_set_step(h, group, step), h)
    return opt
end

"""
    rebind!(opt, tensor, param, grad = nothing)

Points tensor `tensor` (0-based) at new buffers (`dion_tensor_rebind`): Julia arrays of the original shape,
or `Ptr`s. `grad = nothing`: the tensor is skipped until it gets a gradient again.
"""
function rebind!(opt::Optimizer, tensor::Integer, param, grad=nothing)
    h = handle(opt)
    p = param isa AbstractArray ? dense_pointer(param, "param") : raw_pointer(param)
    g = grad === nothing ? C_NULL : grad isa AbstractArray ? dense_pointer(grad, "grad") : raw_pointer(grad)
    GC.@preserve param grad begin
        check(LibDion.dion_tensor_rebind(h, tensor, p, g), h)
    end
    opt.roots[Int32(tensor)] = (param, grad)
    return opt
end

function count_of(f, opt::Optimizer)
    h = handle(opt)
    c = Ref{Int32}(0)
    check(f(h, c), h)
    return Int(c[])
end
"""Number of groups added so far."""
group_count(opt::Optimizer) = count_of(LibDion.dion_group_count, opt)
"""Number of tensors added so far."""
tensor_count(opt::Optimizer) = count_of(LibDion.dion_tensor_count, opt)
"""Number of state buffers."""
state_count(opt::Optimizer) = count_of(LibDion.dion_state_count, opt)

"""`skipped_steps(opt; stream) -> (skipped::Int, last_skipped::Bool)` (`dion_get_skipped_steps`)."""
function skipped_steps(opt::Optimizer; stream=nothing)
    h = handle(opt)
    s, l = Ref{Int64}(0), Ref{Int32}(0)
    check(LibDion.dion_get_skipped_steps(h, s, l, stream_ptr(stream)), h)
    return (Int(s[]), l[] != 0)
end

"""`async_error(opt) -> Int32` — the first error found by enqueued work, or `DION_SUCCESS`."""
function async_error(opt::Optimizer)
    h = handle(opt)
    s = Ref{Int32}(0)
    check(LibDion.dion_get_async_error(h, s), h)
    return s[]
end

"""`comm_bytes(opt, mesh) -> (last_step, total)`: bytes sent over `:replicate`, `:outer` or `:inner`."""
function comm_bytes(opt::Optimizer, mesh)
    h = handle(opt)
    a, b = Ref{UInt64}(0), Ref{UInt64}(0)
    check(LibDion.dion_get_comm_bytes(h, code(MESHES, mesh, "mesh"), a, b), h)
    return (Int(a[]), Int(b[]))
end

"""`memory_usage(opt) -> (state_bytes, workspace_bytes)`."""
function memory_usage(opt::Optimizer)
    h = handle(opt)
    a, b = Ref{UInt64}(0), Ref{UInt64}(0)
    check(LibDion.dion_get_memory_usage(h, a, b), h)
    return (Int(a[]), Int(b[]))
end

"""`sync_for_checkpoint!(opt; stream)` — averages decoupled states over the replicate mesh. Collective."""
function sync_for_checkpoint!(opt::Optimizer; stream=nothing)
    h = handle(opt)
    check(LibDion.dion_sync_for_checkpoint(h, stream_ptr(stream)), h)
    return opt
end

# ---------------------------------------------------------------------------------------------------------
# State (checkpoints)
# ---------------------------------------------------------------------------------------------------------
"""
    state_info(opt, index) -> NamedTuple

Describes state buffer `index` (0-based): `(; index, tensor, group, name, dtype, layout, global_shape,
local_shape, local_offset, local_bytes)`, shapes as tuples in C order (`dion_state_info`).
"""
function state_info(opt::Optimizer, index::Integer)
    h = handle(opt)
    r = Ref{DionStateInfo}()
    r[] = with(r[]; struct_size=sizeof(DionStateInfo))
    check(LibDion.dion_state_info(h, index, r), h)
    i = r[]
    n = Int(i.ndim)
    return (; index=Int(index), tensor=Int(i.tensor), group=Int(i.group), name=unsafe_string(i.name),
            dtype=i.dtype, layout=i.layout, global_shape=Tuple(Int.(i.global_shape[1:n])),
            local_shape=Tuple(Int.(i.local_shape[1:n])), local_offset=Tuple(Int.(i.local_offset[1:n])),
            local_bytes=Int(i.local_bytes))
end

"""`state_infos(opt)` — `state_info` of every state buffer, in libdion's (rank-symmetric) order."""
state_infos(opt::Optimizer) = [state_info(opt, i) for i in 0:state_count(opt)-1]

"""`find_state(opt, tensor, name) -> index` — e.g. `find_state(opt, 0, "momentum")` (`dion_state_find`)."""
function find_state(opt::Optimizer, tensor::Integer, name::AbstractString)
    h = handle(opt)
    r = Ref{Int32}(-1)
    check(LibDion.dion_state_find(h, tensor, String(name), r), h)
    return Int(r[])
end

"""
    read_state_bytes!(opt, index, dst; bytes = sizeof(dst), stream = nothing)

Copies state `index` into `dst` as raw bytes, in libdion's storage order (`dion_state_read`): a dense array
(host, or a device array on the CUDA backend), or a `Ptr` with `bytes` given.
"""
function read_state_bytes!(opt::Optimizer, index::Integer, dst;
                           bytes::Integer=(dst isa AbstractArray ? sizeof(dst) : -1), stream=nothing)
    h = handle(opt)
    bytes < 0 && throw(ArgumentError("read_state_bytes!: give `bytes` for a pointer"))
    p = dst isa AbstractArray ? dense_pointer(dst, "dst") : raw_pointer(dst)
    GC.@preserve dst check(LibDion.dion_state_read(h, index, p, UInt64(bytes), stream_ptr(stream)), h)
    return dst
end

"""`write_state_bytes!(opt, index, src; bytes, stream)` — the inverse of `read_state_bytes!` (`dion_state_write`)."""
function write_state_bytes!(opt::Optimizer, index::Integer, src;
                            bytes::Integer=(src isa AbstractArray ? sizeof(src) : -1), stream=nothing)
    h = handle(opt)
    bytes < 0 && throw(ArgumentError("write_state_bytes!: give `bytes` for a pointer"))
    p = src isa AbstractArray ? dense_pointer(src, "src") : raw_pointer(src)
    GC.@preserve src check(LibDion.dion_state_write(h, index, p, UInt64(bytes), stream_ptr(stream)), h)
    return src
end

"""
    read_state(opt, index) -> Array

State `index` as a Julia array indexed like the C tensor: `A[i, j]` is element (i-1, j-1) of the local shard,
whatever the storage order (row-major states are transposed on the way; column-major ones — the momentum of
a matrix added from a Julia `Matrix` — are read as they are). bf16 states come back as `UInt16` bits.
Host backend, or host-readable memory.
"""
function read_state(opt::Optimizer, index::Integer)
    info = state_info(opt, index)
    T = dtype_eltype(info.dtype)
    if info.layout == LibDion.DION_LAYOUT_COL_MAJOR || length(info.local_shape) <= 1
        A = Array{T}(undef, info.local_shape...)
        return read_state_bytes!(opt, index, A)
    end
    buf = Array{T}(undef, reverse(info.local_shape)...)
    read_state_bytes!(opt, index, buf)
    return permutedims(buf, ndims(buf):-1:1)
end

"""`write_state!(opt, index, A::AbstractArray)` with `A` indexed as `read_state` returns it."""
function write_state!(opt::Optimizer, index::Integer, A::AbstractArray)
    info = state_info(opt, index)
    size(A) == info.local_shape || throw(ArgumentError("state $(index) has local shape $(info.local_shape)"))
    T = dtype_eltype(info.dtype)
    buf = if info.layout == LibDion.DION_LAYOUT_COL_MAJOR || ndims(A) <= 1
        Array{T}(A)
    else
        Array{T}(permutedims(A, ndims(A):-1:1))
    end
    write_state_bytes!(opt, index, buf)
    return A
end

end # module Dion

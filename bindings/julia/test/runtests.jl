# SPDX-License-Identifier: MIT
#
# Tests of Dion.jl on libdion's host backend. Run from bindings/julia with
#     LIBDION_PATH=/path/to/build/libdion.so julia --project -e 'using Pkg; Pkg.test()'
# (without LIBDION_PATH, <repo>/build/libdion.so is used).
#
# NOTE: Julia is not installable where this package was written: this file has been parsed (tree-sitter-julia)
# but never run. See ../README.md for what was and was not executed.
using Test
using Random
using Dion
using Dion: LibDion
using Dion.LibDion: DionOptions, DionTensor, DionGroupOptions, DionStateInfo, DionNcclUniqueId, check, with

println("libdion ", Dion.library_version(), " loaded from ", Dion.library_path(), "; Julia ", VERSION)

const ALGOS = (:dion, :dion2, :muon, :normuon, :nordion2, :adamw, :lion)

# The DionError a call throws (or nothing).
caught(f) = try
    f()
    nothing
catch e
    e
end

relerr(a, b) = maximum(abs.(a .- b)) / max(1.0f-6, maximum(abs.(a)))

# A second optimizer through the raw LibDion interface, on a row-major (m, n) matrix stored as the Julia
# (n, m) array WT (the same bytes as C's row-major X), for the column-major comparison.
function raw_optimizer(algo, WT::Matrix{Float32}, GT::Matrix{Float32}, m, n; kwargs...)
    o = Ref{DionOptions}()
    check(LibDion.dion_options_init(o))
    o[] = with(o[]; seed=42)
    h = Ref{Ptr{Cvoid}}(C_NULL)
    check(LibDion.dion_create(h, o))
    t = Ref{DionTensor}()
    check(LibDion.dion_tensor_init(t))
    t[] = with(t[]; param=pointer(WT), grad=pointer(GT), param_dtype=LibDion.DION_DTYPE_FP32,
               layout=LibDion.DION_LAYOUT_ROW_MAJOR, ndim=2, shape=(m, n, 0, 0))
    go = Ref(Dion.group_options(algo; kwargs...))
    gi = Ref{Int32}(-1)
    GC.@preserve WT GT check(LibDion.dion_add_group(h[], go, t, 1, gi), h[])
    return h[]
end

function raw_momentum(h::Ptr{Cvoid}, m, n)
    idx = Ref{Int32}(-1)
    check(LibDion.dion_state_find(h, 0, "momentum", idx), h)
    buf = Matrix{Float32}(undef, n, m)
    check(LibDion.dion_state_read(h, idx[], buf, sizeof(buf), C_NULL), h)
    return permutedims(buf)
end

@testset "Dion.jl" begin

@testset "layouts" begin
    @test sizeof(DionOptions) == LibDion.dion_options_sizeof()
    @test sizeof(DionTensor) == LibDion.dion_tensor_sizeof()
    @test sizeof(DionGroupOptions) == LibDion.dion_group_options_sizeof()
    @test sizeof(DionNcclUniqueId) == LibDion.DION_NCCL_UNIQUE_ID_BYTES
    @test sizeof(DionStateInfo) == 144   # dion.h has no dion_state_info_sizeof(); LP64 size
    @test LibDion.dion_version() ÷ 10000 == LibDion.DION_VERSION_MAJOR

    o = Ref{DionOptions}()
    @test LibDion.dion_options_init(o) == LibDion.DION_SUCCESS
    @test o[].struct_size == sizeof(DionOptions) && o[].abi_version == LibDion.DION_ABI_VERSION
    @test o[].backend == LibDion.DION_BACKEND_HOST && o[].device == 0 && o[].seed == 0
    @test o[].replicate_grad_sync == 1 && o[].skip_nonfinite == 1 && o[].reserved0 == 0
    @test o[].replicate_comm == C_NULL && o[].outer_comm == C_NULL && o[].inner_comm == C_NULL

    t = Ref{DionTensor}()
    @test LibDion.dion_tensor_init(t) == LibDion.DION_SUCCESS
    @test t[].struct_size == sizeof(DionTensor) && t[].name == C_NULL && t[].grad == C_NULL
    @test t[].grad_dtype == LibDion.DION_DTYPE_UNSET && t[].layout == LibDion.DION_LAYOUT_ROW_MAJOR
    @test t[].outer_shard_dim == -1 && t[].inner_shard_dim == -1

    g = Dion.group_options(:normuon)
    @test g.struct_size == sizeof(DionGroupOptions) && g.algorithm == LibDion.DION_ALGO_NORMUON
    @test (g.lr, g.weight_decay, g.mu, g.beta1, g.beta2, g.epsilon) == (0.01, 0.01, 0.95, 0.9, 0.95, 1e-8)
    @test (g.rank_fraction, g.rank_multiple_of, g.power_iters) == (1.0, 1, 1)
    @test (g.qr_method, g.cqr_warmup_steps, g.oversample) == (LibDion.DION_QR_RCQR, 150, 1.25)
    @test (g.orthogonalizer, g.ortho_steps, g.nesterov, g.adjust_lr, g.cautious_wd) ==
          (LibDion.DION_ORTHO_POLAR_EXPRESS, 5, 0, LibDion.DION_ADJUST_LR_SPECTRAL_NORM, 0)
    @test (g.fraction, g.ef_decay, g.selection_scope, g.muon_beta2, g.flatten) ==
          (0.25, 0.95, LibDion.DION_SELECTION_LOCAL, 0.95, 0)
    @test (g.momentum_dtype, g.q_dtype, g.variance_dtype) == (-1, -1, -1)
    @test g.matmul_precision == LibDion.DION_MATMUL_FP32

    g2 = Dion.group_options(:dion; lr=0.5, nesterov=true, qr_method=:cqr, momentum_dtype=Float32)
    @test g2.lr == 0.5 && g2.nesterov == 1 && g2.qr_method == LibDion.DION_QR_CQR && g2.momentum_dtype == 0
    @test_throws ArgumentError Dion.group_options(:dion; bogus=1)
    @test_throws ArgumentError Dion.group_options(:dion; struct_size=3)
end

@testset "errors" begin
    e = caught(() -> Optimizer(backend=7))
    @test e isa DionError
    @test e.code == LibDion.DION_ERROR_INVALID_ARGUMENT
    @test occursin("backend", e.msg)
    @test occursin("invalid argument", unsafe_string(LibDion.dion_status_string(LibDion.DION_ERROR_INVALID_ARGUMENT)))

    Optimizer() do opt
        W, G = zeros(Float32, 8, 6), zeros(Float32, 8, 6)
        b, gb = zeros(Float32, 8), zeros(Float32, 8)
        e = caught(() -> add_group!(opt, :muon, [W], [G]; lr=-1))
        @test e isa DionError
        @test e.code == LibDion.DION_ERROR_INVALID_ARGUMENT
        @test occursin("lr", e.msg)
        @test group_count(opt) == 0

        e = caught(() -> add_group!(opt, :muon, [W, b], [G, gb]; names=["W", "bias_one"]))
        @test e isa DionError && occursin("bias_one", e.msg)

        g = add_group!(opt, :muon, [W], [G]; names=["W"])
        @test g == 0
        e = caught(() -> set_hparam!(opt, g, :lr, -0.5))
        @test e isa DionError && e.code == LibDion.DION_ERROR_INVALID_ARGUMENT && occursin("lr", e.msg)
        e = caught(() -> set_hparam!(opt, 7, :lr, 0.1))
        @test e isa DionError && e.code == LibDion.DION_ERROR_INVALID_USAGE
        @test_throws ArgumentError set_hparam!(opt, g, :learning_rate, 0.1)
        @test_throws ArgumentError add_group!(opt, :nope, [W], [G])
        @test_throws ArgumentError add_group!(opt, :muon, [zeros(Float32, 2, 3, 4)])
        @test_throws ArgumentError add_group!(opt, :muon, [view(W, 1:2:8, :)])   # strided: refused, not copied
        @test_throws ArgumentError add_group!(opt, :muon, [W], [zeros(Float32, 6, 8)])
        @test_throws ArgumentError add_group!(opt, :adamw, [zeros(Float64, 4)])    # no fp64 in libdion
        e = caught(() -> find_state(opt, 0, "Q"))
        @test e isa DionError && e.code == LibDion.DION_ERROR_INVALID_ARGUMENT
    end
end

@testset "column-major == row-major on the transpose: $(algo) $(shape)" for algo in ALGOS, shape in ((24, 40), (40, 24))
    m, n = shape
    Random.seed!(1000m + n)
    W = randn(Float32, m, n) ./ sqrt(Float32(n))
    G = zeros(Float32, m, n)
    WT, GT = permutedims(W), zeros(Float32, n, m)
    kw = algo === :dion ? (; lr=0.02, weight_decay=0.1, rank_fraction=0.5) : (; lr=0.02, weight_decay=0.1)
    h = raw_optimizer(algo, WT, GT, m, n; kw...)
    try
        Optimizer(seed=42) do opt
            add_group!(opt, algo, [W], [G]; names=["W"], kw...)
            im = find_state(opt, 0, "momentum")
            info = state_info(opt, im)
            @test info.name == "momentum" && info.layout == LibDion.DION_LAYOUT_COL_MAJOR
            @test info.global_shape == (m, n) && info.local_bytes == 4m * n
            for k in 1:5
                G .= randn(Float32, m, n)
                GT .= permutedims(G)
                step!(opt)
                check(LibDion.dion_step(h, C_NULL), h)
                @test relerr(W, permutedims(WT)) <= 1e-5
                @test relerr(read_state(opt, im), raw_momentum(h, m, n)) <= 1e-5
            end
        end
    finally
        LibDion.dion_destroy(h)
    end
end

@testset "raw pointers (Tensor) == arrays" begin
    Random.seed!(3)
    m, n = 16, 12
    W1 = randn(Float32, m, n); W2 = copy(W1)
    G1 = zeros(Float32, m, n); G2 = zeros(Float32, m, n)
    Optimizer() do a
        Optimizer() do b
            add_group!(a, :muon, [W1], [G1])
            add_group!(b, :muon, [Tensor(pointer(W2), pointer(G2), (m, n); layout=:col_major, keep=(W2, G2))])
            for k in 1:3
                G1 .= randn(Float32, m, n)
                G2 .= G1
                step!(a)
                step!(b; stream=C_NULL)
                @test W1 == W2
            end
        end
    end
    @test_throws ArgumentError Tensor(Ptr{Cvoid}(C_NULL), nothing, (2, 2))   # no dtype for a void pointer
end

@testset "training: MLP teacher-student, Muon + AdamW" begin
    Random.seed!(7)
    nin, nhid, nout, batch = 16, 32, 8, 64
    T1, T2 = 2 .* randn(Float32, nhid, nin) ./ sqrt(Float32(nin)), randn(Float32, nout, nhid) ./ sqrt(Float32(nhid))
    teacher(X) = T2 * tanh.(T1 * X)
    W1, b1 = randn(Float32, nhid, nin) ./ sqrt(Float32(nin)), zeros(Float32, nhid)
    W2, b2 = randn(Float32, nout, nhid) ./ sqrt(Float32(nhid)), zeros(Float32, nout)
    gW1, gb1, gW2, gb2 = zero(W1), zero(b1), zero(W2), zero(b2)
    Xe = randn(Float32, nin, 512)
    Ye = teacher(Xe)
    loss(X, Y) = sum(abs2, W2 * tanh.(W1 * X .+ b1) .+ b2 .- Y) / length(Y)
    l0 = loss(Xe, Ye)
    Optimizer() do opt
        gm = add_group!(opt, :muon, [W1, W2], [gW1, gW2]; lr=0.02, weight_decay=0)
        gv = add_group!(opt, :adamw, [b1, b2], [gb1, gb2]; lr=3e-3, weight_decay=0)
        @test (gm, gv) == (0, 1)
        @test tensor_count(opt) == 4
        for step in 1:300
            X = randn(Float32, nin, batch)
            H = tanh.(W1 * X .+ b1)
            dY = 2 .* (W2 * H .+ b2 .- teacher(X)) ./ (nout * batch)
            gW2 .= dY * H'                       # in place: the optimizer holds these arrays' addresses
            gb2 .= vec(sum(dY; dims=2))
            dZ = (W2' * dY) .* (1 .- H .^ 2)
            gW1 .= dZ * X'
            gb1 .= vec(sum(dZ; dims=2))
            step!(opt)
        end
        @test get_step(opt, gm) == 300
    end
    l1 = loss(Xe, Ye)
    println("  training: loss ", l0, " -> ", l1)
    @test l1 < 0.25 * l0
end

@testset "lifecycle" begin
    opt = Optimizer()
    @test occursin("0 groups", sprint(show, opt))
    destroy!(opt)
    destroy!(opt)                                      # idempotent
    @test opt.handle == C_NULL
    @test occursin("destroyed", sprint(show, opt))
    @test_throws ArgumentError step!(opt)
    @test Optimizer(opt -> 42) == 42                   # do-block form returns f's value
    # Finalizer as safety net: forgotten optimizers are destroyed by the GC without error.
    for i in 1:10
        let o = Optimizer()
            add_group!(o, :adamw, [zeros(Float32, 4)], [ones(Float32, 4)])
        end
    end
    GC.gc(true)
    # The optimizer keeps the arrays it points into alive.
    opt = Optimizer()
    add_group!(opt, :adamw, [ones(Float32, 1000)], [ones(Float32, 1000)]; lr=0.1, weight_decay=0)
    GC.gc(true)
    step!(opt)
    p = opt.roots[Int32(0)][1]
    @test all(p .< 1)
    destroy!(opt)
end

@testset "hparams, steps, states, counters" begin
    Random.seed!(11)
    m, n = 16, 12
    W, G = randn(Float32, m, n), zeros(Float32, m, n)
    b, gb = zeros(Float32, m), fill(0.5f0, m)
    Optimizer() do opt
        g0 = add_group!(opt, :muon, [W], [G]; names=["W"])
        g1 = add_group!(opt, :adamw, [b], [gb]; names=["b"])
        @test (group_count(opt), tensor_count(opt)) == (2, 2)
        set_hparam!(opt, g1, :beta2, 0.99)
        @test get_hparam(opt, g1, :beta2) == 0.99
        G .= randn(Float32, m, n)
        step!(opt)
        @test get_step(opt, g0) == 1
        @test all(b .< 0)
        W0 = copy(W)
        G[3, 4] = NaN32
        step!(opt)
        @test skipped_steps(opt) == (1, true)
        @test W == W0
        G2 = randn(Float32, m, n)
        rebind!(opt, 0, W, G2)
        step!(opt)
        @test W != W0
        @test skipped_steps(opt) == (1, false)
        set_step!(opt, g1, 100)
        @test get_step(opt, g1) == 100

        infos = state_infos(opt)
        @test length(infos) == state_count(opt) >= 3
        @test any(i -> i.tensor == 1 && i.name == "variance", infos)
        im = find_state(opt, 0, "momentum")
        M = read_state(opt, im)
        @test size(M) == (m, n) && any(!iszero, M)
        M[1, 2] = 123
        write_state!(opt, im, M)
        @test read_state(opt, im) == M
        iv = find_state(opt, 1, "variance")
        v = read_state(opt, iv)
        @test size(v) == (m,) && all(v .> 0)
        raw = zeros(Float32, m)
        read_state_bytes!(opt, iv, raw)
        @test raw == v
        @test_throws DionError read_state_bytes!(opt, im, zeros(Float32, 4))   # short buffer

        @test memory_usage(opt)[1] >= 4 * (m * n + 2m)
        @test comm_bytes(opt, :replicate) == (0, 0)
        @test async_error(opt) == LibDion.DION_SUCCESS
        sync_for_checkpoint!(opt)
    end
end

end # @testset "Dion.jl"

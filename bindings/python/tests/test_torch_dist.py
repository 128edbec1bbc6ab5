# SPDX-License-Identifier: MIT
"""libdion.torch's multi-rank plumbing in one process: meshes, DTensor -> dion_tensor_t shard fields, the
placements of the states of DTensor parameters, and the error paths. DTensors are the stand-ins of
dtensor_fakes.py (Debian's torch has none); meshes of one rank run the whole optimizer path (registration,
rebinding, step, state_dict/load_state_dict). Several ranks: test_torch_mpi.py (MPI) and tests/torchrun (NCCL)."""
import sys

import pytest

torch = pytest.importorskip("torch", reason="libdion.torch tests need PyTorch (apt-get install python3-torch)")

import libdion  # noqa: E402
import libdion.torch as lt  # noqa: E402
from libdion import _torch_dist as D  # noqa: E402
from dtensor_fakes import (FakeDTensor, FakeGroup, FakeMesh, Partial, Replicate, Shard, _StridedShard,  # noqa: E402
                           chunk_of, distribute, grad_of)
from torch_util import param, randn_like  # noqa: E402


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


def spec(role, ranks, rank=0):
    g = FakeGroup(ranks)
    return D.MeshSpec(role, role + "_mesh", g, "torch", g, len(ranks), rank, tuple(ranks))


def meshes(**kw):
    out = {r: None for r in D.ROLES}
    out.update(kw)
    return out


def fake(global_shape, mesh, placements, dtype=torch.float32):
    t = torch.arange(int(torch.tensor(global_shape).prod()), dtype=torch.float64).reshape(global_shape)
    return distribute(t.to(dtype), mesh, placements)


# --------------------------------------------------------------------------
# DTensor -> shard fields
# --------------------------------------------------------------------------

@pytest.mark.parametrize("coord,off,ext", [(0, 0, 3), (2, 6, 3), (3, 9, 1)])
def test_fsdp_row_chunks(coord, off, ext):
    """FSDP2's Shard(0) over 4 ranks of 10 rows: ceil(10/4) = 3 per rank, the last one short."""
    outer = spec("outer", [0, 1, 2, 3], coord)
    mesh = FakeMesh([(outer.group, 4, coord)])
    p = fake((10, 6), mesh, [Shard(0)])
    sh = D.describe_dtensor(p, meshes(outer=outer), "w")
    assert sh.fields() == dict(outer_shard_dim=0, outer_offset=off, outer_extent=ext, inner_shard_dim=-1,
                               inner_offset=0, inner_extent=0)
    assert sh.global_shape == (10, 6) and sh.local_shape == (ext, 6) and sh.roles == {0: "outer"}


def test_an_empty_trailing_shard():
    """5 rows over 4 ranks: 2, 2, 1, 0 (the last rank's shard is empty, at offset 5)."""
    outer = spec("outer", [0, 1, 2, 3], 3)
    p = fake((5, 4), FakeMesh([(outer.group, 4, 3)]), [Shard(0)])
    assert D.describe_dtensor(p, meshes(outer=outer), "w").fields()["outer_offset"] == 5
    assert D.describe_dtensor(p, meshes(outer=outer), "w").fields()["outer_extent"] == 0
    assert D.local_of(p).shape == (0, 4)


def test_fsdp_times_tp_on_a_2d_mesh():
    """(dp, tp) = (2, 2): FSDP shards dim 1 (outer), TP shards dim 0 (inner); the mesh dims are matched to the
    optimizer's meshes by their groups' ranks, not by position."""
    rank = 3                                   # coordinate (1, 1) of [[0, 1], [2, 3]]
    outer = spec("outer", [1, 3], 1)           # the dp group of rank 3
    inner = spec("inner", [2, 3], 1)           # the tp group of rank 3
    mesh = FakeMesh([(FakeGroup([1, 3]), 2, 1), (FakeGroup([2, 3]), 2, 1)], names=("dp", "tp"))
    p = fake((6, 9), mesh, [Shard(1), Shard(0)])
    sh = D.describe_dtensor(p, meshes(outer=outer, inner=inner), "w")
    assert sh.fields() == dict(outer_shard_dim=1, outer_offset=5, outer_extent=4, inner_shard_dim=0,
                               inner_offset=3, inner_extent=3)
    assert sh.roles == {0: "outer", 1: "inner"} and rank == 3


def test_replicate_placements_and_one_rank_dims_need_nothing():
    rep = spec("replicate", [0, 1])
    mesh = FakeMesh([(rep.group, 2, 0), (FakeGroup([0]), 1, 0)])
    p = fake((4, 4), mesh, [Replicate(), Shard(0)])
    sh = D.describe_dtensor(p, meshes(replicate=rep), "w")
    assert sh.dims == {} and sh.fields()["outer_shard_dim"] == -1 and sh.fields()["inner_shard_dim"] == -1


def test_strided_shard_is_rejected_with_the_fix():
    outer = spec("outer", [0, 1])
    mesh = FakeMesh([(outer.group, 2, 0)])
    p = FakeDTensor(torch.zeros(2, 4), mesh, [_StridedShard(0, 2)], (4, 4))
    with pytest.raises(NotImplementedError, match=r"w: placement _StridedShard\(dim=0, sf=2\) on mesh dim 0 is a "
                                                  r"_StridedShard .*shard_placement_fn"):
        D.describe_dtensor(p, meshes(outer=outer), "w")


def test_a_strided_shard_over_one_rank_is_whole():
    inner = spec("inner", [0, 1])
    mesh = FakeMesh([(FakeGroup([0]), 1, 0), (inner.group, 2, 1)])
    p = FakeDTensor(torch.zeros(4, 4), mesh, [_StridedShard(0, 2), Shard(0)], (8, 4))
    sh = D.describe_dtensor(p, meshes(inner=inner), "w")
    assert sh.fields()["inner_shard_dim"] == 0 and sh.fields()["inner_offset"] == 4
    assert D.state_kinds(sh, "momentum", _state((8, 4), (4, 4), (4, 0))) == sh.kinds


def test_partial_is_rejected():
    mesh = FakeMesh([(FakeGroup([0, 1]), 2, 0)])
    p = FakeDTensor(torch.zeros(4, 4), mesh, [Partial()], (4, 4))
    with pytest.raises(ValueError, match=r"placement Partial\(sum\) on mesh dim 0 is Partial"):
        D.describe_dtensor(p, meshes(), "w")


def test_a_shard_over_a_mesh_the_optimizer_does_not_have():
    outer = spec("outer", [0, 1])
    mesh = FakeMesh([(FakeGroup([0, 2]), 2, 0)], names=("tp",))
    p = fake((4, 4), mesh, [Shard(1)])
    with pytest.raises(ValueError, match=r"w is sharded \(Shard\(dim=1\)\) over mesh dim 0 \(2 ranks, ranks \[0, 2\]\), "
                                         r"which is none of the optimizer's meshes \(outer_mesh \(2 ranks, ranks "
                                         r"\[0, 1\]\)\): pass that mesh \(e.g. mesh\['tp'\]\)"):
        D.describe_dtensor(p, meshes(outer=outer), "w")


def test_a_shard_over_the_replicate_mesh():
    rep = spec("replicate", [0, 1])
    p = fake((4, 4), FakeMesh([(rep.group, 2, 0)]), [Shard(0)])
    with pytest.raises(ValueError, match="which is the optimizer's replicate mesh"):
        D.describe_dtensor(p, meshes(replicate=rep), "w")


def test_one_dim_over_two_meshes():
    outer, inner = spec("outer", [0, 1]), spec("inner", [0, 2])
    mesh = FakeMesh([(outer.group, 2, 0), (inner.group, 2, 0)])
    p = FakeDTensor(torch.zeros(2, 4), mesh, [Shard(0), Shard(0)], (8, 4))
    with pytest.raises(NotImplementedError, match="tensor dim 0 is sharded over two mesh dims"):
        D.describe_dtensor(p, meshes(outer=outer, inner=inner), "w")


def test_uneven_custom_shards_are_rejected():
    """A local shard that is not torch's chunk (here 2 of 10 rows on rank 0 of 2) cannot be described."""
    outer = spec("outer", [0, 1])
    p = FakeDTensor(torch.zeros(2, 4), FakeMesh([(outer.group, 2, 0)]), [Shard(0)], (10, 4))
    with pytest.raises(NotImplementedError, match=r"local shard has shape \(2, 4\) but torch's chunking of the global "
                                                  r"shape \(10, 4\) .* gives \(5, 4\) at offset \(0, 0\)"):
        D.describe_dtensor(p, meshes(outer=outer), "w")


def test_chunk():
    assert [D.chunk(10, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert [D.chunk(5, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert [D.chunk(8, 2, i) for i in range(2)] == [(0, 4), (4, 4)]


# --------------------------------------------------------------------------
# States of DTensor parameters
# --------------------------------------------------------------------------

def _state(global_shape, local_shape, local_offset):
    return dict(global_shape=tuple(global_shape), local_shape=tuple(local_shape), local_offset=tuple(local_offset))


def test_state_placements_of_dion():
    """momentum: the parameter's placements; Q (b x r): Shard(0) on the outer mesh dim (its rows are B's columns,
    the outer-sharded dim), Replicate on the inner one (libdion keeps r whole)."""
    outer, inner = spec("outer", [1, 3], 1), spec("inner", [2, 3], 1)
    mesh = FakeMesh([(outer.group, 2, 1), (inner.group, 2, 1)])
    sh = D.describe_dtensor(fake((6, 9), mesh, [Shard(1), Shard(0)]), meshes(outer=outer, inner=inner), "w")
    assert D.state_kinds(sh, "momentum", _state((6, 9), (3, 4), (3, 5))) == sh.kinds
    assert D.placements_of(sh, sh.kinds) is sh.placements
    q = D.state_kinds(sh, "Q", _state((9, 6), (4, 6), (5, 0)))
    assert q == (("shard", 0), ("replicate", None))
    assert D.placements_of(sh, q) == (Shard(0), Replicate())
    with pytest.raises(libdion.DionInvalidUsage, match=r"state 'Q' \(global \(9, 6\), local \(5, 6\) at \(0, 0\)\) .* "
                                                       "cannot be described as a DTensor"):
        D.state_kinds(sh, "Q", _state((9, 6), (5, 6), (0, 0)))


def test_state_placements_of_q_under_tp_only():
    inner = spec("inner", [0, 1], 1)
    sh = D.describe_dtensor(fake((8, 6), FakeMesh([(inner.group, 2, 1)]), [Shard(1)]), meshes(inner=inner), "w")
    assert D.state_kinds(sh, "Q", _state((8, 4), (8, 4), (0, 0))) == (("replicate", None),)


def test_state_placements_of_row_states():
    """variance_neuron (shape[:-1] + (1,)) keeps the row sharding and is whole along the collapsed last dim."""
    outer = spec("outer", [0, 1], 1)
    mesh = FakeMesh([(outer.group, 2, 1)])
    rows = D.describe_dtensor(fake((6, 4), mesh, [Shard(0)]), meshes(outer=outer), "w")
    assert D.state_kinds(rows, "variance_neuron", _state((6, 1), (3, 1), (3, 0))) == (("shard", 0),)
    cols = D.describe_dtensor(fake((6, 4), mesh, [Shard(1)]), meshes(outer=outer), "w")
    assert D.state_kinds(cols, "variance_neuron", _state((6, 1), (6, 1), (0, 0))) == (("replicate", None),)
    flat = D.describe_dtensor(fake((6, 2, 2), mesh, [Shard(0)]), meshes(outer=outer), "w")
    assert D.state_kinds(flat, "variance_neuron", _state((6, 1), (3, 1), (3, 0))) == (("shard", 0),)


def test_states_become_dtensors_of_the_parameters_mesh():
    outer = spec("outer", [0, 1], 1)
    mesh = FakeMesh([(outer.group, 2, 1)])
    sh = D.describe_dtensor(fake((6, 9), mesh, [Shard(1)]), meshes(outer=outer), "w")
    local = torch.randn(4, 6)
    q = D.to_dtensor(sh, local, D.state_kinds(sh, "Q", _state((9, 6), (4, 6), (5, 0))), (9, 6))
    assert isinstance(q, FakeDTensor) and q.shape == (9, 6) and q._local_tensor is local
    assert q.placements == (Shard(0),) and q.device_mesh is mesh


# --------------------------------------------------------------------------
# Meshes
# --------------------------------------------------------------------------

class OneRank:
    def size(self):
        return 1


def test_mesh_spec_of_none_and_single_rank_meshes():
    assert D.mesh_spec(None, "outer", "x", "w") is None
    assert D.mesh_spec(OneRank(), "outer", "x", "w") is None
    assert D.mesh_spec(FakeMesh([(FakeGroup([0]), 1, 0)]), "outer", "x", "w") is None


def test_mesh_spec_of_a_1d_device_mesh():
    g = FakeGroup([4, 5, 6])
    m = D.mesh_spec(FakeMesh([(g, 3, 2)]), "outer", "outer_shard_mesh", "w")
    assert (m.kind, m.group, m.size, m.rank, m.ranks) == ("torch", g, 3, 2, (4, 5, 6))
    assert m.describe() == "outer_shard_mesh (3 ranks, ranks [4, 5, 6])"


def test_mesh_spec_of_a_2d_device_mesh_without_flatten():
    with pytest.raises(ValueError, match=r"x is a 2-D DeviceMesh; pass a 1-D mesh"):
        D.mesh_spec(FakeMesh([(FakeGroup([0, 1]), 2, 0), (FakeGroup([0, 2]), 2, 0)]), "replicate", "x", "w")


def test_mesh_types():
    with pytest.raises(TypeError, match="replicate_mesh must be None, a torch DeviceMesh, a ProcessGroup or an "
                                        "mpi4py communicator, got str"):
        lt.Dion([param((4, 4), torch.Generator())], replicate_mesh="dp")

    class Two:
        def size(self):
            return 2

    with pytest.raises(TypeError, match="distributed_mesh has 2 ranks but is neither a torch DeviceMesh, a "
                                        "ProcessGroup nor an mpi4py communicator"):
        lt.Muon([param((4, 4), torch.Generator())], distributed_mesh=Two())


def test_two_meshes_over_the_same_ranks():
    with pytest.raises(ValueError, match="replicate_mesh and outer_mesh are the same group of ranks"):
        D.check_distinct(dict(replicate=D.MeshSpec("replicate", "replicate_mesh", None, "torch", FakeGroup([0, 1]),
                                                   2, 0, (0, 1)), outer=spec("outer", [0, 1])), "w")


def test_cpu_meshes_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(NotImplementedError, match=r"w: CPU parameters on a multi-rank mesh use libdion's host backend, "
                                                  r"which communicates over MPI, and mpi4py is not importable .*"
                                                  r"apt-get install python3-mpi4py"):
        D._mpi_comm(spec("outer", [0, 1]), "w")


def test_cuda_parameters_cannot_use_an_mpi_communicator():
    m = D.MeshSpec("outer", "outer_shard_mesh", object(), "mpi", object(), 2, 0, (0, 1))
    with pytest.raises(ValueError, match="outer_shard_mesh is an mpi4py communicator, but the parameters are CUDA "
                                         "tensors: libdion's CUDA backend communicates over NCCL"):
        D._nccl_comm(m, 0, "w")


def test_a_torch_group_needs_torch_distributed_for_nccl():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(RuntimeError, match="outer_mesh has 2 ranks but torch.distributed is not initialized"):
        D._nccl_comm(spec("outer", [0, 1]), 0, "w")


def test_a_gloo_group_of_one_rank(tmp_path, gen, monkeypatch):
    """A real ProcessGroup (gloo, world size 1): accepted. A megabatch mesh of one rank is no mesh; Dion keeps
    it (MPI_COMM_SELF on CPU) so that shard dims over it set the orientation, and drops it without mpi4py."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        pg = dist.new_group([0])
        assert D.mesh_spec(dist.group.WORLD, "replicate", "replicate_mesh", "w") is None
        assert D.group_ranks(pg) == (0,)
        p = param((8, 4), gen)
        opt = lt.Dion([p], replicate_mesh=dist.group.WORLD, outer_shard_mesh=pg)
        mpi = D.mpi_importable()
        assert opt.meshes == {"replicate": "replicate_mesh" if mpi else None, "outer": "outer_shard_mesh" if mpi else None,
                              "inner": None}
        p.grad = randn_like(p, gen)
        opt.step()
        opt.close()
        assert D.COMMS.live() == 0
        assert lt.Muon([param((8, 4), gen)], distributed_mesh=pg).meshes == dict(replicate=None, outer=None, inner=None)
        monkeypatch.setitem(sys.modules, "mpi4py", None)   # no MPI_COMM_SELF: Dion's meshes of one rank are dropped
        opt = lt.Dion([param((8, 4), gen)], replicate_mesh=dist.group.WORLD, outer_shard_mesh=pg)
        assert opt.meshes == dict(replicate=None, outer=None, inner=None)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------
# The optimizer on DTensor parameters of one rank
# --------------------------------------------------------------------------

def _one_rank_mesh():
    return FakeMesh([(FakeGroup([0]), 1, 0)])


@pytest.mark.parametrize("cls", [lt.Dion, lt.Muon, lt.NorMuon, lt.Dion2, lt.NorDion2])
def test_dtensor_parameters_equal_plain_ones(gen, cls):
    """DTensor parameters (all mesh dims of one rank) run through their local shards: same updates and states
    as plain tensors, bit for bit; state_dict() gives DTensors of the parameter's mesh."""
    mesh = _one_rank_mesh()
    w0, b0 = torch.randn(12, 8, generator=gen), torch.randn(8, generator=gen)
    plain = [torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())]
    dts = [distribute(w0, mesh, [Shard(0)]), distribute(b0, mesh, [Replicate()])]
    opts = [cls([dict(params=[ps[0]]), dict(params=[ps[1]], algorithm="lion")], lr=0.05, seed=3)
            for ps in (plain, dts)]
    for _ in range(3):
        gw, gb = torch.randn(12, 8, generator=gen), torch.randn(8, generator=gen)
        plain[0].grad, plain[1].grad = gw.clone(), gb.clone()
        dts[0].grad, dts[1].grad = grad_of(dts[0], gw), grad_of(dts[1], gb)
        for o in opts:
            o.step()
    assert torch.equal(dts[0]._local_tensor, plain[0].detach()) and torch.equal(dts[1]._local_tensor, plain[1].detach())
    sd_plain, sd_dt = opts[0].state_dict(), opts[1].state_dict()
    for i in (0, 1):
        for name, v in sd_plain["state"][i].items():
            got = sd_dt["state"][i][name]
            assert isinstance(got, FakeDTensor) and got.shape == v.shape
            assert torch.equal(got._local_tensor, v)
    assert sd_dt["state"][0]["momentum"].placements == (Shard(0),)
    assert sd_dt["state"][1]["momentum"].placements == (Replicate(),)


def test_dtensor_checkpoint_round_trip(gen):
    """state_dict() -> new optimizer -> load_state_dict() (DTensor states, local-shaped or global-shaped plain
    tensors) -> continue equals never stopping."""
    mesh = _one_rank_mesh()
    w0 = torch.randn(10, 6, generator=gen)
    grads = [torch.randn(10, 6, generator=gen) for _ in range(5)]

    def run(p, opt, gs):
        for g in gs:
            p.grad = grad_of(p, g)
            opt.step()

    p = distribute(w0, mesh, [Shard(1)])
    opt = lt.Dion([p], rank_fraction=0.5, seed=7)
    run(p, opt, grads)
    want = p._local_tensor.clone()

    for form in ("dtensor", "plain"):
        p1 = distribute(w0, mesh, [Shard(1)])
        opt1 = lt.Dion([p1], rank_fraction=0.5, seed=7)
        run(p1, opt1, grads[:2])
        sd = opt1.state_dict()
        if form == "plain":
            sd["state"][0] = {k: v._local_tensor.clone() for k, v in sd["state"][0].items()}
        p2 = distribute(p1._local_tensor, mesh, [Shard(1)])
        opt2 = lt.Dion([p2], rank_fraction=0.5, seed=7)   # the seed keys the sketches
        opt2.load_state_dict(sd)
        assert isinstance(opt2.state[p2]["Q"], FakeDTensor)
        run(p2, opt2, grads[2:])
        assert torch.equal(p2._local_tensor, want), form


def test_dtensor_gradient_checks(gen):
    mesh = _one_rank_mesh()
    p = distribute(torch.randn(6, 4, generator=gen), mesh, [Shard(0)])
    opt = lt.Muon([p])
    p.grad = FakeDTensor(torch.zeros(3, 4), mesh, [Shard(0)], (6, 4))
    with pytest.raises(ValueError, match=r"the gradient's local shard \(cpu, torch.float32, shape \(3, 4\)\) does not "
                                         r"match the parameter's \(\(6, 4\)\)"):
        opt.step()
    p.grad = FakeDTensor(torch.zeros(4, 6).t(), mesh, [Shard(0)], (6, 4))
    with pytest.raises(ValueError, match="the gradient is not contiguous"):
        opt.step()
    p.grad = FakeDTensor(torch.zeros(6, 4), mesh, [Partial()], (6, 4))
    with pytest.raises(ValueError, match=r"the gradient's placements \(Partial\(sum\),\) differ from the "
                                         r"parameter's \(Shard\(dim=0\),\)"):
        opt.step()


def test_a_non_contiguous_local_shard_is_rejected(gen):
    p = FakeDTensor(torch.zeros(4, 6).t(), _one_rank_mesh(), [Shard(0)], (6, 4), requires_grad=True)
    with pytest.raises(ValueError, match=r"\(DTensor, global shape \(6, 4\), float32\): its local shard is not "
                                         r"contiguous"):
        lt.Muon([p])


def test_a_dtensor_sharded_over_no_optimizer_mesh_fails_at_construction(gen):
    mesh = FakeMesh([(FakeGroup([0, 1]), 2, 0)], names=("dp",))
    p = distribute(torch.randn(8, 4, generator=gen), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(DTensor, global shape \(8, 4\), "
                                         r"float32\) is sharded .* none of the optimizer's meshes \(none: all are None "
                                         r"or 1 rank\): pass that mesh \(e.g. mesh\['dp'\]\)"):
        lt.Dion([p])


def test_the_sharding_of_a_parameter_is_fixed(gen):
    mesh = _one_rank_mesh()
    p = distribute(torch.randn(8, 4, generator=gen), mesh, [Shard(0)])
    opt = lt.Muon([p])
    p._local_tensor = p._local_tensor.clone()   # new storage (FSDP2 may do this): checked like a new parameter
    p.placements = (Shard(1),)
    p.grad = grad_of(p, torch.randn(8, 4, generator=gen))
    with pytest.raises(ValueError, match="the parameter's sharding changed"):
        opt.step()


def test_state_is_prepopulated_for_dcp(gen):
    """torch.distributed.checkpoint's state_dict helpers run a zero-gradient step on an optimizer whose .state is
    empty; every parameter has an entry from construction on, so they never do."""
    p, q = param((6, 4), gen), param((4,), gen)
    opt = lt.Dion([dict(params=[p]), dict(params=[q], algorithm="lion")])
    assert set(opt.state) == {p, q}


def test_megabatch_distributed_mesh_role():
    """distributed_mesh is the outer mesh when a parameter is sharded over it (FSDP2), else the replicate mesh
    with no gradient averaging (DDP averaged them already; spec §7.1)."""
    g = FakeGroup([0, 1])
    m = D.mesh_spec(FakeMesh([(g, 2, 0)]), "outer", "distributed_mesh", "w")
    sharded = FakeDTensor(torch.zeros(4, 4), FakeMesh([(g, 2, 0)]), [Shard(0)], (8, 4), requires_grad=True)
    replicated = FakeDTensor(torch.zeros(8, 4), FakeMesh([(g, 2, 0)]), [Replicate()], (8, 4), requires_grad=True)
    assert lt.Muon._sharded_over(sharded, m) and not lt.Muon._sharded_over(replicated, m)
    assert not lt.Muon._sharded_over(torch.zeros(8, 4), m)


def test_chunk_of_matches_the_descriptor():
    outer = spec("outer", [0, 1, 2], 2)
    mesh = FakeMesh([(outer.group, 3, 2)])
    t = torch.arange(70.).reshape(7, 10)
    p = distribute(t, mesh, [Shard(0)])
    f = D.describe_dtensor(p, meshes(outer=outer), "w").fields()
    assert torch.equal(chunk_of(t, mesh, [Shard(0)]), t[f["outer_offset"]:f["outer_offset"] + f["outer_extent"]])

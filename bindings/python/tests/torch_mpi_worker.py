# SPDX-License-Identifier: MIT
"""libdion.torch over MPI on the host backend; run by test_torch_mpi.py as

    mpirun -n N python3 torch_mpi_worker.py        (N = 2 or 4)

Meshes are mpi4py communicators; sharded parameters are dtensor_fakes.FakeDTensor (Debian's torch has no DTensor),
whose mesh dims' groups are those communicators. Every case compares the distributed run with a single-process
libdion.torch optimizer (no mesh, same seed, so the same initial Q and sketches) on the global tensors, driven by
the replica-averaged gradient, run on each rank. Rank 0 prints one "PASS name" / "FAIL name: why" line per case;
the exit status is 1 if any rank failed.

Tolerance: the update X - X0 and the states after synchronize_for_checkpoint() agree within 1e-4 normwise
relative. The distributed run sums P = B Q, R = B^T P, the sketch products and the column norms over the meshes, and
averages the gradients (or P and R) over the replicas, in another order than the single process: fp32
reassociation (~1e-7 relative per sum) amplified by the orthogonalization's conditioning stays far below 1e-4 for
these random matrices, while a wrong offset, orientation or mesh gives O(1) differences. A checkpoint round trip on
the same ranks is exact.
"""
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from mpi4py import MPI  # noqa: E402  (initialises MPI before libdion's communicators are made)
import torch  # noqa: E402

import libdion  # noqa: E402
import libdion.torch as lt  # noqa: E402
from dtensor_fakes import FakeMesh, Replicate, Shard, chunk_of, distribute, grad_of  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
TOL = 1e-4


def rel(a, b):
    a, b = a.double(), b.double()
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def close(what, got, want, tol=TOL):
    if got.numel() == 0:
        return
    d = rel(got, want)
    if not d < tol:
        raise AssertionError("%s: relative difference %.3g >= %.1g" % (what, d, tol))


def window(t, offset, shape):
    for d, (o, n) in enumerate(zip(offset, shape)):
        t = t.narrow(d, o, n)
    return t


# Global shapes: tall, wide, odd sizes (uneven FSDP chunks), and a vector for Lion.
SHAPES = [(13, 8), (8, 13), (11, 9)]


def init(k, shape):
    return randn(1000 + k, *shape)


def grad(step, replica, k, shape):
    return randn(10_000 * (step + 1) + 100 * replica + k, *shape)


# How the outer-sharded cases shard each matrix (Dion's orientation follows it, spec §2.2).
OUTER_PLACEMENTS = [[Shard(0)], [Shard(1)], [Shard(1)]]


def reference(rank_fraction, n_replicas, steps, outer_dims=False, seed=5):
    """Single-process Dion on the global tensors with the replica-averaged gradients.

    With ``outer_dims`` the matrices are DTensors over a mesh of one rank (MPI_COMM_SELF, given as the outer mesh)
    with the distributed run's Shard placements: no communication, but the same shard dims, hence the same
    orientation of Dion's working matrix as the run over several ranks."""
    self_mesh = FakeMesh([(MPI.COMM_SELF, 1, 0)])
    if outer_dims:
        ps = [distribute(init(k, s), self_mesh, pl) for k, (s, pl) in enumerate(zip(SHAPES, OUTER_PLACEMENTS))]
    else:
        ps = [torch.nn.Parameter(init(k, s)) for k, s in enumerate(SHAPES)]
    b = torch.nn.Parameter(init(9, (13,)))
    opt = lt.Dion([dict(params=ps), dict(params=[b], algorithm="lion")], rank_fraction=rank_fraction, lr=0.05,
                  seed=seed, outer_shard_mesh=MPI.COMM_SELF if outer_dims else None)
    ps = ps + [b]
    for s in range(steps):
        for k, (p, shape) in enumerate(zip(ps, SHAPES + [(13,)])):
            g = sum(grad(s, r, k, shape) for r in range(n_replicas)) / n_replicas
            p.grad = grad_of(p, g) if hasattr(p, "_local_tensor") else g
        opt.step()
    return ps, opt


def whole(p):
    """A reference parameter's values (its local tensor when it is a DTensor over one rank)."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p.detach()


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------

def dion_replicate(rank_fraction):
    """DDP: the replicate mesh is the world; each rank its own gradient (compressed P/R sync at 1/4)."""
    def run():
        ps = [torch.nn.Parameter(init(k, s)) for k, s in enumerate(SHAPES)]
        b = torch.nn.Parameter(init(9, (13,)))
        opt = lt.Dion([dict(params=ps), dict(params=[b], algorithm="lion")], replicate_mesh=WORLD,
                      rank_fraction=rank_fraction, lr=0.05, seed=5)
        assert opt.meshes == {"replicate": "replicate_mesh", "outer": None, "inner": None}, opt.meshes
        for s in range(3):
            for k, (p, shape) in enumerate(zip(ps + [b], SHAPES + [(13,)])):
                p.grad = grad(s, RANK, k, shape)
            opt.step()
        ref, ref_opt = reference(rank_fraction, SIZE, 3)
        for k, (p, r) in enumerate(zip(ps + [b], ref)):
            close("parameter %d update" % k, p.detach() - init(k if k < 3 else 9, p.shape),
                  whole(r) - init(k if k < 3 else 9, p.shape))
        opt.synchronize_for_checkpoint()
        sd, rsd = opt.state_dict(), ref_opt.state_dict()
        for k in range(4):
            for name, v in rsd["state"][k].items():
                close("state %r of parameter %d" % (name, k), sd["state"][k][name], v)
        opt.close()
    return run


def _outer_run(outer, replica, n_replicas, rank_fraction, replicate=None, steps=3):
    mesh = FakeMesh([(outer, outer.Get_size(), outer.Get_rank())])
    ps = [distribute(init(k, s), mesh, pl) for k, (s, pl) in enumerate(zip(SHAPES, OUTER_PLACEMENTS))]
    b = distribute(init(9, (13,)), mesh, [Shard(0)])
    opt = lt.Dion([dict(params=ps), dict(params=[b], algorithm="lion")], outer_shard_mesh=outer,
                  replicate_mesh=replicate, rank_fraction=rank_fraction, lr=0.05, seed=5)
    for s in range(steps):
        for k, (p, shape) in enumerate(zip(ps + [b], SHAPES + [(13,)])):
            p.grad = grad_of(p, grad(s, replica, k, shape))
        opt.step()
    ref, ref_opt = reference(rank_fraction, n_replicas, steps, outer_dims=True)
    for k, (p, r) in enumerate(zip(ps + [b], ref)):
        x0 = chunk_of(init(k if k < 3 else 9, r.shape), mesh, p.placements)
        close("parameter %d update" % k, p._local_tensor - x0, chunk_of(whole(r), mesh, p.placements) - x0)
    opt.synchronize_for_checkpoint()
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    infos = {(i["tensor"], i["name"]): i for i in opt.libdion_optimizer.states()}
    for k in range(4):
        for name, v in rsd["state"][k].items():
            got = sd["state"][k][name]
            v = v._local_tensor if hasattr(v, "_local_tensor") else v   # the reference's: whole on one rank
            info = infos[(k, name)]
            assert tuple(got.shape) == tuple(v.shape), (name, got.shape, v.shape)
            if name == "Q":
                want_pl = (Shard(0),)  # Q's rows are B's columns, the outer-sharded dim
            else:
                want_pl = ps[k].placements if k < 3 else b.placements
            assert got.placements == tuple(want_pl), (k, name, got.placements)
            close("state %r of parameter %d" % (name, k), got._local_tensor,
                  window(v, info["local_offset"], info["local_shape"]))
    return opt, ps, b, mesh


def dion_outer(rank_fraction):
    """FSDP: parameters sharded over the world (the outer mesh), uneven chunks, identical gradients."""
    def run():
        opt, *_ = _outer_run(WORLD, 0, 1, rank_fraction)
        opt.close()
    return run


def dion_outer_checkpoint():
    """state_dict() (FakeDTensor states) -> new optimizer -> load_state_dict() -> continue = never stopping."""
    def run():
        mesh = FakeMesh([(WORLD, SIZE, RANK)])

        def build(values):
            ps = [distribute(v, mesh, [Shard(k % 2)]) for k, v in enumerate(values)]
            return ps, lt.Dion(ps, outer_shard_mesh=WORLD, rank_fraction=0.5, lr=0.05, seed=9)

        def steps(ps, opt, lo, hi):
            for s in range(lo, hi):
                for k, p in enumerate(ps):
                    p.grad = grad_of(p, grad(s, 0, k, SHAPES[k]))
                opt.step()

        full = [init(k, s) for k, s in enumerate(SHAPES)]
        ps, opt = build(full)
        steps(ps, opt, 0, 4)
        want = [p._local_tensor.clone() for p in ps]
        opt.close()
        ps1, opt1 = build(full)
        steps(ps1, opt1, 0, 2)
        sd = opt1.state_dict()
        # the model's state: this rank's shards, set into fresh parameters
        ps2, opt2 = build([torch.zeros(s) for s in SHAPES])
        for p2, p1 in zip(ps2, ps1):
            p2._local_tensor.copy_(p1._local_tensor)
        opt1.close()
        opt2.load_state_dict(sd)
        steps(ps2, opt2, 2, 4)
        for k, (p, w) in enumerate(zip(ps2, want)):
            assert torch.equal(p._local_tensor, w), "parameter %d differs from the uninterrupted run" % k
        opt2.close()
    return run


def dion_outer_from_a_single_process_checkpoint():
    """A checkpoint of the single-process run (whole states) loads into the sharded optimizer, each rank taking
    its window; both continue to the same parameters (within TOL: the sums run in another order)."""
    def run():
        ref, ref_opt = reference(0.5, 1, 2, outer_dims=True)
        sd = ref_opt.state_dict()
        mesh = FakeMesh([(WORLD, SIZE, RANK)])
        ps = [distribute(whole(r), mesh, pl) for r, pl in zip(ref[:3], OUTER_PLACEMENTS)]
        b = distribute(whole(ref[3]), mesh, [Shard(0)])
        opt = lt.Dion([dict(params=ps), dict(params=[b], algorithm="lion")], outer_shard_mesh=WORLD,
                      rank_fraction=0.5, lr=0.05, seed=5)
        opt.load_state_dict(sd)
        x1 = [chunk_of(whole(r), mesh, p.placements) for r, p in zip(ref, ps + [b])]
        for s in range(2, 4):
            for k, (p, r, shape) in enumerate(zip(ps + [b], ref, SHAPES + [(13,)])):
                g = grad(s, 0, k, shape)
                p.grad = grad_of(p, g)
                r.grad = grad_of(r, g) if hasattr(r, "placements") else g
            opt.step()
            ref_opt.step()
        for k, (p, r, x) in enumerate(zip(ps + [b], ref, x1)):
            close("parameter %d update after the load" % k, p._local_tensor - x,
                  chunk_of(whole(r), mesh, p.placements) - x)
        opt.close()
    return run


def dion_replicate_x_outer(rank_fraction):
    """HSDP on 4 ranks: replicate mesh {0,2},{1,3} x outer mesh {0,1},{2,3}; each replica its own gradients."""
    def run():
        outer = WORLD.Split(RANK // 2, RANK % 2)
        rep = WORLD.Split(RANK % 2, RANK // 2)
        try:
            opt, *_ = _outer_run(outer, RANK // 2, 2, rank_fraction, replicate=rep)
            opt.close()
        finally:
            outer.Free()
            rep.Free()
    return run


def muon_ddp():
    """Muon with distributed_mesh = the world and plain parameters: DDP averaged the gradients already, so
    the mesh is libdion's replicate mesh without gradient sync, and the result is the single process's."""
    def run():
        ps = [torch.nn.Parameter(init(k, s)) for k, s in enumerate(SHAPES)]
        rs = [torch.nn.Parameter(init(k, s)) for k, s in enumerate(SHAPES)]
        opt = lt.Muon(ps, distributed_mesh=WORLD, lr=0.05, seed=2)
        ref = lt.Muon(rs, lr=0.05, seed=2)
        assert opt.meshes == {"replicate": "distributed_mesh", "outer": None, "inner": None}, opt.meshes
        for s in range(3):
            for k, (p, r) in enumerate(zip(ps, rs)):
                p.grad = grad(s, 0, k, SHAPES[k])
                r.grad = p.grad.clone()
            opt.step()
            ref.step()
        for k, (p, r) in enumerate(zip(ps, rs)):
            close("parameter %d update" % k, p.detach() - init(k, SHAPES[k]), r.detach() - init(k, SHAPES[k]), 1e-5)
        opt.close()
    return run


def muon_fsdp(cls=lt.Muon):
    """Muon (or NorMuon) with distributed_mesh = the world and parameters sharded over it (libdion's outer mesh). Until the
    library serves the Muon family on shard meshes, add_group's NOT_SUPPORTED must surface with the layout named;
    once it does, the result must be the single process's (1e-2: the family may orthogonalize in bf16, spec §3.2,
    whose unit roundoff is 4e-3)."""
    def run():
        mesh = FakeMesh([(WORLD, SIZE, RANK)])
        ps = [distribute(init(k, s), mesh, [Shard(0)]) for k, s in enumerate(SHAPES)]
        rs = [torch.nn.Parameter(init(k, s)) for k, s in enumerate(SHAPES)]
        try:
            opt = cls(ps, distributed_mesh=WORLD, lr=0.05, seed=2)
        except libdion.DionNotSupported as e:
            msg = str(e)
            assert "multi-rank meshes (distributed_mesh" in msg and "sharded parameters" in msg, msg
            return "libdion: %s" % msg.split(": ", 2)[-1][:120]
        assert opt.meshes == {"replicate": None, "outer": "distributed_mesh", "inner": None}, opt.meshes
        ref = cls(rs, lr=0.05, seed=2)
        for s in range(3):
            for k, (p, r) in enumerate(zip(ps, rs)):
                g = grad(s, 0, k, SHAPES[k])
                p.grad = grad_of(p, g)
                r.grad = g
            opt.step()
            ref.step()
        for k, (p, r) in enumerate(zip(ps, rs)):
            x0 = chunk_of(init(k, SHAPES[k]), mesh, p.placements)
            close("parameter %d update" % k, p._local_tensor - x0, chunk_of(r.detach(), mesh, p.placements) - x0, 1e-2)
        # the states are DTensors of the parameters' mesh (variance_neuron: rows sharded like the parameter's)
        sd = opt.state_dict()
        for k, p in enumerate(ps):
            for name, v in sd["state"][k].items():
                assert v.placements == ((Shard(0),) if v.shape[0] == p.shape[0] else (Replicate(),)), \
                    (k, name, v.placements)
        opt.close()
    return run


CASES = [
    ("dion_replicate_uncompressed", dion_replicate(1.0)),
    ("dion_replicate_compressed", dion_replicate(0.25)),
    ("dion_outer", dion_outer(1.0)),
    ("dion_outer_low_rank", dion_outer(0.5)),
    ("dion_outer_checkpoint", dion_outer_checkpoint()),
    ("dion_outer_from_a_single_process_checkpoint", dion_outer_from_a_single_process_checkpoint()),
    ("muon_ddp", muon_ddp()),
    ("muon_fsdp", muon_fsdp()),
    ("normuon_fsdp", muon_fsdp(lt.NorMuon)),
]
if SIZE == 4:
    CASES += [("dion_replicate_x_outer_compressed", dion_replicate_x_outer(0.25)),
              ("dion_replicate_x_outer_uncompressed", dion_replicate_x_outer(1.0))]


def main():
    failed = 0
    for name, fn in CASES:
        note, err = None, ""
        try:
            note = fn()
            ok = 1
        except Exception:  # noqa: BLE001 - reported, and the other cases still run
            ok = 0
            err = "rank %d: %s" % (RANK, traceback.format_exc())
        all_ok = WORLD.allreduce(ok, op=MPI.MIN)
        errs = WORLD.gather(err, root=0)
        if RANK == 0:
            if all_ok:
                print("PASS %s (%d ranks)%s" % (name, SIZE, "" if not note else ": " + note), flush=True)
            else:
                print("FAIL %s (%d ranks): %s" % (name, SIZE, next(e for e in errs if e)), flush=True)
        failed += 0 if all_ok else 1
    if RANK == 0:
        print("%d passed, %d failed" % (len(CASES) - failed, failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

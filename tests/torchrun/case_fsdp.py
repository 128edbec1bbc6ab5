# SPDX-License-Identifier: MIT
"""(i) FSDP2: fully_shard over all ranks, libdion.torch.Dion with outer_shard_mesh = that mesh, against the
single-GPU run of the same model on the same data (see common.py for the reference and the tolerance).

The layer sizes make FSDP2's chunks uneven over 2 and 4 ranks (90 and 30 rows) and give rank 3 of 4 an empty
shard (5 rows: 2, 2, 1, 0). Also: the states of state_dict() are DTensors (momentum placed like the parameter,
Q (b x r) Shard(0) on the FSDP mesh dim) equal to the reference's, and Muon with distributed_mesh = the FSDP
mesh (libdion's outer mesh) is either served (within 1e-2: the family may orthogonalize in bf16) or refused with
DionNotSupported naming the layout (reported as SKIP).

    torchrun --standalone --nproc_per_node 4 tests/torchrun/case_fsdp.py
"""
import sys

import common as C

DIMS = (30, 90, 30, 5)


def fsdp_model(mesh, device, seed):
    base = C.build(DIMS, seed, device=device)
    ref = C.copy_model(base)
    model = C.copy_model(base)
    for layer in model.layers:
        C.fully_shard(layer, mesh=mesh)
    C.fully_shard(model, mesh=mesh)
    return model, ref


def dion(mesh, device, args, rank_fraction):
    import libdion.torch as lt
    C.progress("fsdp: fully_shard")
    model, ref = fsdp_model(mesh, device, args.seed)
    x0 = [p.detach().clone() for p in ref.parameters()]
    C.progress("fsdp: libdion.torch.Dion(outer_shard_mesh=FSDP mesh, rank_fraction=%g)" % rank_fraction)
    opt = lt.Dion(C.groups(model), outer_shard_mesh=mesh, lr=0.02, rank_fraction=rank_fraction, seed=args.seed)
    assert opt.meshes == {"replicate": None, "outer": "outer_shard_mesh", "inner": None}, opt.meshes
    refopt = C.Reference(opt, model, ref, device, args.seed, outer_group=mesh.get_group(0))
    C.train_both(model, opt, ref, refopt, DIMS, args.steps, device)
    worst = C.compare_updates(model, ref, x0, args.tol)
    C.progress("fsdp: state_dict() and its states against the reference's")
    def check(ti, p, name, v):
        if not hasattr(v, "placements"):
            return "not a DTensor"
        if name == "momentum" and (tuple(v.placements) != tuple(p.placements) or v.shape != p.shape):
            return "placements %s / shape %s, expected the parameter's %s / %s" % (v.placements, tuple(v.shape),
                                                                                  p.placements, tuple(p.shape))
        if name == "Q" and not v.placements[0].is_shard(0):
            return "placements %s, expected Shard(0)" % (v.placements,)
        return None

    C.compare_states(opt, refopt, args.tol, check)
    C.progress("fsdp: close()", sync=True)
    opt.close()
    refopt.close()
    return "worst relative difference of the updates %.2g" % worst


def muon(mesh, device, args):
    import libdion
    import libdion.torch as lt
    model, ref = fsdp_model(mesh, device, args.seed)
    x0 = [p.detach().clone() for p in ref.parameters()]
    C.progress("fsdp: libdion.torch.Muon(distributed_mesh=FSDP mesh)")
    try:
        opt = lt.Muon(C.groups(model), distributed_mesh=mesh, lr=0.02, seed=args.seed)
    except libdion.DionNotSupported as e:
        assert "multi-rank meshes" in str(e), str(e)
        raise C.Skip("refused by this libdion: %s" % str(e)[:300])
    assert opt.meshes["outer"] == "distributed_mesh", opt.meshes
    refopt = lt.Muon(C.groups(ref), lr=0.02, seed=args.seed)
    C.train_both(model, opt, ref, refopt, DIMS, args.steps, device)
    worst = C.compare_updates(model, ref, x0, 1e-2)
    opt.close()
    return "worst relative difference of the updates %.2g" % worst


def main(argv=None):
    args = C.parse(__doc__.splitlines()[0], argv)
    if args.dry_run:
        return C.dry_run(DIMS)
    rank, world, device = C.init()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    rep = C.Report(rank, world)
    rep.run("fsdp2_dion_full_rank", dion, mesh, device, args, 1.0)
    rep.run("fsdp2_dion_rank_fraction_0.5", dion, mesh, device, args, 0.5)
    rep.run("fsdp2_muon", muon, mesh, device, args)
    return C.finish(rep)


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: MIT
"""(ii) Tensor parallel: parallelize_module with ColwiseParallel / RowwiseParallel over all ranks,
libdion.torch.Dion with inner_shard_mesh = the TP mesh, against the single-GPU run (common.py).

Layer 0 is column-parallel (weight Shard(0), bias Shard(0)), layer 1 row-parallel (weight Shard(1), bias
Replicate): Dion's working matrix keeps the inner-sharded dim as its rows (spec §2.2), so the two layers run in
opposite orientations; the biases run Lion on a shard and on a replica.

    torchrun --standalone --nproc_per_node 4 tests/torchrun/case_tp.py
"""
import sys

import common as C

DIMS = (32, 64, 32)


def tp_model(mesh, device, seed):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    base = C.build(DIMS, seed, device=device)
    ref = C.copy_model(base)
    model = parallelize_module(C.copy_model(base), mesh, {"layers.0": ColwiseParallel(),
                                                          "layers.1": RowwiseParallel()})
    return model, ref


def dion(mesh, device, args, rank_fraction):
    import libdion.torch as lt
    C.progress("tp: parallelize_module (ColwiseParallel, RowwiseParallel)")
    model, ref = tp_model(mesh, device, args.seed)
    x0 = [p.detach().clone() for p in ref.parameters()]
    C.progress("tp: libdion.torch.Dion(inner_shard_mesh=TP mesh, rank_fraction=%g): NCCL communicator" %
               rank_fraction)
    opt = lt.Dion(C.groups(model), inner_shard_mesh=mesh, lr=0.02, rank_fraction=rank_fraction, seed=args.seed)
    assert opt.meshes == {"replicate": None, "outer": None, "inner": "inner_shard_mesh"}, opt.meshes
    refopt = C.Reference(opt, model, ref, device, args.seed, inner_group=mesh.get_group(0))
    C.train_both(model, opt, ref, refopt, DIMS, args.steps, device)
    worst = C.compare_updates(model, ref, x0, args.tol)
    C.progress("tp: state_dict() and its states against the reference's")
    def check(ti, p, name, v):
        # libdion keeps r whole on the inner mesh: Q is replicated over TP
        if name == "Q" and not all(pl.is_replicate() for pl in v.placements):
            return "placements %s, expected Replicate" % (v.placements,)
        return None

    C.compare_states(opt, refopt, args.tol, check)
    C.progress("tp: close() (destroys the communicators)", sync=True)
    opt.close()
    refopt.close()
    return "worst relative difference of the updates %.2g" % worst


def main(argv=None):
    args = C.parse(__doc__.splitlines()[0], argv)
    if args.dry_run:
        return C.dry_run(DIMS)
    rank, world, device = C.init()
    from torch.distributed.device_mesh import init_device_mesh
    C.progress("init_device_mesh(cuda, (%d,))" % world)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    rep = C.Report(rank, world)
    rep.run("tp_dion_full_rank", dion, mesh, device, args, 1.0)
    rep.run("tp_dion_rank_fraction_0.5", dion, mesh, device, args, 0.5)
    return C.finish(rep)


if __name__ == "__main__":
    sys.exit(main())

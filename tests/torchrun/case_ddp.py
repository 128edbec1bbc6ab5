# SPDX-License-Identifier: MIT
"""(v) DDP: a replicated model, each rank its own batch. libdion.torch.Dion with replicate_mesh = the world:
compressed (rank_fraction 1/4: P and R are averaged over the replicas, not the gradients) and uncompressed
(rank_fraction 1: the gradients are averaged in place), and DistributedDataParallel + replicate_mesh_grad_sync=False;
Muon with distributed_mesh = the world behind DistributedDataParallel (libdion's replicate mesh without gradient
sync). Each against the single-GPU run of libdion.torch (no mesh) on the replica-averaged gradient (the mean of
every rank's loss); after synchronize_for_checkpoint() the momentum and Q equal the reference's too. Tolerance:
common.py (1e-3; 1e-2 for Muon, whose family may orthogonalize in bf16).

    torchrun --standalone --nproc_per_node 4 tests/torchrun/case_ddp.py
"""
import sys

import common as C

DIMS = (32, 96, 48, 16)


def dion(device, args, rank_fraction, ddp):
    import torch
    import torch.distributed as dist
    import libdion.torch as lt
    rank, world = dist.get_rank(), dist.get_world_size()
    base = C.build(DIMS, args.seed, device=device)
    ref, model = C.copy_model(base), C.copy_model(base)
    x0 = [p.detach().clone() for p in ref.parameters()]
    C.progress("ddp: libdion.torch.Dion(replicate_mesh=WORLD, grad sync %s, rank_fraction=%g)" % (not ddp,
                                                                                                  rank_fraction))
    opt = lt.Dion(C.groups(model), replicate_mesh=dist.group.WORLD, replicate_mesh_grad_sync=not ddp, lr=0.02,
                  rank_fraction=rank_fraction, seed=args.seed)
    assert opt.meshes == {"replicate": "replicate_mesh", "outer": None, "inner": None}, opt.meshes
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index]) if ddp else model
    refopt = lt.Dion(C.groups(ref), lr=0.02, rank_fraction=rank_fraction, seed=args.seed)
    C.train_both(net, opt, ref, refopt, DIMS, args.steps, device, rank=rank, ranks_of_data=list(range(world)))
    worst = C.compare_updates(model, ref, x0, args.tol)
    C.progress("ddp: synchronize_for_checkpoint(), state_dict()")
    opt.synchronize_for_checkpoint()
    sd, rsd = opt.state_dict(), refopt.state_dict()
    for ti in rsd["state"]:
        for name, v in rsd["state"][ti].items():
            d = C.rel(sd["state"][ti][name], v)
            assert d < args.tol, "state %r of parameter %d after synchronize_for_checkpoint: relative difference " \
                                 "%.3g" % (name, ti, d)
    opt.close()
    return "worst relative difference of the updates %.2g" % worst


def muon(device, args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import libdion.torch as lt
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ddp",))
    base = C.build(DIMS, args.seed, device=device)
    ref, model = C.copy_model(base), C.copy_model(base)
    x0 = [p.detach().clone() for p in ref.parameters()]
    C.progress("ddp: libdion.torch.Muon(distributed_mesh=DDP mesh)")
    opt = lt.Muon(C.groups(model), distributed_mesh=mesh, lr=0.02, seed=args.seed)
    assert opt.meshes == {"replicate": "distributed_mesh", "outer": None, "inner": None}, opt.meshes
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    refopt = lt.Muon(C.groups(ref), lr=0.02, seed=args.seed)
    C.train_both(net, opt, ref, refopt, DIMS, args.steps, device, rank=rank, ranks_of_data=list(range(world)))
    worst = C.compare_updates(model, ref, x0, 1e-2)
    opt.close()
    return "worst relative difference of the updates %.2g" % worst


def main(argv=None):
    args = C.parse(__doc__.splitlines()[0], argv)
    if args.dry_run:
        return C.dry_run(DIMS)
    rank, world, device = C.init()
    rep = C.Report(rank, world)
    rep.run("ddp_dion_compressed", dion, device, args, 0.25, False)
    rep.run("ddp_dion_uncompressed", dion, device, args, 1.0, False)
    rep.run("ddp_wrapper_dion_no_grad_sync", dion, device, args, 0.25, True)
    rep.run("ddp_wrapper_muon_distributed_mesh", muon, device, args)
    return C.finish(rep)


if __name__ == "__main__":
    sys.exit(main())

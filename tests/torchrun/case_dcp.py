# SPDX-License-Identifier: MIT
"""(iv) torch.distributed.checkpoint: FSDP2 + libdion.torch.Dion (low rank) + Lion biases; save the model and
optimizer with DCP after step k, build a new model and a new optimizer, load, continue: equals the run that never
stopped (same ranks, same layout: bit for bit is expected; within 1e-6 relative is accepted and reported;
1e-4 for the HSDP case below).

Two ways of saving: (a) the optimizer's own state_dict() (DTensor states) with dcp.save / dcp.load in place, then
load_state_dict(); (b) torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict (FQN-keyed;
they would "initialise" an optimizer without state by a zero-gradient step, which libdion.torch's pre-populated
state prevents). A third case saves after synchronize_for_checkpoint() with a compressed replicate mesh
(HSDP: replicate x FSDP on 4 ranks; SKIP on 2).

    torchrun --standalone --nproc_per_node 4 tests/torchrun/case_dcp.py --ckpt-dir /tmp/dcp
"""
import os
import sys
import tempfile

import common as C

DIMS = (30, 90, 30, 5)
K, STEPS = 2, 4


def setup(mesh, device, seed, model_seed, replicate=None):
    import libdion.torch as lt
    model = C.build(DIMS, model_seed, device=device)
    outer = mesh if replicate is None else mesh["dp"]
    for layer in model.layers:
        C.fully_shard(layer, mesh=outer)
    C.fully_shard(model, mesh=outer)
    opt = lt.Dion(C.groups(model), outer_shard_mesh=outer, replicate_mesh=replicate, lr=0.02, rank_fraction=0.5,
                  seed=seed)
    return model, opt


def train(model, opt, device, lo, hi, rank=0):
    for s in range(lo, hi):
        C.progress("dcp: step %d" % s, sync=True)
        x, y = C.batch(s, DIMS, rank, device)
        C.loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def ckpt_dir(args, name):
    import torch.distributed as dist
    base = args.ckpt_dir
    obj = [None]
    if dist.get_rank() == 0:
        obj[0] = base if base else tempfile.mkdtemp(prefix="libdion_dcp_")
    dist.broadcast_object_list(obj, src=0)
    path = os.path.join(obj[0], name)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def compare(a, b, tol):
    worst = 0.0
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        fa, fb = C.full(p), C.full(q)
        d = C.rel(fa, fb)
        worst = max(worst, d)
        if not d < tol:
            raise AssertionError("%s: the resumed run differs from the uninterrupted one (relative %.3g)" % (name, d))
    return "bit for bit" if worst == 0 else "within %.2g relative (not bit for bit)" % worst


def resume(mesh, device, args, how, replicate=None, hsdp_rank=0):
    import torch.distributed.checkpoint as dcp
    path = ckpt_dir(args, "%s_%s" % (how, "hsdp" if replicate is not None else "fsdp"))
    full, full_opt = setup(mesh, device, args.seed, args.seed, replicate)
    train(full, full_opt, device, 0, STEPS, hsdp_rank)
    a, a_opt = setup(mesh, device, args.seed, args.seed, replicate)
    train(a, a_opt, device, 0, K, hsdp_rank)
    if replicate is not None:
        a_opt.synchronize_for_checkpoint()
    C.progress("dcp: save (%s) to %s" % (how, path), sync=True)
    if how == "optimizer_state_dict":
        dcp.save({"model": a.state_dict(), "optim": a_opt.state_dict()}, checkpoint_id=path)
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(a, a_opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    a_opt.close()
    # a new model (other initial weights) and a new optimizer (same libdion seed: it keys the sketches)
    b, b_opt = setup(mesh, device, args.seed, args.seed + 1, replicate)
    C.progress("dcp: load (%s)" % how, sync=True)
    if how == "optimizer_state_dict":
        sd = {"model": b.state_dict(), "optim": b_opt.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        b.load_state_dict(sd["model"])
        b_opt.load_state_dict(sd["optim"])
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(b, b_opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(b, b_opt, model_state_dict=msd, optim_state_dict=osd)
    assert [g["step"] for g in b_opt.state_dict()["param_groups"]] == [K, K]
    train(b, b_opt, device, K, STEPS, hsdp_rank)
    # With a compressed replicate mesh each replica's momentum is its own; synchronize_for_checkpoint() saves their
    # average, an equally valid state of the synchronized algorithm (spec §2.7) that continues to the same
    # parameters up to fp32 reassociation of the averages (hence 1e-4 there).
    C.progress("dcp: compare with the uninterrupted run", sync=True)
    note = compare(b, full, 1e-6 if replicate is None else 1e-4)
    b_opt.close()
    full_opt.close()
    return note


def main(argv=None):
    args = C.parse(__doc__.splitlines()[0], argv)
    if args.dry_run:
        return C.dry_run(DIMS)
    rank, world, device = C.init()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    rep = C.Report(rank, world)
    rep.run("dcp_optimizer_state_dict", resume, mesh, device, args, "optimizer_state_dict")
    rep.run("dcp_get_set_state_dict", resume, mesh, device, args, "get_set_state_dict")
    if world == 4:
        mesh2 = init_device_mesh("cuda", (2, 2), mesh_dim_names=("rep", "dp"))
        rep.run("dcp_hsdp_compressed_after_synchronize", resume, mesh2, device, args, "optimizer_state_dict",
                replicate=mesh2["rep"], hsdp_rank=mesh2.get_local_rank("rep"))
    return C.finish(rep)


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: MIT
"""(iii) FSDP2 x TP on a 2-D mesh (dp, tp) = (2, 2) of 4 GPUs: parallelize_module over "tp", then fully_shard over
"dp"; libdion.torch.Dion with outer_shard_mesh = mesh["dp"], inner_shard_mesh = mesh["tp"], against the single-GPU
run (common.py).

libdion shards each dim over at most one mesh, so FSDP2 must not shard the dim TP shards (it would place a
_StridedShard): shard_placement_fn gives the column-parallel weight (TP Shard(0)) FSDP's Shard(1); the row-parallel
weight (TP Shard(1)) and its bias keep FSDP's Shard(0). The column-parallel layer has no bias (a 1-D TP shard can
only be FSDP-sharded on the same dim). A second case checks that FSDP2's default on the column-parallel weight
(a _StridedShard) is refused with a message naming shard_placement_fn. Needs 4 ranks (SKIP otherwise).

    torchrun --standalone --nproc_per_node 4 tests/torchrun/case_fsdp_tp.py
"""
import sys

import common as C

DIMS = (32, 64, 32)
BIAS = [False, True]


def model_2d(mesh, device, seed, placement_fn=True):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    base = C.build(DIMS, seed, bias=BIAS, device=device)
    ref = C.copy_model(base)
    model = parallelize_module(C.copy_model(base), mesh["tp"], {"layers.0": ColwiseParallel(),
                                                                "layers.1": RowwiseParallel()})

    def fsdp_placement(p):
        tp_rows = p.dim() == 2 and any(pl.is_shard(0) for pl in p.placements)
        return Shard(1) if tp_rows else Shard(0)

    kw = dict(shard_placement_fn=fsdp_placement) if placement_fn else {}
    C.fully_shard(model, mesh=mesh["dp"], **kw)
    return model, ref


def dion(mesh, device, args, rank_fraction):
    import libdion.torch as lt
    C.progress("fsdp_tp: parallelize_module over tp, fully_shard over dp")
    model, ref = model_2d(mesh, device, args.seed)
    x0 = [p.detach().clone() for p in ref.parameters()]
    C.progress("fsdp_tp: libdion.torch.Dion(outer=dp, inner=tp, rank_fraction=%g)" % rank_fraction)
    opt = lt.Dion(C.groups(model), outer_shard_mesh=mesh["dp"], inner_shard_mesh=mesh["tp"], lr=0.02,
                  rank_fraction=rank_fraction, seed=args.seed)
    assert opt.meshes == {"replicate": None, "outer": "outer_shard_mesh", "inner": "inner_shard_mesh"}, opt.meshes
    refopt = C.Reference(opt, model, ref, device, args.seed, outer_group=mesh["dp"].get_group(),
                         inner_group=mesh["tp"].get_group())
    dims = [C.shard_dims(p, mesh["dp"].get_group(), mesh["tp"].get_group()) for p in model.parameters()]
    assert dims[0] == {"outer": 1, "inner": 0} and dims[1] == {"outer": 0, "inner": 1}, dims
    C.train_both(model, opt, ref, refopt, DIMS, args.steps, device)
    worst = C.compare_updates(model, ref, x0, args.tol)
    C.progress("fsdp_tp: state_dict() and its states against the reference's")
    C.compare_states(opt, refopt, args.tol)
    C.progress("fsdp_tp: close()", sync=True)
    opt.close()
    refopt.close()
    return "worst relative difference of the updates %.2g" % worst


def strided_shard_is_refused(mesh, device, args):
    import libdion.torch as lt
    model, _ = model_2d(mesh, device, args.seed, placement_fn=False)
    try:
        lt.Dion(C.groups(model), outer_shard_mesh=mesh["dp"], inner_shard_mesh=mesh["tp"], seed=args.seed)
    except NotImplementedError as e:
        assert "_StridedShard" in str(e) and "shard_placement_fn" in str(e), str(e)
        return "refused: %s" % str(e)[:160]
    raise AssertionError("a _StridedShard placement was accepted")


def main(argv=None):
    args = C.parse(__doc__.splitlines()[0], argv)
    if args.dry_run:
        m = C.build(DIMS, 0, bias=BIAS)
        print("dry run: MLP%s, biases %s, %d parameters" % (DIMS, BIAS, sum(p.numel() for p in m.parameters())))
        return 0
    rank, world, device = C.init()
    rep = C.Report(rank, world)
    if world != 4:
        def skip():
            raise C.Skip("needs 4 ranks for a 2 x 2 mesh, got %d" % world)
        rep.run("fsdp2_x_tp_dion", skip)
        return C.finish(rep)
    from torch.distributed.device_mesh import init_device_mesh
    C.progress("init_device_mesh(cuda, (2, 2))")
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    rep.run("fsdp2_x_tp_dion_full_rank", dion, mesh, device, args, 1.0)
    rep.run("fsdp2_x_tp_dion_rank_fraction_0.5", dion, mesh, device, args, 0.5)
    rep.run("fsdp2_x_tp_strided_shard_is_refused", strided_shard_is_refused, mesh, device, args)
    return C.finish(rep)


if __name__ == "__main__":
    sys.exit(main())

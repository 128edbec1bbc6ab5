# SPDX-License-Identifier: MIT
"""Shared pieces of the tests/torchrun programs (libdion.torch under torchrun on NCCL meshes).

Each program compares a distributed run (FSDP2, tensor parallel, both, DDP) of a small model with a single-GPU run
of the same model on every rank: same initial weights, the same data on every rank (DDP: each rank its own batch,
and the reference sees all of them, i.e. the averaged gradient), the same libdion seed. Dion's working orientation
follows the shard dims (spec §2.2), so the single-GPU reference is built with libdion's C API (``libdion.Optimizer``)
and gets the distributed parameter's shard dims with full extents (and one-rank NCCL communicators), as the C++
suites' references do; the shard dims are derived here from the DTensor placements, independently of libdion.torch.

Pass/fail: the update X - X0 of every parameter within ``--tol`` (default 1e-3) normwise relative of the
reference's. The runs differ by fp32 reassociation only (FSDP2's reduce-scatter of identical gradients, TP's partial
sums, P = B Q / R = B^T P / the sketch and column norms summed over the meshes in another order), ~1e-6 relative
amplified by the orthogonalization's conditioning over a few steps; a wrong offset, orientation or mesh gives O(1).
TF32 is off everywhere. Only rank 0 prints: one "PASS name" / "FAIL name: why" line per case, then
"N passed, M failed"; the exit status is 1 when a case failed on any rank.

Imports of torch.distributed's newer APIs are inside the functions, so ``--dry-run`` (argument parsing and model
construction on the CPU, no process group) works on any torch.

Hang diagnostics (``init()`` arms them on every rank, before the process group): ``progress(phase)`` prints a flushed
line "[rank R/W +SECONDS] phase" (init, each case's start, its steps, the gathering of the results, the teardown);
with DION_CASE_TIMEOUT=SECONDS (run_all.sh sets it from CASE_TIMEOUT) faulthandler dumps every thread's Python
stack 10 s before that timeout (exit=False: the run goes on), when the rank gets SIGTERM (torchrun stopping it)
or SIGUSR1, and on a fatal signal. With DION_TRACE_DIR (run_all.sh: a scratch directory, merged into the case's
log afterwards) the progress lines and stacks also go to DION_TRACE_DIR/rank<R>.txt, one file per rank, so that
the stacks of the ranks do not interleave.
"""
import argparse
import copy
import ctypes
import os
import signal
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bindings", "python"))

import libdion  # noqa: E402
from libdion import _lib as L  # noqa: E402
from libdion.core import TensorSpec  # noqa: E402


def parse(description, argv=None):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    ap.add_argument("--tol", type=float, default=1e-3, help="relative tolerance on the updates (default 1e-3)")
    ap.add_argument("--seed", type=int, default=5, help="libdion seed and model initialisation seed")
    ap.add_argument("--ckpt-dir", default=None, help="directory for checkpoints (shared by the ranks)")
    ap.add_argument("--dry-run", action="store_true", help="build the models on the CPU and exit (no GPU, no "
                                                            "process group)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------

class MLP(torch.nn.Module):
    """Linear layers with GELU between them; `dims` = (d0, d1, ..., dk), `bias` per layer."""

    def __init__(self, dims, bias=True):
        super().__init__()
        biases = bias if isinstance(bias, (list, tuple)) else [bias] * (len(dims) - 1)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=bb) for a, b, bb in zip(dims[:-1], dims[1:],
                                                                                                 biases))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.nn.functional.gelu(x)
        return x


def build(dims, seed, bias=True, device="cpu"):
    torch.manual_seed(seed)
    return MLP(dims, bias).to(device=device, dtype=torch.float32)


def batch(step, dims, rank=0, device="cpu", n=256):
    """One mini-batch. n (default 256) exceeds every layer's width, so each gradient has full rank: full-rank
    Dion completes the basis of a rank-deficient momentum arbitrarily (any completion is orthonormal), and two
    runs that round differently (sharded vs single GPU) would then legitimately disagree."""
    g = torch.Generator().manual_seed(1000 * (step + 1) + rank)
    x = torch.randn(n, dims[0], generator=g)
    y = torch.randn(n, dims[-1], generator=g)
    return x.to(device), y.to(device)


def loss_of(model, x, y):
    out = model(x)
    if hasattr(out, "full_tensor"):
        out = out.full_tensor()
    return torch.nn.functional.mse_loss(out, y)


def groups(model):
    """microsoft/dion's grouping: matrices with the optimizer's algorithm, vectors with Lion."""
    mats = [p for p in model.parameters() if p.dim() == 2]
    vecs = [p for p in model.parameters() if p.dim() != 2]
    out = [dict(params=mats)]
    if vecs:
        out.append(dict(params=vecs, algorithm="lion", weight_decay=0.0))
    return out


# --------------------------------------------------------------------------
# Hang diagnostics
# --------------------------------------------------------------------------

_T0 = time.monotonic()
_TRACE = None  # this rank's file under DION_TRACE_DIR (progress lines and stacks), once watchdog() opened it


def _rank_world():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def progress(phase, sync=False):
    """A flushed "[rank R/W +SECONDS] phase" line on stdout and in this rank's trace file. With sync, the GPU's
    work is waited for first, so that a hang in what was enqueued shows up before this line (the stack dump then
    points at this call's torch.cuda.synchronize)."""
    if sync and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    rank, world = _rank_world()
    line = "[rank %d/%d +%.1fs] %s" % (rank, world, time.monotonic() - _T0, phase)
    print(line, flush=True)
    if _TRACE is not None:
        try:
            _TRACE.write(line + "\n")
            _TRACE.flush()
        except (OSError, ValueError):
            pass


def watchdog():
    """Arms faulthandler on this rank (see the module docstring): the stacks of every thread 10 s before
    DION_CASE_TIMEOUT (half of it when that is 20 s or less), on SIGTERM, on SIGUSR1 and on a fatal signal, into
    DION_TRACE_DIR/rank<R>.txt or stderr. DION_TEST_WATCHDOG=SECONDS: dump and exit after that long (older knob)."""
    global _TRACE
    import faulthandler
    rank, world = _rank_world()
    out = sys.stderr
    trace_dir = os.environ.get("DION_TRACE_DIR")
    if trace_dir and _TRACE is None:
        try:
            _TRACE = open(os.path.join(trace_dir, "rank%d.txt" % rank), "w")
            out = _TRACE
        except OSError as e:
            print("[rank %d] cannot write a trace file under %s: %s" % (rank, trace_dir, e), flush=True)
    elif _TRACE is not None:
        out = _TRACE
    faulthandler.enable(file=out, all_threads=True)
    for sig, chain in ((getattr(signal, "SIGUSR1", None), False), (getattr(signal, "SIGTERM", None), True)):
        if sig is not None:
            try:
                faulthandler.register(sig, file=out, all_threads=True, chain=chain)
            except (AttributeError, RuntimeError, ValueError):  # not on this platform / not the main thread
                pass
    where = ", in %s" % out.name if out is _TRACE else ""
    timeout = float(os.environ.get("DION_CASE_TIMEOUT") or 0)
    if os.environ.get("DION_TEST_WATCHDOG"):  # one timer at a time: this one wins
        faulthandler.dump_traceback_later(float(os.environ["DION_TEST_WATCHDOG"]), exit=True, file=out)
        progress("watchdog: stacks and exit at +%ss (DION_TEST_WATCHDOG)%s" % (os.environ["DION_TEST_WATCHDOG"],
                                                                             where))
    elif timeout > 0:
        delay = timeout - 10 if timeout > 20 else timeout / 2
        faulthandler.dump_traceback_later(delay, exit=False, file=out)
        progress("watchdog: Python stacks of every thread at +%.0fs (DION_CASE_TIMEOUT=%g), on SIGTERM and "
                 "SIGUSR1%s" % (delay, timeout, where))


# --------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------

def init():
    """torch.distributed over NCCL, one GPU per rank; returns (rank, world size, device). Arms the hang
    diagnostics first (watchdog())."""
    import torch.distributed as dist
    watchdog()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    progress("init: %s, GPU %d of %d visible (CUDA_VISIBLE_DEVICES=%s), torch %s" %
             (os.path.basename(sys.argv[0]), local, torch.cuda.device_count(),
              os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), torch.__version__))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    progress("init: init_process_group(nccl)")
    try:
        dist.init_process_group("nccl", device_id=device)
    except TypeError:  # torch without device_id
        dist.init_process_group("nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    progress("init: process group up")
    return rank, world, device


def finish(report):
    """Prints the summary, frees what failed cases left (their optimizers' NCCL communicators, while every rank
    is still here), tears the process group down; returns the exit status."""
    import gc
    import torch.distributed as dist
    code = report.summary()
    progress("finish: freeing what failed cases left", sync=True)
    gc.collect()
    torch.cuda.synchronize()
    progress("finish: barrier")
    dist.barrier()
    progress("finish: destroy_process_group")
    dist.destroy_process_group()
    progress("finish: done (exit %d)" % code)
    return code


class Skip(Exception):
    """Raised by a case that cannot run here (reported as SKIP, not a failure)."""


class Report:
    """Runs cases on every rank and prints one line per case on rank 0: PASS, SKIP (a rank raised Skip) or
    FAIL (a rank raised anything else; the first rank's traceback is printed)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.passed, self.failed, self.skipped = 0, 0, 0

    def run(self, name, fn, *args, **kw):
        import torch.distributed as dist
        progress("case %s: start" % name)
        try:
            out = ("pass", fn(*args, **kw))
        except Skip as e:
            out = ("skip", str(e))
        except Exception:  # noqa: BLE001 - reported; the next cases still run
            out = ("fail", "rank %d: %s" % (self.rank, traceback.format_exc()))
        progress("case %s: %s here; waiting for the GPU" % (name, out[0]))
        torch.cuda.synchronize()
        progress("case %s: gathering the ranks' results (all_gather_object)" % name)
        outs = [None] * self.world
        dist.all_gather_object(outs, out)
        progress("case %s: gathered" % name)
        fails = [o[1] for o in outs if o[0] == "fail"]
        skips = [o[1] for o in outs if o[0] == "skip"]
        label = "%s (%d ranks)" % (name, self.world)
        if fails:
            self.failed += 1
            line = "FAIL %s: %s" % (label, fails[0])
        elif skips:
            self.skipped += 1
            line = "SKIP %s: %s" % (label, skips[0])
        else:
            self.passed += 1
            line = "PASS %s%s" % (label, "" if not outs[0][1] else ": %s" % outs[0][1])
        if self.rank == 0:
            print(line, flush=True)

    def summary(self):
        if self.rank == 0:
            print("%d passed, %d failed, %d skipped" % (self.passed, self.failed, self.skipped), flush=True)
        return 1 if self.failed else 0


def fully_shard(*args, **kw):
    """FSDP2's fully_shard (torch.distributed.fsdp since 2.6, torch.distributed._composable.fsdp before)."""
    try:
        from torch.distributed.fsdp import fully_shard as fs
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard as fs
    return fs(*args, **kw)


# --------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------

def full(t):
    """The global tensor of a parameter (collective for a DTensor: call in the same order on every rank)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a, b):
    a, b = a.double(), b.double()
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()


def compare_updates(model, ref, x0, tol, what="parameter"):
    """Every parameter's update X - X0 (model: distributed, ref: plain) within tol; returns the worst.

    full_tensor() is a collective: every rank gathers every parameter before anything is asserted, so a
    difference seen on one rank fails the case on that rank (reported through Report.run's gather) instead of
    leaving the others waiting in the next parameter's all-gather."""
    progress("comparing the updates (full_tensor of every parameter)")
    worst, bad = 0.0, []
    for (name, p), (_, r), r0 in zip(model.named_parameters(), ref.named_parameters(), x0):
        got = full(p) - r0
        want = r.detach() - r0
        d = rel(got, want)
        worst = max(worst, d)
        if not d < tol:
            bad.append("%s %s: relative difference of the update %.3g >= %.1g" % (what, name, d, tol))
    if bad:
        raise AssertionError("; ".join(bad))
    return worst


def on_every_rank(what, fn, *args, **kw):
    """fn(*args, **kw) on every rank, then an agreement (all_gather_object) on whether it raised anywhere:
    if it did, every rank raises with every failing rank's traceback. Used before a sequence of collectives
    (full_tensor of each state), so that a rank whose call failed does not leave the others waiting in
    them."""
    import torch.distributed as dist
    try:
        out, err = fn(*args, **kw), None
    except Exception:  # noqa: BLE001 - re-raised below on every rank
        out, err = None, traceback.format_exc()
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    bad = ["rank %d: %s" % (r, e) for r, e in enumerate(errs) if e]
    if bad:
        raise AssertionError("%s failed on %d rank(s):\n%s" % (what, len(bad), "\n".join(bad)))
    return out


def compare_states(opt, refopt, tol, check=None):
    """Every state of the distributed optimizer's state_dict against the reference's, within tol.

    check(ti, p, name, v) may return a problem (a string) about a state's placements. As in compare_updates,
    every state is gathered (full_tensor, a collective) on every rank before any problem is raised, and
    state_dict() itself is agreed on every rank first (on_every_rank)."""
    sd = on_every_rank("state_dict()", opt.state_dict)
    params = [p for g in opt.param_groups for p in g["params"]]
    bad = []
    for ti, p in enumerate(params):
        for name, v in sd["state"][ti].items():
            if check is not None:
                why = check(ti, p, name, v)
                if why:
                    bad.append("state %r of parameter %d: %s" % (name, ti, why))
            d = rel(full(v), refopt.state(ti, name))
            if not d < tol:
                bad.append("state %r of parameter %d: relative difference %.3g" % (name, ti, d))
    if bad:
        raise AssertionError("; ".join(bad))


# --------------------------------------------------------------------------
# The single-GPU reference (libdion's C API with the distributed run's shard dims)
# --------------------------------------------------------------------------

def shard_dims(p, outer_group=None, inner_group=None):
    """{"outer": d, "inner": d} of a DTensor parameter: the Shard placements over mesh dims of more than one rank
    whose process group has the ranks of the outer / inner group (plain tensors: {})."""
    import torch.distributed as dist
    if not hasattr(p, "placements"):
        return {}
    want = {}
    for role, g in (("outer", outer_group), ("inner", inner_group)):
        if g is not None:
            want[role] = list(dist.get_process_group_ranks(g))
    out = {}
    mesh = p.device_mesh
    for i, pl in enumerate(p.placements):
        if not pl.is_shard() or mesh.size(i) == 1:
            continue
        ranks = list(dist.get_process_group_ranks(mesh.get_group(i)))
        for role, r in want.items():
            if r == ranks:
                out[role] = pl.dim % p.dim()
    return out


def _nccl_one_rank(device):
    lib = libdion.lib()
    uid = L.dion_nccl_unique_id_t()
    libdion.check(lib.dion_nccl_get_unique_id(ctypes.byref(uid)))
    comm = L.dion_comm_t()
    libdion.check(lib.dion_comm_init_nccl(ctypes.byref(comm), ctypes.byref(uid), 1, 0, int(device.index)))
    return comm.value


class Reference:
    """libdion.Optimizer on the plain parameters of `ref_model`, group by group as `dist_opt` (a libdion.torch
    optimizer over `dist_model`), with each matrix's shard dims (full extents) so that Dion's orientation is
    the distributed run's."""

    def __init__(self, dist_opt, dist_model, ref_model, device, seed, outer_group=None, inner_group=None):
        self.device = device
        self.comms = []
        roles = set()
        dims = {id(p): shard_dims(p, outer_group, inner_group) for p in dist_model.parameters()}
        for d in dims.values():
            roles.update(d)
        progress("reference: one-rank NCCL communicators for %s, libdion.Optimizer" % (sorted(roles) or "no mesh"))
        kw = {}
        for role in sorted(roles):
            c = _nccl_one_rank(device)
            self.comms.append(c)
            kw["%s_comm" % role] = c
        self.core = libdion.Optimizer(backend="cuda", device=device.index, seed=seed, **kw)
        ref_of = {id(p): r for p, r in zip(dist_model.parameters(), ref_model.parameters())}
        self.params = []
        # The libdion groups of dist_opt, with the options it gave the library (same tensor order, so the same
        # tensor ids: the same initial Q and sketches from the same seed).
        for group, gb in zip(dist_opt.param_groups, dist_opt._groups):
            if gb.lib_group is None:
                continue
            specs = []
            for p in group["params"]:
                r = ref_of[id(p)]
                f = {}
                for role, d in dims[id(p)].items():
                    f.update({"%s_shard_dim" % role: d, "%s_offset" % role: 0, "%s_extent" % role: r.shape[d]})
                specs.append(TensorSpec(param=r.data_ptr(), grad=None, shape=tuple(r.shape), dtype="fp32", **f))
                self.params.append(r)
            opts = dict(gb.pushed)
            opts.update(gb.frozen)
            self.core.add_group(gb.algorithm, specs, **opts)

    def step(self):
        for i, r in enumerate(self.params):
            self.core.rebind(i, r.data_ptr(), None if r.grad is None else r.grad.data_ptr())
        self.core.step(torch.cuda.current_stream(self.device).cuda_stream)

    def state(self, tensor, name):
        info = self.core.state_info(self.core.find_state(tensor, name))
        t = torch.empty(info["local_shape"], dtype=torch.float32, device=self.device)
        self.core.read_state_into(info["index"], t.data_ptr(), info["local_bytes"],
                                  torch.cuda.current_stream(self.device).cuda_stream)
        return t

    def close(self):
        self.core.close()
        for c in self.comms:
            libdion.lib().dion_comm_destroy(c)
        self.comms = []


def train_both(model, opt, ref, ref_opt, dims, steps, device, rank=0, ranks_of_data=None):
    """`steps` steps of the distributed model (its own batch `rank`) and of the reference (the batches of
    `ranks_of_data`, averaged: the replica-averaged gradient)."""
    for s in range(steps):
        progress("step %d: forward/backward of the distributed model" % s)
        x, y = batch(s, dims, rank, device)
        loss_of(model, x, y).backward()
        progress("step %d: distributed opt.step()" % s, sync=True)
        opt.step()
        opt.zero_grad()
        progress("step %d: reference step" % s, sync=True)
        srcs = ranks_of_data if ranks_of_data is not None else [rank]
        total = None
        for q in srcs:
            xq, yq = batch(s, dims, q, device)
            lq = loss_of(ref, xq, yq) / len(srcs)
            total = lq if total is None else total + lq
        total.backward()
        ref_opt.step()
        for p in ref.parameters():
            p.grad = None
    progress("%d steps done" % steps, sync=True)


def copy_model(model):
    return copy.deepcopy(model)


def dry_run(*dims_list):
    """--dry-run: build the models on the CPU, run one forward, print what would run."""
    for dims in dims_list:
        m = build(dims, 0)
        x, y = batch(0, dims)
        loss = loss_of(m, x, y)
        print("dry run: MLP%s, %d parameters, loss %.4f, groups %s" %
              (tuple(dims), sum(p.numel() for p in m.parameters()), loss.item(),
               [len(g["params"]) for g in groups(m)]))
    return 0

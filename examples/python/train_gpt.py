#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train a small byte-level GPT with libdion's Dion, Muon or AdamW and plot the loss curves.

The data is the source of the Python standard library (every *.py under
sysconfig.get_paths()["stdlib"], concatenated; --data FILE takes any text
file instead), read as bytes: the vocabulary is the 256 byte values. The last
--val-fraction of the bytes is held out for the validation loss.

Parameter groups follow microsoft/dion's advice:
  * matrices of the transformer blocks (attention and MLP weights) use the
    optimizer's own algorithm: Dion (low rank, --rank-fraction, default 0.25)
    or Muon (Nesterov);
  * embeddings, norms and biases use Lion (--scalar-opt adamw for AdamW),
    with the base learning rate and no weight decay;
  * the LM head uses the scalar algorithm with a scaled learning rate
    (lr / sqrt(d_model) for Lion, lr for AdamW) and no weight decay.
--optimizer adamw puts every parameter in an AdamW group instead (the usual
baseline). --optimizer all (or a list such as dion,muon) trains each from the
same initialisation on the same batches and plots them together.

Several ranks (one GPU each; launched by torchrun):
  --ddp             the model in DistributedDataParallel, which averages the
                    gradients; Dion gets the process group as replicate_mesh
                    with replicate_mesh_grad_sync=False, Muon as its
                    distributed_mesh (libdion splits the orthogonalizations
                    over it), AdamW no mesh;
  --ddp-compressed  Dion without the DDP wrapper: replicate_mesh with
                    replicate_mesh_grad_sync=True, so libdion averages P and R
                    (Dion's compressed sync) and the gradients of the Lion
                    groups; Muon and AdamW run as under --ddp;
  --fsdp            FSDP2: fully_shard on every transformer block and on the
                    whole model over a 1-D DeviceMesh; every parameter (the
                    embeddings, norms and LM head too) is a DTensor sharded on
                    dim 0, and the optimizer gets the mesh (Dion:
                    outer_shard_mesh; Muon and AdamW: distributed_mesh).
--batch-size is the global batch: each of the N ranks takes its own
batch_size / N rows of every batch the single-process run draws (the same
seeded windows), so a run on N ranks sees the same data per step as one on a
single device and the curves compare directly; it must be divisible by N. The
validation loss is averaged over the ranks, tokens/s is the rate of all ranks
together, and only rank 0 prints and writes files. The process group uses NCCL
on CUDA (GPU = LOCAL_RANK) and gloo on the CPU. On the CPU libdion's meshes
communicate over MPI: under torchrun --ddp then runs without a mesh (DDP's
averaged gradients are all it needs), while --ddp-compressed and --fsdp need
the ranks started by mpirun (torch's ranks are then MPI's) and mpi4py.

Examples:
    python3 examples/python/train_gpt.py --optimizer all --steps 2000 --device cuda
    torchrun --standalone --nproc_per_node 4 examples/python/train_gpt.py --fsdp --device cuda --optimizer dion,muon
    python3 examples/python/train_gpt.py --layers 2 --d-model 64 --steps 5 --device cpu   # smoke test
    torchrun --standalone --nproc_per_node 2 examples/python/train_gpt.py --ddp --layers 2 --d-model 64 --steps 5 \\
        --device cpu                                                                       # smoke test, gloo

Each run prints the step, train loss, learning rate and tokens/s, and the
validation loss every --eval-every steps, then a "result:" line per optimizer
(final validation loss, tokens/s); the curves go to OUT/losses.csv and, when
matplotlib is importable (apt-get install python3-matplotlib) and --no-plot is
not given, to OUT/losses.png (examples/python/plot_losses.py draws it from the
CSV elsewhere). libdion must be importable (PYTHONPATH=bindings/python or pip
install ./bindings/python) and find libdion.so (LIBDION_PATH, or a build/
directory of the source tree).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import importlib
import math
import os
import pathlib
import sys
import sysconfig
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # run from a source checkout without installing the binding
    import libdion.torch as lt
except ImportError:  # pragma: no cover - depends on how the example is run
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bindings" / "python"))
    import libdion.torch as lt
import libdion

HERE = pathlib.Path(__file__).resolve().parent
OPTIMIZERS = ("dion", "muon", "adamw")
MODES = ("single", "ddp", "ddp-compressed", "fsdp")

# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def stdlib_source() -> bytes:
    """Every *.py of the standard library (third-party site-packages excluded), in path order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py"))
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    if not files:
        raise SystemExit("train_gpt.py: no *.py files under %s; pass --data FILE" % root)
    return b"\n".join(p.read_bytes() for p in files)


def load_data(path: Optional[str], val_fraction: float, context: int) -> Tuple[torch.Tensor, torch.Tensor, str]:
    raw = pathlib.Path(path).read_bytes() if path else stdlib_source()
    what = path or "Python %s standard library sources" % sysconfig.get_python_version()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    n_val = max(int(len(data) * val_fraction), context + 2)
    if len(data) - n_val < context + 2:
        raise SystemExit("train_gpt.py: %s has %d bytes, too few for a context of %d" % (what, len(data), context))
    return data[:-n_val], data[-n_val:], "%s (%.1f MB)" % (what, len(raw) / 1e6)


def batch(data: torch.Tensor, batch_size: int, context: int, gen: torch.Generator, device: torch.device,
          rank: int = 0, world: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows rank*B/N .. (rank+1)*B/N of a global batch of B random windows: inputs (B/N, T) and next-byte
    targets (B/N, T). Every rank draws the same B starts from the same generator, so the ranks together see
    the batch a single process sees."""
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=gen)
    per = batch_size // world
    x = torch.stack([data[s:s + context + 1] for s in starts[rank * per:(rank + 1) * per].tolist()])
    return x[:, :-1].to(device), x[:, 1:].to(device)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, context: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            # Made here rather than kept as a buffer: DDP broadcasts buffers, and gloo has no bool type.
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, context: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, context)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A pre-norm GPT over bytes (vocabulary 256)."""

    def __init__(self, layers: int, d: int, heads: int, context: int):
        super().__init__()
        self.wte = nn.Embedding(256, d)
        self.wpe = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, context) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, 256, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2 and "blocks" in name:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight"))
                                else 0.02)
        nn.init.zeros_(self.lm_head.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --------------------------------------------------------------------------
# Several ranks
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Parallel:
    """How this process takes part: the mode, its rank among `world`, its device, and what the optimizers get."""

    mode: str = "single"                 # one of MODES
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    group: Any = None                    # the process group of --ddp / --ddp-compressed (dist.group.WORLD)
    mesh: Any = None                     # the 1-D DeviceMesh of --fsdp
    lib_meshes: bool = False             # libdion can communicate over them (CUDA: NCCL; CPU: MPI under mpirun)
    launcher: str = ""

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of a tensor of this rank (collective)."""
        if self.world == 1:
            return t
        import torch.distributed as dist
        t = t.detach().clone()
        dist.all_reduce(t)  # SUM: gloo has no AVG
        return t / self.world

    def close(self, barrier: bool = True) -> None:
        """Tears the process group down (after a barrier, unless a rank failed)."""
        if self.mode != "single":
            import torch.distributed as dist
            if dist.is_initialized():
                if barrier:
                    dist.barrier()
                dist.destroy_process_group()


class Refused(Exception):
    """A mode that cannot run here: the message says why and what to do (exit status 2 on every rank)."""


def _mpi_launch() -> bool:
    """Started by mpirun / mpiexec (Open MPI or an MPICH-like PMI)."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def setup_parallel(args) -> Parallel:
    """Initialises torch.distributed for --ddp / --ddp-compressed / --fsdp (env:// rendezvous, as torchrun
    starts the ranks; under mpirun the rank and world size are taken from MPI's environment)."""
    if args.mode == "single":
        return Parallel(device=torch.device(args.device))
    import torch.distributed as dist
    if not dist.is_available():
        raise Refused("--%s: this torch has no torch.distributed" % args.mode)
    env = os.environ
    launcher = "torchrun"
    if "RANK" not in env and _mpi_launch():
        launcher = "mpirun"
        size = env.get("OMPI_COMM_WORLD_SIZE", env.get("PMI_SIZE"))
        rank = env.get("OMPI_COMM_WORLD_RANK", env.get("PMI_RANK"))
        env["RANK"], env["WORLD_SIZE"] = rank, size
        env.setdefault("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("MPI_LOCALRANKID", rank)))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29533")
    if "RANK" not in env or "WORLD_SIZE" not in env:
        raise Refused("--%s: launch the ranks with torchrun, e.g. torchrun --standalone --nproc_per_node N "
                      "examples/python/train_gpt.py --%s ... (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, "
                      "MASTER_PORT); on the CPU mpirun -n N works too" % (args.mode, args.mode))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local = int(env.get("LOCAL_RANK", rank))
    if args.batch_size % world:
        raise Refused("--batch-size %d is the global batch and must be divisible by the %d ranks" %
                      (args.batch_size, world))
    want = torch.device(args.device)
    if want.type == "cuda":
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise Refused("--%s on CUDA: local rank %d has no GPU (%d visible): one GPU per rank" %
                          (args.mode, local, torch.cuda.device_count() if torch.cuda.is_available() else 0))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif want.type == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise Refused("--%s: device %s is not supported (cuda or cpu)" % (args.mode, want))
    # CUDA parameters: libdion makes NCCL communicators over the groups. CPU parameters: MPI ones, split from
    # MPI.COMM_WORLD, which are torch's groups only when mpirun started the ranks.
    lib_meshes = backend == "nccl" or launcher == "mpirun"
    if backend == "gloo" and launcher == "mpirun":
        try:  # MPI initialised now, before libdion's communicators are made
            importlib.import_module("mpi4py.MPI")
        except ImportError:
            lib_meshes = False
    if not lib_meshes and args.mode in ("ddp-compressed", "fsdp"):
        raise Refused("--%s on the CPU: libdion's host backend communicates over MPI, so the optimizer's mesh "
                      "needs the ranks started by mpirun (torch's ranks = MPI's) and mpi4py (apt-get install "
                      "python3-mpi4py): mpirun -n N python3 examples/python/train_gpt.py --%s --device cpu ...; "
                      "or run on CUDA (NCCL)" % (args.mode, args.mode))
    mesh = init_device_mesh = None
    if args.mode == "fsdp":
        try:
            from torch.distributed.device_mesh import init_device_mesh
            _fully_shard()
        except ImportError as e:
            raise Refused("--fsdp needs FSDP2 (fully_shard) and DeviceMesh, torch >= 2.4; this is torch %s (%s)" %
                          (torch.__version__, e))
    if backend == "nccl":
        try:
            dist.init_process_group("nccl", device_id=device)
        except TypeError:  # torch without device_id
            dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    if init_device_mesh is not None:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return Parallel(args.mode, rank, world, device, group=dist.group.WORLD, mesh=mesh, lib_meshes=lib_meshes,
                    launcher=launcher)


def _fully_shard():
    """FSDP2's fully_shard (torch.distributed.fsdp since 2.6, torch.distributed._composable.fsdp before)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def wrap(model: "GPT", name: str, par: Parallel) -> nn.Module:
    """The module the training steps call: the model itself, its DDP wrapper, or the model FSDP2 sharded in
    place (every block, then the root: embeddings, final norm and LM head)."""
    if par.mode == "fsdp":
        fully_shard = _fully_shard()
        for block in model.blocks:
            fully_shard(block, mesh=par.mesh)
        fully_shard(model, mesh=par.mesh)
        return model
    if ddp_wrapped(name, par):
        ids = [par.device.index] if par.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    return model


def ddp_wrapped(name: str, par: Parallel) -> bool:
    return par.mode == "ddp" or (par.mode == "ddp-compressed" and name != "dion")


# --------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------


def param_groups(model: GPT, name: str, args) -> List[Dict]:
    """microsoft/dion's grouping: matrices -> Dion/Muon; embeddings, norms, biases, LM head -> Lion/AdamW."""
    matrices = [p for n, p in model.blocks.named_parameters() if p.dim() == 2]
    vectors = [p for n, p in model.blocks.named_parameters() if p.dim() < 2] + list(model.ln_f.parameters())
    embeddings = list(model.wte.parameters()) + list(model.wpe.parameters())
    head = list(model.lm_head.parameters())
    if name == "adamw":
        return [dict(params=matrices, algorithm="adamw", lr=args.adamw_lr, weight_decay=args.weight_decay),
                dict(params=vectors + embeddings + head, algorithm="adamw", lr=args.adamw_lr, weight_decay=0.0)]
    scalar = args.scalar_opt
    head_lr = args.lr / math.sqrt(args.d_model) if scalar == "lion" else args.lr
    return [dict(params=matrices),  # the optimizer's own algorithm and defaults
            dict(params=vectors + embeddings, algorithm=scalar, lr=args.lr, weight_decay=0.0),
            dict(params=head, algorithm=scalar, lr=head_lr, weight_decay=0.0)]


def mesh_arguments(name: str, par: Parallel) -> Dict[str, Any]:
    """The optimizer's mesh arguments in this mode (see the module docstring)."""
    if par.mode == "fsdp":  # the parameters are DTensors sharded over the mesh: the optimizer must have it
        return dict(outer_shard_mesh=par.mesh) if name == "dion" else dict(distributed_mesh=par.mesh)
    if par.mode == "single" or not par.lib_meshes or name == "adamw":
        return {}
    if name == "dion":
        return dict(replicate_mesh=par.group, replicate_mesh_grad_sync=par.mode == "ddp-compressed")
    return dict(distributed_mesh=par.group)  # muon: gradients averaged by DDP; the group splits the work


def make_optimizer(model: GPT, name: str, args, par: Parallel) -> torch.optim.Optimizer:
    groups = param_groups(model, name, args)
    meshes = mesh_arguments(name, par)
    if name == "dion":
        return lt.Dion(groups, lr=args.lr, rank_fraction=args.rank_fraction, weight_decay=args.weight_decay,
                       seed=args.seed, **meshes)
    if name == "muon":
        return lt.Muon(groups, lr=args.lr, weight_decay=args.weight_decay, nesterov=True, seed=args.seed, **meshes)
    # AdamW everywhere: any libdion.torch class runs algorithm="adamw" groups
    return lt.Muon(groups, betas=(0.9, 0.95), seed=args.seed, **meshes)


def describe_parallel(name: str, opt, par: Parallel) -> str:
    if par.mode == "single":
        return ""
    how = {"fsdp": "FSDP2 fully_shard per block and root",
           "ddp": "DistributedDataParallel"}.get(par.mode, "DistributedDataParallel" if ddp_wrapped(name, par)
                                                 else "no DDP wrapper: libdion averages (compressed sync)")
    meshes = ", ".join("%s=%s" % (k, v) for k, v in opt.meshes.items() if v) or "none"
    note = "" if par.lib_meshes else " (CPU under %s: no libdion mesh; mpirun gives it MPI)" % par.launcher
    return "; %d ranks, %s, libdion meshes: %s%s" % (par.world, how, meshes, note)


def schedule(args):
    """Linear warm-up, then linear decay to 10% (a LambdaLR factor)."""
    warmup = max(1, int(args.warmup * args.steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 1.0 - 0.9 * (step - warmup) / max(1, args.steps - warmup)
    return factor


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    curve: List[Tuple[int, float, Optional[float]]]  # (step, train loss (mean over the ranks), val loss or None)
    tokens_per_s: float                               # all ranks, after the first step (warm-up) until the last


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, args, par: Parallel) -> float:
    """The mean loss of --val-batches fixed batches (each rank its rows; averaged over the ranks)."""
    model.eval()
    gen = torch.Generator().manual_seed(12345)  # the same validation batches for every optimizer
    total = torch.zeros((), device=par.device)
    for _ in range(args.val_batches):
        x, y = batch(val, args.batch_size, args.context, gen, par.device, par.rank, par.world)
        with autocast(par.device, args):
            logits = model(x)
        total += F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
    model.train()
    return par.all_mean(total / args.val_batches).item()


def autocast(device: torch.device, args):
    enabled = device.type == "cuda" and args.amp
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def train(name: str, train_data: torch.Tensor, val_data: torch.Tensor, args, par: Parallel) -> Result:
    say = print if par.main else (lambda *a, **k: None)
    device = par.device
    torch.manual_seed(args.seed)  # the same initial model for every optimizer, on every rank
    model = GPT(args.layers, args.d_model, args.heads, args.context).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    net = wrap(model, name, par)
    opt = make_optimizer(model, name, args, par)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(args))
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every optimizer (and rank)
    kind = "AdamW groups" if name == "adamw" else "%s + %s groups" % (type(opt).__name__, args.scalar_opt.title())
    say("== %s: %.2fM parameters, %d layers, d_model %d, context %d, batch %d; %s on %s (libdion %s backend)%s" %
        (name, n_params / 1e6, args.layers, args.d_model, args.context, args.batch_size, kind, device, opt.backend,
         describe_parallel(name, opt, par)), flush=True)
    train_losses, vals = [], {}  # losses stay on the device until logged: no per-step synchronisation
    tokens = args.batch_size * args.context  # per step, all ranks together
    t_log, tok_log = time.perf_counter(), 0
    run_time, run_tokens = 0.0, 0  # after step 1 (compilation, allocator and communicator warm-up)
    for step in range(1, args.steps + 1):
        x, y = batch(train_data, args.batch_size, args.context, gen, device, par.rank, par.world)
        with autocast(device, args):
            logits = net(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        train_losses.append(loss.detach())
        tok_log += tokens
        do_eval = step % args.eval_every == 0 or step == args.steps
        if step % args.log_every == 0 or do_eval or step == 1:
            train_loss = par.all_mean(loss).item()  # waits for the step (CUDA)
            dt = time.perf_counter() - t_log
            rate = tok_log / dt  # training throughput, evaluation excluded
            if step > 1 or args.steps == 1:
                run_time, run_tokens = run_time + dt, run_tokens + tok_log
            val = evaluate(model, val_data, args, par) if do_eval else None  # not via the DDP wrapper
            if val is not None:
                vals[step] = val
            say("%-5s step %5d/%d  loss %.4f  lr %.2e  %8.0f tok/s%s" %
                (name, step, args.steps, train_loss, opt.param_groups[0]["lr"], rate,
                 "  val %.4f" % val if val is not None else ""), flush=True)
            t_log, tok_log = time.perf_counter(), 0
    losses = par.all_mean(torch.stack(train_losses)).tolist()
    curve = [(i + 1, v, vals.get(i + 1)) for i, v in enumerate(losses)]
    if not math.isfinite(curve[-1][1]):
        print("%s: the loss diverged (NaN/Inf)" % name, file=sys.stderr)
    opt.close()  # its communicators, before the next optimizer's and before destroy_process_group
    del opt, sched, net, model
    gc.collect()
    return Result(curve, run_tokens / run_time if run_time > 0 else float("nan"))


def write_outputs(curves: Dict[str, List], out: pathlib.Path, title: str, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "losses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["optimizer", "step", "train_loss", "val_loss"])
        for name, curve in curves.items():
            for step, tr, val in curve:
                w.writerow([name, step, "%.6f" % tr, "" if val is None else "%.6f" % val])
    print("wrote %s" % (out / "losses.csv"))
    if not plot:
        return
    sys.path.insert(0, str(HERE))
    try:
        from plot_losses import plot as plot_curves
    finally:
        sys.path.remove(str(HERE))
    plot_curves(curves, out / "losses.png", title)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", default="all", help="dion, muon, adamw, all, or a comma-separated list "
                                                       "(default: all)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (several ranks: each rank takes cuda:LOCAL_RANK)")
    p.add_argument("--data", help="a text file to train on (default: the Python standard library's sources)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, help="attention heads (default: d_model / 64, at least 1)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="the global batch (every rank takes batch / ranks "
                                                              "rows of it; default 16)")
    p.add_argument("--lr", type=float, default=0.02, help="Dion/Muon matrices and the Lion/AdamW scalar groups")
    p.add_argument("--adamw-lr", type=float, default=1e-3, help="learning rate of --optimizer adamw")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--rank-fraction", type=float, default=0.25, help="Dion's rank r / min(m, n) (default 0.25)")
    p.add_argument("--scalar-opt", choices=("lion", "adamw"), default="lion")
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the steps")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--no-amp", dest="amp", action="store_false", help="no bf16 autocast on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="train_gpt_out", help="directory for losses.csv and losses.png")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="write losses.csv only (plot it later "
                                                                        "with examples/python/plot_losses.py)")
    par = p.add_mutually_exclusive_group()
    par.add_argument("--ddp", action="store_true", help="DistributedDataParallel over the torchrun ranks")
    par.add_argument("--ddp-compressed", action="store_true", help="Dion's compressed data-parallel sync (no DDP "
                                                                   "wrapper for Dion)")
    par.add_argument("--fsdp", action="store_true", help="FSDP2 sharding over the torchrun ranks")
    args = p.parse_args(argv)
    names = OPTIMIZERS if args.optimizer == "all" else tuple(s.strip() for s in args.optimizer.split(",") if s.strip())
    bad = [n for n in names if n not in OPTIMIZERS]
    if bad or not names or len(set(names)) != len(names):
        p.error("--optimizer %r: give all or a list of distinct names among %s" % (args.optimizer,
                                                                                  ", ".join(OPTIMIZERS)))
    args.optimizers = names
    args.mode = "fsdp" if args.fsdp else "ddp-compressed" if args.ddp_compressed else "ddp" if args.ddp else "single"
    if args.heads is None:
        args.heads = max(1, args.d_model // 64)
    if args.d_model % args.heads:
        p.error("--d-model %d is not a multiple of --heads %d" % (args.d_model, args.heads))
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.batch_size < 1 or args.val_batches < 1:
        p.error("--batch-size and --val-batches must be >= 1")
    args.eval_every = max(1, args.eval_every)
    args.log_every = max(1, args.log_every)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        par = setup_parallel(args)
    except Refused as e:
        rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
        if rank == "0":  # the same on every rank
            print("train_gpt.py: %s" % e, file=sys.stderr)
        return 2
    ok = False
    try:
        rc = run(args, par)
        ok = True
        return rc
    finally:
        par.close(barrier=ok)


def run(args, par: Parallel) -> int:
    say = print if par.main else (lambda *a, **k: None)
    train_data, val_data, what = load_data(args.data, args.val_fraction, args.context)
    say("data: %s: %d train / %d validation bytes" % (what, len(train_data), len(val_data)))
    if par.mode != "single":
        say("ranks: %d (%s, %s on %s; launched by %s); global batch %d = %d per rank" %
            (par.world, par.mode, "nccl" if par.device.type == "cuda" else "gloo", par.device.type, par.launcher,
             args.batch_size, args.batch_size // par.world))
    results: Dict[str, Result] = {}
    refused: Dict[str, str] = {}
    for name in args.optimizers:
        try:
            results[name] = train(name, train_data, val_data, args, par)
        except libdion.DionNotSupported as e:  # the same on every rank: they all go on to the next optimizer
            refused[name] = str(e)
            say("%s: NOT RUN: libdion does not support it in this mode: %s" % (name, e), flush=True)
            gc.collect()
    if not par.main:
        return 1 if refused else 0
    for name, r in results.items():
        print("result: optimizer=%s mode=%s ranks=%d steps=%d val_loss=%.4f train_loss=%.4f tok_per_s=%.0f" %
              (name, par.mode, par.world, args.steps, r.curve[-1][2], r.curve[-1][1], r.tokens_per_s))
    for name, why in refused.items():
        print("result: optimizer=%s mode=%s ranks=%d NOT RUN: %s" % (name, par.mode, par.world, why.splitlines()[0]))
    if results:
        print("final validation loss: " + ", ".join("%s %.4f" % (n, r.curve[-1][2]) for n, r in results.items()))
        title = "byte-level GPT (%d layers, d %d, context %d, batch %d%s) on %s" % (
            args.layers, args.d_model, args.context, args.batch_size,
            "" if par.mode == "single" else ", %s x %d" % (par.mode, par.world), what)
        write_outputs({n: r.curve for n, r in results.items()}, pathlib.Path(args.out), title, args.plot)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train a small byte-level GPT with libdion's Dion, Muon or AdamW and plot the loss curves.

The data is the source of the Python standard library (every *.py under
sysconfig.get_paths()["stdlib"], concatenated; --data FILE takes any text
file instead), read as bytes: the vocabulary is the 256 byte values. The last
--val-fraction of the bytes is held out for the validation loss.

Parameter groups follow microsoft/dion's advice:
  * matrices of the transformer blocks (attention and MLP weights) use the
    optimizer's own algorithm: Dion (low rank, --rank-fraction) or Muon;
  * embeddings, norms and biases use Lion (--scalar-opt adamw for AdamW),
    with the base learning rate and no weight decay;
  * the LM head uses the scalar algorithm with a scaled learning rate
    (lr / sqrt(d_model) for Lion, lr for AdamW) and no weight decay.
--optimizer adamw puts every parameter in an AdamW group instead (the usual
baseline). --optimizer all trains the three from the same initialisation on
the same batches and plots them together.

Examples:
    python3 examples/python/train_gpt.py --optimizer all --steps 2000 --device cuda
    python3 examples/python/train_gpt.py --layers 2 --d-model 64 --steps 5 --device cpu   # smoke test

Each run prints the step, train loss, learning rate and tokens/s, and the
validation loss every --eval-every steps; the curves go to OUT/losses.csv and,
when matplotlib is importable (apt-get install python3-matplotlib), to
OUT/losses.png. libdion must be importable (PYTHONPATH=bindings/python or
pip install ./bindings/python) and find libdion.so (LIBDION_PATH, or a build/
directory of the source tree).
"""
from __future__ import annotations

import argparse
import csv
import math
import pathlib
import sys
import sysconfig
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # run from a source checkout without installing the binding
    import libdion.torch as lt
except ImportError:  # pragma: no cover - depends on how the example is run
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bindings" / "python"))
    import libdion.torch as lt

OPTIMIZERS = ("dion", "muon", "adamw")

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


def batch(data: torch.Tensor, batch_size: int, context: int, gen: torch.Generator,
          device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs (B, T) and next-byte targets (B, T)."""
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=gen)
    x = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
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
        self.register_buffer("mask", torch.ones(context, context, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
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


def make_optimizer(model: GPT, name: str, args) -> torch.optim.Optimizer:
    groups = param_groups(model, name, args)
    if name == "dion":
        return lt.Dion(groups, lr=args.lr, rank_fraction=args.rank_fraction, weight_decay=args.weight_decay,
                       seed=args.seed)
    if name == "muon":
        return lt.Muon(groups, lr=args.lr, weight_decay=args.weight_decay, nesterov=True, seed=args.seed)
    # AdamW everywhere: any libdion.torch class runs algorithm="adamw" groups
    return lt.Muon(groups, betas=(0.9, 0.95), seed=args.seed)


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


@torch.no_grad()
def evaluate(model: GPT, val: torch.Tensor, args, device: torch.device) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(12345)  # the same validation batches for every optimizer
    losses = []
    for _ in range(args.val_batches):
        x, y = batch(val, args.batch_size, args.context, gen, device)
        with autocast(device, args):
            logits = model(x)
        losses.append(F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def autocast(device: torch.device, args):
    enabled = device.type == "cuda" and args.amp
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def train(name: str, train_data: torch.Tensor, val_data: torch.Tensor, args,
          device: torch.device) -> List[Tuple[int, float, Optional[float]]]:
    torch.manual_seed(args.seed)  # the same initial model for every optimizer
    model = GPT(args.layers, args.d_model, args.heads, args.context).to(device)
    opt = make_optimizer(model, name, args)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(args))
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every optimizer
    n_params = sum(p.numel() for p in model.parameters())
    kind = "AdamW groups" if name == "adamw" else "%s + %s groups" % (type(opt).__name__, args.scalar_opt.title())
    print("== %s: %.2fM parameters, %d layers, d_model %d, context %d; %s on %s (libdion %s backend)" %
          (name, n_params / 1e6, args.layers, args.d_model, args.context, kind, device, opt.backend), flush=True)
    train_losses, vals = [], {}  # losses stay on the device until logged: no per-step synchronisation
    tokens = args.batch_size * args.context
    t_log, tok_log = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        x, y = batch(train_data, args.batch_size, args.context, gen, device)
        with autocast(device, args):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        train_losses.append(loss.detach())
        tok_log += tokens
        do_eval = step % args.eval_every == 0 or step == args.steps
        if step % args.log_every == 0 or do_eval or step == 1:
            train_loss = loss.item()  # waits for the step (CUDA)
            rate = tok_log / (time.perf_counter() - t_log)  # training throughput, evaluation excluded
            val = evaluate(model, val_data, args, device) if do_eval else None
            if val is not None:
                vals[step] = val
            print("%-5s step %5d/%d  loss %.4f  lr %.2e  %8.0f tok/s%s" %
                  (name, step, args.steps, train_loss, opt.param_groups[0]["lr"], rate,
                   "  val %.4f" % val if val is not None else ""), flush=True)
            t_log, tok_log = time.perf_counter(), 0
    curve = [(i + 1, v, vals.get(i + 1)) for i, v in enumerate(torch.stack(train_losses).tolist())]
    if not math.isfinite(curve[-1][1]):
        print("%s: the loss diverged (NaN/Inf)" % name, file=sys.stderr)
    return curve


def write_outputs(curves: Dict[str, List], out: pathlib.Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "losses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["optimizer", "step", "train_loss", "val_loss"])
        for name, curve in curves.items():
            for step, tr, val in curve:
                w.writerow([name, step, "%.6f" % tr, "" if val is None else "%.6f" % val])
    print("wrote %s" % (out / "losses.csv"))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable (apt-get install python3-matplotlib): no plot, see the CSV")
        return
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in curves.items():
        steps = [c[0] for c in curve]
        ax_t.plot(steps, [c[1] for c in curve], label=name, linewidth=0.8)
        vs = [(c[0], c[2]) for c in curve if c[2] is not None]
        ax_v.plot([s for s, _ in vs], [v for _, v in vs], marker="o", markersize=3, label=name)
    for ax, what in ((ax_t, "train loss"), (ax_v, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("%s (nats/byte)" % what)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "losses.png", dpi=120)
    print("wrote %s" % (out / "losses.png"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=OPTIMIZERS + ("all",), default="all")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", help="a text file to train on (default: the Python standard library's sources)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, help="attention heads (default: d_model / 64, at least 1)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.02, help="Dion/Muon matrices and the Lion/AdamW scalar groups")
    p.add_argument("--adamw-lr", type=float, default=1e-3, help="learning rate of --optimizer adamw")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--rank-fraction", type=float, default=0.5, help="Dion's rank r / min(m, n)")
    p.add_argument("--scalar-opt", choices=("lion", "adamw"), default="lion")
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the steps")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--no-amp", dest="amp", action="store_false", help="no bf16 autocast on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="train_gpt_out", help="directory for losses.csv and losses.png")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel (not yet supported by this example)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 sharding (not yet supported by this example)")
    args = p.parse_args(argv)
    if args.heads is None:
        args.heads = max(1, args.d_model // 64)
    if args.d_model % args.heads:
        p.error("--d-model %d is not a multiple of --heads %d" % (args.d_model, args.heads))
    if args.steps < 1:
        p.error("--steps must be >= 1")
    args.eval_every = max(1, args.eval_every)
    args.log_every = max(1, args.log_every)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ddp or args.fsdp:
        print("train_gpt.py: --%s is not yet supported by this example, which trains on one device; libdion.torch "
              "itself takes DDP, FSDP2 and tensor-parallel meshes (bindings/python/README.md, 'Several ranks'; "
              "tests/torchrun has small programs for each)" % ("ddp" if args.ddp else "fsdp"), file=sys.stderr)
        return 2
    device = torch.device(args.device)
    train_data, val_data, what = load_data(args.data, args.val_fraction, args.context)
    print("data: %s: %d train / %d validation bytes" % (what, len(train_data), len(val_data)))
    names = OPTIMIZERS if args.optimizer == "all" else (args.optimizer,)
    curves = {name: train(name, train_data, val_data, args, device) for name in names}
    print("final validation loss: " + ", ".join("%s %.4f" % (n, c[-1][2]) for n, c in curves.items()))
    title = "byte-level GPT (%d layers, d %d, context %d) on %s" % (args.layers, args.d_model, args.context, what)
    write_outputs(curves, pathlib.Path(args.out), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())

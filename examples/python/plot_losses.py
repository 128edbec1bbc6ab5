#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Plot the loss curves of train_gpt.py from its losses.csv files.

    python3 examples/python/plot_losses.py OUT                        # OUT/losses.csv -> OUT/losses.png
    python3 examples/python/plot_losses.py OUT/single OUT/ddp2 OUT/fsdp2 -o compare.png

Each argument is a directory holding losses.csv (or the CSV itself). One input is drawn with its
optimizers' names and written next to its CSV (losses.png) unless -o says otherwise; several inputs go into
one figure, labelled DIR:optimizer, written to -o (default: losses_compare.png in the current directory).
The left panel has the training loss of every step, the right one the validation loss at the evaluation
steps. Needs matplotlib (apt-get install python3-matplotlib); so the CSVs of a machine without it (a GPU
machine, say) can be plotted elsewhere.
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import sys
from typing import Dict, List, Optional, Sequence, Tuple

Curve = List[Tuple[int, float, Optional[float]]]  # (step, train loss, validation loss or None)


def csv_path(path) -> pathlib.Path:
    p = pathlib.Path(path)
    return p / "losses.csv" if p.is_dir() else p


def read_curves(path) -> Dict[str, Curve]:
    """optimizer -> curve, in the order of the file (columns optimizer, step, train_loss, val_loss)."""
    curves: Dict[str, Curve] = {}
    with open(csv_path(path), newline="") as f:
        for row in csv.DictReader(f):
            val = row.get("val_loss") or ""
            curves.setdefault(row["optimizer"], []).append(
                (int(row["step"]), float(row["train_loss"]), float(val) if val else None))
    return curves


def plot(curves: Dict[str, Curve], png, title: str) -> bool:
    """Writes the two-panel figure to `png`; False (and a message) when matplotlib is not importable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable (apt-get install python3-matplotlib): no plot, see the CSV "
              "(examples/python/plot_losses.py draws it elsewhere)")
        return False
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in curves.items():
        ax_t.plot([c[0] for c in curve], [c[1] for c in curve], label=name, linewidth=0.8)
        vs = [(c[0], c[2]) for c in curve if c[2] is not None]
        ax_v.plot([s for s, _ in vs], [v for _, v in vs], marker="o", markersize=3, label=name)
    for ax, what in ((ax_t, "train loss"), (ax_v, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("%s (nats/byte)" % what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(str(png), dpi=120)
    plt.close(fig)
    print("wrote %s" % png)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="OUTDIR", help="train_gpt.py output directories (or losses.csv files)")
    p.add_argument("-o", "--output", help="the PNG to write (default: see above)")
    p.add_argument("--title", help="figure title (default: the inputs)")
    args = p.parse_args(argv)
    merged: Dict[str, Curve] = {}
    for inp in args.inputs:
        if not csv_path(inp).is_file():
            p.error("%s not found" % csv_path(inp))
        for name, curve in read_curves(inp).items():
            label = name if len(args.inputs) == 1 else "%s:%s" % (csv_path(inp).parent.name or inp, name)
            merged[label if label not in merged else "%s #%d" % (label, len(merged))] = curve
    if args.output:
        png = pathlib.Path(args.output)
    elif len(args.inputs) == 1:
        png = csv_path(args.inputs[0]).with_name("losses.png")
    else:
        png = pathlib.Path("losses_compare.png")
    title = args.title or "train_gpt.py: " + ", ".join(str(i) for i in args.inputs)
    for label, curve in merged.items():
        last_val = [c[2] for c in curve if c[2] is not None]
        print("%-24s %5d steps  final train %.4f  final val %s" %
              (label, curve[-1][0], curve[-1][1], "%.4f" % last_val[-1] if last_val else "-"))
    return 0 if plot(merged, png, title) else 1


if __name__ == "__main__":
    sys.exit(main())

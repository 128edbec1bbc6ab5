#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Formats dion-bench JSON lines as a markdown table (standard library only).

usage: format_results.py BENCH.jsonl [--commands COMMANDS.txt] > bench.md
"""
import argparse
import json
import sys

# Targets from the issue (median step time on one H100, ms), keyed by
# (workload, algo, param dtype); the value maps a matmul precision to the
# target, None meaning "any precision" (AdamW: no products). The issue's
# figures are for default options: microsoft/dion orthogonalizes the Muon
# family in bf16 whatever the parameter dtype, so those targets apply to the
# bf16-matmul rows only (the fp32 and tf32 rows of fp32 parameters are other
# configurations, compared with no target).
TARGETS = {
    ("gpt-1.3b", "dion", "fp32"): {"fp32": 120.0, "tf32": 30.0},
    ("gpt-1.3b", "dion", "bf16"): {"bf16": 15.0},
    ("gpt-1.3b", "dion-r1", "fp32"): {"fp32": 450.0},
    ("gpt-160m", "dion", "fp32"): {"fp32": 4.0},
    ("gpt-160m", "dion-r1", "fp32"): {"fp32": 15.0},
    ("gpt-1.3b", "muon", "bf16"): {"bf16": 70.0},
    ("gpt-160m", "muon", "fp32"): {"bf16": 3.0},
    ("gpt-1.3b", "dion2", "bf16"): {"bf16": 14.0},
    ("gpt-160m", "normuon", "fp32"): {"bf16": 3.5},
    ("gpt-1.3b", "adamw", "fp32"): {None: 14.0},
}


def target_of(row):
    t = TARGETS.get((row.get("workload"), row.get("algo"), row.get("dtype")))
    if not t:
        return None
    return t.get(row.get("precision"), t.get(None))


def mib(x):
    return "%.1f" % (x / 2**20) if isinstance(x, (int, float)) else ""


def span(values, fmt):
    lo, hi = min(values), max(values)
    return fmt % lo if fmt % lo == fmt % hi else (fmt + "-" + fmt) % (lo, hi)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--commands", help="file with the command lines that produced the results")
    args = ap.parse_args()

    rows, errors = [], []
    with open(args.jsonl, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append({"line": n, "error": "unparsable line: %s" % e})
                continue
            (errors if "error" in row else rows).append(row)

    out = sys.stdout
    out.write("# dion-bench results\n\n")
    devices = sorted({r.get("device", "?") for r in rows + errors if "device" in r})
    if devices:
        out.write("Device: %s\n\n" % ", ".join(devices))
    rates = {}
    for r in rows:
        rates.setdefault(r["precision"], set()).add(r["gemm_tflops"])
    if rates:
        # Every dion-bench process measures the rates again: show their range.
        out.write("Measured GEMM rate (8192^3, TFLOP/s): %s. " % "; ".join(
            "%s %s" % (p, span(v, "%.1f")) for p, v in sorted(rates.items())))
        out.write("Copy bandwidth (read + write, GB/s): %s.\n\n" % span({r["copy_gbps"] for r in rows}, "%.0f"))
    if args.commands:
        with open(args.commands, encoding="utf-8") as f:
            cmds = [c.strip() for c in f if c.strip()]
        if cmds:
            out.write("Commands:\n\n```\n%s\n```\n\n" % "\n".join(cmds))

    if rows:
        out.write("| workload | algo | params | matmul | median ms | min ms | max ms | floor ms | ratio "
                  "| target ms | state MiB | workspace MiB |\n")
        out.write("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            t = target_of(r)
            tcell = ""
            if t is not None:
                tcell = "%g %s" % (t, "ok" if r["step_ms_median"] <= t else "MISSED")
            out.write("| %s | %s | %s | %s | %.3f | %.3f | %.3f | %.3f | %.2f | %s | %s | %s |\n" % (
                r["workload"], r["algo"], r["dtype"], r["precision"], r["step_ms_median"], r["step_ms_min"],
                r["step_ms_max"], r["floor_ms"], r["ratio"], tcell, mib(r.get("state_bytes")),
                mib(r.get("workspace_bytes"))))
        out.write("\n")
    if errors:
        out.write("Errors:\n\n| workload | algo | params | matmul | error |\n|---|---|---|---|---|\n")
        for e in errors:
            msg = str(e.get("error", "")).replace("|", "\\|").replace("\n", " ")
            out.write("| %s | %s | %s | %s | %s |\n" % (
                e.get("workload", ""), e.get("algo", ""), e.get("dtype", ""), e.get("precision", ""), msg))
        out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Kernel time of one optimizer step from an Nsight Compute CSV.

    ncu --metrics gpu__time_duration.sum --csv --cache-control none \\
        --clock-control none --print-units base \\
        build-gpu/dion-bench --workload gpt-1.3b --algo dion --dtype bf16 \\
        --precision bf16 --iters 1 --warmup 1 > step.csv
    bench/ncu_step.py step.csv [--list]

The bench's steps launch the same kernels in the same order, so the last
step is the shortest period (of 10 kernels or more) at which the kernel
names repeat at the end of the trace. Prints its total (ncu runs the
kernels one at a time, so the total is the step's time less launch gaps
and overlap) and its kernels summed by name; --list also prints them in
launch order with grid and block sizes.
"""
import collections
import csv
import re
import sys


def short(name):
    name = name.replace("void ", "").replace("dion::kernels::", "").replace("(anonymous namespace)::", "")
    return re.sub(r"\(.*", "", name.replace("<unnamed>::", ""))[:70]


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    lines = open(argv[1]).read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = [r for r in csv.DictReader(lines[start:]) if r["Metric Name"] == "gpu__time_duration.sum"]
    ks = [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) / 1e3, r["Grid Size"], r["Block Size"])
          for r in rows]
    names = [k[0] for k in ks]
    n = len(names)
    period = next((p for p in range(10, n // 2 + 1) if names[n - p:] == names[n - 2 * p:n - p]), None)
    if period is None:
        print("no repeated step found (run with --warmup >= 1)")
        return 1
    step = ks[n - period:]
    print("kernels in the trace %d, in one step %d, their time %.1f us" % (n, period, sum(k[1] for k in step)))
    agg = collections.OrderedDict()
    for k in step:
        a = agg.setdefault(short(k[0]), [0, 0.0])
        a[0] += 1
        a[1] += k[1]
    for s, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print("%9.1f us %4d  %s" % (t, c, s))
    if "--list" in argv:
        for k in step:
            print("%9.1f  %s grid %s block %s" % (k[1], short(k[0]), k[2], k[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

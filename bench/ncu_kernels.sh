#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Nsight Compute's memory figures for the kernels of dion-bench steps whose
# names match KERNELS (an extended regular expression): time, DRAM bytes read
# and written, DRAM throughput as a share of peak, active warps, registers and
# grid per launch, one CSV per configuration, packed into OUTDIR/ncu.tgz.
#
#   KERNELS='select_momentum|decay_add' bench/ncu_kernels.sh OUTDIR "ALGO DTYPE PRECISION" ...
# Workload: $WORKLOAD (default gpt-1.3b); binary: $DION_BENCH, else build-gpu/dion-bench.
set -uo pipefail
out=$1
shift
mkdir -p "$out/ncu"
bench=${DION_BENCH:-build-gpu/dion-bench}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size
rc=0
for cfg in "$@"; do
  read -r a d p <<<"$cfg"
  f="$out/ncu/$a-$d-$p.csv"
  timeout "${NCU_TIMEOUT:-240}" "$ncu" --metrics "$M" --csv --print-units base -k "regex:${KERNELS:-.}" \
    "$bench" --workload "${WORKLOAD:-gpt-1.3b}" --algo "$a" --dtype "$d" --precision "$p" --iters 1 --warmup 1 \
    >"$f" 2>"$f.err" || rc=1
  echo "$cfg: $(grep -c '"gpu__time_duration.sum"' "$f") launches"
done
tar -C "$out" -czf "$out/ncu.tgz" ncu && rm -rf "$out/ncu"
exit $rc

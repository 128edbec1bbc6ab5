#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# Runs the dion-bench matrix and writes OUTDIR/bench.jsonl (one JSON line per
# configuration), OUTDIR/bench.md (a markdown table), OUTDIR/commands.txt and
# OUTDIR/bench.log (the bench's stderr: device rates, warnings).
#
# usage: bench/run_all.sh OUTDIR [extra dion-bench arguments, e.g. --device 1]
# The binary is $DION_BENCH, else build/dion-bench under the repository root.
# Extra arguments come last on every command line, so they override (the bench
# keeps the last value of a repeated option).
set -uo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUTDIR [dion-bench arguments...]" >&2
  exit 2
fi
out=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
bench=${DION_BENCH:-$root/build/dion-bench}
if [[ ! -x $bench ]]; then
  echo "run_all.sh: $bench is not an executable; build the dion-bench target or set DION_BENCH" >&2
  exit 2
fi
mkdir -p "$out"
: >"$out/bench.jsonl"
: >"$out/bench.log"
: >"$out/commands.txt"

rc=0
run() {
  echo "$bench $*" >>"$out/commands.txt"
  # A failing configuration prints an error line and the bench goes on; a
  # non-zero exit only says that some line is an error.
  "$bench" "$@" >>"$out/bench.jsonl" 2>>"$out/bench.log" || rc=1
}

# 1. The full matrix: both workloads x all algorithms x fp32/bf16 parameters,
#    matmul precision auto (fp32 for fp32 parameters, bf16 for bf16 ones).
run --workload all --algo all --dtype all --precision auto "$@"
# 2. fp32 parameters with tf32 matmuls (the targets' tf32 row).
for algo in dion dion-r1 muon dion2 normuon nordion2; do
  run --workload all --algo "$algo" --dtype fp32 --precision tf32 "$@"
done
# 3. fp32 parameters with bf16 matmuls for the Muon family: microsoft/dion
#    orthogonalizes in bf16 whatever the parameter dtype, so these are the
#    like-for-like rows for its fp32-parameter Muon/NorMuon/Dion2 figures.
for algo in muon dion2 normuon nordion2; do
  run --workload all --algo "$algo" --dtype fp32 --precision bf16 "$@"
done

python3 "$here/format_results.py" "$out/bench.jsonl" --commands "$out/commands.txt" >"$out/bench.md" || rc=1
echo "run_all.sh: wrote $out/bench.jsonl and $out/bench.md" >&2
exit $rc

#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# The rows of issue 3's performance table, one after another on one GPU:
# OUTFILE receives their JSON lines (median step, floor, ratio), and one line
# per row "workload algo dtype precision: median ms (floor ms, ratio)" goes to
# stdout. Then gpt-1.3b NorMuon and NorDion2 (bf16), which the table leaves out.
#
# usage: bench/targets.sh OUTFILE [extra dion-bench arguments, e.g. --device 1]
# The binary is $DION_BENCH, else build-gpu/dion-bench.
set -uo pipefail
out=$1
shift
bench=${DION_BENCH:-build-gpu/dion-bench}
: >"$out"
rc=0
while read -r w a d p; do
  j=$("$bench" --workload "$w" --algo "$a" --dtype "$d" --precision "$p" --iters 20 --warmup 3 "$@" 2>/dev/null | tail -1)
  echo "$j" >>"$out"
  f() { printf '%s' "$j" | sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }
  [ -n "$(f step_ms_median)" ] || rc=1
  echo "$w $a $d $p: $(f step_ms_median) ms (floor $(f floor_ms) ms, ratio $(f ratio))"
done <<'ROWS'
gpt-1.3b dion fp32 fp32
gpt-1.3b dion fp32 tf32
gpt-1.3b dion bf16 bf16
gpt-1.3b dion-r1 fp32 fp32
gpt-160m dion fp32 fp32
gpt-160m dion-r1 fp32 fp32
gpt-1.3b muon bf16 bf16
gpt-160m muon fp32 bf16
gpt-1.3b dion2 bf16 bf16
gpt-160m normuon fp32 bf16
gpt-1.3b adamw fp32 fp32
gpt-1.3b normuon bf16 bf16
gpt-1.3b nordion2 bf16 bf16
ROWS
exit $rc

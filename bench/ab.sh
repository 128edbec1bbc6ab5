#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# A/B of environment switches on one dion-bench binary, in one run: every
# configuration is timed under each setting, the settings interleaved
# (round 1: A B ..., round 2: A B ...), and the median step of each round
# printed, so that drift of the card shows as a spread between rounds rather
# than as a difference between settings.
#
# usage: bench/ab.sh OUTFILE "SETTING_A" "SETTING_B" [...] -- "CONFIG" [...]
#   SETTING: space-separated VAR=VALUE assignments ("" for the defaults)
#   CONFIG:  dion-bench arguments, e.g. "--workload gpt-1.3b --algo muon --dtype bf16"
# The binary is $DION_BENCH, else build-gpu/dion-bench; a setting's own
# DION_BENCH=PATH picks another, so two builds can be compared the same way
# (e.g. a commit against its parent, built beside it with
#   mkdir _old && git archive PARENT | tar -x -C _old && bash _old/tools/gpu_check.sh OUT/old build
# then "DION_BENCH=_old/build-gpu/dion-bench" "" as the settings). ROUNDS (default 2).
# OUTFILE receives the JSON lines, each prefixed with its setting and round.
set -uo pipefail
out=$1
shift
settings=()
while [[ $# -gt 0 && $1 != -- ]]; do
  settings+=("$1")
  shift
done
shift
bench=${DION_BENCH:-build-gpu/dion-bench}
: >"$out"
for cfg in "$@"; do
  line="$cfg:"
  for ((r = 1; r <= ${ROUNDS:-2}; ++r)); do
    for s in "${settings[@]}"; do
      b=$bench
      for a in $s; do
        case $a in DION_BENCH=*) b=${a#DION_BENCH=} ;; esac
      done
      # shellcheck disable=SC2086
      j=$(env $s "$b" $cfg --iters 20 --warmup 3 2>/dev/null | tail -1)
      echo "[$s] round $r $j" >>"$out"
      ms=$(printf '%s' "$j" | sed -n 's/.*"step_ms_median":\([0-9.]*\).*/\1/p')
      line="$line  [${s:-default}] ${ms:-error}"
    done
  done
  echo "$line"
done

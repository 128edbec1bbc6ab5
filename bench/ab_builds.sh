#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# A/B of two builds of dion-bench in one run (e.g. a commit against its
# parent): every configuration is timed with each binary, the binaries
# interleaved (round 1: A B, round 2: A B, ...), and the median step of each
# printed, so drift of the card shows as a spread between rounds rather than
# as a difference between builds.
#
# usage: bench/ab_builds.sh OUTFILE BUILD_A BUILD_B -- "CONFIG" [...]
#   BUILD_*: build folders holding dion-bench (e.g. _old/build-gpu build-gpu)
#   CONFIG:  dion-bench arguments, e.g. "--workload gpt-1.3b --algo muon --dtype bf16"
# The older tree can be built beside the new one with
#   mkdir _old && git archive PARENT | tar -x -C _old && bash _old/tools/gpu_check.sh OUT/old build
# ROUNDS (default 2). OUTFILE receives the JSON lines, each prefixed with its build and round.
set -uo pipefail
out=$1 a=$2 b=$3
shift 3
[ "${1:-}" = -- ] && shift
: >"$out"
for cfg in "$@"; do
  line="$cfg:"
  for ((r = 1; r <= ${ROUNDS:-2}; ++r)); do
    for build in "$a" "$b"; do
      # shellcheck disable=SC2086
      j=$("$build/dion-bench" $cfg --iters 20 --warmup 3 2>/dev/null | tail -1)
      echo "[$build] round $r $j" >>"$out"
      ms=$(printf '%s' "$j" | sed -n 's/.*"step_ms_median":\([0-9.]*\).*/\1/p')
      line="$line  [$build] ${ms:-error}"
    done
  done
  echo "$line"
done

#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Per-stage profile of selected dion-bench configurations: DION_PROFILE=1
# makes the CUDA backend time every backend call with CUDA events and print
# the totals per step when the optimizer is destroyed (stderr).
#
#   bench/profile.sh OUTDIR [BUILD_DIR]
set -uo pipefail
out=$1
build=${2:-build-gpu}
mkdir -p "$out"
run() {
  local tag=$1
  shift
  DION_PROFILE=1 "$build/dion-bench" --iters 10 --warmup 2 "$@" > "$out/$tag.jsonl" 2> "$out/$tag.prof"
  echo "== $tag: $*"
  grep -o '"step_ms_median":[0-9.]*' "$out/$tag.jsonl"
  grep "dion profile" "$out/$tag.prof" | head -${TOP:-12}
}
run 13b-dion-fp32 --workload gpt-1.3b --algo dion --dtype fp32 --precision fp32
run 13b-dion-bf16 --workload gpt-1.3b --algo dion --dtype bf16 --precision bf16
run 13b-dion-r1-fp32 --workload gpt-1.3b --algo dion-r1 --dtype fp32 --precision fp32
run 13b-muon-bf16 --workload gpt-1.3b --algo muon --dtype bf16 --precision bf16
run 13b-dion2-bf16 --workload gpt-1.3b --algo dion2 --dtype bf16 --precision bf16
run 13b-adamw-fp32 --workload gpt-1.3b --algo adamw --dtype fp32 --precision fp32
run 160m-dion-fp32 --workload gpt-160m --algo dion --dtype fp32 --precision fp32
run 160m-dion-r1-fp32 --workload gpt-160m --algo dion-r1 --dtype fp32 --precision fp32
run 160m-normuon-fp32-bf16mm --workload gpt-160m --algo normuon --dtype fp32 --precision bf16
DION_POTRF_BATCHED_MAX=100000 run 13b-dion-fp32-potrfbatched --workload gpt-1.3b --algo dion --dtype fp32 --precision fp32
DION_POTRF_BATCHED_MAX=100000 run 160m-dion-r1-potrfbatched --workload gpt-160m --algo dion-r1 --dtype fp32 --precision fp32

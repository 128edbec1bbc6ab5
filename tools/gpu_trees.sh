#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Candidate trees against the working tree on the GPU machine, in one
# command. A tree is a directory holding a `git archive` copy, made on the
# development machine and carried along as an untracked directory:
#
#   mkdir _x && git archive wip/some-branch | tar -x -C _x
#
# The trees and the working tree are built at once, each by its own
# tools/gpu_check.sh OUT/NAME build (so with the same configuration) into
# its own build-gpu, the cores shared among them; a tree builds only the
# targets of $BUILD_TARGETS where it is set, e.g. "dion-bench
# ops_elementwise ops_linalg" (a whole build of four trees beside the
# working tree takes minutes on 32 cores). Then every tree runs the test specs of $TESTS: "PROGRAM:FILTER"
# runs PROGRAM (tests/) with --gtest_filter=FILTER, "ctest" runs its whole
# `ctest -L gpu`; each spec is bounded by $TEST_TIMEOUT (default 300 s), so
# a kernel that hangs ends there. With two or more GPUs the trees run their
# tests in parallel, dealt round-robin over the GPUs (the trees of one GPU
# one after another).
# Last, bench/ab.sh times the CONFIGS (dion-bench arguments) under every
# build, the working tree's first, interleaved, $ROUNDS rounds (default 2),
# on GPU $AB_GPU (default 0). Logs and ab.jsonl go under OUTDIR.
#
#   TESTS="ops_elementwise:*Lowrank* ops_linalg:*QrQ*" \
#     bash tools/gpu_trees.sh OUTDIR _x _y -- "--workload gpt-160m --algo dion --dtype fp32 --precision fp32" ...
set -uo pipefail
mkdir -p "$1"
out=$(cd "$1" && pwd)  # absolute: each tree's gpu_check.sh runs in its own folder
cd "$(dirname "$0")/.." || exit 1
shift
trees=()
while [[ $# -gt 0 && $1 != -- ]]; do
  trees+=("${1%/}")
  shift
done
[[ $# -gt 0 ]] && shift
t0=$(date +%s)
jobs=$(($(nproc) / (${#trees[@]} + 1)))
((jobs < 2)) && jobs=2
pids=()
for d in "${trees[@]}"; do
  n=$(basename "$d")
  BUILD_JOBS=$jobs bash "$d/tools/gpu_check.sh" "$out/$n" build >"$out/$n-build.txt" 2>&1 &
  pids+=($!)
done
rc=0
BUILD_JOBS=$jobs BUILD_TARGETS='' bash tools/gpu_check.sh "$out/main" build >"$out/main-build.txt" 2>&1 || {
  echo "the working tree's build failed"
  tail -20 "$out/main-build.txt"
  rc=1
}
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || {
    n=$(basename "${trees[$i]}")
    echo "$n: build failed"
    tail -20 "$out/$n-build.txt"
    rc=1
  }
done
echo "builds: $(($(date +%s) - t0)) s"
((rc == 0)) || exit 1

run_tests() {  # tree, GPU
  local d=$1 n
  n=$(basename "$d")
  export CUDA_VISIBLE_DEVICES=$2
  for spec in ${TESTS:-}; do
    local log="$out/$n-${spec%%:*}.log" r
    if [[ $spec == ctest ]]; then
      timeout "${TEST_TIMEOUT:-300}" ctest --test-dir "$d/build-gpu" -L gpu --output-on-failure >"$log" 2>&1
      r=$?
      echo "$n ctest -L gpu: rc=$r $(grep -E 'tests passed|tests failed' "$log" | tail -1)"
    else
      timeout "${TEST_TIMEOUT:-300}" "$d/build-gpu/tests/${spec%%:*}" --gtest_filter="${spec#*:}" >"$log" 2>&1
      r=$?
      echo "$n $spec: rc=$r $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$log" | tr '\n' ' ')"
    fi
    ((r == 124)) && echo "$n $spec: timed out after ${TEST_TIMEOUT:-300} s"
  done
}
if [[ -n ${TESTS:-} ]]; then
  # GPU g runs the trees i with i % ngpu == g, one after another (two
  # suites on one GPU would disturb the tests that measure its free memory)
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  ((ngpu < 1)) && ngpu=1
  tpids=()
  for ((gpu = 0; gpu < ngpu && gpu < ${#trees[@]}; ++gpu)); do
    (for ((i = gpu; i < ${#trees[@]}; i += ngpu)); do run_tests "${trees[$i]}" "$gpu"; done) &
    tpids+=($!)
  done
  for p in "${tpids[@]}"; do wait "$p"; done
fi
if [[ $# -gt 0 ]]; then
  settings=("")
  for d in "${trees[@]}"; do settings+=("DION_BENCH=$d/build-gpu/dion-bench"); done
  CUDA_VISIBLE_DEVICES=${AB_GPU:-0} bash bench/ab.sh "$out/ab.jsonl" "${settings[@]}" -- "$@"
fi

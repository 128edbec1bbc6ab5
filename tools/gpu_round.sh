#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A short GPU round for iterating on the CUDA backend: build + GPU suites
# (tools/gpu_check.sh test), the Muon-family benchmarks, and the GPU suites
# under compute-sanitizer (memcheck, racecheck), each bounded in time.
#   tools/gpu_round.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1
mkdir -p "$out"
bash tools/gpu_check.sh "$out/check" test > "$out/check.txt" 2>&1
tail -6 "$out/check.txt"
grep -E "Failed|FAILED" "$out/check/ctest-gpu.log" | head -20
b=build-gpu/dion-bench
for algo in muon normuon dion2 nordion2; do
  $b --workload all --algo $algo --dtype all --precision auto --iters 20 --warmup 3 2>/dev/null
  $b --workload all --algo $algo --dtype fp32 --precision bf16 --iters 20 --warmup 3 2>/dev/null
done > "$out/bench-muon-family.jsonl"
python3 bench/format_results.py "$out/bench-muon-family.jsonl" 2>/dev/null | grep "^|" || cat "$out/bench-muon-family.jsonl"
cs=compute-sanitizer
command -v $cs > /dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
for t in ops_elementwise ops_linalg test_cuda_api test_cuda_graph test_cuda_precision; do
  timeout 240 $cs --tool memcheck --leak-check full --error-exitcode 9 build-gpu/tests/$t > "$out/memcheck-$t.log" 2>&1
  echo "memcheck $t: rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$out/memcheck-$t.log" | tr '\n' ' ' | cut -c1-200)"
done
for t in ops_elementwise ops_linalg; do
  timeout 240 $cs --tool racecheck --error-exitcode 9 build-gpu/tests/$t > "$out/racecheck-$t.log" 2>&1
  echo "racecheck $t: rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED' "$out/racecheck-$t.log" | tr '\n' ' ' | cut -c1-200)"
done

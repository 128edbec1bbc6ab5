#!/usr/bin/env bash
# On the GPU machine: build for Hopper (sm_90), run the GPU suites and the unit
# suites, and write every log under the folder given as $1 (default: gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-logs}
mkdir -p "$out"
build=${BUILD_DIR:-build-gpu}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
} 2>&1 | tee "$out/device.txt"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDION_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
rc=0
ctest --test-dir "$build" -L gpu --output-on-failure -V > "$out/ctest-gpu.log" 2>&1 || rc=1
grep -E "tests passed|tests failed|differ" "$out/ctest-gpu.log"
ctest --test-dir "$build" -L unit -j "$(nproc)" > "$out/ctest-unit.log" 2>&1 || rc=1
grep -E "tests passed|tests failed" "$out/ctest-unit.log"
exit $rc

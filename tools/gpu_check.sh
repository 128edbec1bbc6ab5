#!/usr/bin/env bash
# On the GPU machine, in one command: build for Hopper (sm_90), run the GPU
# suites (ctest -L gpu), the unit suites, the Python suite (CUDA tensors and
# graph capture included), and the benchmarks, writing every
# log under the folder given as $1 (default: gpu-logs).
#
#   tools/gpu_check.sh OUTDIR [all|build|test|bench|nccl|mesh-bench|torchrun|racecheck|memcheck]
#
# `nccl` runs the NCCL suites (ctest -L nccl: 2 and 4 ranks, one GPU each;
# on a 2-GPU machine the 4-rank runs are skipped) and the op tests;
# `mesh-bench` runs bench/run_mesh.sh (dion-bench-mesh over the layouts that
# fit the visible GPUs); `torchrun` runs tests/torchrun/run_all.sh (the
# PyTorch front end with FSDP2, TP, DCP and DDP on 2 and 4 GPUs);
# `racecheck` runs the op suites under compute-sanitizer racecheck, one
# process per test case in parallel (the whole ops_linalg program under
# racecheck does not finish in 240 s), each bounded by RACECHECK_TIMEOUT
# (default 480 s), the cases whose names match the extended regular
# expression RACECHECK_CASES (default: all) and not RACECHECK_SKIP; `memcheck` runs every GPU test program (tests/gpu) under
# compute-sanitizer memcheck with leak checking, one process per test case,
# MEMCHECK_JOBS (default 12) at a time, each bounded by MEMCHECK_TIMEOUT
# (default 540 s); test_cuda_resources (1000 optimizers, its own leak
# measurement) is left out, and so is CudaApiSteadyState.NoDeviceAllocationAfterWarmup
# and CudaApiState.ReportedWorkspaceCoversTheMemoryTheFirstStepTakes /
# ReportedWorkspaceCoversTheQrStreams (they compare cudaMemGetInfo before and
# after steps, which the tool's own device allocations move); OpsTest.AllocFailureIsOutOfMemory runs with
# --report-api-errors no (its cudaMalloc of more than the device has is the
# point of the test, and memcheck counts the failed call as an error).
# Environment: BUILD_DIR (default build-gpu), BUILD_JOBS (parallel build
# jobs; default the cores), BUILD_TARGETS (only these targets are built;
# default all), BENCH_ARGS (extra dion-bench arguments for a partial
# benchmark run, e.g. "--workload gpt-160m").
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on the lent machines (it can take shared GPUs
# out of service); mpiexec passes the environment on to the ranks.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${1:-gpu-logs}
what=${2:-all}
mkdir -p "$out"
build=${BUILD_DIR:-build-gpu}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  date -u
} 2>&1 | tee "$out/device.txt"
t0=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDION_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
# shellcheck disable=SC2086
cmake --build "$build" -j "${BUILD_JOBS:-$(nproc)}" ${BUILD_TARGETS:+--target $BUILD_TARGETS} > "$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -40; tail -20 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
[ "$what" = build ] && exit 0
rc=0
if [ "$what" = all ] || [ "$what" = test ]; then
  t0=$(date +%s)
  # On a machine of n >= 2 GPUs the suites are dealt round-robin over them,
  # one ctest per GPU in parallel (19 suites: 171 s on 2 H200s against 314 s
  # on one). Each ctest sees its GPU alone, so that no other process's
  # context lands on it while its tests measure the device's free memory;
  # the cases that need a second device, which skip there, then run once
  # with every GPU visible (each must match a test: a renamed one fails
  # here). GPU_SPLIT=0 keeps one ctest.
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  if [ "${GPU_SPLIT:-1}" != 0 ] && [ "$ngpu" -ge 2 ]; then
    pids=()
    for ((i = 0; i < ngpu; ++i)); do
      CUDA_VISIBLE_DEVICES=$i ctest --test-dir "$build" -L gpu -I "$((i + 1)),,$ngpu" --output-on-failure \
        --timeout 300 > "$out/ctest-gpu.$i.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for ((i = 0; i < ngpu; ++i)); do echo "== GPU $i"; cat "$out/ctest-gpu.$i.log"; done > "$out/ctest-gpu.log"
    rm -f "$out"/ctest-gpu.[0-9]*.log
    for spec in "test_cuda_api CudaApiPointers.PointerOnAnotherDeviceIsRejected:CudaApiDevice.SecondDeviceIsHonouredAndCurrentDeviceKept" \
      "ops_linalg OpsTest.CheckPointer"; do
      read -r prog filter <<<"$spec"
      echo "== every GPU: $prog --gtest_filter=$filter" >> "$out/ctest-gpu.log"
      "$build/tests/$prog" --gtest_filter="$filter" > "$out/two-devices.log" 2>&1 || rc=1
      cat "$out/two-devices.log" >> "$out/ctest-gpu.log"
      grep -q "PASSED  \] [1-9]" "$out/two-devices.log" || { rc=1; echo "$prog $filter: no test ran or passed"; }
    done
    rm -f "$out/two-devices.log"
  else
    ctest --test-dir "$build" -L gpu --output-on-failure --timeout 300 > "$out/ctest-gpu.log" 2>&1 || rc=1
  fi
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Exception" "$out/ctest-gpu.log" | head -60
  echo "gpu suites: $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  ctest --test-dir "$build" -L unit -j "$(nproc)" > "$out/ctest-unit.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed" "$out/ctest-unit.log"
  echo "unit suites: $(( $(date +%s) - t0 )) s"
  # The Python binding's suite against this CUDA build: the libdion.torch
  # tests on CUDA tensors and CUDA-graph capture run here (CI has no GPU and
  # skips them), with the rest of the suite.
  t0=$(date +%s)
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHON=python3 \
    timeout "${PYTEST_TIMEOUT:-420}" bash bindings/python/ci.sh "$build" -rs > "$out/pytest.log" 2>&1 || rc=1
  grep -E "passed|failed|error" "$out/pytest.log" | tail -3
  echo "python suite: $(( $(date +%s) - t0 )) s"
fi
if [ "$what" = nccl ]; then
  t0=$(date +%s)
  ctest --test-dir "$build" -L nccl --output-on-failure --timeout 300 > "$out/ctest-nccl.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Skipped|Failure|Which is|Expected" "$out/ctest-nccl.log" | head -60
  echo "nccl suites: $(( $(date +%s) - t0 )) s"
  ctest --test-dir "$build" -R "^ops_" --output-on-failure > "$out/ctest-ops.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed|\(Failed\)" "$out/ctest-ops.log"
fi
if [ "$what" = torchrun ]; then
  LIBDION_PATH="$PWD/$build/libdion.so" bash tests/torchrun/run_all.sh "$out/torchrun" > "$out/torchrun.log" 2>&1 || rc=1
  tail -40 "$out/torchrun.log"
fi
if [ "$what" = racecheck ]; then
  t0=$(date +%s)
  cs=compute-sanitizer
  command -v $cs > /dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
  mkdir -p "$out/racecheck"
  pids=()
  for prog in ops_linalg ops_elementwise; do
    for case in $("$build/tests/$prog" --gtest_list_tests | awk '/^[^ ]/{suite=$1} /^  /{print suite $1}' |
      grep -E -- "${RACECHECK_CASES:-.}" | grep -v -E -- "${RACECHECK_SKIP:-^$}"); do
      timeout "${RACECHECK_TIMEOUT:-480}" $cs --tool racecheck --racecheck-report all --error-exitcode 9 \
        "$build/tests/$prog" --gtest_filter="$case" > "$out/racecheck/$prog.$(echo "$case" | tr / _).log" 2>&1 &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for f in "$out"/racecheck/*.log; do
    echo "$(basename "$f" .log): $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED|SKIPPED' "$f" | tr '\n' ' ' | cut -c1-160)"
  done | tee "$out/racecheck-summary.txt"
  # one file instead of one per case (the run's files come back by count)
  tail -n 5 "$out"/racecheck/*.log > "$out/racecheck-tails.txt" 2>&1; rm -rf "$out/racecheck"
  echo "racecheck: $(( $(date +%s) - t0 )) s"
fi
if [ "$what" = memcheck ]; then
  t0=$(date +%s)
  cs=compute-sanitizer
  command -v $cs > /dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
  mkdir -p "$out/memcheck"
  for prog in "$build"/tests/ops_* "$build"/tests/test_cuda_* "$build"/tests/test_rng_device; do
    name=$(basename "$prog")
    [ -x "$prog" ] && [ "$name" != test_cuda_resources ] || continue
    "$prog" --gtest_list_tests | awk -v p="$name" '/^[^ ]/{suite=$1} /^  /{print p, suite $1}'
  done | grep -v -e " CudaApiSteadyState.NoDeviceAllocationAfterWarmup$" \
    -e " CudaApiState.ReportedWorkspaceCoversTheMemoryTheFirstStepTakes$" \
    -e " CudaApiState.ReportedWorkspaceCoversTheQrStreams$" > "$out/memcheck-cases.txt"
  export cs build out
  xargs -P "${MEMCHECK_JOBS:-12}" -L 1 sh -c 'log="$out/memcheck/$0.$(echo "$1" | tr / _).log"
    api=; case "$1" in *AllocFailureIsOutOfMemory) api="--report-api-errors no";; esac
    timeout "${MEMCHECK_TIMEOUT:-540}" $cs --tool memcheck $api --leak-check full --error-exitcode 9 \
      "$build/tests/$0" --gtest_filter="$1" > "$log" 2>&1; r=$?; echo "$0.$1 rc=$r"; exit $((r != 0))' \
    < "$out/memcheck-cases.txt" > "$out/memcheck-rc.txt" || rc=1
  grep -vc " rc=0$" "$out/memcheck-rc.txt" | sed 's/^/cases with rc != 0: /'
  grep -v " rc=0$" "$out/memcheck-rc.txt"
  for f in "$out"/memcheck/*.log; do
    echo "$(basename "$f" .log): $(grep -E 'ERROR SUMMARY|LEAK SUMMARY|PASSED|FAILED|SKIPPED' "$f" | tr '\n' ' ' | cut -c1-160)"
  done > "$out/memcheck-summary.txt"
  echo "memcheck: $(wc -l < "$out/memcheck-cases.txt") cases, $(grep -c 'ERROR SUMMARY: 0 errors' "$out/memcheck-summary.txt") with 0 errors"
  tail -n 5 "$out"/memcheck/*.log > "$out/memcheck-tails.txt" 2>&1; rm -rf "$out/memcheck"
  echo "memcheck: $(( $(date +%s) - t0 )) s"
fi
if [ "$what" = mesh-bench ]; then
  DION_BENCH_MESH="$build/dion-bench-mesh" bash bench/run_mesh.sh "$out" "${MESH_ALGOS:-dion muon dion2}" || rc=1
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  t0=$(date +%s)
  if [ -f bench/run_all.sh ] && [ -z "${BENCH_ARGS:-}" ]; then
    DION_BENCH="$build/dion-bench" bash bench/run_all.sh "$out" > "$out/bench-run.log" 2>&1 || rc=1
  else
    # shellcheck disable=SC2086
    "$build/dion-bench" ${BENCH_ARGS:-} > "$out/bench.jsonl" 2> "$out/bench-run.log" || rc=1
  fi
  cat "$out/bench.jsonl" 2>/dev/null | head -80
  echo "bench: $(( $(date +%s) - t0 )) s"
fi
exit $rc

#!/usr/bin/env bash
# On a multi-GPU machine, one bounded round of the distributed checks:
# build, the NCCL kill-a-rank and shard suites, the PyTorch front end under
# torchrun on 2 GPUs, and dion-bench-mesh on a few layouts. Logs under $1.
#   tools/gpu_dist_round.sh OUTDIR
# Environment: NCCL_TESTS (ctest -R regex), TORCHRUN_CASES, MESH_LAYOUTS.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
b=build-gpu
bash tools/gpu_check.sh "$out" build | tail -3 || exit 1
rc=0
echo "== ctest nccl: ${NCCL_TESTS:-kill|nccl_shard_np4}"
timeout 200 ctest --test-dir "$b" -L nccl -R "${NCCL_TESTS:-kill|nccl_shard_np4}" --output-on-failure \
  > "$out/ctest-nccl.log" 2>&1 || rc=1
grep -E "Test #|tests passed|KILL-TEST" "$out/ctest-nccl.log" | cut -c1-300
echo "== torchrun (2 GPUs): ${TORCHRUN_CASES:-tp fsdp ddp dcp}"
NPROCS=2 CASES="${TORCHRUN_CASES:-tp fsdp ddp dcp}" CASE_TIMEOUT=80 LIBDION_PATH="$PWD/$b/libdion.so" \
  timeout 360 bash tests/torchrun/run_all.sh "$out/torchrun" > "$out/torchrun.log" 2>&1 || rc=1
grep -E "PASS|FAIL|SKIP|run_all" "$out/torchrun.log" | cut -c1-300
echo "== dion-bench-mesh"
for spec in ${MESH_LAYOUTS:-1:1x1x1:dion 4:4x1x1:dion 4:1x4x1:dion 4:1x1x4:dion 4:2x2x1:dion 4:1x2x2:dion 1:1x1x1:muon 4:1x4x1:muon 4:2x2x1:muon}; do
  IFS=: read -r n mesh algo <<< "$spec"
  timeout 60 mpiexec --oversubscribe -n "$n" "$b/dion-bench-mesh" --mesh "$mesh" --algo "$algo" --iters 20 \
    >> "$out/bench-mesh.jsonl" 2>> "$out/bench-mesh.err" || { echo "FAILED: $algo $mesh"; rc=1; }
done
cat "$out/bench-mesh.jsonl"
exit $rc

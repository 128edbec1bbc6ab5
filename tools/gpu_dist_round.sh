#!/usr/bin/env bash
# On a multi-GPU machine (2 or 4 GPUs), the distributed checks in parts that
# each fit one 10-minute command of the lent machines. Logs under OUTDIR.
#
#   tools/gpu_dist_round.sh OUTDIR [nccl|torchrun|bench|train|all]
#
#   nccl      build; ctest -L nccl (every NCCL suite at 2 ranks, and at 4 when
#             4 GPUs are visible: collectives, shard, megabatch, overlap,
#             kill_rank) and ctest -L gpu (the single-GPU suites, incl. the
#             two-device cases)
#   torchrun  build libdion; tests/torchrun/run_all.sh at 2 and 4 ranks
#             (FSDP2, TP, FSDP2 x TP on 4, DCP, DDP)
#   bench     build; dion-bench-mesh over the layouts that fit (bench/run_mesh.sh)
#             for MESH_ALGOS (default "dion muon dion2")
#   train     build libdion; examples/python/train_gpt.py with --ddp and --fsdp on
#             2 (and 4) GPUs against one GPU (tools/gpu_train_gpt.sh dist)
#   all       the four in turn (longer than one command of the lent machines)
#
# Every part is bounded by `timeout`; the exit status is 1 if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-logs}
what=${2:-all}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
b=build-gpu
ngpu=$(nvidia-smi -L | wc -l)
nprocs=2
[ "$ngpu" -ge 4 ] && nprocs="2 4"
rc=0
build_all() { bash tools/gpu_check.sh "$out" build | tail -2 || exit 1; }
build_lib() {
  cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDION_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    > "$out/configure-lib.log" 2>&1 && cmake --build "$b" --target dion -j > "$out/build-lib.log" 2>&1 ||
    { tail -30 "$out/build-lib.log"; exit 1; }
}
if [ "$what" = nccl ] || [ "$what" = all ]; then
  build_all
  echo "== ctest -L nccl ($ngpu GPUs)"
  timeout 420 ctest --test-dir "$b" -L nccl --output-on-failure --timeout 200 > "$out/ctest-nccl.log" 2>&1 || rc=1
  grep -E "Test +#|tests passed|tests failed" "$out/ctest-nccl.log" | cut -c1-200
  echo "== ctest -L gpu"
  timeout 150 ctest --test-dir "$b" -L gpu --output-on-failure --timeout 140 > "$out/ctest-gpu.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed|\(Failed\)" "$out/ctest-gpu.log"
fi
if [ "$what" = torchrun ] || [ "$what" = all ]; then
  build_lib
  echo "== torchrun at $nprocs ranks: ${TORCHRUN_CASES:-fsdp tp fsdp_tp dcp ddp}"
  NPROCS="$nprocs" CASES="${TORCHRUN_CASES:-fsdp tp fsdp_tp dcp ddp}" CASE_TIMEOUT=${CASE_TIMEOUT:-60} \
    LIBDION_PATH="$PWD/$b/libdion.so" timeout 540 bash tests/torchrun/run_all.sh "$out/torchrun" \
    > "$out/torchrun.log" 2>&1 || rc=1
  grep -E "PASS|FAIL|SKIP|run_all" "$out/torchrun.log" | cut -c1-300
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  build_all
  echo "== dion-bench-mesh: ${MESH_ALGOS:-dion muon dion2}"
  DION_BENCH_MESH="$b/dion-bench-mesh" timeout 500 bash bench/run_mesh.sh "$out/mesh" "${MESH_ALGOS:-dion muon dion2}" \
    > /dev/null || rc=1
  cat "$out/mesh/bench-mesh.jsonl"
fi
if [ "$what" = train ] || [ "$what" = all ]; then
  build_lib
  NPROCS="$nprocs" DIST_MODES="ddp fsdp" DIST_STEPS=${DIST_STEPS:-100} TOTAL_TIMEOUT=500 \
    LIBDION_PATH="$PWD/$b/libdion.so" bash tools/gpu_train_gpt.sh "$out/gpt" dist > "$out/gpt.log" 2>&1 || rc=1
  tail -12 "$out/gpt.log"
fi
exit $rc

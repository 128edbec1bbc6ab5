#!/usr/bin/env bash
# Runs dion-bench-mesh over the mesh layouts that fit the visible GPUs (one
# MPI rank per GPU) and appends the JSON lines to OUTDIR/bench-mesh.jsonl.
#
#   DION_BENCH_MESH=build-gpu/dion-bench-mesh bash bench/run_mesh.sh OUTDIR [ALGOS]
#
# ALGOS (default "dion muon"): --algo values. Layouts: 1x1x1 (one GPU, the
# baseline), and for 2 and 4 GPUs every RxOxI with R*O*I = GPUs. A layout
# with a replicate mesh (R > 1) is timed three times (overlapped, sequential
# with DION_OVERLAP=0, and without the replicate sync) for the JSON line's
# hidden_share (docs/benchmarks.md); MESH_ARGS="--hidden-share 0" skips that.
set -uo pipefail
out=${1:?OUTDIR}
algos=${2:-dion muon}
bin=${DION_BENCH_MESH:-build-gpu/dion-bench-mesh}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ngpu=$(nvidia-smi -L | wc -l)
mkdir -p "$out"
layouts="1:1x1x1"
[ "$ngpu" -ge 2 ] && layouts="$layouts 2:2x1x1 2:1x2x1 2:1x1x2"
[ "$ngpu" -ge 4 ] && layouts="$layouts 4:4x1x1 4:1x4x1 4:1x1x4 4:2x2x1 4:1x2x2 4:2x1x2"
[ "$ngpu" -ge 8 ] && layouts="$layouts 8:2x2x2 8:1x8x1 8:8x1x1"
rc=0
for algo in $algos; do
  for l in $layouts; do
    n=${l%%:*}
    mesh=${l#*:}
    # shellcheck disable=SC2086
    mpiexec --oversubscribe -n "$n" "$bin" --mesh "$mesh" --algo "$algo" ${MESH_ARGS:-} \
      >> "$out/bench-mesh.jsonl" 2>> "$out/bench-mesh.err" || { echo "FAILED: $algo $mesh" >&2; rc=1; }
  done
done
cat "$out/bench-mesh.jsonl"
exit $rc

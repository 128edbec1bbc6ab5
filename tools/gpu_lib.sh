# SPDX-License-Identifier: MIT
# Sourced by the tools/gpu_*_check.sh scripts (GPU machine, repository root).
#
# gpu_setup OUTDIR: creates OUTDIR, sets $out and $b (the build folder),
# exports the lent machines' NCCL/MPI settings, builds (tools/gpu_check.sh
# OUTDIR build); returns non-zero when the build fails.
gpu_setup() {
  out=${1:-gpu-logs}
  b=build-gpu
  mkdir -p "$out"
  export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  bash tools/gpu_check.sh "$out" build | tail -1
  return "${PIPESTATUS[0]}"
}

# mesh_run N TAG [VAR=VALUE ...] -- DION_BENCH_MESH_ARGS...
# dion-bench-mesh on N ranks with the assignments in its environment (each
# forwarded to the ranks), bounded by MESH_TIMEOUT seconds (default 90);
# appends its JSON line to $out/mesh.jsonl and its stderr to
# $out/mesh-TAG.err, and prints TAG, algorithm, mesh, median step (ms) and
# the outer and inner bytes per step.
mesh_run() {
  local n=$1 tag=$2
  shift 2
  local envs=() fwd=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    envs+=("$1")
    fwd+=(-x "${1%%=*}")
    shift
  done
  [ $# -gt 0 ] && shift
  env "${envs[@]}" timeout "${MESH_TIMEOUT:-90}" mpiexec --oversubscribe "${fwd[@]}" -n "$n" "$b/dion-bench-mesh" "$@" \
    2>>"$out/mesh-$tag.err" | tee -a "$out/mesh.jsonl" |
    python3 -c "import sys,json; [print('$tag', d['algo'], d['mesh'], d['step_ms_median'], d['bytes_per_step_outer'], d['bytes_per_step_inner']) for d in map(json.loads, sys.stdin)]"
}

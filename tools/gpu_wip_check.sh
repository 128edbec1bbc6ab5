#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# On a 4-GPU machine, in one command of at most 10 minutes: the checks this
# branch's unverified changes need (Dion's bucket-by-bucket bf16 P
# communication: the shard suites; the Muon family's pipelined group step:
# the megabatch and overlap suites), then Muon's and Dion2's FSDP steps with
# and without the pipeline and Dion's FSDP step and bytes. Logs under OUTDIR.
#   tools/gpu_wip_check.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
b=build-gpu
bash tools/gpu_check.sh "$out" build | tail -1 || exit 1
rc=0
for suite in shard megabatch overlap; do
  t0=$(date +%s)
  timeout 250 ctest --test-dir $b -R "nccl_${suite}_np" --output-on-failure --timeout 240 > "$out/ctest-$suite.log" 2>&1 || rc=1
  grep -E "Test +#|Failure|Which is|Expected" "$out/ctest-$suite.log" | head -12
  echo "$suite: $(( $(date +%s) - t0 )) s"
done
mesh() {  # N MESH ALGO TAG [env...]
  local n=$1 m=$2 a=$3 tag=$4
  shift 4
  env "$@" timeout 60 mpiexec --oversubscribe -x DION_MEGABATCH_PIPELINE -n "$n" $b/dion-bench-mesh --mesh "$m" --algo "$a" \
    --iters 20 --hidden-share 0 2>>"$out/mesh.err" | tee -a "$out/mesh.jsonl" |
    python3 -c "import sys,json; [print('$tag', d['algo'], d['mesh'], d['step_ms_median'], d['bytes_per_step_outer']) for d in map(json.loads, sys.stdin)]"
}
mesh 4 1x4x1 muon pipelined DION_MEGABATCH_PIPELINE=1
mesh 4 1x4x1 muon bucket-by-bucket DION_MEGABATCH_PIPELINE=0
mesh 4 1x4x1 muon pipelined DION_MEGABATCH_PIPELINE=1
mesh 4 1x4x1 dion2 pipelined DION_MEGABATCH_PIPELINE=1
mesh 4 1x4x1 dion2 bucket-by-bucket DION_MEGABATCH_PIPELINE=0
mesh 4 1x4x1 dion default DION_MEGABATCH_PIPELINE=1
exit $rc

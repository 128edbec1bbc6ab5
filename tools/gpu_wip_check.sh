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
. tools/gpu_lib.sh
gpu_setup "${1:-gpu-logs}" || exit 1
rc=0
for suite in shard megabatch overlap; do
  t0=$(date +%s)
  timeout 250 ctest --test-dir $b -R "nccl_${suite}_np" --output-on-failure --timeout 240 > "$out/ctest-$suite.log" 2>&1 || rc=1
  grep -E "Test +#|Failure|Which is|Expected" "$out/ctest-$suite.log" | head -12
  echo "$suite: $(( $(date +%s) - t0 )) s"
done
MESH_TIMEOUT=60
mesh() {  # N MESH ALGO TAG [VAR=VALUE...]
  local n=$1 m=$2 a=$3 tag=$4
  shift 4
  mesh_run "$n" "$tag" "$@" -- --mesh "$m" --algo "$a" --iters 20 --hidden-share 0
}
mesh 4 1x4x1 muon pipelined DION_MEGABATCH_PIPELINE=1
mesh 4 1x4x1 muon bucket-by-bucket DION_MEGABATCH_PIPELINE=0
mesh 4 1x4x1 muon pipelined DION_MEGABATCH_PIPELINE=1
mesh 4 1x4x1 dion2 pipelined DION_MEGABATCH_PIPELINE=1
mesh 4 1x4x1 dion2 bucket-by-bucket DION_MEGABATCH_PIPELINE=0
mesh 4 1x4x1 dion default DION_MEGABATCH_PIPELINE=1
exit $rc

#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# On a 4-GPU machine, in one command of at most 10 minutes: the checks of
# Dion over the inner (TP) mesh: the shard and overlap NCCL suites at 2 and 4
# ranks, then Dion's 1x2x2 (FSDP x TP) step phased and bucket by bucket
# (DION_PHASED=0) with its bytes, and 1x4x1 and 1x1x1 for reference. Logs
# under OUTDIR.
#   tools/gpu_tp_check.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_lib.sh
gpu_setup "${1:-gpu-logs}" || exit 1
rc=0
for t in shard_np2 shard_np4 overlap_np2 overlap_np4; do
  t0=$(date +%s)
  timeout 170 ctest --test-dir $b -R "nccl_${t}\$" --output-on-failure --timeout 160 > "$out/ctest-$t.log" 2>&1 || rc=1
  echo "$t: rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "Failure|Which is|Expected|FAILED" "$out/ctest-$t.log" | head -8
done
MESH_TIMEOUT=60
args=(--algo dion --workload gpt-1.3b --dtype bf16 --iters 20 --hidden-share 0)
for r in 1 2; do
  mesh_run 4 phased DION_PHASED=1 -- --mesh 1x2x2 "${args[@]}"
  mesh_run 4 bucket-by-bucket DION_PHASED=0 -- --mesh 1x2x2 "${args[@]}"
done
mesh_run 4 phased DION_PHASED=1 -- --mesh 1x4x1 "${args[@]}"
mesh_run 1 one DION_PHASED=1 -- --mesh 1x1x1 "${args[@]}"
exit $rc

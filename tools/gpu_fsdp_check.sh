#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# On a 4-GPU machine, in one command of at most 10 minutes: where the FSDP
# Dion step's time goes (issue 4's target: the 1x4x1 step at most 1/3 of the
# one-GPU step). Builds, then for gpt-1.3b bf16 Dion: the 1x4x1 and 1x1x1
# steps (two rounds), DION_PROFILE=1 of both (every rank's breakdown of
# 1x4x1), the same with the collectives on the caller's stream
# (DION_OVERLAP=0), an Nsight Systems trace of rank 0 of 1x4x1 summarised by
# kernel (NCCL's kernels included) where nsys is installed, and the own
# Cholesky above its default bound (DION_OWN_CHOLESKY_MAX=2048 against the
# default, full-rank Dion, one GPU). Logs under OUTDIR.
#   tools/gpu_fsdp_check.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_lib.sh
gpu_setup "${1:-gpu-logs}" || exit 1
args=(--algo dion --workload gpt-1.3b --dtype bf16 --hidden-share 0)
for r in 1 2; do
  mesh_run 4 fsdp -- --mesh 1x4x1 "${args[@]}" --iters 20
  mesh_run 1 one -- --mesh 1x1x1 "${args[@]}" --iters 20
  mesh_run 4 fsdp-overlap0 DION_OVERLAP=0 -- --mesh 1x4x1 "${args[@]}" --iters 20
done
mesh_run 4 fsdp-profile DION_PROFILE=1 -- --mesh 1x4x1 "${args[@]}" --iters 12
grep "dion profile" "$out/mesh-fsdp-profile.err" | head -60
mesh_run 1 one-profile DION_PROFILE=1 -- --mesh 1x1x1 "${args[@]}" --iters 12
grep "dion profile" "$out/mesh-one-profile.err" | head -20
if command -v nsys > /dev/null; then
  timeout 150 mpiexec --oversubscribe -n 4 bash -c 'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then
      exec nsys profile -t cuda,nvtx -o "'"$out"'/fsdp-rank0" --force-overwrite true "$@"; else exec "$@"; fi' _ \
    $b/dion-bench-mesh --mesh 1x4x1 "${args[@]}" --iters 10 > "$out/nsys-run.log" 2>&1
  nsys stats --report cuda_gpu_kern_sum --format csv "$out/fsdp-rank0.nsys-rep" > "$out/nsys-kern.csv" 2>/dev/null
  python3 - "$out/nsys-kern.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
h = rows[0]; data = [dict(zip(h, r)) for r in rows[1:]]
key = next(k for k in h if k.startswith("Total Time"))
tot = sum(float(d[key]) for d in data)
nccl = sum(float(d[key]) for d in data if "nccl" in d.get("Name", "").lower())
steps = 15  # 5 warm-up + 10 timed
print("rank 0 kernels per step: %.2f ms in all, NCCL %.2f ms (%d kernels listed)" % (tot / 1e6 / steps, nccl / 1e6 / steps, len(data)))
for d in sorted(data, key=lambda d: -float(d[key]))[:25]:
    print("%8.3f ms/step %8s  %s" % (float(d[key]) / 1e6 / steps, d.get("Instances", ""), d.get("Name", "")[:110]))
PY
else
  echo "nsys not installed"
fi
ROUNDS=2 bash bench/ab.sh "$out/ab-large.jsonl" "DION_OWN_CHOLESKY_MAX=2048" "" -- \
  "--workload gpt-160m --algo dion-r1 --dtype fp32" "--workload gpt-1.3b --algo dion-r1 --dtype bf16"

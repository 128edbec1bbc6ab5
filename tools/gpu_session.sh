#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# One command for the GPU machine: build for sm_90, then in parallel
#   GPU 0: ctest -L gpu (every single-GPU suite)
#   GPU 1: EXTRA1 (a command, eval'd, output in OUTDIR/extra1.txt; an A/B,
#          say), bench/targets.sh (issue 3's rows), the DION_PROFILE=2
#          profiles of PROFILE_ROWS (dion-bench arguments, ';'-separated;
#          default none), then the Python suite against the CUDA build
# and after both, ctest -L nccl at 2 ranks (NP4=1: also at 4 when 4 GPUs are
# visible). With 4 GPUs the 2-rank NCCL suites run on GPUs 2 and 3 beside the
# two lanes instead of after them; NCCL=0 leaves the NCCL suites out (for a
# second command on the same lease). With one GPU the two lanes run one
# after the other on it (about 7 minutes in all on an H200) and the NCCL
# suites, which need a GPU per rank, are left out. Logs under OUTDIR; the
# exit status is 1 if any suite failed.
#
#   tools/gpu_session.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
b=build-gpu
bash tools/gpu_check.sh "$out" build || exit 1
rc=0
t0=$(date +%s)
gpus=$(nvidia-smi -L | wc -l)
lane1_gpu=1
[ "$gpus" -ge 2 ] || lane1_gpu=0
lane0() {
  CUDA_VISIBLE_DEVICES=0 ctest --test-dir $b -L gpu --output-on-failure --timeout 300 > "$out/ctest-gpu.log" 2>&1
  echo "gpu suites rc=$? after $(( $(date +%s) - t0 )) s: $(grep -E 'tests passed' "$out/ctest-gpu.log")"
  grep -E "\(Failed\)|\(Timeout\)" "$out/ctest-gpu.log" | head -20
}
lane1() {
  export CUDA_VISIBLE_DEVICES=$lane1_gpu
  if [ -n "${EXTRA1:-}" ]; then
    eval "$EXTRA1" > "$out/extra1.txt" 2>&1
    echo "EXTRA1 rc=$? after $(( $(date +%s) - t0 )) s"
  fi
  DION_BENCH=$b/dion-bench bash bench/targets.sh "$out/targets.jsonl"
  echo "targets after $(( $(date +%s) - t0 )) s"
  i=0
  IFS=';' read -ra rows <<< "${PROFILE_ROWS:-}"
  for r in "${rows[@]}"; do
    [ -n "$r" ] || continue
    i=$((i + 1))
    # shellcheck disable=SC2086
    DION_PROFILE=2 $b/dion-bench --iters 10 --warmup 2 $r > "$out/profile-$i.jsonl" 2> "$out/profile-$i.txt"
    echo "== profile $i: $r: $(grep -o '"step_ms_median":[0-9.]*' "$out/profile-$i.jsonl")"
  done
  echo "profiles after $(( $(date +%s) - t0 )) s"
  PYTHON=python3 timeout 420 bash bindings/python/ci.sh $b -rs > "$out/pytest.log" 2>&1
  echo "python suite rc=$? after $(( $(date +%s) - t0 )) s: $(grep -E 'passed|failed' "$out/pytest.log" | tail -1)"
}
if [ "$gpus" -ge 2 ]; then
  lane0 > "$out/lane0.txt" 2>&1 &
  p0=$!
  lane1 > "$out/lane1.txt" 2>&1 &
  p1=$!
else
  # one GPU: the lanes one after the other (the timings then have the card to themselves)
  (lane0 > "$out/lane0.txt" 2>&1; lane1 > "$out/lane1.txt" 2>&1) &
  p0=$!
  p1=
fi
p2=
if [ "$gpus" -ge 4 ] && [ "${NCCL:-1}" != 0 ]; then
  (
    CUDA_VISIBLE_DEVICES=2,3 ctest --test-dir $b -L nccl -R '_np2$' --output-on-failure --timeout 300 \
      > "$out/ctest-nccl2.log" 2>&1
    echo "nccl (_np2\$, GPUs 2 and 3) rc=$? after $(( $(date +%s) - t0 )) s: $(grep -E 'tests passed' "$out/ctest-nccl2.log")"
    grep -E "\(Failed\)|\(Timeout\)" "$out/ctest-nccl2.log" | head
  ) > "$out/lane2.txt" 2>&1 &
  p2=$!
fi
wait $p0
[ -n "$p1" ] && wait $p1
[ -n "$p2" ] && wait $p2
cat "$out/lane0.txt" "$out/lane1.txt"
grep -q "gpu suites rc=0" "$out/lane0.txt" || rc=1
grep -q "python suite rc=0" "$out/lane1.txt" || rc=1
# The 2-rank suites here unless lane 2 ran them; the 4-rank ones with NP4=1
# (lane 2 exists exactly when 4 GPUs are visible).
sel='_np2$'
[ "${NCCL:-1}" = 0 ] && sel=
if [ "$gpus" -lt 2 ] && [ "${NCCL:-1}" != 0 ]; then
  echo "one GPU: the NCCL suites (a GPU per rank) not run"
  sel=
fi
if [ -n "$p2" ]; then
  cat "$out/lane2.txt"
  grep -q "rc=0" "$out/lane2.txt" || rc=1
  sel=
  [ "${NP4:-0}" = 1 ] && sel='_np4$'
fi
if [ -n "$sel" ]; then
  t0=$(date +%s)
  ctest --test-dir $b -L nccl -R "$sel" --output-on-failure --timeout 300 > "$out/ctest-nccl.log" 2>&1 || rc=1
  echo "nccl ($sel) after $(( $(date +%s) - t0 )) s: $(grep -E 'tests passed' "$out/ctest-nccl.log")"
  grep -E "\(Failed\)|\(Timeout\)" "$out/ctest-nccl.log" | head
fi
exit $rc

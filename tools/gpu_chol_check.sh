#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# On one GPU, in one command: the checks of the backend's own blocked
# Cholesky (DION_OWN_CHOLESKY): build, ops_linalg (its Cholesky and QR tests
# run both factorizations), the isolated timing against cuSOLVER's, ncu of
# its block kernel (alone, and in a gpt-1.3b Dion step), the Dion step A/B
# and DION_PROFILE's factorization times (then `tools/gpu_check.sh OUTDIR
# test` for the suites). Logs under OUTDIR; about 3 minutes on an H100.
#   tools/gpu_chol_check.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_lib.sh
gpu_setup "$1" || exit 1
t0=$(date +%s)
timeout 200 $b/tests/ops_linalg > "$out/ops-own.log" 2>&1; echo "ops_linalg own rc=$? $(( $(date +%s) - t0 )) s"
grep -E "FAILED|Failure|Expected|Which is|PASSED|cholesky batched" "$out/ops-own.log" | head -30
DION_OWN_CHOLESKY=0 timeout 100 $b/tests/ops_linalg --gtest_filter='*Timings*:*Cholesky*' > "$out/ops-cusolver.log" 2>&1
echo "cusolver:"; grep -E "FAILED|PASSED|cholesky batched" "$out/ops-cusolver.log" | head
t0=$(date +%s)
ROUNDS=2 bash bench/ab.sh "$out/ab.jsonl" "" "DION_OWN_CHOLESKY=0" -- "--workload gpt-1.3b --algo dion --dtype bf16" \
  "--workload gpt-160m --algo dion --dtype fp32"
# Above the default bound (512): full-rank Dion's Cholesky factorizations of
# r = 768 (gpt-160m) and 2048 (gpt-1.3b), own against cuSOLVER's.
ROUNDS=2 bash bench/ab.sh "$out/ab-large.jsonl" "DION_OWN_CHOLESKY_MAX=2048" "" -- \
  "--workload gpt-160m --algo dion-r1 --dtype fp32" "--workload gpt-1.3b --algo dion-r1 --dtype bf16"
echo "ab: $(( $(date +%s) - t0 )) s"
own=$(grep "n  512" "$out/ops-own.log" | sed -n 's/.*cholesky batched \([0-9.]*\) ms.*/\1/p')
cus=$(grep "n  512" "$out/ops-cusolver.log" | sed -n 's/.*cholesky batched \([0-9.]*\) ms.*/\1/p')
echo "own $own cusolver $cus"
timeout 60 ncu -k regex:chol_block --launch-count 24 --metrics gpu__time_duration.sum $b/tests/ops_linalg --gtest_filter='*Timings*' > "$out/ncu-leaf.log" 2>&1
grep -E "chol_block|gpu__time_duration" "$out/ncu-leaf.log" | paste - - | awk '{print $NF}' | tr '\n' ' '; echo
# Both leaves (fp32: the Cholesky of P1's Gram; fp64: qr_r's) in a gpt-1.3b step.
timeout 90 ncu --csv -k regex:chol_block --launch-count 16 --metrics gpu__time_duration.sum $b/dion-bench \
  --workload gpt-1.3b --algo dion --dtype bf16 --iters 1 --warmup 0 > "$out/ncu-step.csv" 2>&1
python3 - "$out/ncu-step.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and r[0] in ("ID",) or (len(r) > 10 and r[0].isdigit())]
h = rows[0]
for r in rows[1:]:
    d = dict(zip(h, r))
    print(("d" if "double" in d["Kernel Name"] else "f") + d["Metric Value"], end=" ")
print()
PY
for v in 1 0; do
  DION_OWN_CHOLESKY=$v DION_PROFILE=1 timeout 60 $b/dion-bench --workload gpt-1.3b --algo dion --dtype bf16 --iters 6 --warmup 1 2>&1 |
    grep -E "cholesky|qr_r|trsm|steps" | sed "s/^/own=$v /"
done
# Where the block kernel's cycles go: ncu's full set on its second launch
# of the timing test (fp32, 24 matrices of 128), the source view (SASS with
# stall samples) summarised: the stall reasons and the 12 instructions with
# the most samples.
timeout 90 ncu --set full -k regex:chol_block --launch-skip 1 --launch-count 1 -o "$out/leaf" --force-overwrite \
  $b/tests/ops_linalg --gtest_filter='*Timings*' > "$out/ncu-full.log" 2>&1
ncu --import "$out/leaf.ncu-rep" --page source --csv --print-source sass > "$out/leaf-sass.csv" 2>/dev/null
python3 - "$out/leaf-sass.csv" <<'PY'
import collections, csv, sys
rows = list(csv.reader(open(sys.argv[1])))
i = next(n for n, r in enumerate(rows) if "Address" in r)
h, data = rows[i], rows[i + 1:]
ix = {k: n for n, k in enumerate(h)}
num = lambda r, k: int(r[ix[k]] or 0) if k in ix and r[ix[k]].strip().isdigit() else 0
smp = "Warp Stall Sampling (All Samples)"
stalls = [k for k in h if k.startswith("stall_") and "Not Issued" not in k]
agg = collections.Counter({k: sum(num(r, k) for r in data) for k in stalls})
print("leaf: %d SASS instructions, %d samples; %s" % (len(data), sum(num(r, smp) for r in data), agg.most_common(6)))
for r in sorted(data, key=lambda r: -num(r, smp))[:12]:
    print("%5d %8d  %s" % (num(r, smp), num(r, "Instructions Executed"), r[ix["Source"]].strip()[:70]))
PY
awk -v a="$own" -v b="$cus" 'BEGIN{exit !(a < b)}' && echo "own faster" || echo "own not faster"

#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# libdion.torch on NCCL meshes under torchrun, on 2 and 4 GPUs of one host:
#   (i) FSDP2, (ii) tensor parallel, (iii) FSDP2 x TP on a 2 x 2 mesh, (iv) DCP save/load/continue,
#   (v) DDP with compressed Dion (and Muon behind DistributedDataParallel).
# Each program compares with a single-GPU run of the same model (tests/torchrun/common.py).
#
#   bash tests/torchrun/run_all.sh OUTDIR
#
# Needs a CUDA build of libdion: LIBDION_PATH (the .so, or its directory), else build-gpu/ then build/ of the
# source tree, e.g. cmake -S . -B build-gpu -G Ninja -DDION_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 &&
# cmake --build build-gpu. PYTHON (default python3) must have torch with CUDA; NPROCS (default "2 4") sets the
# world sizes (those above the GPU count are skipped; case_fsdp_tp.py needs 4 and reports SKIP on 2). CASES
# (default "fsdp tp fsdp_tp dcp ddp") picks the programs, CASE_TIMEOUT (default 300 s) bounds each run.
#
# Files: OUTDIR/<case>_np<N>.log (everything the ranks printed, then each rank's trace: its progress lines and
# Python stacks), OUTDIR/summary.txt (the PASS/FAIL/SKIP lines, also on stdout) and OUTDIR/libdion_info.txt.
# DCP checkpoints and the per-rank trace files live in a scratch directory that is removed after each run.
# Hang diagnostics: every rank prints "[rank R/W +SECONDS] phase" lines, and faulthandler dumps every thread's
# Python stack 10 s before CASE_TIMEOUT (DION_CASE_TIMEOUT, see common.py) and when torchrun stops the rank; for
# a case that failed or timed out the last TAIL_LINES (default 30) lines of each rank's trace and of the log
# are printed here. Exits 1 if any program failed, 3 if none could run (no GPU).
set -uo pipefail

out=${1:?usage: run_all.sh OUTDIR}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python=${PYTHON:-python3}

# NVLink multicast must stay off on the lent machines (NCCL, PyTorch's symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$repo/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
if [[ -z "${LIBDION_PATH:-}" ]]; then
  for b in build-gpu build; do
    if [[ -e "$repo/$b/libdion.so" ]]; then export LIBDION_PATH="$repo/$b/libdion.so"; break; fi
  done
fi
if [[ -z "${LIBDION_PATH:-}" || ! -e "$LIBDION_PATH" ]]; then
  echo "run_all.sh: no libdion.so (set LIBDION_PATH, or build build-gpu/ with -DDION_WITH_CUDA=ON)" >&2
  exit 2
fi
echo "run_all.sh: LIBDION_PATH=$LIBDION_PATH"
"$python" -m libdion --no-probe 2>&1 | head -n 20 > "$out/libdion_info.txt" || true

ngpu=$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
ngpu=${ngpu:-0}
echo "run_all.sh: $("$python" -c 'import torch; print("torch", torch.__version__)'), $ngpu GPU(s)"
if command -v torchrun >/dev/null 2>&1; then launcher=(torchrun); else launcher=("$python" -m torch.distributed.run); fi

case_timeout=${CASE_TIMEOUT:-300}
tail_lines=${TAIL_LINES:-30}
nprocs=${NPROCS:-2 4}
cases=${CASES:-fsdp tp fsdp_tp dcp ddp}
for n in $nprocs; do
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_all.sh: NPROCS must be positive integers (got '$nprocs')" >&2
    exit 2
  fi
done
echo "run_all.sh: NPROCS='$nprocs' CASES='$cases' CASE_TIMEOUT=$case_timeout"

# The end of a failed run: each rank's trace (progress lines, stacks), then the last lines other than progress
# lines of what the ranks and torchrun printed (the first $4 lines of the log; the traces are appended after them).
show_tail() {
  local tag=$1 log=$2 tdir=$3 nlog=$4 f r
  for f in "$tdir"/rank*.txt; do
    [[ -e "$f" ]] || continue
    r=$(basename "$f" .txt)
    echo "---- $tag $r: last $tail_lines lines of its trace ----"
    tail -n "$tail_lines" "$f" | cut -c1-300
  done
  echo "---- $tag: last $tail_lines lines of $log other than progress lines ----"
  head -n "$nlog" "$log" | grep -v '^\[rank [0-9]*/[0-9]* +' | tail -n "$tail_lines" | cut -c1-300
}

summary="$out/summary.txt"
: > "$summary"
failed=0
programs=0
for n in $nprocs; do
  if (( n > ngpu )); then
    echo "SKIP np$n: only $ngpu GPU(s)" | tee -a "$summary"
    continue
  fi
  for case in $cases; do
    log="$out/${case}_np${n}.log"
    tdir=$(mktemp -d "${TMPDIR:-/tmp}/libdion_torchrun_${case}_np${n}.XXXXXX")
    programs=$((programs + 1))
    echo "== [np$n $case] started $(date -u +%T) UTC (timeout $case_timeout s)"
    t0=$SECONDS
    DION_TRACE_DIR="$tdir" DION_CASE_TIMEOUT="$case_timeout" \
      timeout -k 20 "$case_timeout" "${launcher[@]}" --standalone --nproc_per_node "$n" "$here/case_${case}.py" \
      --ckpt-dir "$tdir/ckpt" > "$log" 2>&1
    rc=$?
    nlog=$(wc -l < "$log")
    for f in "$tdir"/rank*.txt; do
      [[ -e "$f" ]] || continue
      { echo "==== $(basename "$f" .txt) trace (progress lines and Python stacks) ===="; cat "$f"; } >> "$log"
    done
    grep -E '^(PASS|FAIL|SKIP) ' "$log" | cut -c1-400 | sed "s/^/[np$n $case] /" | tee -a "$summary"
    if (( rc != 0 )) || grep -q '^FAIL ' "$log"; then
      how="exited $rc"
      (( rc == 124 || rc == 137 )) && how="TIMEOUT after $case_timeout s"
      (( rc != 0 )) && failed=$((failed + 1))
      echo "FAIL [np$n $case] $how, $((SECONDS - t0)) s (see $log)" | tee -a "$summary"
      show_tail "[np$n $case]" "$log" "$tdir" "$nlog"
    else
      echo "[np$n $case] exited 0 in $((SECONDS - t0)) s"
    fi
    rm -rf "$tdir"
  done
done
pass=$(grep -c '] PASS ' "$summary" || true)
fail=$(grep -c '] FAIL ' "$summary" || true)
skip=$(grep -c '] SKIP ' "$summary" || true)
echo "run_all.sh: $programs programs, $failed exited non-zero; cases: $pass passed, $fail failed, $skip skipped" \
  | tee -a "$summary"
if (( programs == 0 )); then
  echo "run_all.sh: nothing ran (no GPU)" >&2
  exit 3
fi
(( failed == 0 && fail == 0 ))

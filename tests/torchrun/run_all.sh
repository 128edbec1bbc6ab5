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
# world sizes (those above the GPU count are skipped). Logs go to OUTDIR/<case>_np<N>.log, the PASS/FAIL/SKIP
# lines to stdout and OUTDIR/summary.txt. Exits 1 if any program failed, 3 if none could run (no GPU). CASES
# (default "fsdp tp fsdp_tp dcp ddp") picks the programs, CASE_TIMEOUT (default 300 s) bounds each run.
set -uo pipefail

out=${1:?usage: run_all.sh OUTDIR}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python=${PYTHON:-python3}

# NVLink multicast (NVLS) must stay off on the lent machines.
export NCCL_NVLS_ENABLE=0
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

summary="$out/summary.txt"
: > "$summary"
failed=0
programs=0
for n in ${NPROCS:-2 4}; do
  if (( n > ngpu )); then
    echo "SKIP np$n: only $ngpu GPU(s)" | tee -a "$summary"
    continue
  fi
  for case in ${CASES:-fsdp tp fsdp_tp dcp ddp}; do
    log="$out/${case}_np${n}.log"
    programs=$((programs + 1))
    timeout "${CASE_TIMEOUT:-300}" "${launcher[@]}" --standalone --nproc_per_node "$n" "$here/case_${case}.py" \
      --ckpt-dir "$out/ckpt_${case}_np${n}" > "$log" 2>&1
    rc=$?
    grep -E '^(PASS|FAIL|SKIP) ' "$log" | cut -c1-400 | sed "s/^/[np$n $case] /" | tee -a "$summary"
    if (( rc != 0 )); then
      failed=$((failed + 1))
      echo "FAIL [np$n $case] exited $rc (see $log)" | tee -a "$summary"
    fi
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

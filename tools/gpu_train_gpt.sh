#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# examples/python/train_gpt.py on a GPU machine: the single-GPU comparison of Dion, Muon and AdamW with the
# example's defaults, then (with >= 2 GPUs visible) short torchrun runs with --ddp, --fsdp and --ddp-compressed on
# 2 and 4 GPUs, and a one-GPU run of the same length to compare them with.
#
#   tools/gpu_train_gpt.sh OUT [all|single|dist]
#
#   OUT/single/   python3 examples/python/train_gpt.py --optimizer all --device cuda (1000 steps)
#   OUT/ref1/     the same for DIST_STEPS steps, --optimizer dion,muon (the distributed runs' reference)
#   OUT/ddpN/     torchrun --nproc_per_node N ... --ddp            (N = 2, and 4 when 4 GPUs are visible)
#   OUT/fsdpN/    torchrun --nproc_per_node N ... --fsdp
#   OUT/ddpcN/    torchrun --nproc_per_node N ... --ddp-compressed --optimizer dion
#   OUT/summary.txt  one line per optimizer and run: final validation loss, tokens/s (the "result:" lines)
# Each run directory holds log.txt and losses.csv only (no PNG: examples/python/plot_losses.py OUT/single
# OUT/ddp2 ... draws them where matplotlib is). Every run is bounded by `timeout`; the summary is printed at the
# end. Exits 0 when every run that was started succeeded, 1 otherwise, 2 without libdion.so, 3 without a GPU.
#
# Environment: LIBDION_PATH (default build-gpu/libdion.so of this tree; a CUDA build, e.g.
# tools/gpu_check.sh OUT build), PYTHON (python3), SINGLE_STEPS (the example's default, 1000), SINGLE_TIMEOUT
# (540 s), DIST_STEPS (200), DIST_TIMEOUT (180 s per run), DIST_OPTIMIZERS (dion,muon), DIST_MODES
# ("ddp fsdp ddp-compressed"), NPROCS ("2 4"; those above the GPU count are skipped), TRAIN_ARGS (more
# train_gpt.py arguments for every run), TOTAL_TIMEOUT (seconds for the whole script: a run that would end later
# gets the time left, none is started with less than 45 s left; default none), PLOT=1 (also write losses.png).
# On the lent machines (10 minutes a command) run `single` and `dist` as two commands, e.g.
#   TOTAL_TIMEOUT=560 tools/gpu_train_gpt.sh /tmp/gpt single; TOTAL_TIMEOUT=560 tools/gpu_train_gpt.sh /tmp/gpt dist
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${1:?usage: gpu_train_gpt.sh OUT [all|single|dist]}
what=${2:-all}
case "$what" in all|single|dist) ;; *) echo "usage: gpu_train_gpt.sh OUT [all|single|dist]" >&2; exit 2 ;; esac
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python=${PYTHON:-python3}
t_start=$(date +%s)

# NVLink multicast stays off on the lent machines (it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$repo/bindings/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export LIBDION_PATH=${LIBDION_PATH:-$repo/build-gpu/libdion.so}
if [[ ! -e "$LIBDION_PATH" ]]; then
  echo "gpu_train_gpt.sh: $LIBDION_PATH not found: build libdion with CUDA first (tools/gpu_check.sh OUT build," \
       "or cmake -S . -B build-gpu -G Ninja -DDION_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 &&" \
       "cmake --build build-gpu), or set LIBDION_PATH" >&2
  exit 2
fi
ngpu=$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
ngpu=${ngpu:-0}
info="$("$python" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1), $ngpu GPU(s)"
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *//')
  info="$info: $(tr '\n' ' ' <<< "$gpus")"
fi
echo "gpu_train_gpt.sh: $info; LIBDION_PATH=$LIBDION_PATH"
if (( ngpu == 0 )); then
  echo "gpu_train_gpt.sh: no GPU visible" >&2
  exit 3
fi
if command -v torchrun >/dev/null 2>&1; then launcher=(torchrun); else launcher=("$python" -m torch.distributed.run); fi
example="$repo/examples/python/train_gpt.py"
read -r -a extra <<< "${TRAIN_ARGS:-}"
plot=(--no-plot)
[[ "${PLOT:-0}" == 1 ]] && plot=()

summary="$out/summary.txt"
[[ "$what" == dist ]] || : > "$summary"
echo "# $(date -u '+%F %T') UTC, $info, stage $what" >> "$summary"
failed=0
runs=()

# run NAME TIMEOUT COMMAND...: the command with --out OUT/NAME, its output in OUT/NAME/log.txt.
run() {
  local name=$1 limit=$2
  shift 2
  local dir="$out/$name"
  if [[ -n "${TOTAL_TIMEOUT:-}" ]]; then
    local left=$(( TOTAL_TIMEOUT - ($(date +%s) - t_start) - 15 ))
    if (( left < 45 )); then
      echo "SKIP $name: ${left} s left of TOTAL_TIMEOUT=$TOTAL_TIMEOUT" | tee -a "$summary"
      return
    fi
    (( limit > left )) && limit=$left
  fi
  mkdir -p "$dir"
  rm -f "$dir/losses.csv" "$dir/losses.png"
  runs+=("$name")
  echo "== $name (timeout $limit s): $*" | tee "$dir/log.txt"
  local t0=$SECONDS
  timeout -k 20 "$limit" "$@" --out "$dir" "${plot[@]}" "${extra[@]}" >> "$dir/log.txt" 2>&1
  local rc=$?
  local how="exit $rc"
  (( rc == 124 || rc == 137 )) && how="TIMEOUT after $limit s"
  echo "-- $name: $how, $((SECONDS - t0)) s" | tee -a "$dir/log.txt"
  if (( rc != 0 )); then
    failed=$((failed + 1))
    echo "FAIL $name: $how (last lines of $dir/log.txt follow)" | tee -a "$summary"
    tail -n 15 "$dir/log.txt" | cut -c1-300 | sed "s/^/  [$name] /"
  fi
}

if [[ "$what" == all || "$what" == single ]]; then
  run single "${SINGLE_TIMEOUT:-540}" "$python" "$example" --optimizer all --device cuda \
    ${SINGLE_STEPS:+--steps "$SINGLE_STEPS"}
fi

if [[ "$what" == all || "$what" == dist ]]; then
  if (( ngpu < 2 )); then
    echo "SKIP distributed runs: only $ngpu GPU visible" | tee -a "$summary"
  else
    steps=${DIST_STEPS:-200}
    opts=${DIST_OPTIMIZERS:-dion,muon}
    run ref1 "${DIST_TIMEOUT:-180}" "$python" "$example" --optimizer "$opts" --device cuda --steps "$steps"
    for n in ${NPROCS:-2 4}; do
      if (( n > ngpu )); then
        echo "SKIP np$n: only $ngpu GPUs visible" | tee -a "$summary"
        continue
      fi
      for mode in ${DIST_MODES:-ddp fsdp ddp-compressed}; do
        name="${mode/ddp-compressed/ddpc}$n"
        o=$opts
        [[ "$mode" == ddp-compressed ]] && o=dion  # Muon and AdamW run as under --ddp in that mode
        run "$name" "${DIST_TIMEOUT:-180}" "${launcher[@]}" --standalone --nproc_per_node "$n" "$example" \
          "--$mode" --optimizer "$o" --device cuda --steps "$steps"
      done
    done
  fi
fi

echo "== summary ($what; $(( $(date +%s) - t_start )) s)"
for name in "${runs[@]}"; do
  log="$out/$name/log.txt"
  if grep -q '^result:' "$log" 2>/dev/null; then
    grep '^result:' "$log" | sed "s/^result: /$name  /" | tee -a "$summary"
  else
    echo "$name  no result (see $log)" | tee -a "$summary"
  fi
done
if [[ -e "$out/single/log.txt" && ("$what" == all || "$what" == single) ]]; then
  # The example's claim: with its defaults on one GPU, Dion and Muon end below AdamW's validation loss.
  awk '/^result: optimizer=/ { split($2, o, "="); for (i = 3; i <= NF; i++) if ($i ~ /^val_loss=/) {
         split($i, v, "="); val[o[2]] = v[2] } }
       END { if (!("adamw" in val)) exit;
             for (k in val) if (k != "adamw") printf "single: %s %.4f %s adamw %.4f\n", k, val[k],
               (val[k] < val["adamw"] ? "<" : ">="), val["adamw"] }' "$out/single/log.txt" | tee -a "$summary"
fi
echo "gpu_train_gpt.sh: ${#runs[@]} runs, $failed failed; $summary"
(( failed == 0 ))

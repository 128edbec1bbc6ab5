#!/usr/bin/env bash
# Runs kill_rank with N ranks under Open MPI's --enable-recovery and checks
# that each of the N - 1 survivors printed "KILL-TEST PASS" (see kill_rank.c).
#   run_kill_rank.sh MPIEXEC BINARY N
set -u
mpiexec=$1 bin=$2 n=$3
log=$(NCCL_NVLS_ENABLE=0 DION_COMM_TIMEOUT=3 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  timeout 120 "$mpiexec" --oversubscribe --enable-recovery -n "$n" "$bin" 2>&1)
echo "$log"
if grep -q "needs one GPU per rank" <<< "$log"; then exit 0; fi
pass=$(grep -c "KILL-TEST PASS" <<< "$log")
if [ "$pass" -ne $((n - 1)) ]; then
  echo "expected $((n - 1)) survivors to pass, got $pass"
  exit 1
fi
echo "all $pass survivors returned an error in bounded time"

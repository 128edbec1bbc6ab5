/* SPDX-License-Identifier: MIT
 *
 * A rank dies mid-training: the others must get an error from dion_step in
 * bounded time, not hang (issue: communication faults). Run by
 * run_kill_rank.sh under `mpiexec --enable-recovery` (Open MPI: the survivors
 * keep running when a process dies) with DION_COMM_TIMEOUT=3.
 *
 * Every rank trains a Dion matrix over the replicate mesh (MPI_COMM_WORLD)
 * for a few steps; then the last rank kills itself (SIGKILL: no clean-up,
 * as a crashed node). Each survivor then calls dion_step, which must return
 * DION_ERROR_MPI within 3 x the timeout with a message naming the replicate
 * mesh and the timeout; a second dion_step must fail at once (the
 * communicator is marked failed), and the parameters must not have moved.
 * Each survivor prints one "KILL-TEST PASS" or "KILL-TEST FAIL" line and
 * leaves without MPI_Finalize (a collective teardown with a dead peer would
 * hang).
 */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dion_mpi.h"

enum { M = 48, N = 32 };

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  static float w[M * N], g[M * N], before[M * N];
  for (int i = 0; i < M * N; ++i) {
    w[i] = 0.01f * (float)((i * 37) % 101 - 50);
    g[i] = 0.001f * (float)((i * 53 + rank) % 97 - 48);
  }
  dion_comm_t comm = NULL;
  dion_optimizer_t opt = NULL;
  dion_options_t o;
  dion_options_init(&o);
  if (dion_comm_from_mpi(&comm, MPI_COMM_WORLD) != DION_SUCCESS) {
    printf("rank %d: KILL-TEST FAIL setup: %s\n", rank, dion_last_error(NULL));
    _exit(1);
  }
  o.replicate_comm = comm;
  dion_group_options_t go;
  dion_group_options_init(&go, DION_ALGO_DION);
  go.rank_fraction = 0.25;
  dion_tensor_t t;
  dion_tensor_init(&t);
  t.name = "w";
  t.param = w;
  t.grad = g;
  t.ndim = 2;
  t.shape[0] = M;
  t.shape[1] = N;
  if (dion_create(&opt, &o) != DION_SUCCESS || dion_add_group(opt, &go, &t, 1, NULL) != DION_SUCCESS) {
    printf("rank %d: KILL-TEST FAIL setup: %s\n", rank, dion_last_error(opt));
    _exit(1);
  }
  for (int s = 0; s < 3; ++s)
    if (dion_step(opt, NULL) != DION_SUCCESS) {
      printf("rank %d: KILL-TEST FAIL step %d before the kill: %s\n", rank, s, dion_last_error(opt));
      _exit(1);
    }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == size - 1) raise(SIGKILL);
  usleep(200000); /* let the death happen first */

  memcpy(before, w, sizeof w);
  const double timeout = 3.0;
  double t0 = now();
  dion_status_t st = dion_step(opt, NULL);
  const double first = now() - t0;
  const char* msg = dion_last_error(opt);
  char saved[1024];
  snprintf(saved, sizeof saved, "%s", msg ? msg : "");
  t0 = now();
  dion_status_t st2 = dion_step(opt, NULL);
  const double second = now() - t0;
  const int unmoved = memcmp(before, w, sizeof w) == 0;
  const int ok = st == DION_ERROR_MPI && first < 3 * timeout && strstr(saved, "replicate mesh") &&
                 strstr(saved, "DION_COMM_TIMEOUT") && st2 == DION_ERROR_MPI && second < 1.0 && unmoved;
  printf("rank %d: KILL-TEST %s: first step %s after %.2f s (\"%s\"); second step %s after %.3f s; parameters %s\n",
         rank, ok ? "PASS" : "FAIL", dion_status_string(st), first, saved, dion_status_string(st2), second,
         unmoved ? "unchanged" : "CHANGED");
  fflush(stdout);
  _exit(ok ? 0 : 1);
}

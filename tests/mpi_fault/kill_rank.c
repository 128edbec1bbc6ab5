/* SPDX-License-Identifier: MIT
 *
 * A rank dies mid-training: the others must get an error in bounded time,
 * not hang (issue: communication faults). Run by run_kill_rank.sh under
 * `mpiexec --enable-recovery` (Open MPI: the survivors keep running when a
 * process dies) with DION_COMM_TIMEOUT=3. Built twice: host backend over MPI,
 * and (DION_KILL_NCCL) CUDA backend over NCCL, one GPU per rank.
 *
 * Every rank trains a Dion matrix over the replicate mesh (MPI_COMM_WORLD)
 * for a few steps; then the last rank kills itself (SIGKILL: no clean-up,
 * as a crashed node). Each survivor then calls dion_step and, on the CUDA
 * backend where the step only enqueues work, dion_get_skipped_steps (a
 * blocking wait): one of them must return DION_ERROR_MPI / DION_ERROR_NCCL
 * within 3 x the timeout; a second dion_step must fail at once (the
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
#ifdef DION_KILL_NCCL
#include <cuda_runtime_api.h>
#define EXPECTED DION_ERROR_NCCL
#else
#define EXPECTED DION_ERROR_MPI
#endif

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
  void *param = w, *grad = g;
#ifdef DION_KILL_NCCL
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < size) {
    if (rank == 0) printf("kill_rank: needs one GPU per rank (%d ranks, %d GPUs)\n", size, ndev);
    MPI_Finalize();
    return 0;
  }
  cudaSetDevice(rank);
  o.backend = DION_BACKEND_CUDA;
  o.device = rank;
  dion_nccl_unique_id_t id;
  memset(&id, 0, sizeof id);
  if (rank == 0) dion_nccl_get_unique_id(&id);
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  const int made = dion_comm_init_nccl(&comm, &id, size, rank, rank) == DION_SUCCESS;
  if (cudaMalloc(&param, sizeof w) != cudaSuccess || cudaMalloc(&grad, sizeof g) != cudaSuccess) {
    printf("rank %d: KILL-TEST FAIL setup: cudaMalloc\n", rank);
    _exit(1);
  }
  cudaMemcpy(param, w, sizeof w, cudaMemcpyHostToDevice);
  cudaMemcpy(grad, g, sizeof g, cudaMemcpyHostToDevice);
#else
  const int made = dion_comm_from_mpi(&comm, MPI_COMM_WORLD) == DION_SUCCESS;
#endif
  if (!made) {
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
  t.param = param;
  t.grad = grad;
  t.ndim = 2;
  t.shape[0] = M;
  t.shape[1] = N;
  if (dion_create(&opt, &o) != DION_SUCCESS || dion_add_group(opt, &go, &t, 1, NULL) != DION_SUCCESS) {
    printf("rank %d: KILL-TEST FAIL setup: %s\n", rank, dion_last_error(opt));
    _exit(1);
  }
  int64_t skipped = 0;
  int32_t last = 0;
  for (int s = 0; s < 3; ++s)
    if (dion_step(opt, NULL) != DION_SUCCESS || dion_get_skipped_steps(opt, &skipped, &last, NULL) != DION_SUCCESS) {
      printf("rank %d: KILL-TEST FAIL step %d before the kill: %s\n", rank, s, dion_last_error(opt));
      _exit(1);
    }
#ifdef DION_KILL_NCCL
  cudaMemcpy(w, param, sizeof w, cudaMemcpyDeviceToHost);
#endif
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == size - 1) raise(SIGKILL);
  usleep(200000); /* let the death happen first */

  memcpy(before, w, sizeof w);
  const double timeout = 3.0;
  double t0 = now();
  dion_status_t st = dion_step(opt, NULL);
  if (st == DION_SUCCESS) st = dion_get_skipped_steps(opt, &skipped, &last, NULL);
  const double first = now() - t0;
  const char* msg = dion_last_error(opt);
  char saved[1024];
  snprintf(saved, sizeof saved, "%s", msg ? msg : "");
  t0 = now();
  dion_status_t st2 = dion_step(opt, NULL);
  const double second = now() - t0;
#ifdef DION_KILL_NCCL
  /* The kernels of the aborted step have finished (the communicator was
   * aborted), so the parameters can be read back. */
  cudaMemcpy(w, param, sizeof w, cudaMemcpyDeviceToHost);
  const int named = strstr(saved, "DION_COMM_TIMEOUT") || strstr(saved, "NCCL") || strstr(saved, "nccl");
#else
  const int named = strstr(saved, "replicate mesh") && strstr(saved, "DION_COMM_TIMEOUT");
#endif
  const int unmoved = memcmp(before, w, sizeof w) == 0;
  const int ok = st == EXPECTED && first < 3 * timeout && named && st2 == EXPECTED && second < 1.0 && unmoved;
  printf("rank %d: KILL-TEST %s: first step %s after %.2f s (\"%s\"); second step %s after %.3f s; parameters %s\n",
         rank, ok ? "PASS" : "FAIL", dion_status_string(st), first, saved, dion_status_string(st2), second,
         unmoved ? "unchanged" : "CHANGED");
  fflush(stdout);
  _exit(ok ? 0 : 1);
}

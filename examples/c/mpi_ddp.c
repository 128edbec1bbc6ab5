/* SPDX-License-Identifier: MIT
 *
 * Data-parallel training with MPI on the host backend: every rank holds the
 * same weights and its own data; libdion averages over the replicate mesh
 * what it needs (for Dion, the low-rank factors P and R instead of the
 * gradient). Run:  mpiexec -np 4 ./dion-mpi-ddp
 *
 * The model is a linear map W (64 x 32) learning a teacher W* from noisy
 * samples; each rank draws different samples. The program checks that the
 * loss falls tenfold and that every rank ends with the same weights, and
 * prints the bytes the replicate mesh moved per step next to what averaging
 * the full gradient would move. Uses only dion.h, dion_mpi.h and MPI.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dion_mpi.h"

enum { M = 64, N = 32, BATCH = 32, STEPS = 300 };

/* A deterministic uniform in [-1, 1) from (seed, index). */
static float uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)((double)(z >> 40) / (double)(1ull << 23) - 1.0);
}

#define CHECK(call)                                                             \
  do {                                                                          \
    dion_status_t s_ = (call);                                                  \
    if (s_ != DION_SUCCESS) {                                                   \
      fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, dion_last_error(opt)); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                             \
    }                                                                           \
  } while (0)

/* Mean squared error of W on a fixed evaluation set (the same on every rank). */
static double eval_loss(const float* w, const float* teacher) {
  double loss = 0;
  for (int s = 0; s < 256; ++s) {
    float x[N];
    for (int j = 0; j < N; ++j) x[j] = uniform(777, (uint64_t)s * N + j);
    for (int i = 0; i < M; ++i) {
      double y = 0, t = 0;
      for (int j = 0; j < N; ++j) {
        y += (double)w[i * N + j] * x[j];
        t += (double)teacher[i * N + j] * x[j];
      }
      loss += (y - t) * (y - t);
    }
  }
  return loss / (256.0 * M);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  dion_optimizer_t opt = NULL;

  static float w[M * N], g[M * N], teacher[M * N];
  for (int i = 0; i < M * N; ++i) {
    teacher[i] = uniform(1, (uint64_t)i) / sqrtf((float)N);
    w[i] = 0.0f;
  }

  dion_comm_t comm = NULL;
  CHECK(dion_comm_from_mpi(&comm, MPI_COMM_WORLD));
  dion_options_t o;
  dion_options_init(&o);
  o.replicate_comm = comm; /* replicate_grad_sync = 1 by default: libdion averages */
  CHECK(dion_create(&opt, &o));

  dion_group_options_t go;
  dion_group_options_init(&go, DION_ALGO_DION);
  go.lr = 0.05;
  go.weight_decay = 0.0;
  go.rank_fraction = 0.25; /* r = 8: (64 + 32) * 8 < 64 * 32, so P and R are averaged, not G */
  dion_tensor_t t;
  dion_tensor_init(&t);
  t.name = "w";
  t.param = w;
  t.grad = g;
  t.ndim = 2;
  t.shape[0] = M;
  t.shape[1] = N;
  CHECK(dion_add_group(opt, &go, &t, 1, NULL));

  const double loss0 = eval_loss(w, teacher);
  uint64_t bytes = 0;
  for (int step = 0; step < STEPS; ++step) {
    /* This rank's mini-batch: the gradient of 0.5 |W x - W* x - noise|^2. */
    memset(g, 0, sizeof g);
    for (int s = 0; s < BATCH; ++s) {
      const uint64_t id = ((uint64_t)step * (uint64_t)size + (uint64_t)rank) * BATCH + (uint64_t)s;
      float x[N];
      for (int j = 0; j < N; ++j) x[j] = uniform(2, id * N + (uint64_t)j);
      for (int i = 0; i < M; ++i) {
        float err = -0.01f * uniform(3, id * M + (uint64_t)i);
        for (int j = 0; j < N; ++j) err += (w[i * N + j] - teacher[i * N + j]) * x[j];
        for (int j = 0; j < N; ++j) g[i * N + j] += err * x[j] / BATCH;
      }
    }
    /* An orthonormal update has a fixed size, so the learning rate decays
     * linearly to reach below the noise floor (a schedule, as in training). */
    CHECK(dion_group_set_hparam(opt, 0, DION_HPARAM_LR, 0.05 * (1.0 - (double)step / STEPS)));
    CHECK(dion_step(opt, NULL));
    CHECK(dion_get_comm_bytes(opt, DION_MESH_REPLICATE, &bytes, NULL));
    if (rank == 0 && (step % 50 == 0 || step == STEPS - 1))
      printf("step %3d  eval loss %.3e  replicate bytes this step %llu (the full gradient: %d)\n", step,
             eval_loss(w, teacher), (unsigned long long)bytes, (int)(4 * M * N));
  }
  const double loss1 = eval_loss(w, teacher);

  /* Every rank must hold rank 0's weights, bit for bit. */
  static float w0[M * N];
  memcpy(w0, w, sizeof w);
  MPI_Bcast(w0, M * N, MPI_FLOAT, 0, MPI_COMM_WORLD);
  int same = memcmp(w0, w, sizeof w) == 0, all_same = 0;
  MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);

  /* A checkpoint would now call dion_sync_for_checkpoint (Dion's momenta are
   * decoupled across replicas) and save the states of one rank. */
  CHECK(dion_sync_for_checkpoint(opt, NULL));
  dion_destroy(opt);
  dion_comm_destroy(comm);

  int ok = all_same && loss1 < 0.1 * loss0;
  if (rank == 0)
    printf("%d ranks: eval loss %.3e -> %.3e (%.0fx lower); weights identical on every rank: %s; %s\n", size, loss0,
           loss1, loss0 / loss1, all_same ? "yes" : "NO", ok ? "OK" : "FAILED");
  MPI_Finalize();
  return ok ? 0 : 1;
}

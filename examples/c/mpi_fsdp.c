/* SPDX-License-Identifier: MIT
 *
 * Sharded data-parallel training (FSDP / HSDP) with MPI on the host backend:
 * the ranks form a replicate x outer grid (2 x size/2 when the world size is
 * even and above 2, else 1 x size). Each rank holds only its FSDP chunk of
 * the weight's rows (ceil(64 / outer) rows, trailing chunks short or empty)
 * and of the optimizer state; replicas draw different samples. libdion runs
 * Dion on the shards: P = B Q is summed over the outer mesh, the column norms
 * of R too, and P and R are averaged over the replicas instead of the
 * gradient. Run:  mpiexec -np 4 ./dion-mpi-fsdp
 *
 * The model is a linear map W (64 x 32) learning a teacher W* from noisy
 * samples; a row-sharded linear layer computes its own output rows, so the
 * gradient of a shard needs no communication. The program checks that the
 * loss falls tenfold and that the replicas end with the same weights, and
 * prints the bytes each mesh moved per step. Uses only dion.h, dion_mpi.h
 * and MPI.
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

#define CHECK(call)                                                                      \
  do {                                                                                   \
    dion_status_t s_ = (call);                                                           \
    if (s_ != DION_SUCCESS) {                                                            \
      fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, dion_last_error(opt));    \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                      \
    }                                                                                    \
  } while (0)

/* This shard's part of the mean squared error on a fixed evaluation set. */
static double eval_loss_rows(const float* w, const float* teacher, int row0, int rows) {
  double loss = 0;
  for (int s = 0; s < 256; ++s) {
    float x[N];
    for (int j = 0; j < N; ++j) x[j] = uniform(777, (uint64_t)s * N + j);
    for (int i = 0; i < rows; ++i) {
      double y = 0, t = 0;
      for (int j = 0; j < N; ++j) {
        y += (double)w[i * N + j] * x[j];
        t += (double)teacher[(row0 + i) * N + j] * x[j];
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

  /* The grid: replica r = rank / O, outer rank o = rank % O. */
  const int R = (size > 2 && size % 2 == 0) ? 2 : 1, O = size / R;
  const int r = rank / O, o = rank % O;
  MPI_Comm rep_mpi, outer_mpi;
  MPI_Comm_split(MPI_COMM_WORLD, o, r, &rep_mpi);   /* same shard, other replicas */
  MPI_Comm_split(MPI_COMM_WORLD, r, o, &outer_mpi); /* the shards of one replica */

  /* FSDP chunking of the rows. */
  const int chunk = (M + O - 1) / O;
  const int row0 = o * chunk < M ? o * chunk : M;
  const int rows = M - row0 < chunk ? M - row0 : chunk;

  static float teacher[M * N], w[M * N], g[M * N]; /* w, g: the first rows * N elements are used */
  for (int i = 0; i < M * N; ++i) teacher[i] = uniform(1, (uint64_t)i) / sqrtf((float)N);
  memset(w, 0, sizeof w);

  dion_comm_t rep = NULL, outer = NULL;
  if (R > 1) CHECK(dion_comm_from_mpi(&rep, rep_mpi));
  CHECK(dion_comm_from_mpi(&outer, outer_mpi));
  dion_options_t opts;
  dion_options_init(&opts);
  opts.replicate_comm = rep; /* replicate_grad_sync = 1: libdion averages what it needs */
  opts.outer_comm = outer;
  CHECK(dion_create(&opt, &opts));

  dion_group_options_t go;
  dion_group_options_init(&go, DION_ALGO_DION);
  go.lr = 0.05;
  go.weight_decay = 0.0;
  go.rank_fraction = 0.25;
  dion_tensor_t t;
  dion_tensor_init(&t);
  t.name = "w";
  t.param = w;
  t.grad = g;
  t.ndim = 2;
  t.shape[0] = M; /* the GLOBAL shape */
  t.shape[1] = N;
  t.outer_shard_dim = 0; /* this rank holds rows [row0, row0 + rows) */
  t.outer_offset = row0;
  t.outer_extent = rows;
  CHECK(dion_add_group(opt, &go, &t, 1, NULL));

  double loss0 = 0, part = eval_loss_rows(w, teacher, row0, rows);
  MPI_Allreduce(&part, &loss0, 1, MPI_DOUBLE, MPI_SUM, outer_mpi);
  uint64_t rep_bytes = 0, outer_bytes = 0;
  for (int step = 0; step < STEPS; ++step) {
    /* This replica's mini-batch; the gradient of this shard's output rows. */
    memset(g, 0, sizeof g);
    for (int s = 0; s < BATCH; ++s) {
      const uint64_t id = ((uint64_t)step * (uint64_t)R + (uint64_t)r) * BATCH + (uint64_t)s;
      float x[N];
      for (int j = 0; j < N; ++j) x[j] = uniform(2, id * N + (uint64_t)j);
      for (int i = 0; i < rows; ++i) {
        float err = -0.01f * uniform(3, id * M + (uint64_t)(row0 + i));
        for (int j = 0; j < N; ++j) err += (w[i * N + j] - teacher[(row0 + i) * N + j]) * x[j];
        for (int j = 0; j < N; ++j) g[i * N + j] += err * x[j] / BATCH;
      }
    }
    CHECK(dion_group_set_hparam(opt, 0, DION_HPARAM_LR, 0.05 * (1.0 - (double)step / STEPS)));
    CHECK(dion_step(opt, NULL));
    CHECK(dion_get_comm_bytes(opt, DION_MESH_REPLICATE, &rep_bytes, NULL));
    CHECK(dion_get_comm_bytes(opt, DION_MESH_OUTER, &outer_bytes, NULL));
    if (step % 50 == 0 || step == STEPS - 1) {
      double loss = 0;
      part = eval_loss_rows(w, teacher, row0, rows);
      MPI_Allreduce(&part, &loss, 1, MPI_DOUBLE, MPI_SUM, outer_mpi);
      if (rank == 0)
        printf("step %3d  eval loss %.3e  bytes this step: replicate %llu, outer %llu (a gradient shard: %d)\n", step,
               loss, (unsigned long long)rep_bytes, (unsigned long long)outer_bytes, (int)(4 * chunk * N));
    }
  }
  double loss1 = 0;
  part = eval_loss_rows(w, teacher, row0, rows);
  MPI_Allreduce(&part, &loss1, 1, MPI_DOUBLE, MPI_SUM, outer_mpi);

  /* Replicas of a shard must hold the same rows, bit for bit. */
  static float w0[M * N];
  memcpy(w0, w, sizeof w);
  MPI_Bcast(w0, rows * N, MPI_FLOAT, 0, rep_mpi);
  int same = memcmp(w0, w, sizeof(float) * (size_t)rows * N) == 0, all_same = 0;
  MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);

  CHECK(dion_sync_for_checkpoint(opt, NULL)); /* before each rank saves its state shard */
  dion_destroy(opt);
  dion_comm_destroy(outer);
  if (rep) dion_comm_destroy(rep);
  MPI_Comm_free(&rep_mpi);
  MPI_Comm_free(&outer_mpi);

  const int ok = all_same && loss1 < 0.1 * loss0;
  if (rank == 0)
    printf("%d ranks (%d replicas x %d shards): eval loss %.3e -> %.3e (%.0fx lower); replicas identical: %s; %s\n",
           size, R, O, loss0, loss1, loss0 / loss1, all_same ? "yes" : "NO", ok ? "OK" : "FAILED");
  MPI_Finalize();
  return ok ? 0 : 1;
}

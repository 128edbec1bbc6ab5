// SPDX-License-Identifier: MIT
// The main of the NCCL (CUDA-backend) instantiations of the shard-mesh
// harnesses (tests/mpi/shard_harness.hpp, megabatch_harness.hpp): every mesh
// an NCCL communicator created through dion_comm_init_nccl (MPI only splits
// the world and carries the unique ids), parameters, gradients and every
// other buffer handed to libdion in device memory. One rank per GPU (rank r
// uses device r % device_count); with fewer GPUs than ranks the program says
// so and exits 0, which ctest reports as skipped (SKIP_REGULAR_EXPRESSION in
// tests/CMakeLists.txt). Include after the harness (which declares g_env,
// g_rank, g_size); the MPI counterpart is tests/mpi/mpi_harness_main.hpp.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "../mpi/rank_printer.hpp"

ShardEnv g_env;
int g_rank = 0, g_size = 1;

namespace nccl_harness {

inline dion_comm_t comm(MPI_Comm c) {
  int r = 0, n = 1;
  MPI_Comm_rank(c, &r);
  MPI_Comm_size(c, &n);
  dion_nccl_unique_id_t id;
  std::memset(&id, 0, sizeof id);
  if (r == 0) {
    EXPECT_EQ(dion_nccl_get_unique_id(&id), DION_SUCCESS) << dion_last_error(nullptr);
  }
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, c);
  dion_comm_t out = nullptr;
  EXPECT_EQ(dion_comm_init_nccl(&out, &id, n, r, g_env.device), DION_SUCCESS) << dion_last_error(nullptr);
  return out;
}

inline void* dev_alloc(size_t bytes) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
  return p;
}
inline void dev_free(void* p) { cudaFree(p); }
inline void h2d(void* d, const void* h, size_t bytes) {
  EXPECT_EQ(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}
inline void d2h(void* h, const void* d, size_t bytes) {
  EXPECT_EQ(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

}  // namespace nccl_harness

// `program` names the binary in the "needs one GPU per rank" line; with
// every_rank_prints, ranks other than 0 keep the full gtest output.
inline int nccl_harness_main(int argc, char** argv, const char* program, bool every_rank_prints) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess) ndev = 0;
  int fewest = ndev;
  MPI_Allreduce(&ndev, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (fewest < g_size) {
    if (g_rank == 0) std::printf("%s: needs one GPU per rank (%d ranks, %d GPUs)\n", program, g_size, fewest);
    MPI_Finalize();
    return 0;
  }
  g_env.backend = DION_BACKEND_CUDA;
  g_env.device = g_rank % ndev;
  cudaSetDevice(g_env.device);
  g_env.make_comm = nccl_harness::comm;
  g_env.alloc = nccl_harness::dev_alloc;
  g_env.free = nccl_harness::dev_free;
  g_env.h2d = nccl_harness::h2d;
  g_env.d2h = nccl_harness::d2h;
  ::testing::InitGoogleTest(&argc, argv);
  if (!every_rank_prints) print_failures_only_unless_rank0(g_rank);
  const int rc = RUN_ALL_TESTS();
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}

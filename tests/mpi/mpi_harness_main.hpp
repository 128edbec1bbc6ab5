// SPDX-License-Identifier: MIT
// The main of the host-backend (MPI) instantiations of the shard-mesh
// harnesses: every mesh an MPI communicator (dion_comm_from_mpi), buffers in
// host memory. Include after the harness (which declares g_env, g_rank,
// g_size).
#pragma once
#include "rank_printer.hpp"

ShardEnv g_env;
int g_rank = 0, g_size = 1;

inline dion_comm_t mpi_harness_comm(MPI_Comm c) {
  dion_comm_t out = nullptr;
  EXPECT_EQ(dion_comm_from_mpi(&out, c), DION_SUCCESS) << dion_last_error(nullptr);
  return out;
}

// With every_rank_prints, ranks other than 0 keep the full gtest output.
inline int mpi_harness_main(int argc, char** argv, bool every_rank_prints) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  g_env.make_comm = mpi_harness_comm;
  ::testing::InitGoogleTest(&argc, argv);
  if (!every_rank_prints) print_failures_only_unless_rank0(g_rank);
  const int rc = RUN_ALL_TESTS();
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}

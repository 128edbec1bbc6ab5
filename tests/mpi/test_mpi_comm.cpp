// SPDX-License-Identifier: MIT
// MPI communicators on the host backend (run under mpiexec with 2 ranks):
// wrapping MPI_COMM_WORLD and MPI_COMM_SELF, size/rank, the caller's
// communicator left untouched, multi-rank replicate and shard meshes
// accepted.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

#include "dion_mpi.h"
#include "rank_printer.hpp"

TEST(MpiComm, WrapsWorldAndSelf) {
  int wsize = 0, wrank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &wsize);
  MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
  dion_comm_t world = nullptr, self = nullptr;
  ASSERT_EQ(dion_comm_from_mpi(&world, MPI_COMM_WORLD), DION_SUCCESS) << dion_last_error(nullptr);
  ASSERT_EQ(dion_comm_from_mpi_fint(&self, static_cast<int32_t>(MPI_Comm_c2f(MPI_COMM_SELF))), DION_SUCCESS)
      << dion_last_error(nullptr);
  int32_t s = -1, r = -1;
  EXPECT_EQ(dion_comm_size(world, &s), DION_SUCCESS);
  EXPECT_EQ(dion_comm_rank(world, &r), DION_SUCCESS);
  EXPECT_EQ(s, wsize);
  EXPECT_EQ(r, wrank);
  EXPECT_EQ(dion_comm_size(self, &s), DION_SUCCESS);
  EXPECT_EQ(s, 1);

  // A one-rank replicate mesh is accepted.
  dion_options_t o;
  dion_options_init(&o);
  o.replicate_comm = self;
  dion_optimizer_t opt = nullptr;
  EXPECT_EQ(dion_create(&opt, &o), DION_SUCCESS) << dion_last_error(nullptr);
  dion_destroy(opt);

  // Multi-rank replicate and shard meshes are accepted on the host backend.
  if (wsize > 1) {
    for (dion_comm_t* mesh : {&o.replicate_comm, &o.outer_comm, &o.inner_comm}) {
      *mesh = world;
      opt = nullptr;
      EXPECT_EQ(dion_create(&opt, &o), DION_SUCCESS) << dion_last_error(nullptr);
      EXPECT_NE(opt, nullptr);
      dion_destroy(opt);
      *mesh = nullptr;
    }
  }
  // The same communicator for two meshes is an argument error.
  o.replicate_comm = self;
  o.outer_comm = self;
  EXPECT_EQ(dion_create(&opt, &o), DION_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion_last_error(nullptr)).find("same communicator"), std::string::npos);

  EXPECT_EQ(dion_comm_destroy(world), DION_SUCCESS);
  EXPECT_EQ(dion_comm_destroy(self), DION_SUCCESS);
  // The caller's communicator still works.
  int sum = 0, one = 1;
  EXPECT_EQ(MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(sum, wsize);
}

TEST(MpiComm, NullCommIsAnError) {
  dion_comm_t c = nullptr;
  EXPECT_EQ(dion_comm_from_mpi(&c, MPI_COMM_NULL), DION_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dion_comm_from_mpi(nullptr, MPI_COMM_WORLD), DION_ERROR_INVALID_ARGUMENT);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  print_failures_only_unless_rank0(rank);
  int rc = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}

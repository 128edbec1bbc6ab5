// SPDX-License-Identifier: MIT
// Dion on the shard meshes over NCCL on the CUDA backend: the layouts,
// tensors, single-device references and tolerances of
// tests/mpi/test_mpi_shard.cpp (see there for what is asserted and why),
// with every buffer in device memory and every mesh an NCCL communicator
// created through dion_comm_init_nccl (MPI only splits the world and carries
// the unique ids). One rank per GPU (rank r uses device r % device_count);
// with fewer GPUs than ranks the program says so and exits 0, which ctest
// reports as skipped. The reference optimizer runs on each rank's own GPU.
#include "../mpi/shard_harness.hpp"
#include "nccl_harness_main.hpp"

int main(int argc, char** argv) { return nccl_harness_main(argc, argv, "test_nccl_shard", false); }

// SPDX-License-Identifier: MIT
// Muon, NorMuon, Dion2 and NorDion2 on the meshes over NCCL on the CUDA
// backend: the layouts, tensors, single-device references, float64
// emulation of Dion2's local selection and tolerances of
// tests/mpi/test_mpi_megabatch.cpp (see there for what is asserted and why),
// with parameters, gradients and every other buffer handed to libdion in
// device memory and every mesh an NCCL communicator created through
// dion_comm_init_nccl (MPI only splits the world, carries the unique ids and
// sums the test's byte counters); states are read back into host memory with
// dion_state_read. One rank per GPU (rank r uses device r % device_count);
// with fewer GPUs than ranks the program says so and exits 0, which ctest
// reports as skipped. The reference optimizer runs on each rank's own GPU.
//
// Tolerances are the host suite's: the CUDA backend works in fp32 like the
// host one (cuBLAS with CUBLAS_COMPUTE_32F, no TF32 at the default
// matmul_precision), so only the order of its sums differs, which is the
// ~1e-7-per-sum reassociation the host bounds already budget for. The byte
// counters are those of dion::Collectives, the same for both transports, so
// Muon's exact volume is asserted here too.
#include "../mpi/megabatch_harness.hpp"
#include "nccl_harness_main.hpp"

int main(int argc, char** argv) { return nccl_harness_main(argc, argv, "test_nccl_megabatch", verbose()); }

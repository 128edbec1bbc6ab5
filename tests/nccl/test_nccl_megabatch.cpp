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
#include <cuda_runtime.h>

#include <cstdio>

#include "../mpi/megabatch_harness.hpp"
#include "../mpi/rank_printer.hpp"

ShardEnv g_env;
int g_rank = 0, g_size = 1;

namespace {

dion_comm_t nccl_comm(MPI_Comm c) {
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

void* dev_alloc(size_t bytes) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
  return p;
}
void dev_free(void* p) { cudaFree(p); }
void h2d(void* d, const void* h, size_t bytes) { EXPECT_EQ(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), cudaSuccess); }
void d2h(void* h, const void* d, size_t bytes) { EXPECT_EQ(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess); }

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess) ndev = 0;
  int fewest = ndev;
  MPI_Allreduce(&ndev, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (fewest < g_size) {
    if (g_rank == 0) std::printf("test_nccl_megabatch: needs one GPU per rank (%d ranks, %d GPUs)\n", g_size, fewest);
    MPI_Finalize();
    return 0;
  }
  g_env.backend = DION_BACKEND_CUDA;
  g_env.device = g_rank % ndev;
  cudaSetDevice(g_env.device);
  g_env.make_comm = nccl_comm;
  g_env.alloc = dev_alloc;
  g_env.free = dev_free;
  g_env.h2d = h2d;
  g_env.d2h = d2h;
  ::testing::InitGoogleTest(&argc, argv);
  if (!verbose()) print_failures_only_unless_rank0(g_rank);  // verbose: every rank prints everything
  const int rc = RUN_ALL_TESTS();
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}

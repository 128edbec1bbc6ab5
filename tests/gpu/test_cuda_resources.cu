// SPDX-License-Identifier: MIT
// Resource hygiene of the CUDA backend (issue 7, item 6): a thousand
// optimizers created, given groups of every algorithm, stepped on a stream,
// read and destroyed leave neither device memory nor host memory behind.
//
// Device memory is measured with cudaMemGetInfo (what the driver has handed
// out on the device, including cuBLAS/cuSOLVER handles and workspaces), host
// memory with the resident set size. Both are read after 50 iterations, once
// the CUDA runtime, the libraries' lazy modules and the host allocator have
// warmed up, and again after 1000. The tensors are sized so that a leak of
// any single state buffer is far above the bounds: the smallest matrix
// state is Dion's Q (256 x 64 fp32 = 64 KiB), so leaking it in every
// iteration would add 59 MiB over the 950 measured iterations. The device
// bound is 4 MiB (two of the driver's 2 MiB allocation pages: cudaMemGetInfo
// moves in that granularity, so a smaller bound would test the driver's
// sub-allocator, not the library); the host bound 8 MiB (the CUDA runtime
// keeps per-handle bookkeeping that the host allocator need not return to
// the system at once).
// Its own executable: the driver's free-memory figure would otherwise include
// the allocations of whatever suite ran before in the same process.
#include <unistd.h>

#include <cstdio>

#include "gpu_test_util.h"

namespace {

using namespace dion_gpu_test;

long rss_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  long size = 0, resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * sysconf(_SC_PAGESIZE) : -1;
}

size_t device_used() {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return 0;
  return total_b - free_b;
}

TEST(CudaResources, ThousandOptimizersLeaveNoDeviceOrHostMemory) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  // Every algorithm in turn on a 256 x 256 matrix and a 256 x 64 one (Dion
  // with each QR method), plus an AdamW group of a vector, in fp32 and bf16.
  const std::vector<int64_t> s1 = {256, 256}, s2 = {256, 64}, s3 = {1000};
  DeviceBuffer x1(4 * 256 * 256), g1(4 * 256 * 256), x2(4 * 256 * 64), g2(4 * 256 * 64), x3(4 * 1000),
      g3(4 * 1000);
  CUDA_ASSERT(g1.upload(random_bytes(256 * 256, DION_DTYPE_FP32, 1, 0.01)));
  CUDA_ASSERT(g2.upload(random_bytes(256 * 64, DION_DTYPE_FP32, 2, 0.01)));
  CUDA_ASSERT(g3.upload(random_bytes(1000, DION_DTYPE_FP32, 3, 0.01)));
  const std::vector<unsigned char> x1_init = random_bytes(256 * 256, DION_DTYPE_FP32, 4, 0.05);
  const std::vector<unsigned char> x2_init = random_bytes(256 * 64, DION_DTYPE_FP32, 5, 0.05);
  const std::vector<unsigned char> x3_init = random_bytes(1000, DION_DTYPE_FP32, 6, 0.05);
  const dion_algorithm_t algos[] = {DION_ALGO_DION,     DION_ALGO_DION2, DION_ALGO_MUON, DION_ALGO_NORMUON,
                                    DION_ALGO_NORDION2, DION_ALGO_ADAMW, DION_ALGO_LION};
  Stream stream;
  size_t dev_warm = 0;
  long rss_warm = 0;
  uint64_t state_seen = 0, ws_seen = 0;
  for (int it = 0; it < 1000; ++it) {
    if (it == 50) {
      CUDA_ASSERT(cudaDeviceSynchronize());
      dev_warm = device_used();
      rss_warm = rss_bytes();
    }
    CUDA_ASSERT(x1.upload(x1_init));
    CUDA_ASSERT(x2.upload(x2_init));
    CUDA_ASSERT(x3.upload(x3_init));
    dion_optimizer_t opt = nullptr;
    dion_options_t o = options(DION_BACKEND_CUDA, static_cast<uint64_t>(it), 0);
    ASSERT_EQ(dion_create(&opt, &o), DION_SUCCESS) << dion_last_error(nullptr);
    const dion_algorithm_t a = algos[it % 7];
    dion_group_options_t go = group_options(a);
    go.qr_method = it % 3 == 0 ? DION_QR_CQR : it % 3 == 1 ? DION_QR_QR : DION_QR_RCQR;
    go.cqr_warmup_steps = 0;
    go.matmul_precision = (it / 7) % 2 == 0 ? DION_MATMUL_FP32 : DION_MATMUL_BF16;
    const dion_tensor_t t[2] = {descriptor("res.a", x1.get(), g1.get(), DION_DTYPE_FP32, s1),
                                descriptor("res.b", x2.get(), g2.get(), DION_DTYPE_FP32, s2)};
    ASSERT_EQ(dion_add_group(opt, &go, t, 2, nullptr), DION_SUCCESS) << "iteration " << it << ": "
                                                                      << dion_last_error(opt);
    dion_group_options_t ga = group_options(DION_ALGO_ADAMW);
    const dion_tensor_t v = descriptor("res.v", x3.get(), g3.get(), DION_DTYPE_FP32, s3);
    ASSERT_EQ(dion_add_group(opt, &ga, &v, 1, nullptr), DION_SUCCESS) << dion_last_error(opt);
    ASSERT_EQ(dion_step(opt, stream.dion()), DION_SUCCESS) << dion_last_error(opt);
    ASSERT_EQ(dion_step(opt, stream.dion()), DION_SUCCESS) << dion_last_error(opt);
    const std::vector<StateData> st = read_states(opt, stream.get());
    ASSERT_FALSE(st.empty());
    uint64_t sb = 0, wb = 0;
    ASSERT_EQ(dion_get_memory_usage(opt, &sb, &wb), DION_SUCCESS) << dion_last_error(opt);
    state_seen = std::max(state_seen, sb);
    ws_seen = std::max(ws_seen, wb);
    // A failing call records a message on the handle: that must not accumulate either.
    EXPECT_EQ(dion_group_set_hparam(opt, 9, DION_HPARAM_LR, 0.1), DION_ERROR_INVALID_USAGE);
    // Destroyed with the second step possibly still in flight on the stream:
    // dion_destroy waits for it.
    ASSERT_EQ(dion_destroy(opt), DION_SUCCESS) << dion_last_error(nullptr);
  }
  CUDA_ASSERT(cudaDeviceSynchronize());
  const size_t dev_end = device_used();
  const long rss_end = rss_bytes();
  ASSERT_GT(dev_warm, 0u) << "cudaMemGetInfo failed";
  ASSERT_GT(rss_warm, 0) << "/proc/self/statm is not readable";
  // The measurement can see a leak of the size the header's argument needs:
  // the library held at least one Q-sized state in every iteration.
  ASSERT_GE(state_seen, 256u * 64u * 4u);
  std::printf("    device memory in use after 50 iterations %.2f MiB, after 1000 %.2f MiB; RSS %.2f -> %.2f MiB; "
              "largest state %.2f MiB, workspace %.2f MiB\n",
              dev_warm / 1048576.0, dev_end / 1048576.0, rss_warm / 1048576.0, rss_end / 1048576.0,
              state_seen / 1048576.0, ws_seen / 1048576.0);
  EXPECT_LE(static_cast<long long>(dev_end) - static_cast<long long>(dev_warm), 4LL << 20)
      << "device memory grew by " << (static_cast<long long>(dev_end) - static_cast<long long>(dev_warm)) / 1024
      << " KiB over 950 iterations";
  EXPECT_LE(rss_end - rss_warm, 8L << 20) << "RSS grew by " << (rss_end - rss_warm) / 1024
                                          << " KiB over 950 iterations";
}

}  // namespace

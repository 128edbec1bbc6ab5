// SPDX-License-Identifier: MIT
// The caller's stream belongs to the caller. Once a dion_step on it has
// returned and the caller has synchronised and destroyed the stream (legal
// CUDA: frameworks create and drop streams freely), the optimizer must keep
// working: the calls that take no stream (dion_group_get_step,
// dion_group_set_hparam, dion_group_set_step, dion_destroy) may not use the
// stream of the last dion_step, which is now a dangling handle. "dion_destroy
// waits for work the optimizer enqueued" has to go through something the
// library owns: an event it recorded on that stream during the step, its
// own stream, or the device.
//
// A library that synchronises the remembered stream crashes here (a
// segmentation fault inside libcuda, seen as the process dying), so this
// suite is its own executable: the crash cannot take other suites with it.
#include "gpu_test_util.h"

namespace {

using namespace dion_gpu_test;

TEST(CudaApiLifetime, OptimizerOutlivesTheCallersStream) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  const std::vector<int64_t> shape = {64, 48};
  const int64_t n = 64 * 48;
  DeviceBuffer param(4 * n), grad(4 * n);
  CUDA_ASSERT(param.upload(random_bytes(n, DION_DTYPE_FP32, 1, 0.05)));
  CUDA_ASSERT(grad.upload(random_bytes(n, DION_DTYPE_FP32, 2, 1.0)));
  Optimizer opt;
  ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA, 1, 0)), DION_SUCCESS);
  dion_group_options_t g = group_options(DION_ALGO_DION);
  g.rank_fraction = 0.5;
  const dion_tensor_t t = descriptor("life.dion", param.get(), grad.get(), DION_DTYPE_FP32, shape);
  DION_ASSERT_OK(opt.get(), dion_add_group(opt, &g, &t, 1, nullptr));
  {
    Stream s;
    for (int k = 0; k < 2; ++k) DION_ASSERT_OK(opt.get(), dion_step(opt, s.dion()));
    CUDA_ASSERT(s.sync());
  }  // the caller's stream is destroyed here, its work complete
  // Churn stream handles so that the freed one is likely reused or unmapped.
  for (int i = 0; i < 16; ++i) {
    Stream other;
    CUDA_ASSERT(other.sync());
  }
  int64_t step = -1;
  DION_EXPECT_OK(opt.get(), dion_group_get_step(opt, 0, &step));
  EXPECT_EQ(step, 2);
  DION_EXPECT_OK(opt.get(), dion_group_set_hparam(opt, 0, DION_HPARAM_LR, 0.005));
  DION_EXPECT_OK(opt.get(), dion_group_set_step(opt, 0, 2));
  // A step on the legacy default stream still works after all that.
  DION_EXPECT_OK(opt.get(), dion_step(opt, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  {
    // The last step was on another stream, destroyed again before destroy.
    Stream s;
    DION_EXPECT_OK(opt.get(), dion_step(opt, s.dion()));
    CUDA_ASSERT(s.sync());
  }
  EXPECT_EQ(dion_destroy(opt.release()), DION_SUCCESS) << dion_last_error(nullptr);
}

}  // namespace

// SPDX-License-Identifier: MIT
// API contract of the CUDA backend (DION_BACKEND_CUDA), beyond the numbers
// (test_cuda_vs_host.cu) and graph capture (test_cuda_graph.cu):
//  - buffers: param and grad must be device memory of the optimizer's
//    device, aligned to their element size; anything else is rejected at
//    dion_add_group / dion_tensor_rebind with INVALID_ARGUMENT naming the
//    tensor and "param" / "grad", and the failed call changes nothing;
//  - the non-finite guard runs on the device: a step with a NaN/Inf gradient
//    changes no parameter, state or step counter, and is counted;
//  - steady state: no device allocation after the warm-up step; 1000 steps
//    stay finite;
//  - dion_state_read / dion_state_write take host or device buffers and are
//    complete when they return; dion_get_memory_usage reports the workspace;
//  - dion_step is enqueued on the caller's stream, ordered after the work
//    already there and before the work enqueued later, without waiting.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <chrono>
#include <deque>

#include "gpu_test_util.h"

namespace {

using namespace dion_gpu_test;

// ----------------------------------------------------------------- kernels --

__device__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins for `ns` nanoseconds, then copies `bytes` bytes from src to dst: work
// that the step enqueued after it must wait for (and see the copy of).
__global__ void spin_then_copy(uint64_t ns, const unsigned char* src, unsigned char* dst, size_t bytes) {
  if (threadIdx.x == 0) {
    const uint64_t t0 = globaltimer_ns();
    while (globaltimer_ns() - t0 < ns) {
    }
  }
  __syncthreads();
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
}

// scale * hash_uniform(seed, i), the host's splitmix64 draw, in dtype `dt`.
__global__ void fill_random(void* p, int64_t n, int32_t dt, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float v = scale * static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 23) - 1.0);
    if (dt == DION_DTYPE_FP32)
      static_cast<float*>(p)[i] = v;
    else if (dt == DION_DTYPE_BF16)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else
      static_cast<__half*>(p)[i] = __float2half_rn(v);
  }
}

// ------------------------------------------------------------------ model --

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};
struct GroupSpec {
  dion_group_options_t opts;
  std::vector<TensorSpec> tensors;
};

// A CUDA optimizer over device tensors described by GroupSpecs.
struct DevModel {
  Optimizer opt;
  std::deque<DeviceTensor> tensors;
  int32_t groups = 0;

  void build(const std::vector<GroupSpec>& spec, dion_dtype_t dt, uint64_t data_seed, uint64_t lib_seed = 5) {
    ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA, lib_seed, 0)), DION_SUCCESS);
    for (const GroupSpec& g : spec) {
      std::vector<dion_tensor_t> d;
      for (const TensorSpec& ts : g.tensors) {
        tensors.emplace_back();
        DeviceTensor& t = tensors.back();
        t.name = ts.name;
        t.shape = ts.shape;
        t.dtype = dt;
        CUDA_ASSERT(t.allocate());
        CUDA_ASSERT(t.param.upload(random_bytes(t.numel(), dt, data_seed + tensors.size(), 0.05)));
        CUDA_ASSERT(t.grad.upload(random_bytes(t.numel(), dt, data_seed + 500 + tensors.size(), 1.0)));
        d.push_back(t.desc());
      }
      int32_t gi = -1;
      DION_ASSERT_OK(opt.get(), dion_add_group(opt, &g.opts, d.data(), d.size(), &gi));
      ASSERT_EQ(gi, groups);
      ++groups;
    }
  }
  // New gradients for every tensor, a pure function of (seed, tensor).
  void set_grads(uint64_t seed) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      DeviceTensor& t = tensors[i];
      CUDA_ASSERT(t.grad.upload(random_bytes(t.numel(), t.dtype, seed * 131 + i, 1.0)));
    }
  }
  std::vector<std::vector<unsigned char>> params() const {
    cudaDeviceSynchronize();
    std::vector<std::vector<unsigned char>> v;
    for (const DeviceTensor& t : tensors) v.push_back(t.param.download());
    return v;
  }
  std::vector<int64_t> steps() const {
    std::vector<int64_t> v;
    for (int32_t g = 0; g < groups; ++g) v.push_back(group_step(opt, g));
    return v;
  }
};

void expect_same_params(const std::vector<std::vector<unsigned char>>& a,
                        const std::vector<std::vector<unsigned char>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(a[i], b[i])) << what << ": parameter of tensor " << i;
}

dion_group_options_t opts(dion_algorithm_t a) {
  dion_group_options_t g = group_options(a);
  if (a == DION_ALGO_DION) g.rank_fraction = 0.5;  // RCQR on a tall P
  return g;
}

// One group per algorithm, all of them.
std::vector<GroupSpec> all_algorithms() {
  return {{opts(DION_ALGO_DION), {{"api.dion", {64, 48}}}},
          {opts(DION_ALGO_MUON), {{"api.muon", {48, 64}}, {"api.muon3d", {2, 16, 24}}}},
          {opts(DION_ALGO_ADAMW), {{"api.adamw", {37}}}},
          {opts(DION_ALGO_LION), {{"api.lion", {2, 3, 4}}}},
          {opts(DION_ALGO_NORDION2), {{"api.nordion2", {32, 32}}}},
          {opts(DION_ALGO_NORMUON), {{"api.normuon", {24, 40}}}},
          {opts(DION_ALGO_DION2), {{"api.dion2", {40, 24}}}}};
}

void skipped(dion_optimizer_t opt, cudaStream_t s, int64_t* n, int32_t* last) {
  ASSERT_EQ(dion_get_skipped_steps(opt, n, last, reinterpret_cast<dion_stream_t>(s)), DION_SUCCESS)
      << dion_last_error(opt);
}

// Adds one group of one tensor over the given buffers and returns the status.
dion_status_t add_one(Optimizer& opt, const char* name, void* param, const void* grad, dion_dtype_t dt,
                      const std::vector<int64_t>& shape, dion_algorithm_t algo = DION_ALGO_MUON) {
  const dion_tensor_t t = descriptor(name, param, grad, dt, shape);
  const dion_group_options_t g = group_options(algo);
  return dion_add_group(opt, &g, &t, 1, nullptr);
}

void expect_nothing_added(dion_optimizer_t opt) {
  int32_t g = -1, t = -1;
  EXPECT_EQ(dion_group_count(opt, &g), DION_SUCCESS);
  EXPECT_EQ(dion_tensor_count(opt, &t), DION_SUCCESS);
  EXPECT_EQ(g, 0) << "a rejected dion_add_group must add no group";
  EXPECT_EQ(t, 0) << "a rejected dion_add_group must add no tensor";
}

// -------------------------------------------------------------- pointers --

// A malloc'd host pointer is not device memory: the CUDA backend cannot
// dereference it in a kernel, so dion_add_group must refuse it up front.
TEST(CudaApiPointers, HostParamIsRejectedNamingTensorAndParam) {
  DION_REQUIRE_GPU();
  Optimizer opt;
  ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA)), DION_SUCCESS);
  const std::vector<int64_t> shape = {16, 24};
  std::vector<float> host(16 * 24, 0.5f);
  DeviceBuffer grad(sizeof(float) * host.size());
  EXPECT_TRUE(is_error(add_one(opt, "w.hostparam", host.data(), grad.get(), DION_DTYPE_FP32, shape),
                       DION_ERROR_INVALID_ARGUMENT, opt, {"w.hostparam", "param"}));
  expect_nothing_added(opt);
}

TEST(CudaApiPointers, HostGradIsRejectedNamingTensorAndGrad) {
  DION_REQUIRE_GPU();
  Optimizer opt;
  ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA)), DION_SUCCESS);
  const std::vector<int64_t> shape = {16, 24};
  DeviceBuffer param(sizeof(float) * 16 * 24);
  std::vector<float> host(16 * 24, 0.5f);
  EXPECT_TRUE(is_error(add_one(opt, "w.hostgrad", param.get(), host.data(), DION_DTYPE_FP32, shape),
                       DION_ERROR_INVALID_ARGUMENT, opt, {"w.hostgrad", "grad"}));
  expect_nothing_added(opt);
}

// Element-size alignment is required (a kernel cannot load a float from an
// odd address): base + 1 byte for fp32 or bf16, base + 2 for an fp32 grad.
TEST(CudaApiPointers, MisalignedDevicePointersAreRejected) {
  DION_REQUIRE_GPU();
  const std::vector<int64_t> shape = {16, 24};
  const size_t n = 16 * 24;
  DeviceBuffer pbuf(4 * n + 64), gbuf(4 * n + 64);
  {
    Optimizer opt;
    ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA)), DION_SUCCESS);
    EXPECT_TRUE(is_error(add_one(opt, "w.mis_fp32", pbuf.bytes_ptr() + 1, gbuf.get(), DION_DTYPE_FP32, shape),
                         DION_ERROR_INVALID_ARGUMENT, opt, {"w.mis_fp32", "param"}));
    expect_nothing_added(opt);
  }
  {
    Optimizer opt;
    ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA)), DION_SUCCESS);
    EXPECT_TRUE(is_error(add_one(opt, "w.mis_grad", pbuf.get(), gbuf.bytes_ptr() + 2, DION_DTYPE_FP32, shape),
                         DION_ERROR_INVALID_ARGUMENT, opt, {"w.mis_grad", "grad"}));
    expect_nothing_added(opt);
  }
  {
    Optimizer opt;
    ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA)), DION_SUCCESS);
    EXPECT_TRUE(is_error(add_one(opt, "w.mis_bf16", pbuf.bytes_ptr() + 1, gbuf.get(), DION_DTYPE_BF16, shape),
                         DION_ERROR_INVALID_ARGUMENT, opt, {"w.mis_bf16", "param"}));
    expect_nothing_added(opt);
  }
}

// Element alignment is all that is required (not 16 bytes): fp32 buffers at
// base + 4 and bf16 at base + 2 are accepted, and the step computes what it
// computes on 256-byte aligned copies. AdamW and Muon load parameters and
// gradients into fp32 workspace before any GEMM, so alignment can only
// select a different element-wise load/store path: bit-identical. Dion
// updates aligned parameters with a pointer-array GEMM (cuBLAS assumes
// 16-byte aligned pointers there) and element-aligned ones through a
// product and an element-wise pass: the same arithmetic summed in another
// order, so within fp32's roundoff amplified by P's conditioning (1e-4
// relative; the update is far smaller than the parameter), or one rounding
// of bf16 (2^-8).
TEST(CudaApiPointers, ElementAlignedPointersAreAcceptedAndComputeTheSame) {
  DION_REQUIRE_GPU();
  for (dion_dtype_t dt : {DION_DTYPE_FP32, DION_DTYPE_BF16})
    for (dion_algorithm_t algo : {DION_ALGO_ADAMW, DION_ALGO_MUON, DION_ALGO_DION}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + algo_name(algo));
      const std::vector<int64_t> shape = {48, 40};
      const int64_t n = 48 * 40;
      const size_t es = elem_size(dt), off = es;  // one element past a 256-byte boundary
      const std::vector<unsigned char> x0 = random_bytes(n, dt, 1, 0.05), g = random_bytes(n, dt, 2, 1.0);
      DeviceBuffer ap(n * es), ag(n * es), up(n * es + 64), ug(n * es + 64);
      CUDA_ASSERT(ap.upload(x0));
      CUDA_ASSERT(ag.upload(g));
      // A guard pattern around the offset buffers shows any out-of-bounds store.
      CUDA_ASSERT(cudaMemset(up.get(), 0x5A, up.bytes()));
      CUDA_ASSERT(cudaMemcpy(up.bytes_ptr() + off, x0.data(), x0.size(), cudaMemcpyHostToDevice));
      CUDA_ASSERT(cudaMemcpy(ug.bytes_ptr() + off, g.data(), g.size(), cudaMemcpyHostToDevice));
      Optimizer aligned, offset;
      ASSERT_EQ(aligned.create(options(DION_BACKEND_CUDA)), DION_SUCCESS);
      ASSERT_EQ(offset.create(options(DION_BACKEND_CUDA)), DION_SUCCESS);
      DION_ASSERT_OK(aligned.get(), add_one(aligned, "w.aligned", ap.get(), ag.get(), dt, shape, algo));
      DION_ASSERT_OK(offset.get(),
                     add_one(offset, "w.offset", up.bytes_ptr() + off, ug.bytes_ptr() + off, dt, shape, algo));
      for (int s = 0; s < 3; ++s) {
        DION_ASSERT_OK(aligned.get(), dion_step(aligned, nullptr));
        DION_ASSERT_OK(offset.get(), dion_step(offset, nullptr));
      }
      CUDA_ASSERT(cudaDeviceSynchronize());
      std::vector<unsigned char> got(x0.size());
      CUDA_ASSERT(cudaMemcpy(got.data(), up.bytes_ptr() + off, got.size(), cudaMemcpyDeviceToHost));
      const double tol = dt == DION_DTYPE_FP32 ? 1e-4 : std::ldexp(1.0, -8);
      if (algo == DION_ALGO_DION)
        EXPECT_LE(rel_diff(got, ap.download(), dt), tol) << "the element-aligned buffer's update differs";
      else
        EXPECT_TRUE(same_bits(got, ap.download())) << "the element-aligned buffer's update differs";
      EXPECT_FALSE(same_bits(got, x0)) << "the step did not change the offset parameter";
      // The bytes around the offset buffer keep their guard pattern (no
      // vectorised store rounding the address down or spilling past the end).
      const std::vector<unsigned char> all = up.download();
      size_t touched = 0;
      for (size_t b = 0; b < all.size(); ++b)
        if ((b < off || b >= off + x0.size()) && all[b] != 0x5A) ++touched;
      EXPECT_EQ(touched, 0u) << "bytes outside the parameter buffer were written";
      if (algo != DION_ALGO_DION) {
        expect_same_states(read_states(offset), read_states(aligned), "states, offset vs aligned buffers");
        continue;
      }
      const std::vector<StateData> so = read_states(offset), sa = read_states(aligned);
      ASSERT_EQ(so.size(), sa.size());
      for (size_t i = 0; i < so.size(); ++i)
        EXPECT_LE(rel_diff(so[i].raw, sa[i].raw, so[i].info.dtype), tol) << "state " << so[i].name;
    }
}

// A device pointer of another GPU is not memory of the optimizer's device.
TEST(CudaApiPointers, PointerOnAnotherDeviceIsRejected) {
  DION_REQUIRE_GPU();
  if (gpu_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<int64_t> shape = {16, 24};
  CUDA_ASSERT(cudaSetDevice(1));
  DeviceBuffer other(4 * 16 * 24);
  CUDA_ASSERT(cudaSetDevice(0));
  DeviceBuffer mine(4 * 16 * 24);
  Optimizer opt;
  ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA, 0, 0)), DION_SUCCESS);
  EXPECT_TRUE(is_error(add_one(opt, "w.dev1param", other.get(), mine.get(), DION_DTYPE_FP32, shape),
                       DION_ERROR_INVALID_ARGUMENT, opt, {"w.dev1param", "param"}));
  EXPECT_TRUE(is_error(add_one(opt, "w.dev1grad", mine.get(), other.get(), DION_DTYPE_FP32, shape),
                       DION_ERROR_INVALID_ARGUMENT, opt, {"w.dev1grad", "grad"}));
  expect_nothing_added(opt);
}

// dion_tensor_rebind checks pointers like dion_add_group, and a rejected
// rebind changes nothing: parameters, states and step counters are
// bit-identical, and the next step still uses the previous buffers (it
// equals the step of a twin that never saw the failed calls).
TEST(CudaApiPointers, RebindRejectsHostAndMisalignedPointersAndChangesNothing) {
  DION_REQUIRE_GPU();
  const std::vector<GroupSpec> spec = {{opts(DION_ALGO_MUON), {{"rb.muon", {48, 64}}}},
                                       {opts(DION_ALGO_ADAMW), {{"rb.adamw", {37}}}}};
  DevModel m, twin;
  m.build(spec, DION_DTYPE_FP32, 3);
  if (HasFatalFailure()) return;
  twin.build(spec, DION_DTYPE_FP32, 3);
  if (HasFatalFailure()) return;
  DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, nullptr));
  DION_ASSERT_OK(twin.opt.get(), dion_step(twin.opt, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  const auto params_before = m.params();
  const auto states_before = read_states(m.opt);
  const auto steps_before = m.steps();

  DeviceTensor& t = m.tensors[0];
  std::vector<unsigned char> host(t.bytes());
  EXPECT_TRUE(is_error(dion_tensor_rebind(m.opt, 0, host.data(), t.grad.get()), DION_ERROR_INVALID_ARGUMENT, m.opt,
                       {"rb.muon", "param"}));
  EXPECT_TRUE(is_error(dion_tensor_rebind(m.opt, 0, t.param.get(), host.data()), DION_ERROR_INVALID_ARGUMENT, m.opt,
                       {"rb.muon", "grad"}));
  DeviceBuffer spare(t.bytes() + 64);
  EXPECT_TRUE(is_error(dion_tensor_rebind(m.opt, 0, spare.bytes_ptr() + 1, t.grad.get()), DION_ERROR_INVALID_ARGUMENT,
                       m.opt, {"rb.muon", "param"}));
  EXPECT_TRUE(is_error(dion_tensor_rebind(m.opt, 1, m.tensors[1].param.get(), spare.bytes_ptr() + 2),
                       DION_ERROR_INVALID_ARGUMENT, m.opt, {"rb.adamw", "grad"}));

  expect_same_params(m.params(), params_before, "after rejected rebinds");
  expect_same_states(read_states(m.opt), states_before, "after rejected rebinds");
  EXPECT_EQ(m.steps(), steps_before);

  m.set_grads(9);
  twin.set_grads(9);
  DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, nullptr));
  DION_ASSERT_OK(twin.opt.get(), dion_step(twin.opt, nullptr));
  expect_same_params(m.params(), twin.params(), "the step after rejected rebinds vs a twin");
  expect_same_states(read_states(m.opt), read_states(twin.opt), "states after rejected rebinds vs a twin");
}

// A valid rebind to new device buffers is honoured: the next step reads the
// new gradient and updates the new parameter buffer, the old one stays as it was.
TEST(CudaApiPointers, RebindToNewDeviceBuffersIsUsed) {
  DION_REQUIRE_GPU();
  const std::vector<GroupSpec> spec = {{opts(DION_ALGO_MUON), {{"rb2.muon", {48, 64}}}}};
  DevModel m, twin;
  m.build(spec, DION_DTYPE_FP32, 4);
  if (HasFatalFailure()) return;
  twin.build(spec, DION_DTYPE_FP32, 4);
  if (HasFatalFailure()) return;
  DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, nullptr));
  DION_ASSERT_OK(twin.opt.get(), dion_step(twin.opt, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  const std::vector<unsigned char> old_param = m.tensors[0].param.download();
  const std::vector<unsigned char> new_grad = random_bytes(m.tensors[0].numel(), DION_DTYPE_FP32, 77, 1.0);
  DeviceBuffer np(old_param.size()), ng(new_grad.size());
  CUDA_ASSERT(np.upload(old_param));
  CUDA_ASSERT(ng.upload(new_grad));
  DION_ASSERT_OK(m.opt.get(), dion_tensor_rebind(m.opt, 0, np.get(), ng.get()));
  CUDA_ASSERT(twin.tensors[0].grad.upload(new_grad));
  DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, nullptr));
  DION_ASSERT_OK(twin.opt.get(), dion_step(twin.opt, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(m.tensors[0].param.download(), old_param)) << "the old parameter buffer was written";
  EXPECT_TRUE(same_bits(np.download(), twin.tensors[0].param.download()))
      << "the rebound buffers did not get the step the twin got";
}

// ----------------------------------------------------------------- guard --

struct Injection {
  size_t tensor;  // index into all_algorithms()' tensors
  float value;
  const char* what;
};

// The guard on the device: after two clean steps, a gradient with one bad
// element makes the step change nothing (bit for bit), counts it, and leaves
// every group's step counter; the following clean step equals the step of a
// twin that never saw the bad one (so nothing hidden, e.g. the sketch key,
// advanced either). Bit-identical: the same kernels run in the same order.
TEST(CudaApiGuard, NonFiniteGradientSkipsTheStepOnTheDevice) {
  DION_REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  const Injection cases[] = {{0, std::numeric_limits<float>::quiet_NaN(), "NaN in the Dion gradient"},
                             {1, inf, "+Inf in a Muon gradient"},
                             {3, -inf, "-Inf in the AdamW gradient"},
                             {7, std::numeric_limits<float>::quiet_NaN(), "NaN in the Dion2 gradient"}};
  for (const Injection& inj : cases) {
    SCOPED_TRACE(inj.what);
    Stream s;
    DevModel m, twin;
    m.build(all_algorithms(), DION_DTYPE_FP32, 21);
    if (HasFatalFailure()) return;
    twin.build(all_algorithms(), DION_DTYPE_FP32, 21);
    if (HasFatalFailure()) return;
    for (int k = 1; k <= 2; ++k) {
      m.set_grads(k);
      twin.set_grads(k);
      DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, s.dion()));
      DION_ASSERT_OK(twin.opt.get(), dion_step(twin.opt, s.dion()));
    }
    CUDA_ASSERT(s.sync());
    const auto params_before = m.params();
    const auto states_before = read_states(m.opt, s.get());
    const auto steps_before = m.steps();

    m.set_grads(3);
    DeviceTensor& bad = m.tensors[inj.tensor];
    const int64_t at = bad.numel() / 2;
    CUDA_ASSERT(cudaMemcpy(bad.grad.bytes_ptr() + 4 * at, &inj.value, 4, cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaDeviceSynchronize());  // landed before the step on the non-blocking stream reads it
    DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, s.dion()));
    int64_t n = -1;
    int32_t last = -1;
    skipped(m.opt, s.get(), &n, &last);
    EXPECT_EQ(n, 1) << "dion_get_skipped_steps after the bad step";
    EXPECT_EQ(last, 1);
    expect_same_params(m.params(), params_before, "a skipped step");
    expect_same_states(read_states(m.opt, s.get()), states_before, "a skipped step");
    EXPECT_EQ(m.steps(), steps_before) << "a skipped step must not advance any group's step counter";

    m.set_grads(4);
    twin.set_grads(4);
    DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, s.dion()));
    DION_ASSERT_OK(twin.opt.get(), dion_step(twin.opt, s.dion()));
    CUDA_ASSERT(s.sync());
    skipped(m.opt, s.get(), &n, &last);
    EXPECT_EQ(n, 1);
    EXPECT_EQ(last, 0) << "the clean step after the bad one was applied";
    EXPECT_EQ(m.steps(), std::vector<int64_t>(7, 3));
    expect_same_params(m.params(), twin.params(), "the clean step after a skipped one vs a twin");
    expect_same_states(read_states(m.opt, s.get()), read_states(twin.opt, s.get()),
                       "states after the clean step vs a twin");
  }
}

// ---------------------------------------------------------- steady state --

// No device allocation after the warm-up: cudaMemGetInfo's free bytes are
// exactly the same before and after 10 more steps (0 bytes of slack), and
// dion_get_memory_usage does not move. cudaMemGetInfo sees allocations at
// the driver's page granularity (2 MiB), so a small cudaMalloc served from an
// already mapped page would escape it; the graph capture suite, where any
// cudaMalloc during capture is an error, covers those.
TEST(CudaApiSteadyState, NoDeviceAllocationAfterWarmup) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  Stream s;
  DevModel m;
  m.build(all_algorithms(), DION_DTYPE_FP32, 31);
  if (HasFatalFailure()) return;
  // Two warm-up steps (the contract says one): a kernel first used by the
  // second step (e.g. with a non-zero momentum) would be loaded lazily by
  // the CUDA driver then (CUDA_MODULE_LOADING=LAZY, the default), taking
  // device memory for its code that is not the library's allocation.
  for (int k = 0; k < 2; ++k) DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, s.dion()));
  CUDA_ASSERT(s.sync());
  CUDA_ASSERT(cudaDeviceSynchronize());
  size_t free0 = 0, total = 0;
  CUDA_ASSERT(cudaMemGetInfo(&free0, &total));
  uint64_t state0 = 0, ws0 = 0;
  DION_ASSERT_OK(m.opt.get(), dion_get_memory_usage(m.opt, &state0, &ws0));
  for (int k = 0; k < 10; ++k) DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, s.dion()));
  CUDA_ASSERT(s.sync());
  CUDA_ASSERT(cudaDeviceSynchronize());
  size_t free1 = 0;
  CUDA_ASSERT(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(free1, free0) << "device memory changed by "
                          << (static_cast<long long>(free0) - static_cast<long long>(free1))
                          << " bytes over 10 steady-state steps";
  uint64_t state1 = 0, ws1 = 0;
  DION_ASSERT_OK(m.opt.get(), dion_get_memory_usage(m.opt, &state1, &ws1));
  EXPECT_EQ(state1, state0);
  EXPECT_EQ(ws1, ws0);
  EXPECT_EQ(m.steps(), std::vector<int64_t>(7, 12));
}

class CudaApiLongRun : public ::testing::TestWithParam<dion_dtype_t> {};

// 1000 steps of Dion and Muon on 256 x 512 with fresh random gradients
// (drawn on the device, so the run takes seconds), two of them exactly zero:
// every parameter and state stays finite, no step is skipped (a finite
// gradient must never trip the guard), and every step is counted.
TEST_P(CudaApiLongRun, ThousandStepsOfDionAndMuonStayFinite) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  const dion_dtype_t dt = GetParam();
  Stream s;
  DevModel m;
  dion_group_options_t dion = group_options(DION_ALGO_DION);
  dion.rank_fraction = 0.25;
  m.build({{dion, {{"long.dion", {256, 512}}}}, {group_options(DION_ALGO_MUON), {{"long.muon", {256, 512}}}}}, dt, 41);
  if (HasFatalFailure()) return;
  const auto x0 = m.params();
  for (int k = 1; k <= 1000; ++k) {
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      DeviceTensor& t = m.tensors[i];
      const float scale = (k == 500 || k == 501) ? 0.0f : 1.0f;
      fill_random<<<64, 256, 0, s.get()>>>(t.grad.get(), t.numel(), dt, 1000003ull * k + i, scale);
    }
    CUDA_ASSERT(cudaGetLastError());
    DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, s.dion()));
  }
  CUDA_ASSERT(s.sync());
  const auto x = m.params();
  for (size_t i = 0; i < x.size(); ++i) {
    const std::vector<double> v = to_values(x[i], dt);
    int64_t bad = 0;
    for (double e : v) bad += std::isfinite(e) ? 0 : 1;
    EXPECT_EQ(bad, 0) << "non-finite elements in parameter " << m.tensors[i].name;
    EXPECT_FALSE(same_bits(x[i], x0[i])) << m.tensors[i].name << " never changed";
  }
  for (const StateData& st : read_states(m.opt, s.get())) {
    int64_t bad = 0;
    for (double e : to_values(st.raw, st.info.dtype)) bad += std::isfinite(e) ? 0 : 1;
    EXPECT_EQ(bad, 0) << "non-finite elements in state " << st.name << " of tensor " << st.info.tensor;
  }
  int64_t n = -1;
  int32_t last = -1;
  skipped(m.opt, s.get(), &n, &last);
  EXPECT_EQ(n, 0) << "finite gradients were skipped";
  EXPECT_EQ(m.steps(), (std::vector<int64_t>{1000, 1000}));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaApiLongRun, ::testing::Values(DION_DTYPE_FP32, DION_DTYPE_BF16),
                         [](const ::testing::TestParamInfo<dion_dtype_t>& i) { return dtype_name(i.param); });

// ------------------------------------------------------------------ state --

// dion_state_write then dion_state_read returns exactly what was written,
// through host buffers and through device buffers, and both calls are
// complete when they return: the host buffer is checked without any
// synchronisation, and a device buffer is copied back with cudaMemcpy on the
// legacy stream, which does not wait for the non-blocking stream the calls
// were given.
TEST(CudaApiState, WriteReadRoundTripThroughHostAndDeviceBuffers) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  Stream s;
  for (dion_dtype_t dt : {DION_DTYPE_FP32, DION_DTYPE_BF16}) {
    SCOPED_TRACE(dtype_name(dt));
    DevModel m;
    m.build({{opts(DION_ALGO_DION), {{"st.dion", {64, 48}}}},
             {opts(DION_ALGO_ADAMW), {{"st.adamw", {37}}}},
             {opts(DION_ALGO_NORMUON), {{"st.normuon", {24, 40}}}}},
            dt, 51);
    if (HasFatalFailure()) return;
    for (int k = 0; k < 2; ++k) DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, s.dion()));
    const std::vector<StateData> original = read_states(m.opt, s.get());
    int32_t count = 0;
    DION_ASSERT_OK(m.opt.get(), dion_state_count(m.opt, &count));
    ASSERT_EQ(count, 2 + 2 + 2);  // momentum+Q, momentum+variance, momentum+variance_neuron
    for (int32_t i = 0; i < count; ++i) {
      const dion_state_info_t info = state_info(m.opt, i);
      SCOPED_TRACE(std::string("state ") + info.name + " of tensor " + std::to_string(info.tensor));
      const size_t bytes = static_cast<size_t>(info.local_bytes);
      const int64_t n = static_cast<int64_t>(bytes / elem_size(info.dtype));
      ASSERT_GT(n, 0);
      // Host -> state -> host.
      const std::vector<unsigned char> a = random_bytes(n, info.dtype, 900 + i, 2.0);
      DION_ASSERT_OK(m.opt.get(), dion_state_write(m.opt, i, a.data(), bytes, s.dion()));
      std::vector<unsigned char> back(bytes, 0xCD);
      DION_ASSERT_OK(m.opt.get(), dion_state_read(m.opt, i, back.data(), bytes, s.dion()));
      EXPECT_TRUE(same_bits(back, a)) << "host write, host read";
      // State -> device -> host.
      DeviceBuffer dev(bytes);
      CUDA_ASSERT(cudaMemset(dev.get(), 0xCD, bytes));
      CUDA_ASSERT(cudaDeviceSynchronize());
      DION_ASSERT_OK(m.opt.get(), dion_state_read(m.opt, i, dev.get(), bytes, s.dion()));
      EXPECT_TRUE(same_bits(dev.download(), a)) << "host write, device read";
      // Device -> state -> host.
      const std::vector<unsigned char> b = random_bytes(n, info.dtype, 1900 + i, 3.0);
      CUDA_ASSERT(dev.upload(b));
      DION_ASSERT_OK(m.opt.get(), dion_state_write(m.opt, i, dev.get(), bytes, s.dion()));
      std::fill(back.begin(), back.end(), 0xCD);
      DION_ASSERT_OK(m.opt.get(), dion_state_read(m.opt, i, back.data(), bytes, s.dion()));
      EXPECT_TRUE(same_bits(back, b)) << "device write, host read";
    }
    // Writing the real states back (the patterns above hold, e.g., negative
    // AdamW variances) gives an optimizer that steps to finite parameters.
    for (int32_t i = 0; i < count; ++i)
      DION_ASSERT_OK(m.opt.get(), dion_state_write(m.opt, i, original[static_cast<size_t>(i)].raw.data(),
                                                   original[static_cast<size_t>(i)].raw.size(), s.dion()));
    DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, s.dion()));
    CUDA_ASSERT(s.sync());
    for (const auto& p : m.params()) {
      int64_t bad = 0;
      for (double e : to_values(p, dt)) bad += std::isfinite(e) ? 0 : 1;
      EXPECT_EQ(bad, 0);
    }
  }
}

// With the legacy default stream (stream NULL, dion.h), dion_state_read and
// dion_state_write are ordered after the work already enqueued there, as on
// any other stream: a 100 ms kernel on the legacy stream writes the read's
// destination (or the write's source) at its end, and the call must come
// after it. PyTorch's default stream is the legacy stream, and its caching
// allocator hands out memory that such pending kernels still write (the
// torchrun TP case saw a state read overwritten by an all-gather's
// rearrangement when the read did not wait).
TEST(CudaApiState, ReadAndWriteOnTheLegacyStreamFollowTheWorkAlreadyThere) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  DevModel m;
  m.build({{opts(DION_ALGO_DION), {{"legacy.dion", {64, 48}}}}}, DION_DTYPE_FP32, 57);
  if (HasFatalFailure()) return;
  DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  const dion_state_info_t info = state_info(m.opt, 0);  // the momentum
  const size_t bytes = static_cast<size_t>(info.local_bytes);
  const int64_t n = static_cast<int64_t>(bytes / elem_size(info.dtype));
  std::vector<unsigned char> state(bytes);
  DION_ASSERT_OK(m.opt.get(), dion_state_read(m.opt, 0, state.data(), bytes, nullptr));
  const uint64_t spin_ns = 100ull * 1000 * 1000;

  // Read: the kernel writes a pattern into the destination, then the read.
  const std::vector<unsigned char> pattern = random_bytes(n, info.dtype, 77, 5.0);
  DeviceBuffer pat(bytes), dst(bytes);
  CUDA_ASSERT(pat.upload(pattern));
  CUDA_ASSERT(cudaDeviceSynchronize());
  spin_then_copy<<<1, 256, 0, 0>>>(spin_ns, pat.as<unsigned char>(), static_cast<unsigned char*>(dst.get()), bytes);
  CUDA_ASSERT(cudaGetLastError());
  DION_ASSERT_OK(m.opt.get(), dion_state_read(m.opt, 0, dst.get(), bytes, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(dst.download(), state)) << "dion_state_read ran before the kernel ahead of it on the legacy stream";

  // Write: the kernel writes the new value into the source, then the write.
  DeviceBuffer src(bytes);
  CUDA_ASSERT(src.upload(state));
  CUDA_ASSERT(cudaDeviceSynchronize());
  spin_then_copy<<<1, 256, 0, 0>>>(spin_ns, pat.as<unsigned char>(), static_cast<unsigned char*>(src.get()), bytes);
  CUDA_ASSERT(cudaGetLastError());
  DION_ASSERT_OK(m.opt.get(), dion_state_write(m.opt, 0, src.get(), bytes, nullptr));
  std::vector<unsigned char> back(bytes, 0xCD);
  DION_ASSERT_OK(m.opt.get(), dion_state_read(m.opt, 0, back.data(), bytes, nullptr));
  EXPECT_TRUE(same_bits(back, pattern)) << "dion_state_write read its source before the kernel ahead of it wrote it";
  CUDA_ASSERT(cudaDeviceSynchronize());
}

// dion_get_memory_usage: the state bytes cover every state buffer, and the
// workspace (allocated by the first step at the latest) is not empty.
TEST(CudaApiState, MemoryUsageReportsStateAndWorkspace) {
  DION_REQUIRE_GPU();
  DevModel m;
  m.build(all_algorithms(), DION_DTYPE_FP32, 61);
  if (HasFatalFailure()) return;
  uint64_t sum = 0;
  for (const StateData& st : read_states(m.opt)) sum += st.info.local_bytes;
  DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  uint64_t state = 0, ws = 0;
  DION_ASSERT_OK(m.opt.get(), dion_get_memory_usage(m.opt, &state, &ws));
  EXPECT_GE(state, sum) << "state_bytes must cover the " << sum << " bytes of the state buffers";
  EXPECT_GT(ws, 0u) << "workspace_bytes after a step of Dion and Muon";
}

// The device memory the first step of a one-group model (g over tensors t,
// fp32) takes and the growth of its reported workspace over that step, in MiB.
void first_step_memory(const dion_group_options_t& g, const std::vector<TensorSpec>& t, uint64_t seed,
                       double* taken, double* grown) {
  CUDA_ASSERT(cudaSetDevice(0));
  DevModel m;
  m.build({{g, t}}, DION_DTYPE_FP32, seed);
  if (::testing::Test::HasFatalFailure()) return;
  CUDA_ASSERT(cudaDeviceSynchronize());
  uint64_t state = 0, ws0 = 0, ws1 = 0;
  DION_ASSERT_OK(m.opt.get(), dion_get_memory_usage(m.opt, &state, &ws0));
  size_t free0 = 0, free1 = 0, total = 0;
  CUDA_ASSERT(cudaMemGetInfo(&free0, &total));
  DION_ASSERT_OK(m.opt.get(), dion_step(m.opt, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  CUDA_ASSERT(cudaMemGetInfo(&free1, &total));
  DION_ASSERT_OK(m.opt.get(), dion_get_memory_usage(m.opt, &state, &ws1));
  *taken = (static_cast<double>(free0) - static_cast<double>(free1)) / (1 << 20);
  *grown = (static_cast<double>(ws1) - static_cast<double>(ws0)) / (1 << 20);
  std::printf("    first step: device memory taken %.1f MiB, reported workspace grew by %.1f MiB (to %.1f MiB)\n", *taken,
              *grown, static_cast<double>(ws1) / (1 << 20));
}

// The workspace dion_get_memory_usage reports includes the CUDA backend's
// scratch (factorization and reduction buffers, grown by the first
// step): the device memory the first step takes (cudaMemGetInfo) equals the
// growth of the reported workspace within 16 MiB (2 MiB allocation
// granularity, lazily loaded kernels, library handles), while the scratch of
// this model alone is 72 MiB (RCQR at rank 2048 on a 4096 x 2048 matrix: the
// fp64 sketch product, 2560 x 2048, and Gram matrix, 2048 x 2048), so a
// workspace that left the scratch out would miss by far more than that.
TEST(CudaApiState, ReportedWorkspaceCoversTheMemoryTheFirstStepTakes) {
  DION_REQUIRE_GPU();
  dion_group_options_t g = opts(DION_ALGO_DION);
  g.rank_fraction = 1.0;
  g.matmul_precision = DION_MATMUL_BF16;
  double taken = 0, grown = 0;
  first_step_memory(g, {{"mem.dion", {4096, 2048}}}, 63, &taken, &grown);
  if (HasFatalFailure()) return;
  EXPECT_GT(taken, 64.0) << "the model is meant to need large scratch";
  EXPECT_NEAR(grown, taken, 16.0);
}

// The same with Householder QR on a batch of 8 square P (1024 x 1024 at full
// rank): what qr_q's 8 streams and their cuSOLVER handles take on their
// first use is reported as workspace too.
TEST(CudaApiState, ReportedWorkspaceCoversTheQrStreams) {
  DION_REQUIRE_GPU();
  dion_group_options_t g = opts(DION_ALGO_DION);
  g.rank_fraction = 1.0;
  g.qr_method = DION_QR_QR;
  std::vector<TensorSpec> t;
  for (int i = 0; i < 8; ++i) t.push_back({"mem.qr" + std::to_string(i), {1024, 1024}});
  double taken = 0, grown = 0;
  first_step_memory(g, t, 71, &taken, &grown);
  if (HasFatalFailure()) return;
  EXPECT_NEAR(grown, taken, 16.0);
}

// The CUDA backend's default workspace cap of a batch is 4 GiB (the host's
// 1 GiB): 96 Dion matrices of 1024 x 4096 at rank 256, about 6 GB of
// workspace in one batch, are planned by default exactly as with
// DION_BATCH_WORKSPACE_MIB=4096 (the same workspace: two batches), and
// differently from the caps of 1024 MiB (more batches: a smaller workspace)
// and 8192 MiB (one batch: a larger one).
TEST(CudaApiState, DefaultBatchWorkspaceCapIsFourGiB) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  const dion_group_options_t g = opts(DION_ALGO_DION);
  auto workspace = [&](const char* mib) -> double {
    std::vector<TensorSpec> t;
    for (int i = 0; i < 96; ++i) t.push_back({"cap.w" + std::to_string(i), {1024, 4096}});
    DevModel m;
    {
      ScopedEnv cap("DION_BATCH_WORKSPACE_MIB", mib);  // null: unset, the default
      m.build({{g, t}}, DION_DTYPE_BF16, 67);
    }
    uint64_t state = 0, ws = 0;
    EXPECT_EQ(dion_get_memory_usage(m.opt, &state, &ws), DION_SUCCESS);
    return static_cast<double>(ws) / (1 << 20);
  };
  const double dflt = workspace(nullptr), w1 = workspace("1024"), w4 = workspace("4096"), w8 = workspace("8192");
  std::printf("    workspace of 96 matrices: default %.1f MiB; cap 1024: %.1f, 4096: %.1f, 8192: %.1f MiB\n", dflt, w1, w4,
              w8);
  EXPECT_EQ(dflt, w4) << "the default cap should plan the batches that DION_BATCH_WORKSPACE_MIB=4096 plans";
  EXPECT_GT(dflt, 2048.0) << "half of the 96 matrices are meant to need more than 2 GiB";
  EXPECT_LT(w1, 0.5 * dflt) << "a 1 GiB cap should cut them into smaller batches";
  EXPECT_GT(w8, dflt) << "an 8 GiB cap should take them in one batch (more than the default's two)";
}

// ----------------------------------------------------------------- stream --

// dion_step is enqueued on the caller's stream without waiting:
//  - it returns while a 250 ms kernel queued before it on the same
//    non-blocking stream still runs (cudaStreamQuery: not ready, and the
//    call took far less than 250 ms);
//  - it is ordered after that kernel: the kernel writes the gradient at its
//    end, and the step used the new gradient (equal, bit for bit, to a twin
//    stepped with that gradient directly);
//  - work queued after it on the stream sees its result (an async copy of
//    the parameter equals the parameter), so internal streams were joined
//    back into the caller's stream;
//  - dion_get_skipped_steps waits for the stream (it is idle afterwards).
TEST(CudaApiStream, StepIsEnqueuedOnTheGivenStreamWithoutWaiting) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  const std::vector<GroupSpec> spec = {{opts(DION_ALGO_DION), {{"stream.dion", {256, 128}}}},
                                       {opts(DION_ALGO_MUON), {{"stream.muon", {128, 256}}}}};
  Stream s;
  DevModel a, b;
  a.build(spec, DION_DTYPE_FP32, 71);
  if (HasFatalFailure()) return;
  b.build(spec, DION_DTYPE_FP32, 71);
  if (HasFatalFailure()) return;
  DION_ASSERT_OK(a.opt.get(), dion_step(a.opt, s.dion()));  // warm-up: first-step allocations
  DION_ASSERT_OK(b.opt.get(), dion_step(b.opt, s.dion()));
  CUDA_ASSERT(s.sync());

  // The gradients of step 2: the twin gets them directly, A from the kernel.
  std::vector<DeviceBuffer> staged;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const std::vector<unsigned char> g = random_bytes(a.tensors[i].numel(), DION_DTYPE_FP32, 4242 + i, 1.0);
    staged.emplace_back(g.size());
    CUDA_ASSERT(staged.back().upload(g));
    CUDA_ASSERT(b.tensors[i].grad.upload(g));
  }
  const uint64_t spin_ns = 250ull * 1000 * 1000;
  spin_then_copy<<<1, 256, 0, s.get()>>>(spin_ns, staged[0].as<unsigned char>(), a.tensors[0].grad.bytes_ptr(),
                                         staged[0].bytes());
  for (size_t i = 1; i < a.tensors.size(); ++i)
    spin_then_copy<<<1, 256, 0, s.get()>>>(0, staged[i].as<unsigned char>(), a.tensors[i].grad.bytes_ptr(),
                                           staged[i].bytes());
  CUDA_ASSERT(cudaGetLastError());

  const auto t0 = std::chrono::steady_clock::now();
  DION_ASSERT_OK(a.opt.get(), dion_step(a.opt, s.dion()));
  const auto t1 = std::chrono::steady_clock::now();
  const cudaError_t q = cudaStreamQuery(s.get());
  const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  EXPECT_EQ(q, cudaErrorNotReady) << "the stream was idle right after dion_step returned: it waited for the device";
  EXPECT_LT(ms, 125.0) << "dion_step took " << ms << " ms with a 250 ms kernel ahead of it on its stream";

  // Queued after the step on the same stream: must see the updated parameters.
  std::vector<DeviceBuffer> snap;
  for (const DeviceTensor& t : a.tensors) {
    snap.emplace_back(t.bytes());
    CUDA_ASSERT(cudaMemcpyAsync(snap.back().get(), t.param.get(), t.bytes(), cudaMemcpyDeviceToDevice, s.get()));
  }
  int64_t n = -1;
  int32_t last = -1;
  skipped(a.opt, s.get(), &n, &last);
  EXPECT_EQ(cudaStreamQuery(s.get()), cudaSuccess) << "dion_get_skipped_steps must wait for the stream";
  EXPECT_EQ(n, 0);

  DION_ASSERT_OK(b.opt.get(), dion_step(b.opt, s.dion()));
  CUDA_ASSERT(s.sync());
  const auto pa = a.params(), pb = b.params();
  expect_same_params(pa, pb, "the step ordered after the gradient-writing kernel vs a twin");
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(same_bits(snap[i].download(), pa[i])) << "a copy queued after dion_step missed its result";
  EXPECT_EQ(group_step(a.opt, 0), 2);
}

// ----------------------------------------------------------------- device --

// options.device selects the GPU: an optimizer on device 1 works on device-1
// buffers while the caller's current device is 0, leaves the current device
// alone, and computes what the same optimizer computes on device 0 (same
// GPU model, same kernels: bit for bit).
TEST(CudaApiDevice, SecondDeviceIsHonouredAndCurrentDeviceKept) {
  DION_REQUIRE_GPU();
  if (gpu_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  cudaDeviceProp p0, p1;
  CUDA_ASSERT(cudaGetDeviceProperties(&p0, 0));
  CUDA_ASSERT(cudaGetDeviceProperties(&p1, 1));
  const std::vector<int64_t> shape = {64, 48};
  const int64_t n = 64 * 48;
  const std::vector<unsigned char> x0 = random_bytes(n, DION_DTYPE_FP32, 1, 0.05),
                                   g = random_bytes(n, DION_DTYPE_FP32, 2, 1.0);
  std::vector<unsigned char> result[2];
  for (int dev : {0, 1}) {
    CUDA_ASSERT(cudaSetDevice(dev));
    DeviceBuffer p(4 * n), gr(4 * n);
    CUDA_ASSERT(p.upload(x0));
    CUDA_ASSERT(gr.upload(g));
    CUDA_ASSERT(cudaSetDevice(0));  // the caller's current device stays 0 throughout
    Optimizer opt;
    ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA, 3, dev)), DION_SUCCESS);
    dion_group_options_t o = opts(DION_ALGO_DION);
    const dion_tensor_t t = descriptor("dev.dion", p.get(), gr.get(), DION_DTYPE_FP32, shape);
    DION_ASSERT_OK(opt.get(), dion_add_group(opt, &o, &t, 1, nullptr));
    for (int k = 0; k < 3; ++k) DION_ASSERT_OK(opt.get(), dion_step(opt, nullptr));
    int cur = -1;
    CUDA_ASSERT(cudaGetDevice(&cur));
    EXPECT_EQ(cur, 0) << "libdion changed the caller's current device";
    CUDA_ASSERT(cudaSetDevice(dev));
    CUDA_ASSERT(cudaDeviceSynchronize());
    result[dev] = p.download();
    opt.reset();
    CUDA_ASSERT(cudaSetDevice(dev));  // free on its own device
  }
  CUDA_ASSERT(cudaSetDevice(0));
  if (std::string(p0.name) == p1.name)
    EXPECT_TRUE(same_bits(result[0], result[1])) << "device 0 and device 1 (" << p0.name << ") computed differently";
  EXPECT_FALSE(same_bits(result[1], x0)) << "the device-1 optimizer did not update its parameter";
}

}  // namespace

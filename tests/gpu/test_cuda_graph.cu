// SPDX-License-Identifier: MIT
// dion_step can be captured in a CUDA graph (after one eager warm-up step)
// and the graph replayed: each replay is one full optimizer step. A replay
// must read everything that changes from step to step from device memory,
// not from values frozen at capture: the step counter (AdamW's bias
// correction, Dion's RCQR sketch key), and lr / weight_decay / beta1 / beta2
// set with dion_group_set_hparam between replays.
//
// Each test drives two CUDA optimizers built identically (same seed, same
// initial parameters, the same fixed gradients): A is captured once and
// replayed, its twin B takes the same number of eager steps with the same
// hyperparameter schedule. They must agree BIT FOR BIT. Why not a tolerance:
// a replay launches the kernels the eager step launches, with the same
// launch configurations, in the same order, on the same stream and device,
// and cuBLAS is bitwise reproducible for one problem on one stream (cuBLAS
// guide, "Results reproducibility"); so any difference is a value frozen at
// capture. And the subtlest frozen value needs bits to be seen: RCQR's result
// does not depend on its sketch in exact arithmetic (the sketch only
// preconditions the Cholesky QR), so a graph that replays step 2's sketch at
// step 6 differs from the eager run only at the rounding level, ~1e-7
// relative, which a 1e-6 tolerance would accept.
#include <deque>
#include <functional>

#include "gpu_test_util.h"

namespace {

using namespace dion_gpu_test;

struct GraphCase {
  std::string name;
  dion_algorithm_t algo;
  bool bf16_products = false;  // Dion at matmul precision BF16 with a bf16 momentum
  // Matmul precision BF16 on kLargeShapes: the Newton-Schulz products by
  // blocks (Backend::gemm_bf16_lower and mirror_bf16, s >= 1024).
  bool large_bf16 = false;
  // Dion with Householder QR (DION_QR_QR): the batch's geqrf / orgqr spread
  // over the backend's QR streams, forked from and joined to the captured one.
  bool householder = false;
};
void PrintTo(const GraphCase& c, std::ostream* os) { *os << c.name; }

std::vector<GraphCase> graph_cases() {
  return {
      {"Dion_RCQR", DION_ALGO_DION}, {"Muon", DION_ALGO_MUON}, {"AdamW", DION_ALGO_ADAMW}, {"Dion2", DION_ALGO_DION2},
      {"Dion_RCQR_bf16_momentum_products", DION_ALGO_DION, true},
      {"Muon_bf16_symmetric_blocks", DION_ALGO_MUON, false, true},
      {"Dion_Householder_QR_streams", DION_ALGO_DION, false, false, true}};
}

dion_group_options_t case_options(const GraphCase& c) {
  const dion_algorithm_t a = c.algo;
  dion_group_options_t g = group_options(a);
  if (c.bf16_products) {
    g.matmul_precision = DION_MATMUL_BF16;
    g.momentum_dtype = DION_DTYPE_BF16;
  }
  if (c.large_bf16) g.matmul_precision = DION_MATMUL_BF16;
  g.weight_decay = 0.1;  // visible: lr * wd = 1e-3 per step
  if (a == DION_ALGO_DION) {
    // r = 24 < 64 rows: the randomized Cholesky QR (with its step-keyed
    // sketch) runs, not the Householder QR a square P would get.
    g.qr_method = DION_QR_RCQR;
    g.rank_fraction = 0.5;
    if (c.householder) g.qr_method = DION_QR_QR;
  }
  return g;
}

// Two same-shape tensors (batched together) and a transposed one.
const std::vector<std::vector<int64_t>> kShapes = {{64, 48}, {64, 48}, {48, 64}};
const std::vector<std::vector<int64_t>> kLargeShapes = {{1024, 1280}, {1024, 1280}, {1280, 1024}};

// One CUDA optimizer over its own device tensors.
struct Rig {
  Optimizer opt;
  std::deque<DeviceTensor> tensors;

  // Creates the optimizer and one group of kShapes (kLargeShapes) with the given initial
  // parameters and (fixed) gradients.
  void build(const GraphCase& c, uint64_t data_seed) {
    ASSERT_EQ(opt.create(options(DION_BACKEND_CUDA, /*seed=*/99, 0)), DION_SUCCESS);
    std::vector<dion_tensor_t> d;
    const std::vector<std::vector<int64_t>>& shapes = c.large_bf16 ? kLargeShapes : kShapes;
    for (size_t i = 0; i < shapes.size(); ++i) {
      tensors.emplace_back();
      DeviceTensor& t = tensors.back();
      t.name = "graph.t" + std::to_string(i);
      t.shape = shapes[i];
      CUDA_ASSERT(t.allocate());
      CUDA_ASSERT(t.param.upload(random_bytes(t.numel(), t.dtype, data_seed + i, 0.05)));
      CUDA_ASSERT(t.grad.upload(random_bytes(t.numel(), t.dtype, data_seed + 1000 + i, 1.0)));
      d.push_back(t.desc());
    }
    const dion_group_options_t g = case_options(c);
    int32_t gi = -1;
    DION_ASSERT_OK(opt.get(), dion_add_group(opt, &g, d.data(), d.size(), &gi));
    ASSERT_EQ(gi, 0);
  }
  std::vector<std::vector<unsigned char>> params() const {
    cudaDeviceSynchronize();
    std::vector<std::vector<unsigned char>> v;
    for (const DeviceTensor& t : tensors) v.push_back(t.param.download());
    return v;
  }
  void set_grad_element(size_t tensor, int64_t index, float value) {
    DeviceTensor& t = tensors[tensor];
    CUDA_ASSERT(cudaMemcpy(t.grad.bytes_ptr() + 4 * index, &value, 4, cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaDeviceSynchronize());  // landed before work on a non-blocking stream reads it
  }
};

void expect_same_params(const std::vector<std::vector<unsigned char>>& a,
                        const std::vector<std::vector<unsigned char>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(same_bits(a[i], b[i])) << what << ": parameter of tensor " << i << " differs; relative difference "
                                       << rel_diff(a[i], b[i], DION_DTYPE_FP32);
}

void skipped(dion_optimizer_t opt, cudaStream_t s, int64_t* n, int32_t* last) {
  ASSERT_EQ(dion_get_skipped_steps(opt, n, last, reinterpret_cast<dion_stream_t>(s)), DION_SUCCESS)
      << dion_last_error(opt);
}

// An instantiated graph of one captured dion_step.
class CapturedStep {
 public:
  ~CapturedStep() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  // Captures dion_step(opt, s) in global mode (any stream-unsafe CUDA call
  // made by the library from any thread during the capture invalidates it).
  void capture(dion_optimizer_t opt, cudaStream_t s) {
    CUDA_ASSERT(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    const dion_status_t st = dion_step(opt, reinterpret_cast<dion_stream_t>(s));
    const std::string msg = dion_last_error(opt);
    const cudaError_t end = cudaStreamEndCapture(s, &graph_);  // always end the capture
    ASSERT_EQ(st, DION_SUCCESS) << "dion_step under stream capture: " << msg;
    ASSERT_EQ(end, cudaSuccess) << "cudaStreamEndCapture: " << cudaGetErrorString(end)
                                << " (the library made a call that is illegal during capture)";
    ASSERT_NE(graph_, nullptr);
    size_t nodes = 0;
    CUDA_ASSERT(cudaGraphGetNodes(graph_, nullptr, &nodes));
    EXPECT_GT(nodes, 0u) << "the captured step is an empty graph";
    CUDA_ASSERT(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  cudaError_t launch(cudaStream_t s) { return cudaGraphLaunch(exec_, s); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

class CudaGraph : public ::testing::TestWithParam<GraphCase> {
 protected:
  // Warm-up, capture, then N replays of A against N eager steps of B;
  // `before(k, opt)` runs on both before replay / step k (1..N).
  void run(int replays, const std::function<void(int, dion_optimizer_t)>& before);
};

void CudaGraph::run(int replays, const std::function<void(int, dion_optimizer_t)>& before) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  const GraphCase c = GetParam();
  Stream s;  // declared first: it outlives the optimizers that used it
  Rig a, b;
  a.build(c, 7);
  if (HasFatalFailure()) return;
  b.build(c, 7);
  if (HasFatalFailure()) return;

  // Eager warm-up of both: identical inputs, identical eager steps.
  DION_ASSERT_OK(a.opt.get(), dion_step(a.opt, s.dion()));
  DION_ASSERT_OK(b.opt.get(), dion_step(b.opt, s.dion()));
  CUDA_ASSERT(s.sync());
  const std::vector<std::vector<unsigned char>> after_warmup = a.params();
  expect_same_params(after_warmup, b.params(), std::string(c.name) + " after the eager warm-up (two eager twins)");

  CapturedStep graph;
  graph.capture(a.opt, s.get());
  if (HasFatalFailure()) return;
  // Capturing records work without running it: nothing may have changed.
  CUDA_ASSERT(s.sync());
  EXPECT_EQ(group_step(a.opt, 0), 1) << "capturing dion_step must not advance the step counter";
  expect_same_params(a.params(), after_warmup, c.name + ": capture must not run the step");

  for (int k = 1; k <= replays; ++k) {
    // dion_group_set_hparam takes no stream: the test waits for the
    // previous replay first, so the change cannot race with it.
    CUDA_ASSERT(s.sync());
    if (before) {
      before(k, a.opt.get());
      before(k, b.opt.get());
      if (HasFatalFailure()) return;
    }
    CUDA_ASSERT(graph.launch(s.get()));
    DION_ASSERT_OK(b.opt.get(), dion_step(b.opt, s.dion()));
  }
  CUDA_ASSERT(s.sync());

  const std::vector<std::vector<unsigned char>> pa = a.params(), pb = b.params();
  expect_same_params(pa, pb, c.name + ": " + std::to_string(replays) + " graph replays vs eager steps");
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_FALSE(same_bits(pa[i], after_warmup[i])) << c.name << ": the replays did not change tensor " << i;
  expect_same_states(read_states(a.opt, s.get()), read_states(b.opt, s.get()), c.name + ": states after the replays");
  // The step counter lives on the device and each replay advanced it.
  EXPECT_EQ(group_step(a.opt, 0), 1 + replays) << "dion_group_get_step after " << replays << " replays";
  EXPECT_EQ(group_step(b.opt, 0), 1 + replays);
  int64_t n = -1;
  int32_t last = -1;
  skipped(a.opt, s.get(), &n, &last);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(last, 0);
}

// Five replays with constant hyperparameters equal five eager steps: the
// step-dependent quantities (bias correction, sketch key, step counter) are
// read on the device at every replay.
TEST_P(CudaGraph, ReplaysEqualEagerStepsBitForBit) { run(5, nullptr); }

// lr changes before every replay, weight_decay before the third and (AdamW)
// beta1/beta2 before the fourth; the eager twin gets the same schedule.
TEST_P(CudaGraph, ReplaysHonourHparamChangesBitForBit) {
  const dion_algorithm_t algo = GetParam().algo;
  run(5, [algo](int k, dion_optimizer_t opt) {
    ASSERT_EQ(dion_group_set_hparam(opt, 0, DION_HPARAM_LR, 0.01 * (1.0 - 0.15 * k)), DION_SUCCESS)
        << dion_last_error(opt);
    if (k == 3)
      ASSERT_EQ(dion_group_set_hparam(opt, 0, DION_HPARAM_WEIGHT_DECAY, 0.3), DION_SUCCESS) << dion_last_error(opt);
    if (k == 4 && algo == DION_ALGO_ADAMW) {
      ASSERT_EQ(dion_group_set_hparam(opt, 0, DION_HPARAM_BETA1, 0.8), DION_SUCCESS) << dion_last_error(opt);
      ASSERT_EQ(dion_group_set_hparam(opt, 0, DION_HPARAM_BETA2, 0.99), DION_SUCCESS) << dion_last_error(opt);
    }
  });
}

// The non-finite guard inside a replay: a replay whose gradient holds a NaN
// changes no parameter, no state and no step counter and is counted; the
// next clean replay continues exactly like an eager twin that skipped the
// same step (so the skipped replay did not advance the device step counter
// that keys the sketches and the bias correction).
TEST_P(CudaGraph, NonFiniteGradientSkipsTheReplay) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  const GraphCase c = GetParam();
  Stream s;  // declared first: it outlives the optimizers that used it
  Rig a, b;
  a.build(c, 11);
  if (HasFatalFailure()) return;
  b.build(c, 11);
  if (HasFatalFailure()) return;
  DION_ASSERT_OK(a.opt.get(), dion_step(a.opt, s.dion()));
  DION_ASSERT_OK(b.opt.get(), dion_step(b.opt, s.dion()));
  CapturedStep graph;
  graph.capture(a.opt, s.get());
  if (HasFatalFailure()) return;

  // Replay 1 (clean).
  CUDA_ASSERT(graph.launch(s.get()));
  DION_ASSERT_OK(b.opt.get(), dion_step(b.opt, s.dion()));
  CUDA_ASSERT(s.sync());
  const std::vector<std::vector<unsigned char>> before = a.params();
  const std::vector<StateData> states_before = read_states(a.opt, s.get());

  // Replay 2: one NaN in the middle of tensor 1's gradient, on both.
  const float saved = [&] {
    float v = 0;
    cudaMemcpy(&v, a.tensors[1].grad.bytes_ptr() + 4 * 100, 4, cudaMemcpyDeviceToHost);
    return v;
  }();
  a.set_grad_element(1, 100, std::numeric_limits<float>::quiet_NaN());
  b.set_grad_element(1, 100, std::numeric_limits<float>::quiet_NaN());
  CUDA_ASSERT(graph.launch(s.get()));
  DION_ASSERT_OK(b.opt.get(), dion_step(b.opt, s.dion()));
  int64_t n = -1;
  int32_t last = -1;
  skipped(a.opt, s.get(), &n, &last);
  EXPECT_EQ(n, 1) << "the replay with a NaN gradient is counted as skipped";
  EXPECT_EQ(last, 1);
  expect_same_params(a.params(), before, c.name + ": a skipped replay must not change parameters");
  expect_same_states(read_states(a.opt, s.get()), states_before, c.name + ": a skipped replay must not change states");
  EXPECT_EQ(group_step(a.opt, 0), 2) << "a skipped replay must not advance the step counter";

  // Replay 3 (clean again) equals the eager twin's third applied step.
  a.set_grad_element(1, 100, saved);
  b.set_grad_element(1, 100, saved);
  CUDA_ASSERT(graph.launch(s.get()));
  DION_ASSERT_OK(b.opt.get(), dion_step(b.opt, s.dion()));
  CUDA_ASSERT(s.sync());
  skipped(a.opt, s.get(), &n, &last);
  EXPECT_EQ(n, 1);
  EXPECT_EQ(last, 0) << "the clean replay after the skipped one was applied";
  EXPECT_EQ(group_step(a.opt, 0), 3);
  expect_same_params(a.params(), b.params(), c.name + ": after skip and recovery, graph vs eager");
  expect_same_states(read_states(a.opt, s.get()), read_states(b.opt, s.get()), c.name + ": states, graph vs eager");
}

INSTANTIATE_TEST_SUITE_P(Algorithms, CudaGraph, ::testing::ValuesIn(graph_cases()),
                         [](const ::testing::TestParamInfo<GraphCase>& i) { return i.param.name; });

}  // namespace

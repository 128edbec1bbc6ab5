// SPDX-License-Identifier: MIT
// The CUDA backend: one device, one current stream (set_stream), cuBLAS (and
// cuBLASLt for some products: lt_plan) for GEMM and triangular
// solves, cuSOLVER for Cholesky and Householder QR, and the kernels of
// kernels/ for everything else.
//
// Capturability: no method allocates, frees or waits, except alloc/release/
// copy_sync/synchronize and the first use of a shape that needs more scratch
// (then the stream is drained and the scratch buffer re-allocated). cuBLAS
// gets a preallocated workspace, cuSOLVER's buffer sizes are queried on the
// host and its devInfo lives in device scratch that is never read back. So,
// once one step has run eagerly (the warm-up), a step can be captured in a
// CUDA graph and replayed.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <chrono>
#include <thread>
#include <climits>
#include <limits>
#include <vector>
#include <string>
#include <cstring>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <tuple>

#include "backend/cuda/cuda_check.hpp"
#include "core/backend.hpp"
#include "core/error.hpp"
#include "kernels/launch.hpp"

namespace dion {

namespace {

using cuda::check;

// cuBLAS wants a user workspace for graph capture; 32 MiB is its documented
// recommendation for Hopper.
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;
// Largest n for which the Cholesky of a batch goes through potrfBatched;
// larger ones are factored one by one with potrf. Measured on an H100
// (bench/profile.sh, docs/benchmarks.md): at n = 512 and 768 the batched call
// is already faster than a loop of potrf.
constexpr int64_t kPotrfBatchedMaxN = 4096;
// Largest n factored by the backend's own blocked Cholesky
// (blocked_cholesky): the sizes where it was measured faster than
// potrfBatched (n = 32 to 512 in isolation, and full-rank Dion's r = 768 and
// 2048 in the step, docs/benchmarks.md); larger ones keep cuSOLVER's
// (DION_OWN_CHOLESKY_MAX moves the bound).
constexpr int64_t kOwnCholeskyMaxN = 2048;
// The most scratch the 3xTF32 products' split parts (and partial sums) take
// (kSplit, split_bytes): gpt-1.3b's largest batch of lowrank_gemm, 24
// products 8192 x 2048 of rank 512, needs 960 MiB and fits; larger batches
// run a chunk of products at a time.
constexpr size_t kSplitBytes = size_t(1) << 30;
// The smallest FP32 product (2 m n k times the batch), in MFLOP, gemm takes
// at 3xTF32 (gemm_x3; DION_GEMM_3XTF32_MIN_MFLOP moves it): gpt-160m's
// smallest solve product, 12 x 768 x 192 x 192, is 680.
constexpr int kGemmX3MinMflop = 256;
// Streams over which qr_q spreads its matrices (qr_lanes): cuSOLVER's geqrf /
// orgqr have no batched form at these sizes, and one call on a matrix of a
// few hundred to a few thousand columns leaves most of the device idle (its
// panel factorizations are latency-bound). DION_QR_STREAMS lowers it (1:
// every matrix on the current stream, as before).
constexpr int kQrLanesMax = 8;

int64_t env_int(const char* name, int64_t dflt) {
  const char* e = std::getenv(name);
  return e && *e ? std::strtoll(e, nullptr, 10) : dflt;
}

int to_int(int64_t v, const char* what) {
  DION_REQUIRE(v >= 0 && v <= INT_MAX, DION_ERROR_NOT_SUPPORTED,
               "cuda backend: %s = %lld exceeds the 32-bit cuBLAS/cuSOLVER interface", what,
               static_cast<long long>(v));
  return static_cast<int>(v);
}

// Makes `device` current for the scope of a call and restores the caller's
// device afterwards (cheap when it is already current).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ == device) {
      prev_ = -1;
    } else {
      check(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~DeviceScope() {
    if (prev_ >= 0) (void)cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
};

// DION_PROFILE=1: every backend call is bracketed by CUDA events on its
// stream; at each end of step the events of the step before are read (they
// are complete by then, or nearly: the host does not drain the device
// between steps, which would leave it idle while the next step's first
// calls are enqueued and charge that idle time to them) and each call's
// time is added to its name. The totals, per step, go to stderr when the
// optimizer is destroyed. DION_PROFILE=2 also names each GEMM by its
// precision, shape and batch (detail()). Nested calls (a trsm's GEMMs) are
// counted under both names.
class Profiler {
 public:
  Profiler() {
    const char* e = std::getenv("DION_PROFILE");
    on_ = e && *e && std::strcmp(e, "0") != 0;
    detail_ = on_ && std::strcmp(e, "2") == 0;
  }
  bool on() const { return on_; }
  bool detail() const { return detail_; }
  // Renames the innermost open call (detail mode).
  void rename(std::string name) { open_.back().name = std::move(name); }
  void begin(const char* name, cudaStream_t s) {
    cudaEvent_t a = get(), b = get();
    (void)cudaEventRecord(a, s);
    open_.push_back({name, a, b, s});
  }
  void end() {
    Open o = open_.back();
    open_.pop_back();
    (void)cudaEventRecord(o.b, o.s);
    done_.push_back(o);
  }
  // The first step's calls are read here and not counted: they include the
  // scratch growth (a stream synchronisation and cudaMalloc between a call's
  // events) and cuBLAS's first-call setup, which a short run spreads over
  // every step (a 25-step 1x4x1 FSDP profile reported 22-28 ms of calls per
  // 9.7 ms step; nested calls, counted twice, are part of that).
  void step_done() {
    drain(prev_, true);
    if (first_) {
      first_ = false;
      drain(done_, false);
      return;
    }
    ++steps_;
    prev_.swap(done_);
  }
  void report() {
    if (!on_ || steps_ == 0) return;
    drain(prev_, true);
    std::vector<std::pair<std::string, std::pair<double, long>>> v(totals_.begin(), totals_.end());
    std::sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.second.first > y.second.first; });
    double all = 0;
    for (auto& x : v) all += x.second.first;
    std::fprintf(stderr, "[dion profile] %ld steps after the first, %.3f ms of backend calls per step\n", steps_,
                 all / steps_);
    for (auto& x : v)
      std::fprintf(stderr, "[dion profile] %-18s %9.3f ms/step %6.1f%% %7.1f calls/step\n", x.first.c_str(),
                   x.second.first / steps_, 100.0 * x.second.first / all, static_cast<double>(x.second.second) / steps_);
  }
  ~Profiler() {
    for (cudaEvent_t e : pool_) (void)cudaEventDestroy(e);
  }

 private:
  struct Open {
    std::string name;
    cudaEvent_t a, b;
    cudaStream_t s;
  };
  void drain(std::vector<Open>& done, bool count) {
    for (Open& o : done) {
      float ms = 0;
      if (cudaEventSynchronize(o.b) == cudaSuccess && count && cudaEventElapsedTime(&ms, o.a, o.b) == cudaSuccess) {
        auto& t = totals_[o.name];
        t.first += ms;
        t.second += 1;
      }
      pool_.push_back(o.a);
      pool_.push_back(o.b);
    }
    done.clear();
  }
  cudaEvent_t get() {
    if (!pool_.empty()) {
      cudaEvent_t e = pool_.back();
      pool_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    (void)cudaEventCreate(&e);
    return e;
  }
  bool on_ = false, detail_ = false, first_ = true;
  long steps_ = 0;
  std::vector<Open> open_, done_, prev_;  // prev_: the last step's, read at the next step_done
  std::vector<cudaEvent_t> pool_;
  std::map<std::string, std::pair<double, long>> totals_;
};

// The cuBLAS compute type of an fp32 GEMM at a group's matmul precision:
// plain fp32 (no TF32: the default math mode allows none), TF32, or fp32
// operands converted to bf16 by cuBLAS.
cublasComputeType_t compute_type(dion_matmul_precision_t precision) {
  if (precision == DION_MATMUL_TF32) return CUBLAS_COMPUTE_32F_FAST_TF32;
  if (precision == DION_MATMUL_BF16) return CUBLAS_COMPUTE_32F_FAST_16BF;
  return CUBLAS_COMPUTE_32F;
}

// A GEMM's name in a DION_PROFILE=2 profile: kind, m x n x k, transposes, batch.
std::string gemm_tag(const char* kind, int64_t m, int64_t n, int64_t k, bool ta, bool tb, int64_t batch) {
  char b[128];
  std::snprintf(b, sizeof b, "%s %lldx%lldx%lld%s%s b%lld", kind, static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k), ta ? " tA" : "", tb ? " tB" : "", static_cast<long long>(batch));
  return b;
}

class ProfScope {
 public:
  // detail_only: only under DION_PROFILE=2, a part of one backend call timed
  // on its own under `name` (a nested call, so counted a second time in the
  // report's total).
  ProfScope(Profiler& p, const char* name, cudaStream_t s, bool detail_only = false)
      : p_(p.on() && (!detail_only || p.detail()) ? &p : nullptr) {
    if (p_) p_->begin(name, s);
  }
  ~ProfScope() {
    if (p_) p_->end();
  }
  ProfScope(const ProfScope&) = delete;
  ProfScope& operator=(const ProfScope&) = delete;
  // DION_PROFILE=2: this call's time goes under `name` (built only then).
  template <class F>
  void detail(F&& name) {
    if (p_ && p_->detail()) p_->rename(name());
  }

 private:
  Profiler* p_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    int count = 0;
    check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    DION_REQUIRE(device >= 0 && device < count, DION_ERROR_INVALID_ARGUMENT,
                 "cuda backend: device %d does not exist (%d CUDA device(s) visible)", device, count);
    // The handles, stream and events are made on `device`; the caller's
    // current device is restored on the way out (test_cuda_api: an
    // optimizer on device 1 leaves device 0 current).
    DeviceScope ds(device);
    // From here on the destructor releases whatever was created, if a later step throws.
    try {
      check(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
      check(cublasCreate(&blas_), "cublasCreate");
      check(cublasLtCreate(&lt_), "cublasLtCreate");
      check(cusolverDnCreate(&solver_), "cusolverDnCreate");
      // Same bits on every run (cuSOLVER's default, made explicit; cuBLAS is
      // deterministic with its atomics off, the default, and a fixed workspace).
      check(cusolverDnSetDeterministicMode(solver_, CUSOLVER_DETERMINISTIC_RESULTS), "cusolverDnSetDeterministicMode");
      kernels::chol_block_init();
      bool clusters = false;
      smem_optin_ = kernels::householder_init(device, &clusters);
      qr_panel_cluster_ = qr_panel_cluster_ && clusters;
      const bool x3 = kernels::lowrank_tf32x3_init(device);
      lowrank_tf32x3_ = lowrank_tf32x3_ && x3;
      field_tf32x3_ = field_tf32x3_ && x3;
      gemm_tf32x3_ = gemm_tf32x3_ && x3;
      blas_ws_ = cuda::device_malloc(kCublasWorkspaceBytes, device_, "cuBLAS workspace");
      check(cudaStreamCreateWithFlags(&own_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      check(cudaEventCreateWithFlags(&mark_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      bind_stream();
    } catch (...) {
      destroy();
      throw;
    }
  }
  ~CudaBackend() override {
    prof_.report();
    destroy();
  }

  bool host_memory() const override { return false; }

  void set_stream(void* stream) override {
    DeviceScope ds(device_);
    stream_ = static_cast<cudaStream_t>(stream);
    bind_stream();
  }
  void* stream() const override { return stream_; }
  size_t scratch_bytes() const override {
    size_t n = kCublasWorkspaceBytes + handle_bytes_;
    for (const Buffer& b : scratch_) n += b.bytes;
    return n;
  }

  // ---- memory ----
  void* alloc(size_t bytes) override {
    DeviceScope ds(device_);
    return cuda::device_malloc(bytes, device_, "alloc");
  }
  void release(void* p) override {
    if (!p) return;
    DeviceScope ds(device_);
    check(cudaFree(p), "cudaFree");
  }
  void zero(void* p, size_t bytes) override {
    if (!bytes) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "zero", stream_);
    check(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync (zero)");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes || dst == src) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "copy", stream_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync (copy)");
  }
  void copy2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) override {
    if (!width || !height) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "copy", stream_);
    check(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault, stream_),
          "cudaMemcpy2DAsync (copy2d)");
  }
  // The blocking calls never touch a stream the caller may have destroyed
  // since: they wait for the event end_step() recorded after the last step
  // (also recorded by replays of a captured step), for the stream of the
  // current API call if it named one, and copy on the backend's own stream.
  void copy_sync(void* dst, const void* src, size_t bytes) override {
    if (!bytes || dst == src) return;
    DeviceScope ds(device_);
    wait_for_work();
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, own_), "cudaMemcpyAsync (copy_sync)");
    check(cudaStreamSynchronize(own_), "cudaStreamSynchronize (copy_sync)");
  }
  void synchronize() override {
    DeviceScope ds(device_);
    wait_for_work();
    check(cudaStreamSynchronize(own_), "cudaStreamSynchronize");
  }
  void end_step() override {
    DeviceScope ds(device_);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream_, &cs), "cudaStreamIsCapturing");
    // Inside a capture the record becomes an external event node, so each
    // replay records it again and the blocking calls wait for the replay.
    check(cudaEventRecordWithFlags(done_, stream_, cs == cudaStreamCaptureStatusActive ? cudaEventRecordExternal : 0),
          "cudaEventRecordWithFlags (end of step)");
    if (prof_.on() && cs == cudaStreamCaptureStatusNone) prof_.step_done();
  }

  // ---- the communication stream ----
  // Non-blocking, so it never syncs implicitly with the legacy default
  // stream: it is tied to the caller's stream only by the event waits below.
  // Each wait uses an event's latest record at the time it is enqueued, so a
  // few reused events serve every step (and, recorded on a capturing stream,
  // become graph dependencies instead).
  bool make_comm_stream() override {
    if (comm_) return true;
    DeviceScope ds(device_);
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (comm stream)");
    cudaEvent_t ev[2 + kCommMarks] = {};
    try {
      for (cudaEvent_t& e : ev)
        check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags (comm stream)");
    } catch (...) {
      for (cudaEvent_t e : ev)
        if (e) (void)cudaEventDestroy(e);
      (void)cudaStreamDestroy(s);
      throw;
    }
    comm_ = s;
    fork_ = ev[0];
    join_ = ev[1];
    for (int k = 0; k < kCommMarks; ++k) marks_[k] = ev[2 + k];
    return true;
  }
  void* comm_stream() const override { return comm_; }
  void comm_wait_main() override {
    DeviceScope ds(device_);
    check(cudaEventRecord(fork_, stream_), "cudaEventRecord (fork to the comm stream)");
    check(cudaStreamWaitEvent(comm_, fork_, 0), "cudaStreamWaitEvent (fork to the comm stream)");
  }
  void main_wait_comm() override {
    DeviceScope ds(device_);
    check(cudaEventRecord(join_, comm_), "cudaEventRecord (join from the comm stream)");
    check(cudaStreamWaitEvent(stream_, join_, 0), "cudaStreamWaitEvent (join from the comm stream)");
  }
  void comm_mark(int slot) override {
    DeviceScope ds(device_);
    check(cudaEventRecord(marks_[slot], comm_), "cudaEventRecord (comm stream mark)");
  }
  void main_wait_mark(int slot) override {
    DeviceScope ds(device_);
    check(cudaStreamWaitEvent(stream_, marks_[slot], 0), "cudaStreamWaitEvent (comm stream mark)");
  }
  void load_comm(float* dst, const void* src, dion_dtype_t dt, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "load (comm stream)", comm_);
    kernels::load(kernels::Ctx{comm_, sms_}, dst, src, dt, n);
  }
  void store_comm(void* dst, dion_dtype_t dt, const float* src, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "store (comm stream)", comm_);
    kernels::store(kernels::Ctx{comm_, sms_}, dst, dt, src, n);
  }

  // ---- conversions and step bookkeeping ----
  void load(float* dst, const void* src, dion_dtype_t dt, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "load", stream_);
    kernels::load(ctx(), dst, src, dt, n);
  }
  void store(void* dst, dion_dtype_t dt, const float* src, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "store", stream_);
    kernels::store(ctx(), dst, dt, src, n);
  }
  void split_bf16(void* hi, void* lo, const float* src, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "split_bf16", stream_);
    kernels::split_bf16(ctx(), hi, lo, src, n);
  }
  void load_multi(float* dst, const TensorEntry* list, int64_t count, Field f, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "load_multi", stream_);
    kernels::load_multi(ctx(), dst, list, count, f, n);
  }
  void load_multi_bf16(void* dst, const TensorEntry* list, int64_t count, Field f, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "load_multi_bf16", stream_);
    kernels::load_multi_bf16(ctx(), dst, list, count, f, n);
  }
  void store_multi(const TensorEntry* list, int64_t count, Field f, const float* src, int64_t n,
                   const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "store_multi", stream_);
    kernels::store_multi(ctx(), list, count, f, src, n, skip);
  }
  void store_multi_bf16(const TensorEntry* list, int64_t count, Field f, const void* src, int64_t n,
                        const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "store_multi_bf16", stream_);
    kernels::store_multi_bf16(ctx(), list, count, f, src, n, skip);
  }
  void scale_multi(const TensorEntry* list, int64_t count, Field f, int64_t n, float a,
                   const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "scale_multi", stream_);
    kernels::scale_multi(ctx(), list, count, f, n, a, skip);
  }
  void check_nonfinite(const TensorEntry* list, int64_t count, int64_t max_n, Field f, int32_t* flag) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "check_nonfinite", stream_);
    kernels::check_nonfinite(ctx(), list, count, max_n, f, flag);
  }
  void advance_step(GroupScalars* gs, const StepStatus* status) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "advance_step", stream_);
    kernels::advance_step(ctx(), gs, status);
  }
  void merge_skip(StepStatus* status) override {
    DeviceScope ds(device_);
    kernels::merge_skip(ctx(), status);
  }
  void count_skip(StepStatus* status) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "count_skip", stream_);
    kernels::count_skip(ctx(), status);
  }

  // ---- random ----
  void randn(float* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t global_cols,
             const PhiloxKey& key, const TensorEntry* tensors, const int64_t* step, float scale) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "randn", stream_);
    check(kernels::randn(stream_, out, batch, rows, cols, row0, col0, global_cols, key, tensors, step, scale),
          "randn kernel");
  }
  void randn_bf16(void* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                  int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors, const int64_t* step,
                  float scale) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "randn_bf16", stream_);
    check(kernels::randn_bf16(stream_, out, batch, rows, cols, row0, col0, global_cols, key, tensors, step, scale),
          "randn_bf16 kernel");
  }

  // ---- dense linear algebra ----
  void gemm(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta, MatBatch c,
            dion_matmul_precision_t precision) override {
    const int64_t m = c.rows, n = c.cols, k = ta ? a.rows : a.cols;
    DION_REQUIRE((ta ? a.cols : a.rows) == m && (tb ? b.cols : b.rows) == k && (tb ? b.rows : b.cols) == n,
                 DION_ERROR_INTERNAL, "cuda gemm: shape mismatch");
    if (m == 0 || n == 0 || c.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "gemm", stream_);
    const bool x3 = gemm_x3(precision, tb, beta, m, n, k, c.batch);
    ps.detail([&] {
      const char* kind = x3                              ? "gemm fp32 3xtf32"
                         : precision == DION_MATMUL_FP32 ? "gemm fp32"
                         : precision == DION_MATMUL_TF32 ? "gemm tf32"
                                                         : "gemm bf16";
      return gemm_tag(kind, m, n, k, ta, tb, c.batch);
    });
    if (k == 0) {  // an empty sum: C = beta * C
      kernels::scale_matrix(ctx(), c, beta);
      return;
    }
    if (x3 && field_x3({nullptr, b.p, b.stride, b.ld}, {nullptr, a.p, a.stride, a.ld}, ta, c, k, false, alpha)) return;
    const cublasComputeType_t compute = compute_type(precision);
    // A small B (k <= m: the inverse of a triangular solve) is given K-major
    // to TF32 products (tf32_kmajor).
    if (tf32_kmajor(precision, !tb && !ta && k <= m, m, n, k, c.batch)) {
      b = kmajor_copy(b, k, n);
      tb = true;
    }
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the
    // buffers are passed as they are, B first, with m and n swapped.
    const int M = to_int(m, "gemm m"), N = to_int(n, "gemm n"), K = to_int(k, "gemm k");
    const int lda = to_int(std::max<int64_t>(a.ld, 1), "gemm lda"), ldb = to_int(std::max<int64_t>(b.ld, 1), "gemm ldb"),
              ldc = to_int(std::max<int64_t>(c.ld, 1), "gemm ldc");
    // TF32 products with a long inner dimension (RCQR's sketches S P: k x r
    // outputs, P's rows inner) take cuBLASLt's 128 x 128 tiles
    // (lt_plan). On an H200 (DION_PROFILE=2, gpt-1.3b Dion at TF32) the
    // sketches took 1.21 ms per step instead of 1.75; the same tiles for
    // every TF32 product of this function were slower on gpt-1.3b at r = 1.0
    // (295 -> 300 ms per step).
    if (precision == DION_MATMUL_TF32 && lt_gemm_ && k >= 4 * std::max(m, n) &&
        lt_matmul(LtProduct{N, M, K, tb, ta, ldb, lda, ldc, c.batch, b.stride, a.stride, c.stride,
                            /*pointer_array=*/false, /*device_scalars=*/false, pointer_alignment(b.p, b.stride * 4),
                            pointer_alignment(a.p, a.stride * 4), pointer_alignment(c.p, c.stride * 4)},
                  &alpha, b.p, a.p, &beta, c.p, c.p, "cublasLtMatmul (gemm)"))
      return;
    check(cublasGemmStridedBatchedEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                                     &alpha, b.p, CUDA_R_32F, ldb, b.stride, a.p, CUDA_R_32F, lda, a.stride, &beta, c.p,
                                     CUDA_R_32F, ldc, c.stride, to_int(c.batch, "gemm batch"), compute,
                                     CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx");
  }

  // Whether gemm takes kernels::field_tf32x3 (3xTF32 promoted to fp32, as
  // exact as SGEMM) for a product at FP32: on Hopper, C = alpha op(A) B (B as
  // stored, beta 0: RCQR's triangular solves' products, the triangular
  // inverses' and the Gram matrices), of at least gemm_x3_min_flop_ a batch (smaller ones keep
  // cuBLAS's SGEMM, where the split pass and launches would outweigh the
  // product). Any alpha: the kernel's stores scale by it. DION_GEMM_3XTF32=0:
  // SGEMM for all.
  bool gemm_x3(dion_matmul_precision_t precision, bool tb, float beta, int64_t m, int64_t n, int64_t k,
               int64_t batch) const {
    return gemm_tf32x3_ && precision == DION_MATMUL_FP32 && !tb && beta == 0.0f && k > 0 &&
           2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) *
                   static_cast<double>(batch) >= gemm_x3_min_flop_;
  }

  // C = alpha op(X) B through kernels::field_tf32x3 with its scratch (kSplit):
  // gemm_field's products (pointer arrays) and gemm's and gram's (strided
  // batches; symmetric: A^T A). False where the kernel cannot take the
  // shapes.
  bool field_x3(kernels::X3Operand b, kernels::X3Operand x, bool trans_x, MatBatch c, int64_t k, bool symmetric,
                float alpha = 1.0f) {
    const size_t bytes = split_bytes(kernels::field_tf32x3_scratch(ctx(), c.batch, c.rows, c.cols, k, 1, symmetric),
                                     c.batch);
    return kernels::field_tf32x3(ctx(), b, x, trans_x, c, k, alpha, scratch(kSplit, bytes), bytes, symmetric);
  }
  // The split scratch (kSplit) for `count` products of `one` bytes each: the
  // whole batch, or as many products as kSplitBytes holds (one at
  // least; the launchers run a chunk at a time): more launches, not more
  // memory.
  static size_t split_bytes(size_t one, int64_t count) {
    return std::max(one, std::min(one * static_cast<size_t>(count), kSplitBytes / one * one));
  }

  // TF32 products want their operands K-major (the inner dimension
  // contiguous): with B row-major k x n (n contiguous) cuBLAS's choice on an
  // H100 ran gpt-1.3b Dion's P = B Q at 231 TFLOP/s and R = B^T P at 250,
  // against 390 and 421 with Q, P stored transposed (bench/micro/tf32_layouts.cu:
  // 24 8192 x 2048 matrices at rank 512, 1.81 -> 1.19 and 1.69 -> 0.99 ms);
  // fp32 (SIMT) products ran the same either way. So where B is the small
  // operand, or A is read transposed, B is copied transposed (one pass over
  // B: 0.27 ms for the P of that batch) and passed with OP_T: gpt-1.3b Dion
  // at TF32 39.5 -> 37.4 ms. Only for fp32 B at TF32, and only for products
  // of at least 16 GFLOP a batch: gpt-160m's (at most 11) ran 2.91 -> 2.95 ms
  // with the copies. DION_TF32_KMAJOR=0 turns it off.
  bool tf32_kmajor(dion_matmul_precision_t precision, bool wanted, int64_t m, int64_t n, int64_t k,
                   int64_t batch) const {
    return tf32_kmajor_ && precision == DION_MATMUL_TF32 && wanted && batch > 0 &&
           2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * static_cast<double>(batch) >=
               tf32_kmajor_min_flop_;
  }
  // B (k x n row-major, its ld and stride) copied to scratch as n x k
  // row-major (ld k, stride n k): the same matrix, read with OP_T. A B
  // shared by the batch (stride 0) is copied once. With field >= 0, matrix b
  // of B is instead that field of list[b] (fp32, dense k x n).
  ConstMatBatch kmajor_copy(ConstMatBatch b, int64_t k, int64_t n, const TensorEntry* list = nullptr, int field = -1) {
    const bool fields = field >= 0;
    const bool shared = !fields && b.stride == 0;
    const int64_t copies = shared ? 1 : b.batch;
    float* t = static_cast<float*>(scratch(kKmajor, sizeof(float) * static_cast<size_t>(copies * n * k)));
    kernels::transpose(ctx(), b.p, k, n, fields ? n : b.ld, b.stride, t, k, n * k, copies, fields ? list : nullptr,
                       fields ? field : 0);
    return ConstMatBatch(t, n, k, k, shared ? 0 : n * k, b.batch);
  }

  // A^T A as S products over row chunks of A, summed (kernels::sum_parts),
  // when one product per matrix leaves the device mostly idle: an r x r
  // output of r = 512 is 8 of cuBLAS's 256 x 128 tiles, so gpt-1.3b's 24
  // Gram matrices of a class were 192 tiles on 132 SMs (1.45 rounds, the
  // second half empty), and a rank's 6 under FSDP over 4 GPUs 48. S is the
  // power of two (at most 16) that brings the tiles to about four rounds,
  // with chunks of at least max(r, 256) rows that divide A's rows, so the
  // chunks of all matrices are one strided batch of T S. fp32 partial sums
  // (the products' own accumulation is fp32). DION_GRAM_SPLIT=0: one product.
  // The result is symmetric: where triangle_blocks gives nb > 1 blocks, the
  // products form only the nb (nb + 1) / 2 blocks on and below the block
  // diagonal (one pointer-array GEMM over chunks and blocks, 5/8 of the
  // FLOPs for nb = 4), and the sum writes each block above the diagonal as
  // its mirror's transpose (DION_GRAM_BLOCKS=1: whole products). On an H200
  // (with tri_product's blocks, against DION_GRAM_BLOCKS=1): gpt-1.3b Dion
  // fp32 133.7 -> 132.0 ms per step, tf32 34.4 -> 34.2, bf16 21.7 -> 21.4,
  // gpt-1.3b r = 1.0 tf32 (r = 2048) 305.8 -> 300.5.
  void gram(ConstMatBatch a, MatBatch c, dion_matmul_precision_t precision) override {
    const int64_t p = a.rows, r = a.cols, T = c.batch;
    // At FP32 on Hopper the product at 3xTF32 (gemm_x3; it splits the
    // inner dimension itself where the tiles are few), only its tiles that
    // hold the lower triangle formed and that triangle mirrored: faster than
    // the blocks' 5/8 of the FLOPs at cuBLAS's SIMT rate (gpt-1.3b Dion r =
    // 1.0 fp32, with the solves' products: 528.8 -> 500.1 ms per step on an
    // H200, the whole product formed then).
    if (gemm_x3(precision, false, 0.0f, r, r, p, T)) {
      DeviceScope ds(device_);
      ProfScope ps(prof_, "gram", stream_);
      ps.detail([&] { return gemm_tag("gram fp32 3xtf32", r, r, p, true, false, T); });
      if (field_x3({nullptr, a.p, a.stride, a.ld}, {nullptr, a.p, a.stride, a.ld}, true, c, p, true)) return;
    }
    const int64_t S = gram_split_ ? gram_splits(p, r, T) : 1;
    const int64_t nb = p > 0 ? triangle_blocks(r, gram_blocks_, 128) : 1;
    if ((S <= 1 && nb <= 1) || a.ld != r || a.stride != p * r || c.rows != r || c.cols != r) {
      gemm(true, false, 1.0f, a, a, 0.0f, c, precision);
      return;
    }
    DeviceScope ds(device_);
    ProfScope ps(prof_, "gram", stream_);
    float* parts = static_cast<float*>(scratch(kGram, sizeof(float) * static_cast<size_t>(T * S * r * r)));
    const ConstMatBatch chunks(a.p, p / S, r, r, (p / S) * r, T * S);
    const MatBatch pm{parts, r, r, r, r * r, T * S};
    if (nb <= 1) {
      gemm(true, false, 1.0f, chunks, chunks, 0.0f, pm, precision);
      kernels::sum_parts(ctx(), parts, S, c);
      return;
    }
    ps.detail([&] { return gemm_tag(precision == DION_MATMUL_FP32 ? "gram blocks fp32" : "gram blocks", r, r, p / S,
                                    true, false, T * S); });
    const float one = 1.0f, zero = 0.0f;
    const int64_t bs = lower_blocks_gemm(true, false, &one, chunks, chunks, &zero, pm, p / S, nb, CUDA_R_32F,
                                         compute_type(precision), "gram blocks", "cublasGemmBatchedEx (gram blocks)");
    kernels::sum_parts(ctx(), parts, S, c, bs);
  }

  void gemm_bf16(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta, MatBatch c) override {
    gemm_bf16_to(ta, tb, alpha, a, b, beta, c, CUDA_R_16BF, "gemm_bf16");
  }
  // The blocks on and below the diagonal of an nb x nb grid in one
  // pointer-array GEMM (sym_blocks says when and how many; else the full
  // product). At 4 x 4 blocks, 10 of 16 block products: on an H100 (bench/micro/sym_blocks.cu)
  // the Gram matrix of 24 2048 x 8192 matrices 2.04 -> 1.29 ms, A A of 24
  // symmetric 2048 x 2048 ones 0.54 -> 0.35 ms, with the full product's bits.
  int64_t gemm_bf16_lower(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta,
                          MatBatch c) override {
    const int64_t n = c.rows, k = ta ? a.rows : a.cols;
    const int64_t nb = sym_blocks(a, b, c, k);
    if (nb <= 1) {
      gemm_bf16_to(ta, tb, alpha, a, b, beta, c, CUDA_R_16BF, "gemm_bf16");
      return 0;
    }
    DION_REQUIRE(c.cols == n && (ta ? a.cols : a.rows) == n && (tb ? b.rows : b.cols) == n &&
                     (tb ? b.cols : b.rows) == k,
                 DION_ERROR_INTERNAL, "cuda gemm_bf16_lower: shape mismatch");
    DeviceScope ds(device_);
    ProfScope ps(prof_, "gemm_bf16_lower", stream_);
    ps.detail([&] { return gemm_tag("gemm_bf16_lower", n, n, k, ta, tb, c.batch); });
    return lower_blocks_gemm(ta, tb, &alpha, a, b, &beta, c, k, nb, CUDA_R_16BF, CUBLAS_COMPUTE_32F, "gemm_bf16_lower",
                             "cublasGemmBatchedEx (gemm_bf16_lower)");
  }
  // C's blocks on and below the block diagonal of an nb x nb grid, C =
  // alpha op(A) op(B) + beta C for each, in one pointer-array GEMM
  // (kernels::sym_block_pointers) of elements of `type` (bf16, fp32 or
  // fp64; alpha and beta of compute's scale type); returns the block size.
  // upper: the blocks on and above it instead (qr_r's column-major lower
  // triangle). gemm_bf16_lower's, gram's and qr_r's products; `name` for
  // argument errors, `what` for cuBLAS's.
  int64_t lower_blocks_gemm(bool ta, bool tb, const void* alpha, ConstMatBatch a, ConstMatBatch b, const void* beta,
                            MatBatch c, int64_t k, int64_t nb, cudaDataType_t type, cublasComputeType_t compute,
                            const char* name, const char* what, bool upper = false) {
    const int64_t bs = c.rows / nb, cnt = c.batch * nb * (nb + 1) / 2;
    const int64_t es = type == CUDA_R_16BF ? 2 : type == CUDA_R_64F ? 8 : 4;
    void** ptr = static_cast<void**>(scratch(kPtrGemm, sizeof(void*) * static_cast<size_t>(3 * cnt) + 64));
    kernels::sym_block_pointers(ctx(), a, ta, b, tb, c, nb, bs, es, const_cast<const void**>(ptr), upper);
    check(cublasGemmBatchedEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, to_int(bs, name),
                              to_int(bs, name), to_int(k, name), alpha, ptr, type, to_int(b.ld, name), ptr + cnt, type,
                              to_int(a.ld, name), beta, ptr + 2 * cnt, type, to_int(c.ld, name), to_int(cnt, name),
                              compute, CUBLAS_GEMM_DEFAULT),
          what);
    return bs;
  }
  void mirror_bf16(MatBatch m, int64_t bs, float diag, const MatBatch* copy, const FrobScale* scale) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "mirror_bf16", stream_);
    kernels::mirror_bf16(ctx(), m, bs, diag, copy ? *copy : MatBatch{nullptr, 0, 0, 0, 0, 0},
                         scale ? scale->parts : nullptr, scale ? scale->nparts : 0, scale ? scale->factor : 1.0f,
                         scale ? scale->eps : 0.0f, scale ? scale->power : 0);
  }
  // One pointer-array GEMM: the fields' pointers from the table (a small
  // setup kernel), B's and C's from their strides. Row-major C = op(X) B is
  // column-major C^T = B^T op(X)^T: B first, as gemm passes its operands.
  void gemm_field(const TensorEntry* list, int64_t count, Field f, int64_t rows, int64_t cols, dion_dtype_t x_dtype,
                  bool trans_x, ConstMatBatch b, MatBatch c, dion_matmul_precision_t precision, dion_dtype_t c_dtype,
                  int b_field) override {
    const int64_t m = c.rows, n = c.cols, k = trans_x ? rows : cols;
    const bool c16 = c_dtype == DION_DTYPE_BF16;
    DION_REQUIRE((trans_x ? cols : rows) == m && b.rows == k && b.cols == n && b.batch == count &&
                     c.batch == count && (x_dtype == DION_DTYPE_FP32 || x_dtype == DION_DTYPE_BF16) &&
                     (c_dtype == DION_DTYPE_FP32 ||
                      (c16 && x_dtype == DION_DTYPE_BF16 && c.ld == n && c.stride == m * n)) &&
                     (b_field < 0 || x_dtype == DION_DTYPE_FP32),
                 DION_ERROR_INTERNAL, "cuda gemm_field: bad shapes or dtype");
    if (count <= 0 || m == 0 || n == 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "gemm_field", stream_);
    const bool lowp = x_dtype == DION_DTYPE_BF16;
    const bool x3 = !lowp && !c16 && precision == DION_MATMUL_FP32 && field_tf32x3_;
    ps.detail([&] {
      return gemm_tag(lowp ? "gemm_field bf16" : x3 ? "gemm_field fp32 3xtf32" : "gemm_field fp32", m, n, k, trans_x,
                      false, count);
    });
    if (k == 0) {  // an empty sum
      if (c16)
        check(cudaMemsetAsync(c.p, 0, 2 * static_cast<size_t>(count * m * n), stream_),
              "cudaMemsetAsync (gemm_field)");
      else
        kernels::scale_matrix(ctx(), c, 0.0f);
      return;
    }
    // FP32 on Hopper (kernels::field_tf32x3): three TF32 products of the
    // split parts promoted to fp32, X split as the kernel reads it in place
    // and B transposed into the scratch (kSplit, as lowrank_gemm's).
    if (x3) {
      void** ptr = static_cast<void**>(scratch(kPtrGemm, sizeof(void*) * static_cast<size_t>(3 * count) + 64));
      const kernels::PtrSource src[3] = {{b_field >= 0 ? nullptr : b.p, b.stride * 4, b_field},
                                         {nullptr, 0, static_cast<int>(f)},
                                         {c.p, c.stride * 4, -1}};  // C's are not read
      kernels::gemm_pointers(ctx(), list, count, src, const_cast<const void**>(ptr), nullptr, 0.0f, nullptr, nullptr);
      if (field_x3({ptr, nullptr, 0, b.ld}, {ptr + count, nullptr, 0, cols}, trans_x, c, k, false)) return;
    }
    // At TF32, Q (k <= m: P = B Q) and P (X read transposed: R = B^T P) go
    // K-major (tf32_kmajor); B from the fields (b_field) is transposed from
    // there, else its pointers are the fields'.
    const bool kmaj = !lowp && tf32_kmajor(precision, trans_x || k <= m, m, n, k, count);
    if (kmaj) {
      b = kmajor_copy(b, k, n, list, b_field);
      b_field = -1;
    }
    void** ptr = static_cast<void**>(scratch(kPtrGemm, sizeof(void*) * static_cast<size_t>(3 * count) + 64));
    const kernels::PtrSource src[3] = {{b_field >= 0 ? nullptr : b.p, b.stride * (lowp ? 2 : 4), b_field},
                                       {nullptr, 0, static_cast<int>(f)},
                                       {c.p, c.stride * (c16 ? 2 : 4), -1}};
    kernels::gemm_pointers(ctx(), list, count, src, const_cast<const void**>(ptr), nullptr, 0.0f, nullptr, nullptr);
    const cublasComputeType_t compute = lowp ? CUBLAS_COMPUTE_32F : compute_type(precision);
    const cudaDataType_t type = lowp ? CUDA_R_16BF : CUDA_R_32F;
    const float alpha = 1.0f, beta = 0.0f;
    check(cublasGemmBatchedEx(blas_, kmaj ? CUBLAS_OP_T : CUBLAS_OP_N, trans_x ? CUBLAS_OP_T : CUBLAS_OP_N,
                              to_int(n, "gemm_field n"), to_int(m, "gemm_field m"), to_int(k, "gemm_field k"), &alpha,
                              ptr, type, to_int(std::max<int64_t>(b.ld, 1), "gemm_field ldb"), ptr + count, type,
                              to_int(cols, "gemm_field ldx"), &beta, ptr + 2 * count, c16 ? CUDA_R_16BF : CUDA_R_32F,
                              to_int(std::max<int64_t>(c.ld, 1), "gemm_field ldc"), to_int(count, "gemm_field batch"),
                              compute, CUBLAS_GEMM_DEFAULT),
          "cublasGemmBatchedEx (gemm_field)");
  }
  // Through cuBLASLt (C apart from D), else a copy of c into d and the
  // cuBLAS product.
  void gemm_bf16_out(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta, ConstMatBatch c,
                     MatBatch d) override {
    const int64_t m = d.rows, n = d.cols, k = ta ? a.rows : a.cols;
    DION_REQUIRE(c.rows == m && c.cols == n && c.batch == d.batch && c.ld == n && d.ld == n && c.stride == m * n &&
                     d.stride == m * n && (ta ? a.cols : a.rows) == m && (tb ? b.cols : b.rows) == k &&
                     (tb ? b.rows : b.cols) == n && k > 0,
                 DION_ERROR_INTERNAL, "cuda gemm_bf16_out: shape mismatch, or c and d not dense");
    if (m == 0 || n == 0 || d.batch <= 0) return;
    DeviceScope ds(device_);
    {
      ProfScope ps(prof_, "gemm_bf16_out", stream_);
      ps.detail([&] { return gemm_tag("gemm_bf16_out", m, n, k, ta, tb, d.batch); });
      const int M = to_int(m, "gemm m"), N = to_int(n, "gemm n"), K = to_int(k, "gemm k");
      const int64_t cd_align = std::min(pointer_alignment(c.p, c.stride * 2), pointer_alignment(d.p, d.stride * 2));
      if (lt_matmul(LtProduct{N, M, K, tb, ta, b.ld, a.ld, n, d.batch, b.stride, a.stride, d.stride,
                              /*pointer_array=*/false, /*device_scalars=*/false, pointer_alignment(b.p, b.stride * 2),
                              pointer_alignment(a.p, a.stride * 2), cd_align, /*bf16=*/true},
                    &alpha, b.p, a.p, &beta, c.p, d.p, "cublasLtMatmul (gemm_bf16_out)"))
        return;
      check(cudaMemcpyAsync(d.p, c.p, sizeof(uint16_t) * static_cast<size_t>(d.batch * d.stride),
                            cudaMemcpyDeviceToDevice, stream_),
            "cudaMemcpyAsync (gemm_bf16_out)");
    }
    gemm_bf16_to(ta, tb, alpha, a, b, beta, d, CUDA_R_16BF, "gemm_bf16");
  }
  void gemm_bf16_f32(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta,
                     MatBatch c) override {
    gemm_bf16_to(ta, tb, alpha, a, b, beta, c, CUDA_R_32F, "gemm_bf16_f32");
  }

  void add_diag_bf16(MatBatch m, float v) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "add_diag_bf16", stream_);
    kernels::add_diag_bf16(ctx(), m, v);
  }

  void ns_shift_bf16(MatBatch a, MatBatch b, float coef, float diag, const FrobScale* scale, void* a3) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "ns_shift_bf16", stream_);
    kernels::ns_shift_bf16(ctx(), a, b, coef, diag, scale ? scale->parts : nullptr, scale ? scale->nparts : 0,
                           scale ? scale->factor : 1.0f, scale ? scale->eps : 0.0f, a3);
  }

  void qr_q(MatBatch a) override {
    const int64_t p = a.rows, r = a.cols;
    if (p == 0 || r == 0 || a.batch <= 0) return;
    DION_REQUIRE(p >= r, DION_ERROR_INTERNAL, "cuda qr_q: needs rows >= cols");
    DeviceScope ds(device_);
    ProfScope ps(prof_, "qr_q", stream_);
    const int P = to_int(p, "qr rows"), R = to_int(r, "qr cols");
    to_int(a.batch, "qr batch");
    if (const int nb = qr_batched_ ? kernels::householder_panel_width(p, smem_optin_) : 0) {
      qr_q_batched(a, nb);
      return;
    }
    const int lanes = qr_lanes(a.batch);
    float* cm = static_cast<float*>(scratch(kMat, sizeof(float) * static_cast<size_t>(a.batch * p * r)));
    float* tau = static_cast<float*>(scratch(kTau, sizeof(float) * static_cast<size_t>(a.batch * r)));
    int* info = static_cast<int*>(scratch(kInfo, sizeof(int) * static_cast<size_t>(a.batch)));
    const int lwork = qr_lwork(P, R, true);
    float* work = static_cast<float*>(scratch(kWork, sizeof(float) * static_cast<size_t>(lwork) * lanes));
    // Row-major p x r with leading dimension ld, transposed, is column-major p x r with leading dimension p.
    kernels::transpose(ctx(), a.p, p, r, a.ld, a.stride, cm, p, p * r, a.batch);
    // Matrix b on lane b % lanes: Householder QR, then Q formed in place.
    qr_fork(lanes);
    try {
      for (int64_t b = 0; b < a.batch; ++b) {
        const int lane = static_cast<int>(b % lanes);
        cusolverDnHandle_t h = lanes > 1 ? qr_solvers_[lane] : solver_;
        float* w = work + static_cast<size_t>(lwork) * lane;
        check(cusolverDnSgeqrf(h, P, R, cm + b * p * r, P, tau + b * r, w, lwork, info + b), "cusolverDnSgeqrf");
        check(cusolverDnSorgqr(h, P, R, R, cm + b * p * r, P, tau + b * r, w, lwork, info + b), "cusolverDnSorgqr");
      }
    } catch (...) {
      // The step's stream still waits for what the lanes were given, so
      // nothing enqueued after the error overtakes it (scratch reused by the
      // next call, a step retried by the caller).
      (void)qr_join(lanes);
      throw;
    }
    check(qr_join(lanes), "joining the qr streams (event record / wait)");
    kernels::transpose(ctx(), cm, r, p, p, p * r, a.p, a.ld, a.stride, a.batch);
  }

  // C (m x n, ldc, sc; column-major) = alpha op(A) op(B) + beta C over a
  // strided batch, in the element type: DGEMM for double, an fp32 GEMM (no
  // TF32) for float. The blocked factorizations' products (Cholesky, qr_q).
  template <class T>
  void cm_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* alpha, const T* A, int64_t lda, int64_t sa,
               const T* B, int64_t ldb, int64_t sb, const T* beta, T* C, int64_t ldc, int64_t sc, int64_t batch,
               const char* what) {
    if (m == 0 || n == 0) return;
    const int M = to_int(m, "gemm m"), N = to_int(n, "gemm n"), K = to_int(k, "gemm k"), la = to_int(lda, "gemm lda"),
              lb = to_int(ldb, "gemm ldb"), lc = to_int(ldc, "gemm ldc"), bc = to_int(batch, "gemm batch");
    const cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    if constexpr (std::is_same_v<T, double>)
      check(cublasDgemmStridedBatched(blas_, oa, ob, M, N, K, alpha, A, la, sa, B, lb, sb, beta, C, lc, sc, bc), what);
    else
      check(cublasGemmStridedBatchedEx(blas_, oa, ob, M, N, K, alpha, A, CUDA_R_32F, la, sa, B, CUDA_R_32F, lb, sb, beta,
                                       C, CUDA_R_32F, lc, sc, bc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            what);
  }

  // qr_q for the whole batch in the same launches (kernels/householder.cu),
  // where a panel of nb >= 16 columns fits in shared memory (p up to about
  // 3400 on Hopper; nb = 32 up to about 1660): blocked Householder QR of the column-major copy cm, in
  // outer blocks of NO = kHouseholderBlock columns, each factored by panels
  // of nb columns (one CTA per matrix; the rest of the outer block updated
  // with the panel's V and T by three batched SGEMMs); the outer block's T
  // from S = V^T V, and the columns to its right updated as C -= V T^T (V^T
  // C) in three batched SGEMMs of inner dimension NO. Then Q, backward, as
  // LAPACK's sorgqr forms it: Q = I, and Q[J0:, J0:] -= V T (V^T Q[J0:,
  // J0:]) per outer block, formed transposed straight into a (row-major a
  // is column-major Q^T), so no transpose back. The reflectors are those of
  // cuSOLVER's path below (larfg's convention), so Q agrees with it and the
  // host's to rounding. Products in fp32 (CUBLAS_COMPUTE_32F, no TF32).
  void qr_q_batched(MatBatch a, int nb) {
    const int64_t p = a.rows, r = a.cols, B = a.batch;
    const int64_t NO = std::clamp<int64_t>(qr_block_ / nb * nb, nb, kernels::kHouseholderBlock);
    const int64_t K = (r + NO - 1) / NO, sA = p * r, sW = NO * r, sT = NO * NO;
    const auto pad = [](int64_t n) { return (n + 63) / 64 * 64; };  // 256-byte aligned sections
    const int64_t n_tau = pad(B * r), n_tin = pad(B * nb * nb), n_s = pad(B * sT), n_t = pad(K * B * sT),
                  n_w = pad(B * sW);
    float* cm = static_cast<float*>(scratch(kMat, sizeof(float) * static_cast<size_t>(B * p * r)));
    float* tau = static_cast<float*>(
        scratch(kWork, sizeof(float) * static_cast<size_t>(n_tau + n_tin + n_s + n_t + 2 * n_w)));
    float *tin = tau + n_tau, *S = tin + n_tin, *TJ = S + n_s, *W = TJ + n_t, *W2 = W + n_w;
    const auto gemm = [&](bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
                          int64_t sa, const float* Bm, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc,
                          int64_t sc, const char* what) {
      cm_gemm(ta, tb, m, n, k, &alpha, A, lda, sa, Bm, ldb, sb, &beta, C, ldc, sc, B, what);
    };
    // C (m x n at column-major C, ld p) -= V T^T (V^T C): the reflectors
    // V (m x k, ld p) with their T (k x k, ld ldt, stride st) applied from
    // the left as H^T = I - V T^T V^T, through W = V^T C and W2 = T^T W.
    // A panel's (k = its width) or an outer block's (k = its width, C the
    // columns to its right).
    const auto reflect = [&](const float* V, const float* T, int64_t ldt, int64_t st, int64_t m, int64_t k, float* C,
                             int64_t n, bool panel) {
      gemm(true, false, k, n, m, 1.f, V, p, sA, C, p, sA, 0.f, W, NO, sW,
           panel ? "cublasGemmStridedBatchedEx (qr panel V^T C)" : "cublasGemmStridedBatchedEx (qr V^T C)");
      gemm(true, false, k, n, k, 1.f, T, ldt, st, W, NO, sW, 0.f, W2, NO, sW,
           panel ? "cublasGemmStridedBatchedEx (qr panel T^T W)" : "cublasGemmStridedBatchedEx (qr T^T W)");
      gemm(false, false, m, n, k, -1.f, V, p, sA, W2, NO, sW, 1.f, C, p, sA,
           panel ? "cublasGemmStridedBatchedEx (qr panel update)" : "cublasGemmStridedBatchedEx (qr trailing update)");
    };
    kernels::transpose(ctx(), a.p, p, r, a.ld, a.stride, cm, p, sA, B);
    for (int64_t J0 = 0; J0 < r; J0 += NO) {
      const int64_t bo = std::min(NO, r - J0);
      for (int64_t j0 = J0; j0 < J0 + bo; j0 += nb) {
        const int64_t b = std::min<int64_t>(nb, J0 + bo - j0);
        {
          ProfScope d(prof_, "qr_q: panels", stream_, true);
          kernels::householder_panel(ctx(), cm, p, r, J0, j0, b, nb, tau, tin, B,
                                     qr_panel_cluster_ ? kernels::householder_panel_cluster(ctx(), p, j0, nb, B) : 1);
        }
        ProfScope d(prof_, "qr_q: panel updates", stream_, true);
        reflect(cm + j0 * p + j0, tin, nb, nb * nb, p - j0, b, cm + (j0 + b) * p + j0, J0 + bo - j0 - b, true);
      }
      const int64_t m = p - J0;
      const float* V = cm + J0 * p + J0;
      float* T = TJ + J0 / NO * B * sT;
      {
        ProfScope d(prof_, "qr_q: block T", stream_, true);
        gemm(true, false, bo, bo, m, 1.f, V, p, sA, V, p, sA, 0.f, S, NO, sT, "cublasGemmStridedBatchedEx (qr V^T V)");
        kernels::householder_block_t(ctx(), S, NO, sT, tau, r, J0, bo, T, NO, sT, B);
      }
      ProfScope d(prof_, "qr_q: trailing updates", stream_, true);
      reflect(V, T, NO, sT, m, bo, cm + (J0 + bo) * p + J0, r - J0 - bo, false);
    }
    // Q^T (column-major r x p, ld a.ld): Q^T[J0:, J0:] -= ((Q^T[J0:, J0:] V) T^T) V^T.
    ProfScope d(prof_, "qr_q: forming Q", stream_, true);
    kernels::identity(ctx(), a);
    for (int64_t J0 = (K - 1) * NO; J0 >= 0; J0 -= NO) {
      const int64_t bo = std::min(NO, r - J0), m = p - J0, n = r - J0;
      const float* V = cm + J0 * p + J0;
      const float* T = TJ + J0 / NO * B * sT;
      float* Qt = a.p + J0 * a.ld + J0;
      gemm(false, false, n, bo, m, 1.f, Qt, a.ld, a.stride, V, p, sA, 0.f, W, r, sW,
           "cublasGemmStridedBatchedEx (qr Q^T V)");
      gemm(false, true, n, bo, bo, 1.f, W, r, sW, T, NO, sT, 0.f, W2, r, sW, "cublasGemmStridedBatchedEx (qr W T^T)");
      gemm(false, true, n, m, bo, -1.f, W2, r, sW, V, p, sA, 1.f, Qt, a.ld, a.stride,
           "cublasGemmStridedBatchedEx (qr Q update)");
    }
  }

  // R of A's QR from the Cholesky factor of A^T A computed in fp64: for the
  // fp32 input of RCQR (the sketched S P, condition number that of P) the
  // fp64 Gram matrix keeps cond^2 * 2^-53 far below one, so this equals the
  // Householder R (with a positive diagonal) to fp32 accuracy, in one batched
  // DGEMM and one batched potrf instead of a geqrf per matrix. A numerically
  // singular A gives a failed or garbage factor; the Cholesky that follows in
  // RCQR then fails and orth_fallback takes over (see src/algo/dion.cpp).
  void qr_r(MatBatch a, MatBatch r_out) override {
    const int64_t p = a.rows, r = a.cols;
    DION_REQUIRE(p >= r && r_out.rows == r && r_out.cols == r, DION_ERROR_INTERNAL, "cuda qr_r: bad shapes");
    if (r == 0 || a.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "qr_r", stream_);
    const int P = to_int(p, "qr rows"), R = to_int(r, "qr cols"), B = to_int(a.batch, "qr batch");
    double* x = static_cast<double*>(scratch(kDblA, sizeof(double) * static_cast<size_t>(a.batch * p * r)));
    double* g = static_cast<double*>(scratch(kDblG, sizeof(double) * static_cast<size_t>(a.batch * r * r)));
    kernels::to_double(ctx(), a, x);
    // Row-major x (p x r) is column-major x^T (r x p): G = x^T x = (x^T)(x^T)^T.
    const double one = 1.0, zero = 0.0;
    // The factorizations below read G's lower triangle (column-major) only:
    // with nb > 1 blocks (triangle_blocks, as gram's) one pointer-array
    // DGEMM forms only the blocks that hold it, (nb + 1) / (2 nb) of the
    // FLOPs (5/8 at r = 512: 4 x 4 blocks of 128), and the rest of G is not
    // written (nothing reads it). On an H200 (2026-11-28, twelfth session),
    // against the whole product: gpt-1.3b Dion tf32 31.12 / 31.06 / 31.17 ->
    // 30.83 / 30.99 / 30.94 ms, bf16 18.77 / 18.85 / 18.95 -> 18.74 / 18.75 /
    // 18.81 (the DGEMM 0.55 ms of a bf16 step before).
    const int64_t nb = triangle_blocks(r, gram_blocks_, 128);
    if (nb > 1) {
      // The row-major blocks on and above the diagonal of G = x^T x (ta,
      // upper): column-major, those on and below it.
      const ConstMatBatch xm(reinterpret_cast<const float*>(x), p, r, r, p * r, a.batch);
      const MatBatch gm{reinterpret_cast<float*>(g), r, r, r, r * r, a.batch};
      lower_blocks_gemm(true, false, &one, xm, xm, &zero, gm, p, nb, CUDA_R_64F, CUBLAS_COMPUTE_64F, "qr_r",
                        "cublasGemmBatchedEx (qr_r Gram blocks)", true);
    } else {
      check(cublasDgemmStridedBatched(blas_, CUBLAS_OP_N, CUBLAS_OP_T, R, R, P, &one, x, R, p * r, x, R, p * r, &zero,
                                      g, R, r * r, B),
            "cublasDgemmStridedBatched (qr_r Gram)");
    }
    int* info = static_cast<int*>(scratch(kInfo, sizeof(int) * static_cast<size_t>(a.batch)));
    if (r <= own_cholesky_max_) {
      blocked_cholesky(g, r, r, r * r, a.batch, info);
    } else if (a.batch > 1 && r <= potrf_batched_max_) {
      double** ptrs = static_cast<double**>(scratch(kPtrA, sizeof(double*) * static_cast<size_t>(a.batch)));
      // fill_pointers computes base + b * stride in floats: a double stride is twice as many.
      kernels::fill_pointers(ctx(), reinterpret_cast<float**>(ptrs), reinterpret_cast<const float*>(g), 2 * r * r,
                             a.batch);
      check(cusolverDnDpotrfBatched(solver_, CUBLAS_FILL_MODE_LOWER, R, ptrs, R, info, B), "cusolverDnDpotrfBatched");
    } else {
      int lwork = 0;
      const auto key = std::make_tuple(static_cast<int>(kOpDpotrf), R, R);
      auto it = lwork_.find(key);
      if (it != lwork_.end()) {
        lwork = it->second;
      } else {
        check(cusolverDnDpotrf_bufferSize(solver_, CUBLAS_FILL_MODE_LOWER, R, g, R, &lwork),
              "cusolverDnDpotrf_bufferSize");
        lwork_.emplace(key, lwork);
      }
      double* work = static_cast<double*>(scratch(kWork, sizeof(double) * static_cast<size_t>(std::max(lwork, 1))));
      for (int64_t b = 0; b < a.batch; ++b)
        check(cusolverDnDpotrf(solver_, CUBLAS_FILL_MODE_LOWER, R, g + b * r * r, R, work, lwork, info + b),
              "cusolverDnDpotrf");
    }
    kernels::extract_r_double(ctx(), g, r_out);
  }

  void cholesky_upper(MatBatch a, int32_t* info) override {
    const int64_t n = a.rows;
    DION_REQUIRE(a.cols == n, DION_ERROR_INTERNAL, "cuda cholesky_upper: matrix is not square");
    if (a.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "cholesky_upper", stream_);
    if (n == 0) {
      check(cudaMemsetAsync(info, 0, sizeof(int32_t) * static_cast<size_t>(a.batch), stream_),
            "cudaMemsetAsync (cholesky info)");
      return;
    }
    // The row-major upper factor U (A = U^T U) is, read column-major, the
    // lower factor L = U^T of A = L L^T: potrf with uplo = lower on the buffer as is.
    const int N = to_int(n, "cholesky n"), ld = to_int(a.ld, "cholesky ld");
    if (n <= own_cholesky_max_) {
      blocked_cholesky(a.p, n, a.ld, a.stride, a.batch, info);
    } else if (a.batch > 1 && n <= potrf_batched_max_) {
      const int batch = to_int(a.batch, "cholesky batch");
      float** ptrs = static_cast<float**>(scratch(kPtrA, sizeof(float*) * static_cast<size_t>(a.batch)));
      kernels::fill_pointers(ctx(), ptrs, a.p, a.stride, a.batch);
      check(cusolverDnSpotrfBatched(solver_, CUBLAS_FILL_MODE_LOWER, N, ptrs, ld, info, batch),
            "cusolverDnSpotrfBatched");
    } else {
      const int lwork = cached_lwork(kOpPotrf, N, ld, [&](int* lw) {
        return cusolverDnSpotrf_bufferSize(solver_, CUBLAS_FILL_MODE_LOWER, N, a.p, ld, lw);
      });
      float* work = static_cast<float*>(scratch(kWork, sizeof(float) * static_cast<size_t>(std::max(lwork, 1))));
      for (int64_t b = 0; b < a.batch; ++b)
        check(cusolverDnSpotrf(solver_, CUBLAS_FILL_MODE_LOWER, N, a.p + b * a.stride, ld, work, lwork, info + b),
              "cusolverDnSpotrf");
    }
    kernels::cholesky_fixup(ctx(), a, info);
  }

  // In place: the lower Cholesky factor L (A = L L^T) of each n x n
  // column-major matrix of a (ld, stride; the row-major upper factor U =
  // L^T of the same buffer), as potrf(lower) leaves it: the strictly upper
  // column-major part is not the caller's any more (cholesky_fixup zeroes
  // it; qr_r's extraction does not read it). Left-looking, by blocks of
  // kCholBlock columns, all in T (fp32 GEMMs for float, FP64 for double):
  // block column j is first brought up to date by one batched GEMM,
  // A[o:n, o:o+nb] -= L[o:n, 0:o] L[o:o+nb, 0:o]^T, then a kernel factors
  // its diagonal block and forms the block's inverse (kernels::chol_block),
  // and a second GEMM forms its panel L21 = A21 L11^-T. Each panel goes
  // transposed into the strictly upper part, which nothing reads otherwise
  // (chol_block reads its block's upper triangle and ignores it), so
  // L[o:n, 0:o] is the plain submatrix U[0:o, o:n]^T of the same buffer and
  // no scratch holds the panels; one last kernel mirrors them into the lower
  // part. n = 512 takes 8 block kernels, 14 GEMMs and the mirror whatever
  // the batch, against the fixed cost of potrfBatched's own launches, which
  // dominated RCQR's factorizations (docs/benchmarks.md). The updates do
  // n^3 / 3 multiply-adds in all, about 0.6 of what the right-looking form
  // before it did (the whole trailing square after each block, the panels
  // in scratch): on an H200 (2026-11-29, A/B in one binary), gpt-1.3b Dion
  // tf32 31.63-31.74 -> 31.10-31.28 ms per step, bf16 18.63-18.75 -> 18.18-
  // 18.37, fp32 131.83-131.87 -> 131.40-131.51 (qr_r 1.47 -> 1.21 ms,
  // cholesky_upper 0.74 -> 0.55 at tf32). info as potrf: the first failing
  // pivot's 1-based column, 0 for none.
  template <class T>
  void blocked_cholesky(T* a, int64_t n, int64_t ld, int64_t stride, int64_t batch, int32_t* info) {
    constexpr int64_t nbk = kernels::kCholBlock;
    if (n <= 0 || batch <= 0) return;
    T* inv = static_cast<T*>(scratch(kCholInv, sizeof(T) * static_cast<size_t>(batch * nbk * nbk)));
    to_int(batch, "cholesky batch");  // before anything is enqueued
    const T one = 1, zero = 0, minus_one = -1;
    // cm_gemm over the batch, named as a panel's or an update's product.
    auto gemm = [&](bool ta, bool tb, int64_t m, int64_t nc, int64_t k, const T* alpha, const T* A, int64_t lda,
                    int64_t sa, const T* Bm, int64_t ldb, int64_t sb, const T* beta, T* C, int64_t ldc, int64_t sc,
                    bool update) {
      constexpr bool dbl = std::is_same_v<T, double>;
      cm_gemm(ta, tb, m, nc, k, alpha, A, lda, sa, Bm, ldb, sb, beta, C, ldc, sc, batch,
              update ? (dbl ? "cublasDgemmStridedBatched (cholesky update)" : "cublasGemmStridedBatchedEx (cholesky update)")
                     : (dbl ? "cublasDgemmStridedBatched (cholesky panel)" : "cublasGemmStridedBatchedEx (cholesky panel)"));
    };
    kernels::CholBlock<T> g{a, ld, stride, batch, 0, 0, nullptr, info, true};
    for (int64_t o = 0; o < n; o += nbk) {
      const int64_t nb = std::min(nbk, n - o), m = n - o - nb;
      T* col = a + o * ld;  // column o: U[0:o, o:n] from its row 0, block column o from its row o
      if (o > 0)            // A[o:n, o:o+nb] -= U[0:o, o:n]^T U[0:o, o:o+nb]
        gemm(true, false, n - o, nb, o, &minus_one, col, ld, stride, col, ld, stride, &one, col + o, ld, stride, true);
      g.o = o;
      g.nb = static_cast<int>(nb);
      g.inv = m > 0 ? inv : nullptr;
      g.first = o == 0;
      kernels::chol_block(ctx(), g);
      if (m == 0) break;
      // U[o:o+nb, o+nb:n] = L11^-1 A21^T: L21 transposed, into the upper part
      gemm(false, true, nb, m, nbk, &one, inv, nbk, nbk * nbk, col + o + nb, ld, stride, &zero, a + (o + nb) * ld + o,
           ld, stride, false);
    }
    kernels::chol_mirror_panels(ctx(), a, n, ld, stride, batch);
  }

  // B U^{-1}. A tall B (RCQR's P, a >= r: via_inverse) goes through the explicit
  // inverse, formed in fp32 by blocked recursion (tri_inverse_upper), then
  // one GEMM, which runs several times faster than cuBLAS's triangular solve
  // on these shapes. The product has the column space of B exactly (any
  // nonsingular right factor keeps it) and rounding errors of the order of
  // the solve's, cond(U) * eps, which the Cholesky pass that follows in
  // (R)CQR absorbs. It runs in fp32 for precision FP32 and in TF32
  // otherwise: for the BF16/TF32 groups, whose P comes out of
  // reduced-precision products, a TF32 product (unit roundoff 2^-11) adds an
  // error below theirs.
  // Whether B (rows x n) U^-1 takes the explicit inverse: n >= 32 and B at
  // least 4 n tall (RCQR's P at rank fraction 1/4 or less), or at least n
  // tall (DION_TRSM_INVERSE_ROWS: that many times n) where cuBLAS's trsm is
  // the slower: at TF32 and BF16 (the product then runs on tensor cores,
  // cublasStrsmBatched in fp32), and at FP32 for n <= 1024, or for every n
  // where the FP32 products run at 3xTF32 (gemm_x3, Hopper). On an H100,
  // full-rank Dion's 3d x d factors (qkv) by the inverse: gpt-160m fp32
  // (n = 768) 40.0 -> 38.9 ms per step, gpt-1.3b tf32 (n = 2048) 364.8 ->
  // 328.9; but gpt-1.3b fp32 952.3 -> 959.0 with SGEMM products, the
  // inverse's extra n^3 / 3 against a trsm already at the SIMT GEMM rate.
  // With the inverse's and the product's GEMMs at 3xTF32, on an H200
  // (2026-11-29, A/B in one binary): gpt-1.3b Dion r = 1.0 fp32 (n = 2048)
  // 474.2 / 473.7 -> 450.1 / 450.8 ms per step.
  // DION_TRSM_INVERSE_FP32_MAX_N (>= 0) sets the FP32 bound on n instead.
  bool via_inverse(int64_t rows, int64_t n, dion_matmul_precision_t precision) const {
    if (!trsm_via_inverse_ || n < 32) return false;
    if (rows >= 4 * n) return true;
    const int64_t fp32_max_n = trsm_inverse_fp32_max_n_ >= 0 ? trsm_inverse_fp32_max_n_
                               : gemm_tf32x3_                ? std::numeric_limits<int64_t>::max()
                                                             : 1024;
    return (precision != DION_MATMUL_FP32 || n <= fp32_max_n) && rows >= trsm_inverse_rows_ * n;
  }

  // B U^-1 as the product of B (rows x n) with the inverse, which is upper
  // triangular (its strictly lower part zero): block column j of the result
  // needs only the first (j + 1) bs columns of B and rows of the inverse, so
  // nb products of rows x bs x (j + 1) bs do (nb + 1) / (2 nb) of the whole
  // product's FLOPs (5/8 for nb = 4), as a triangular multiply (trmm) would.
  // es_inv: the element size of the inverse (fp32 or bf16 storage; B's
  // blocks all start at its first column), `product` one of the backend's
  // batched products, `simt` whether it runs in fp32 (FP32) rather than on
  // tensor cores. On an H200 (2026-11-28, docs/benchmarks.md): gpt-1.3b Dion
  // fp32 (n = 512, blocks of 128) 137.8 -> 133.7 ms per step, gpt-160m Dion
  // r = 1.0 fp32 (n = 768) 38.0 -> 37.1, gpt-1.3b r = 1.0 tf32 (n = 2048,
  // blocks of 512) 313.2 -> 305.3; but TF32 products with blocks of 128 ran
  // slower than the whole one (gpt-1.3b tf32 34.0 -> 34.4, bf16 21.4 -> 21.7:
  // the solves' products 2.0 -> 2.7 ms), so tensor-core products take blocks
  // of at least 256 (n >= 512: triangle_blocks). FP32 products on the
  // 3xTF32 kernel (gemm_x3, Hopper) follow x3_blocks, a rule fitted to the
  // three sizes measured on an H200 (twenty-sixth session, ms per step, two
  // rounds): gpt-160m Dion r = 1.0 fp32 (n = 768) ran 20.14 / 20.03 with 4
  // blocks (of 192, on the kernel's 128 x 96 tiles), 19.91 / 19.97 with 3
  // (of 256), 19.93 / 19.92 with 6 and 19.47 / 19.46 with 2 (of 384); at
  // n = 512 and 2048 (blocks of 128 and 512) 4 stayed best (gpt-1.3b fp32
  // 76.71 / 77.23 against 77.48 / 77.80 with 2, gpt-1.3b r = 1.0 413.1 /
  // 414.3 against 422.4 / 423.4). Why 2 wins at 768 is not measured (3
  // blocks of whole 128-column tiles did not), so other n keep the rule's
  // guess.
  template <class Product>
  void tri_product(ConstMatBatch in, ConstMatBatch inv, size_t es_inv, MatBatch out, bool simt, Product product) {
    const int64_t n = out.cols;
    const int64_t nb =
        simt && gemm_tf32x3_ && tri_blocks_ <= 0 ? x3_blocks(n) : triangle_blocks(n, tri_blocks_, simt ? 128 : 256);
    if (nb <= 1) {
      product(in, inv, out);
      return;
    }
    const int64_t bs = n / nb;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t k = (j + 1) * bs;
      const auto* ip = reinterpret_cast<const float*>(reinterpret_cast<const char*>(inv.p) + es_inv * j * bs);
      product(ConstMatBatch(in.p, in.rows, k, in.ld, in.stride, in.batch),
              ConstMatBatch(ip, k, bs, inv.ld, inv.stride, inv.batch),
              MatBatch{out.p + j * bs, out.rows, bs, out.ld, out.stride, out.batch});
    }
  }
  // tri_product's and gram's (and qr_r's) block count: 4 where that leaves
  // blocks of at least min_block, else 2 where it does, else 1 (whole
  // products). min_block is 128 (below that the saving does not pay for the
  // extra launches), 256 for tri_product on tensor cores (with blocks of 128
  // the TF32 and BF16 products ran slower than the whole one; at n = 512, 2
  // blocks of 256 against the whole product, H200, 2026-11-28, twelfth
  // session: gpt-1.3b Dion tf32 31.05 / 30.89 / 31.36 -> 30.85 / 30.86 /
  // 30.96 ms, bf16 18.92 / 19.01 / 18.79 -> 18.75 / 18.55 / 18.83). Blocks
  // are a multiple of 8 elements (32-byte aligned offsets). forced > 0
  // (DION_TRI_BLOCKS, DION_GRAM_BLOCKS) sets it whatever n (1: whole
  // products).
  int64_t triangle_blocks(int64_t n, int64_t forced, int64_t min_block) const {
    const int64_t nb = forced > 0 ? forced : n >= 4 * min_block ? 4 : n >= 2 * min_block ? 2 : 1;
    return nb > 1 && n % (8 * nb) == 0 ? nb : 1;
  }
  // tri_product's block count for FP32 products on the 3xTF32 kernel: 4
  // where n is a multiple of 512, else 2 where it is one of 256, else
  // triangle_blocks' rule (see tri_product for the measurements).
  int64_t x3_blocks(int64_t n) const {
    for (const int64_t nb : {4, 2})
      if (n % (128 * nb) == 0) return nb;
    return triangle_blocks(n, 0, 128);
  }

  using Backend::trsm_right_upper;
  void trsm_right_upper(ConstMatBatch u, ConstMatBatch in, MatBatch bm, dion_matmul_precision_t precision) override {
    const int64_t n = u.rows, rows = bm.rows;
    DION_REQUIRE(u.cols == n && bm.cols == n && in.rows == rows && in.cols == n && in.batch == bm.batch,
                 DION_ERROR_INTERNAL, "cuda trsm_right_upper: bad shapes");
    if (n == 0 || rows == 0 || bm.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "trsm_right_upper", stream_);
    const auto dense = [&](int64_t ld, int64_t stride) { return ld == n && stride == rows * n; };
    if (via_inverse(rows, n, precision) && dense(in.ld, in.stride) && dense(bm.ld, bm.stride)) {
      // One inverse per distinct U (stride 0: one U for the whole batch).
      const int64_t nu = u.stride == 0 ? 1 : bm.batch;
      float* inv = static_cast<float*>(scratch(kInv, sizeof(float) * static_cast<size_t>(nu * n * n)));
      // In place, the product goes to a scratch buffer and is copied back.
      const bool inplace = in.p == bm.p;
      const size_t tmp_floats = static_cast<size_t>(inplace ? bm.batch * rows * n : (nu * n * n + 3) / 4);
      float* tmp = static_cast<float*>(scratch(kTmp, sizeof(float) * tmp_floats));
      MatBatch I{inv, n, n, n, n * n, nu};
      tri_inverse_upper(ConstMatBatch(u.p, n, n, u.ld, u.stride, nu), I, tmp);
      MatBatch out = inplace ? MatBatch{tmp, rows, n, n, rows * n, bm.batch} : bm;
      ConstMatBatch Ib{inv, n, n, n, u.stride == 0 ? 0 : n * n, bm.batch};
      const dion_matmul_precision_t p = precision == DION_MATMUL_FP32 ? DION_MATMUL_FP32 : DION_MATMUL_TF32;
      tri_product(in, Ib, sizeof(float), out, p == DION_MATMUL_FP32, [&](ConstMatBatch x, ConstMatBatch y, MatBatch z) {
        gemm(false, false, 1.0f, x, y, 0.0f, z, p);
      });
      if (inplace)
        check(cudaMemcpyAsync(bm.p, tmp, sizeof(float) * static_cast<size_t>(bm.batch * rows * n),
                              cudaMemcpyDeviceToDevice, stream_),
              "cudaMemcpyAsync (trsm result)");
      return;
    }
    if (in.p != bm.p) copy_mats(in, bm);
    solve(u, bm);
  }

  // The inverses of all of u at once (tri_inverse_upper), then one product per
  // part, when every part takes the explicit-inverse path out of place;
  // otherwise one trsm_right_upper per part.
  void trsm_right_upper_many(ConstMatBatch u, const TrsmPart* parts, int64_t count,
                             dion_matmul_precision_t precision) override {
    const int64_t n = u.rows;
    bool all = u.stride != 0 && count > 0, any16 = false, precondition = true;
    for (int64_t i = 0; i < count && all; ++i) {
      const TrsmPart& pt = parts[i];
      precondition = precondition && pt.precondition;
      const int64_t rows = pt.out.rows;
      all = via_inverse(rows, n, precision) && pt.in.ld == n && pt.in.stride == rows * n && pt.out.ld == n &&
            pt.out.stride == rows * n && pt.in.p != pt.out.p && pt.first + pt.in.batch <= u.batch;
      any16 = any16 || (pt.in_bf16 && pt.in.batch > 0);
    }
    // bf16 inputs take bf16 products at precision BF16 only (else the default widens them).
    all = all && (!any16 || precision == DION_MATMUL_BF16);
    if (!all) {
      Backend::trsm_right_upper_many(u, parts, count, precision);
      return;
    }
    DeviceScope ds(device_);
    ProfScope ps(prof_, "trsm_right_upper_many", stream_);
    const int64_t nu = u.batch;
    float* inv = static_cast<float*>(scratch(kInv, sizeof(float) * static_cast<size_t>(nu * n * n)));
    float* tmp = static_cast<float*>(scratch(kTmp, sizeof(float) * static_cast<size_t>((nu * n * n + 3) / 4)));
    const dion_matmul_precision_t p = precision == DION_MATMUL_FP32 ? DION_MATMUL_FP32 : DION_MATMUL_TF32;
    tri_inverse_upper(u, MatBatch{inv, n, n, n, n * n, nu}, tmp,
                      p == DION_MATMUL_TF32 && precondition && inverse_tf32_ ? DION_MATMUL_TF32 : DION_MATMUL_FP32);
    // The inverses rounded to bf16 for the parts given in bf16 (Dion's P as
    // its bf16 collectives left it: RCQR's first solve, whose error the
    // second pass absorbs as it does the TF32 product's).
    uint16_t* inv16 = nullptr;
    if (any16) {
      inv16 = static_cast<uint16_t*>(scratch(kInv16, sizeof(uint16_t) * static_cast<size_t>(nu * n * n)));
      store(inv16, DION_DTYPE_BF16, inv, nu * n * n);
    }
    for (int64_t i = 0; i < count; ++i) {
      const TrsmPart& pt = parts[i];
      if (pt.in.batch <= 0) continue;
      if (pt.in_bf16) {
        const float* i16 = reinterpret_cast<const float*>(inv16 + pt.first * n * n);  // bf16 elements
        tri_product(ConstMatBatch(static_cast<const float*>(pt.in_bf16), pt.out.rows, n, n, pt.out.rows * n,
                                  pt.in.batch),
                    ConstMatBatch(i16, n, n, n, n * n, pt.in.batch), sizeof(uint16_t), pt.out, false,
                    [&](ConstMatBatch x, ConstMatBatch y, MatBatch z) { gemm_bf16_f32(false, false, 1.0f, x, y, 0.0f, z); });
        continue;
      }
      tri_product(pt.in, ConstMatBatch(inv + pt.first * n * n, n, n, n, n * n, pt.in.batch), sizeof(float), pt.out,
                  p == DION_MATMUL_FP32,
                  [&](ConstMatBatch x, ConstMatBatch y, MatBatch z) { gemm(false, false, 1.0f, x, y, 0.0f, z, p); });
    }
  }

 private:
  // gram's chunk count S for T products of p x r (1: one product).
  int64_t gram_splits(int64_t p, int64_t r, int64_t T) const {
    const int64_t tiles = ((r + 255) / 256) * ((r + 127) / 128) * T, want = 4 * static_cast<int64_t>(sms_);
    if (T <= 0 || tiles >= want) return 1;
    int64_t S = 1;
    while (S < 16 && S * tiles < want) S *= 2;
    while (S > 1 && (p % S != 0 || p / S < std::max<int64_t>(r, 256))) S /= 2;
    return S;
  }

  // bf16 A and B, fp32 accumulation, C of type ctype (bf16 or fp32).
  void gemm_bf16_to(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta, MatBatch c,
                    cudaDataType_t ctype, const char* name) {
    const int64_t m = c.rows, n = c.cols, k = ta ? a.rows : a.cols;
    // k = 0 (an empty sum, C = beta C, as gemm) with an fp32 C only.
    DION_REQUIRE((ta ? a.cols : a.rows) == m && (tb ? b.cols : b.rows) == k && (tb ? b.rows : b.cols) == n &&
                     (k > 0 || ctype == CUDA_R_32F),
                 DION_ERROR_INTERNAL, "cuda %s: shape mismatch", name);
    if (m == 0 || n == 0 || c.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, name, stream_);
    ps.detail([&] { return gemm_tag(name, m, n, k, ta, tb, c.batch); });
    if (k == 0) {
      kernels::scale_matrix(ctx(), c, beta);
      return;
    }
    const int M = to_int(m, "gemm m"), N = to_int(n, "gemm n"), K = to_int(k, "gemm k");
    const int lda = to_int(std::max<int64_t>(a.ld, 1), "gemm lda"), ldb = to_int(std::max<int64_t>(b.ld, 1), "gemm ldb"),
              ldc = to_int(std::max<int64_t>(c.ld, 1), "gemm ldc");
    check(cublasGemmStridedBatchedEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                                     &alpha, b.p, CUDA_R_16BF, ldb, b.stride, a.p, CUDA_R_16BF, lda, a.stride, &beta,
                                     c.p, ctype, ldc, c.stride, to_int(c.batch, "gemm batch"), CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT),
          ctype == CUDA_R_16BF ? "cublasGemmStridedBatchedEx (bf16)" : "cublasGemmStridedBatchedEx (bf16, fp32 C)");
  }

  // inv <- U^{-1} for upper-triangular U (n x n per matrix), in fp32, by
  // blocked recursion: for U = [A B; 0 C], U^{-1} = [A^{-1}, -A^{-1} B C^{-1};
  // 0, C^{-1}]. The diagonal blocks of at most 64 are inverted by back
  // substitution (kernels::tri_inverse_leaves); everything above them is
  // GEMMs. tmp holds batch * n * n / 4 floats. inv's strictly lower part is
  // zero.
  //
  // When n = L 2^k with L <= 64 (every power-of-two multiple of a block of at
  // most 64: 64, 96, 128, 192, 256, 384, 512, ...) the recursion's nodes of
  // one depth all have the same size, and each depth runs as one batched call
  // over every matrix and node (tri_inverse_levels): the 2^k diagonal blocks
  // in one kernel (kernels::tri_inverse_leaves), then per level one
  // pointer-array fill and two GEMMs, bottom up. For n = 512 that is 10
  // launches instead of the recursion's 23 (a zero fill, 8 leaf kernels, 14
  // GEMMs; the calls are latency-bound: 64 x 64 products of a batch of 24
  // take about as long as 256 x 256 ones, measured on an H100).
  //
  // prec: the GEMMs' precision above the diagonal blocks, FP32 or TF32
  // (tensor cores, for an inverse that only preconditions:
  // TrsmPart::precondition).
  void tri_inverse_upper(ConstMatBatch u, MatBatch inv, float* tmp,
                         dion_matmul_precision_t prec = DION_MATMUL_FP32) {
    const int64_t n = inv.rows;
    int k = 0;
    while ((n >> k) > 64 && ((n >> k) & 1) == 0) ++k;
    if ((n >> k) <= 64 && tri_inverse_levels_) {
      tri_inverse_levels(u, inv, tmp, k, prec);
      return;
    }
    check(cudaMemsetAsync(inv.p, 0, sizeof(float) * static_cast<size_t>(inv.batch * inv.stride), stream_),
          "cudaMemsetAsync (inverse)");
    tri_inverse_block(u, inv, 0, inv.rows, tmp, prec);
  }
  void tri_inverse_block(ConstMatBatch u, MatBatch inv, int64_t off, int64_t n, float* tmp,
                         dion_matmul_precision_t prec) {
    const int64_t ldu = u.ld, ldi = inv.ld;
    if (n <= 64) {  // a leaf, by the levels' kernel (inv's lower part is already zero)
      kernels::tri_inverse_leaves(ctx(), ConstMatBatch(u.p + off * ldu + off, n, n, ldu, u.stride, u.batch),
                                  MatBatch{inv.p + off * ldi + off, n, n, ldi, inv.stride, inv.batch}, n, 1);
      return;
    }
    const int64_t h = n / 2, c = n - h;
    tri_inverse_block(u, inv, off, h, tmp, prec);
    tri_inverse_block(u, inv, off + h, c, tmp, prec);
    // T = A^{-1} B (h x c), then the upper-right block = -T C^{-1}.
    MatBatch t{tmp, h, c, c, h * c, inv.batch};
    gemm(false, false, 1.0f, ConstMatBatch(inv.p + off * ldi + off, h, h, ldi, inv.stride, inv.batch),
         ConstMatBatch(u.p + off * ldu + off + h, h, c, ldu, u.stride, u.batch), 0.0f, t, prec);
    gemm(false, false, -1.0f, t, ConstMatBatch(inv.p + (off + h) * ldi + off + h, c, c, ldi, inv.stride, inv.batch),
         0.0f, MatBatch{inv.p + off * ldi + off + h, h, c, ldi, inv.stride, inv.batch}, prec);
  }

  // tri_inverse_upper for n = L 2^k, L <= 64, by levels (see there).
  void tri_inverse_levels(ConstMatBatch u, MatBatch inv, float* tmp, int k, dion_matmul_precision_t prec) {
    const cublasComputeType_t ct = compute_type(prec);
    const int64_t n = inv.rows, L = n >> k, blocks = int64_t(1) << k, B = inv.batch;
    const int64_t ldu = u.ld, ldi = inv.ld;
    const int Ldu = to_int(ldu, "inverse ldu"), Ldi = to_int(ldi, "inverse ldi");
    float** ptr = static_cast<float**>(scratch(kPtrLevel, sizeof(float*) * static_cast<size_t>(5 * B * blocks)));
    // The diagonal blocks: inv_jj <- U_jj^{-1} (row-major), zeros below
    // them, in one kernel (kernels::tri_inverse_leaves) instead of an
    // identity fill of inv and cublasStrsmBatched against it, which took 53
    // + 135 us per inverse of gpt-1.3b Dion's (Nsight Compute). On an H200
    // (2026-11-29, A/B in one binary): gpt-1.3b Dion tf32 30.13-30.38 ->
    // 30.10-30.13 ms per step (trsm_right_upper_many 2.78 -> 2.67), bf16
    // 18.20-18.28 -> 18.01-18.21.
    kernels::tri_inverse_leaves(ctx(), u, inv, L, blocks);
    const float one = 1.0f, zero = 0.0f, minus_one = -1.0f;
    // Level by level: node j of size 2h at off = 2 h j has A^{-1} at (off,
    // off), C^{-1} at (off + h, off + h), both complete, and B = U(off, off +
    // h); T = A^{-1} B into tmp, then inv(off, off + h) = -T C^{-1}.
    for (int64_t h = L; h < n; h *= 2) {
      const int64_t nodes = n / (2 * h), cnt = B * nodes;
      // At FP32, levels whose products gemm takes at 3xTF32 (gemm_x3: on
      // Hopper, of at least DION_GEMM_3XTF32_MIN_MFLOP) go node by node,
      // each node's two products one strided batch over the matrices (the
      // kernel takes no pointer array for C): n / (2 h) nodes, at most 4 in
      // the levels of h >= n / 8, which hold 98% of the FLOPs. T of node j
      // at tmp + j B h^2 (tmp holds B n^2 / 4 floats).
      if (gemm_x3(prec, false, 0.0f, h, h, h, B)) {
        for (int64_t j = 0; j < nodes; ++j) {
          const int64_t off = 2 * h * j;
          const MatBatch t{tmp + j * B * h * h, h, h, h, h * h, B};
          gemm(false, false, 1.0f, ConstMatBatch(inv.p + off * ldi + off, h, h, ldi, inv.stride, B),
               ConstMatBatch(u.p + off * ldu + off + h, h, h, ldu, u.stride, B), 0.0f, t, prec);
          gemm(false, false, -1.0f, t, ConstMatBatch(inv.p + (off + h) * ldi + off + h, h, h, ldi, inv.stride, B),
               0.0f, MatBatch{inv.p + off * ldi + off + h, h, h, ldi, inv.stride, B}, prec);
        }
        continue;
      }
      const int H = to_int(h, "inverse level");
      const kernels::BlockPointers lv[5] = {
          {inv.p, inv.stride, 2 * h * (ldi + 1)},                // A^{-1}
          {u.p + h, u.stride, 2 * h * (ldu + 1)},                // B
          {tmp, nodes * h * h, h * h},                           // T (h x h, dense)
          {inv.p + h * ldi + h, inv.stride, 2 * h * (ldi + 1)},  // C^{-1}
          {inv.p + h, inv.stride, 2 * h * (ldi + 1)}};           // the upper-right block
      kernels::fill_block_pointers(ctx(), ptr, lv, 5, nodes, cnt);
      void** p = reinterpret_cast<void**>(ptr);
      const int C = to_int(cnt, "inverse nodes");
      // Row-major X = Y Z is column-major X^T = Z^T Y^T: Z's pointers first.
      check(cublasGemmBatchedEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, H, H, H, &one, p + cnt, CUDA_R_32F, Ldu, p,
                                CUDA_R_32F, Ldi, &zero, p + 2 * cnt, CUDA_R_32F, H, C, ct, CUBLAS_GEMM_DEFAULT),
            "cublasGemmBatchedEx (inverse, A^-1 B)");
      check(cublasGemmBatchedEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, H, H, H, &minus_one, p + 3 * cnt, CUDA_R_32F, Ldi,
                                p + 2 * cnt, CUDA_R_32F, H, &zero, p + 4 * cnt, CUDA_R_32F, Ldi, C, ct,
                                CUBLAS_GEMM_DEFAULT),
            "cublasGemmBatchedEx (inverse, -T C^-1)");
    }
  }

  // B U^{-1} (row-major) is, column-major, the solve U^T X^T = B^T, and U's
  // buffer read column-major is U^T (lower): a left, lower, non-transposed solve.
  void solve(ConstMatBatch u, MatBatch bm) {
    const int64_t n = u.rows, rows = bm.rows;
    const int N = to_int(n, "trsm n"), R = to_int(rows, "trsm rows");
    const int ldu = to_int(u.ld, "trsm ldu"), ldb = to_int(bm.ld, "trsm ldb");
    const float one = 1.0f;
    if (bm.batch == 1) {
      check(cublasStrsm(blas_, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, N, R, &one,
                        u.p, ldu, bm.p, ldb),
            "cublasStrsm");
      return;
    }
    const size_t bytes = sizeof(float*) * static_cast<size_t>(bm.batch);
    float** pu = static_cast<float**>(scratch(kPtrA, bytes));
    float** pb = static_cast<float**>(scratch(kPtrB, bytes));
    kernels::fill_pointers(ctx(), pu, u.p, u.stride, bm.batch);  // stride 0: one U for all
    kernels::fill_pointers(ctx(), pb, bm.p, bm.stride, bm.batch);
    check(cublasStrsmBatched(blas_, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, N, R,
                             &one, pu, ldu, pb, ldb, to_int(bm.batch, "trsm batch")),
          "cublasStrsmBatched");
  }


 public:
  void orth_fallback(MatBatch p, ConstMatBatch p0, const int32_t* info) override {
    fallback(p, p0, nullptr, info);
  }
  void orth_fallback_bf16(MatBatch p, const void* p0, const int32_t* info) override {
    fallback(p, ConstMatBatch(nullptr, p.rows, p.cols, p.cols, p.rows * p.cols, p.batch),
             static_cast<const uint16_t*>(p0), info);
  }

  // ---- element-wise and reductions ----
  void axpby(float a, const float* x, float b, float* y, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "axpby", stream_);
    kernels::axpby(ctx(), a, x, b, y, n);
  }
  void lincomb(float a, const float* x, float b, const float* y, float* z, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "lincomb", stream_);
    kernels::lincomb(ctx(), a, x, b, y, z, n);
  }
  void nan_to_num(float* x, int64_t n) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "nan_to_num", stream_);
    kernels::nan_to_num(ctx(), x, n);
  }
  void zero_fixup(ConstMatBatch m, MatBatch p, MatBatch r, ConstMatBatch q) override {
    if (m.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "zero_fixup", stream_);
    void* s = scratch(kReduce, kernels::zero_fixup_scratch(ctx(), m));
    kernels::zero_fixup(ctx(), m, p, r, q, s);
  }
  void nonzero_flags(ConstMatBatch m, int32_t* flags) override {
    if (m.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "zero_fixup", stream_);
    kernels::nonzero_flags(ctx(), m, flags);
  }
  void zero_fixup_flagged(const int32_t* flags, MatBatch p, MatBatch r, ConstMatBatch q) override {
    if (p.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "zero_fixup", stream_);
    kernels::zero_fixup_flagged(ctx(), flags, p, r, q);
  }
  void frob_normalize(MatBatch m, float factor, float eps) override {
    if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "frob_normalize", stream_);
    void* s = scratch(kReduce, kernels::frob_normalize_scratch(ctx(), m));
    kernels::frob_normalize(ctx(), m, factor, eps, s);
  }
  void frob_normalize_bf16(ConstMatBatch m, float factor, float eps, void* out) override {
    if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "frob_normalize_bf16", stream_);
    const MatBatch shape{nullptr, m.rows, m.cols, m.ld, m.stride, m.batch};
    void* s = scratch(kReduce, kernels::frob_normalize_scratch(ctx(), shape));
    kernels::frob_normalize_bf16(ctx(), m, factor, eps, out, s);
  }
  void frob_normalize_bf16_parts(ConstMatBatch m, const double* parts, int64_t nparts, float factor, float eps,
                                 void* out) override {
    if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "frob_normalize_bf16_parts", stream_);
    kernels::frob_normalize_bf16_parts(ctx(), m, parts, nparts, factor, eps, out);
  }
  void frob_scale_bf16(MatBatch m, const FrobScale& s, float diag) override {
    if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "frob_scale_bf16", stream_);
    kernels::frob_scale_bf16(ctx(), m, s.parts, s.nparts, s.factor, s.eps, s.power, diag);
  }
  void col_normalize(MatBatch m, float eps) override {
    if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "col_normalize", stream_);
    void* s = scratch(kReduce, kernels::col_normalize_scratch(ctx(), m));
    kernels::col_normalize(ctx(), m, eps, s);
  }
  void finish_p(MatBatch p, const int32_t* flags, void* pb, bool pb_all) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "finish_p", stream_);
    kernels::finish_p(ctx(), p, flags, pb, pb_all);
  }
  void finish_r(MatBatch r, const int32_t* flags, ConstMatBatch q, const TensorEntry* qlist, Field qf, void* rb,
                double* sumsq) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "finish_r", stream_);
    void* s = scratch(kReduce, kernels::finish_r_scratch(ctx(), r));
    kernels::finish_r(ctx(), r, flags, q, qlist, qf, rb, sumsq, s);
  }
  void col_scale_store(MatBatch r, const double* sumsq, float eps, void* rb, const TensorEntry* list, Field f,
                       const int32_t* skip, bool write_r) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "col_scale_store", stream_);
    kernels::col_scale_store(ctx(), r, sumsq, eps, rb, list, f, skip, write_r);
  }
  void slice_l1(ConstMatBatch m, Axis axis, float* out) override {
    if (m.batch <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "slice_l1", stream_);
    const size_t bytes = kernels::slice_l1_scratch(ctx(), m, axis);
    void* s = bytes ? scratch(kReduce, bytes) : nullptr;
    kernels::slice_l1(ctx(), m, axis, out, s);
  }

  // ---- optimizer updates ----
  void apply_update(float* x, const float* u, int64_t n, const GroupScalars* gs, float lr_mult,
                    bool cautious) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "apply_update", stream_);
    kernels::apply_update(ctx(), x, u, n, gs, lr_mult, cautious);
  }
  void decay(float* x, int64_t n, const GroupScalars* gs) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "decay", stream_);
    kernels::decay(ctx(), x, n, gs);
  }
  void adamw(const TensorEntry* list, int64_t count, int64_t max_n, const GroupScalars* gs, float eps, bool cautious,
             const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "adamw", stream_);
    kernels::adamw(ctx(), list, count, max_n, gs, eps, cautious, skip);
  }
  void lion(const TensorEntry* list, int64_t count, int64_t max_n, const GroupScalars* gs, bool cautious,
            const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "lion", stream_);
    kernels::lion(ctx(), list, count, max_n, gs, cautious, skip);
  }
  void neuron_scales(int64_t batch, int64_t rows, int64_t cols, Axis axis, const void* in_bf16, float* v,
                     int64_t v_per_matrix, float beta2, double* scales) override {
    if (batch <= 0 || rows <= 0 || cols <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "neuron_scales", stream_);
    const MatBatch shape{nullptr, rows, cols, cols, rows * cols, batch};
    void* s = scratch(kReduce, kernels::neuron_normalize_scratch(ctx(), shape, axis));
    kernels::neuron_scales(ctx(), batch, rows, cols, axis, in_bf16, v, v_per_matrix, beta2, s, scales);
  }
  void apply_update_neuron_multi(const TensorEntry* list, int64_t count, int64_t rows, int64_t cols, const void* u,
                                 dion_dtype_t u_dtype, const double* scales, Axis axis, const GroupScalars* gs,
                                 float lr_mult, bool cautious, const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "apply_update_neuron_multi", stream_);
    kernels::apply_update_neuron_multi(ctx(), list, count, rows, cols, u, u_dtype, scales, axis == kRows, gs, lr_mult,
                                       cautious, skip);
  }
  void neuron_normalize(MatBatch u, Axis axis, float* v, int64_t v_per_matrix, float beta2,
                        const int32_t* selected) override {
    if (u.batch <= 0 || u.rows <= 0 || u.cols <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "neuron_normalize", stream_);
    void* s = scratch(kReduce, kernels::neuron_normalize_scratch(ctx(), u, axis));
    kernels::neuron_normalize(ctx(), u, axis, v, v_per_matrix, beta2, selected, s);
  }

  // ---- slice selection ----
  void topk(const float* scores, int64_t batch, int64_t n, int64_t k, int32_t* idx) override {
    DION_REQUIRE(k >= 0 && k <= n && n <= INT_MAX, DION_ERROR_INTERNAL, "cuda topk: bad k = %lld of n = %lld",
                 static_cast<long long>(k), static_cast<long long>(n));
    DeviceScope ds(device_);
    ProfScope ps(prof_, "topk", stream_);
    kernels::topk(ctx(), scores, batch, n, k, idx);
  }
  void gather_slices(ConstMatBatch m, Axis axis, const int32_t* idx, int64_t k, MatBatch out) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "gather_slices", stream_);
    kernels::gather_slices(ctx(), m, axis, idx, k, out);
  }
  void scale_slices(MatBatch m, Axis axis, const int32_t* idx, int64_t k, float s) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "scale_slices", stream_);
    kernels::scale_slices(ctx(), m, axis, idx, k, s);
  }
  void add_slices(MatBatch m, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u, const GroupScalars* gs,
                  float mult) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "add_slices", stream_);
    kernels::add_slices(ctx(), m, axis, idx, k, u, gs, mult);
  }

  // ---- fused passes over typed buffers ----
  void momentum_multi(const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale, bool nesterov,
                      bool store_state, void* u, dion_dtype_t u_dtype, const int32_t* skip,
                      int32_t* nonzero) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "momentum_multi", stream_);
    kernels::momentum_multi(ctx(), list, count, n, mu, g_scale, nesterov, store_state, u, u_dtype, skip, nonzero);
  }
  void momentum_multi_sums(const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale, bool nesterov,
                           void* u, dion_dtype_t u_dtype, const int32_t* skip, double* sumsq) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "momentum_multi_sums", stream_);
    kernels::momentum_multi_sums(ctx(), list, count, n, mu, g_scale, nesterov, u, u_dtype, skip, sumsq);
  }
  int64_t momentum_parts(int64_t count, int64_t n) override { return kernels::momentum_parts(ctx(), count, n); }
  void apply_update_multi(const TensorEntry* list, int64_t count, int64_t n, const void* u, dion_dtype_t u_dtype,
                          const GroupScalars* gs, float lr_mult, bool cautious, const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "apply_update_multi", stream_);
    kernels::apply_update_multi(ctx(), list, count, n, u, u_dtype, gs, lr_mult, cautious, skip);
  }
  // lowrank_gemm (below) with C = the parameters / the momentum states.
  void update_lowrank(const TensorEntry* list, int64_t count, ConstMatBatch a, ConstMatBatch b, dion_dtype_t ab_dtype,
                      dion_dtype_t x_dtype, dion_matmul_precision_t precision, const GroupScalars* gs, float lr_mult,
                      const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "update_lowrank", stream_);
    lowrank_gemm(ps, "update_lowrank", list, count, kParam, a, b, ab_dtype, x_dtype, precision, gs, lr_mult, skip);
  }
  void accumulate_lowrank(const TensorEntry* list, int64_t count, ConstMatBatch a, ConstMatBatch b,
                          dion_dtype_t ab_dtype, dion_dtype_t x_dtype, dion_matmul_precision_t precision, float alpha,
                          const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "accumulate_lowrank", stream_);
    lowrank_gemm(ps, "accumulate_lowrank", list, count, kState0, a, b, ab_dtype, x_dtype, precision, nullptr, alpha,
                 skip);
  }
  void store_slices_multi(const TensorEntry* list, int64_t count, Field f, ConstMatBatch m, Axis axis,
                          const int32_t* idx, int64_t k, const int32_t* skip) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "store_slices_multi", stream_);
    kernels::store_slices_multi(ctx(), list, count, f, m, axis, idx, k, skip);
  }
  void momentum_l1_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols, Axis axis,
                         float* out, int32_t* nonfinite) override {
    DeviceScope ds(device_);
    ProfScope ps(prof_, "momentum_l1_multi", stream_);
    const size_t bytes = kernels::momentum_l1_multi_scratch(ctx(), count, per, rows, cols, axis);
    void* s = bytes ? scratch(kReduce, bytes) : nullptr;
    kernels::momentum_l1_multi(ctx(), list, count, per, rows, cols, axis, out, s, nonfinite);
  }
  int64_t select_momentum_parts(int64_t count, int64_t per, int64_t rows, int64_t cols) override {
    return kernels::select_momentum_parts(ctx(), count, per, rows, cols);
  }
  void select_momentum_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                             Axis axis, const int32_t* idx, int64_t k, float decay, MatBatch out,
                             dion_dtype_t out_dtype, const int32_t* skip, double* sumsq) override {
    DION_REQUIRE(out_dtype == DION_DTYPE_FP32 || out_dtype == DION_DTYPE_BF16, DION_ERROR_INTERNAL,
                 "cuda select_momentum_multi: out must be fp32 or bf16");
    DeviceScope ds(device_);
    ProfScope ps(prof_, "select_momentum_multi", stream_);
    const size_t bytes = kernels::decay_add_slices_multi_scratch(count, per, rows, cols, axis, k);
    void* s = bytes ? scratch(kPos, bytes) : nullptr;
    kernels::select_momentum_multi(ctx(), list, count, per, rows, cols, axis, idx, k, decay, out,
                                   out_dtype == DION_DTYPE_BF16, skip, s, sumsq);
  }
  void decay_add_slices_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                              Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u, dion_dtype_t u_dtype,
                              const double* scales, const GroupScalars* gs, float mult,
                              const int32_t* skip) override {
    DION_REQUIRE(u_dtype == DION_DTYPE_FP32 || u_dtype == DION_DTYPE_BF16, DION_ERROR_INTERNAL,
                 "cuda decay_add_slices_multi: u must be fp32 or bf16");
    DION_REQUIRE(!scales || axis == kRows, DION_ERROR_INTERNAL,
                 "cuda decay_add_slices_multi: neuron scales need selected rows");
    DeviceScope ds(device_);
    ProfScope ps(prof_, "decay_add_slices_multi", stream_);
    const size_t bytes = kernels::decay_add_slices_multi_scratch(count, per, rows, cols, axis, k);
    void* s = bytes ? scratch(kPos, bytes) : nullptr;
    kernels::decay_add_slices_multi(ctx(), list, count, per, rows, cols, axis, idx, k, u, u_dtype == DION_DTYPE_BF16,
                                    scales, gs, mult, skip, s);
  }

 private:
  // Scratch buffers, one per purpose, so that one call can hold several.
  enum Slot {
    kPtrA, kPtrB, kMat, kTau, kWork, kInfo, kReduce, kDblA, kDblG, kInv, kTmp, kPos, kPtrLevel, kPtrGemm, kGram, kCholInv, kInv16, kKmajor, kSplit, kSlotCount
  };
  enum LworkOp { kOpGeqrf, kOpOrgqr, kOpPotrf, kOpDpotrf };
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
  };

  kernels::Ctx ctx() const { return kernels::Ctx{stream_, sms_}; }

  // gemm_bf16_lower's grid: 8 x 8 blocks for n >= 2048, a multiple of 256,
  // 4 x 4 for n >= 1024, a multiple of 128 (blocks of a multiple of 32, as
  // mirror_bf16 needs), else 1 (the full product): below that the saving
  // does not pay for the extra launches (an H100, gpt-160m Muon, s = 768:
  // 3.94 -> 4.43 ms with 4 x 4 blocks of 192; gpt-1.3b Dion2, s = 512: 13.55
  // -> 14.0), nor where the product is empty, DION_SYM_PRODUCTS=0, or a
  // block pointer would not be 16-byte aligned (the pointer-array kernels
  // assume it: strides and lds multiples of 8 elements, the bases aligned).
  // At s = 2048 (gpt-1.3b Muon, bf16, an H100) 8 x 8 blocks of 256 (36 of
  // 64 block products) ran 77.9 / 78.2 -> 76.3 / 77.1 ms against 4 x 4, and
  // 16 x 16 of 128 79.8 / 79.8. DION_SYM_BLOCKS=nb sets the grid (where n is
  // a multiple of 32 nb).
  int64_t sym_blocks(ConstMatBatch a, ConstMatBatch b, ConstMatBatch c, int64_t k) const {
    if (!sym_products_ || k <= 0 || c.batch <= 0 || c.rows != c.cols) return 1;
    const int64_t n = c.rows;
    if (n < 1024) return 1;
    const int64_t nb = sym_grid_ > 0 ? sym_grid_ : n >= 2048 && n % 256 == 0 ? 8 : 4;
    if (nb < 2 || n % (32 * nb) != 0) return 1;
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    for (const ConstMatBatch* m : {&a, &b, &c})
      if (!aligned(m->p) || m->ld % 8 != 0 || m->stride % 8 != 0) return 1;
    return nb;
  }

  // update_lowrank and accumulate_lowrank: one pointer-array GEMM per batch,
  // C = field f of each tensor (in place), alpha and beta read from the
  // device (pointer mode device for this call), computed there by the setup
  // kernel from the group's scalars (gs) or alpha = mult, beta = 1 (gs
  // null), and the skip flag ({0, 1} on a skipped step: C = 1 * C + 0 *
  // (A B^T) leaves C's bits, and A, B are finite: Dion's P and R pass
  // finish_p / finish_r before). A row-major X = A B^T is column-major X^T
  // = B A^T: B's pointers first, transposed. fp32 factors into fp32 C at
  // FP32 take kernels::lowrank_tf32x3 where the device runs it (Hopper):
  // three TF32 products of the factors' split parts promoted to fp32, as
  // exact as cuBLAS's SGEMM and faster (the kernel file has the figures).
  void lowrank_gemm(ProfScope& ps, const char* what, const TensorEntry* list, int64_t count, Field f, ConstMatBatch a,
                    ConstMatBatch b, dion_dtype_t ab_dtype, dion_dtype_t x_dtype, dion_matmul_precision_t precision,
                    const GroupScalars* gs, float mult, const int32_t* skip) {
    const int64_t rows = a.rows, cols = b.rows, r = a.cols;
    DION_REQUIRE(b.cols == r && a.batch == count && b.batch == count && update_lowrank_takes(ab_dtype, x_dtype),
                 DION_ERROR_INTERNAL, "cuda %s: bad shapes or dtypes", what);
    if (count <= 0 || rows == 0 || cols == 0) return;
    const bool lowp = ab_dtype == DION_DTYPE_BF16;
    const bool x3 = lowrank_tf32x3_ && !lowp && precision == DION_MATMUL_FP32 && x_dtype == DION_DTYPE_FP32 && r > 0;
    ps.detail([&] {
      return gemm_tag(lowp ? "lowrank bf16" : x3 ? "lowrank fp32 3xtf32" : "lowrank fp32", rows, cols, r, false, true,
                      count);
    });
    void** ptr = static_cast<void**>(scratch(kPtrGemm, sizeof(void*) * static_cast<size_t>(3 * count) + 64));
    float* coef = reinterpret_cast<float*>(ptr + 3 * count);
    const int64_t es = lowp ? 2 : 4;
    const kernels::PtrSource src[3] = {
        {b.p, b.stride * es, -1}, {a.p, a.stride * es, -1}, {nullptr, 0, static_cast<int>(f)}};
    kernels::gemm_pointers(ctx(), list, count, src, const_cast<const void**>(ptr), gs, mult, skip, coef);
    if (x3) {
      const size_t bytes = split_bytes(kernels::lowrank_tf32x3_scratch(1, rows, cols, r), count);
      if (kernels::lowrank_tf32x3(ctx(), a, b, ptr + 2 * count, coef, cols, scratch(kSplit, bytes), bytes)) return;
    }
    // bf16 factors are multiplied exactly, with fp32 accumulation
    const cublasComputeType_t compute = lowp ? CUBLAS_COMPUTE_32F : compute_type(precision);
    const cudaDataType_t ab = lowp ? CUDA_R_16BF : CUDA_R_32F;
    if (!lowp && precision == DION_MATMUL_TF32 && lt_lowrank_ &&
        lt_matmul(LtProduct{cols, rows, r, true, false, b.ld, a.ld, cols, count, 0, 0, 0, /*pointer_array=*/true,
                            /*device_scalars=*/true, pointer_alignment(b.p, b.stride * es),
                            pointer_alignment(a.p, a.stride * es), 16},
                  coef, ptr, ptr + count, coef + 1, ptr + 2 * count, ptr + 2 * count, "cublasLtMatmul (lowrank)"))
      return;
    check(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_DEVICE), "cublasSetPointerMode (device)");
    const cublasStatus_t st = cublasGemmBatchedEx(
        blas_, CUBLAS_OP_T, CUBLAS_OP_N, to_int(cols, "lowrank cols"), to_int(rows, "lowrank rows"),
        to_int(r, "lowrank rank"), coef, ptr, ab, to_int(b.ld, "lowrank ldb"), ptr + count, ab,
        to_int(a.ld, "lowrank lda"), coef + 1, ptr + 2 * count, x_dtype == DION_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F,
        to_int(cols, "lowrank ldx"), to_int(count, "lowrank batch"), compute, CUBLAS_GEMM_DEFAULT);
    check(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode (host)");
    check(st, "cublasGemmBatchedEx (lowrank)");
  }

  // The largest power of two (at most 256) that divides the address of every
  // matrix of a strided batch: its base and its stride in bytes.
  static int pointer_alignment(const void* base, int64_t stride_bytes) {
    const uintptr_t v = reinterpret_cast<uintptr_t>(base) | static_cast<uintptr_t>(stride_bytes) | 256;
    return static_cast<int>(v & (~v + 1));
  }

  // TF32 products through cuBLASLt, with an algorithm of cuBLASLt's
  // heuristic chosen once per shape: the first of its first 8 with a 128 x
  // 128 tile, else its first. cuBLAS's default takes 256 x 64 tiles for most
  // of Dion's error feedback and update products (lowrank_gemm), and the
  // 128 x 128 ones ran them 1.3 to 1.4 times faster on an H200
  // (bench/micro/lowrank_configs.cu: 24 products of rank 512 into C 2048 x
  // 8192 2.00 -> 1.41 ms, 6144 x 2048 1.51 -> 1.06, 2048 x 2048 0.52 ->
  // 0.39; rank 192, 12 products of gpt-160m's shapes, 0.134 -> 0.100). The
  // choice is a function of the shape, the alignments and the library
  // version only, never of a timing, so every rank and every run takes the
  // same algorithm (the same bits). ok is false where cuBLASLt offers none:
  // the caller then makes its cuBLAS call. DION_LT_LOWRANK=0 keeps
  // lowrank_gemm's cuBLAS call at TF32, DION_LT_GEMM=0 gemm's (which takes
  // this path for products with a long inner dimension only). bf16
  // products (gemm_bf16_out, for its C apart from D) take the heuristic's
  // first algorithm, as cuBLAS would.
  struct LtPlan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool ok = false;
  };
  // One such product: column-major C (m x n) = alpha op(A) op(B) + beta C,
  // op(A), op(B) transposed where ta, tb; a strided batch (the strides in
  // elements) or, with pointer_array, arrays of pointers (strides unused);
  // alpha and beta in device memory where device_scalars; the smallest
  // alignments (bytes) of A's, B's and C's matrices. fp32 elements at TF32
  // (the first 128 x 128-tile algorithm of the heuristic's first 8), or,
  // with bf16, bf16 elements with fp32 accumulation (the heuristic's first).
  struct LtProduct {
    int64_t m, n, k;
    bool ta, tb;
    int64_t lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
    bool pointer_array, device_scalars;
    int64_t align_a, align_b, align_c;
    bool bf16 = false;
    std::array<int64_t, 18> key() const {
      return {m,        n,        k,        ta,       tb,       lda,           ldb,            ldc,     batch,
              stride_a, stride_b, stride_c, pointer_array, device_scalars, align_a, align_b, align_c, bf16};
    }
  };
  // The product g through cuBLASLt (a, b, c the buffers, or the pointer
  // arrays, its layouts describe; the result goes to d, with C's layout: c
  // itself in place, another buffer for gemm_bf16_out) if its plan has an
  // algorithm; false where it has none, and the caller makes its cuBLAS call.
  bool lt_matmul(const LtProduct& g, const void* alpha, const void* a, const void* b, const void* beta, const void* c,
                 void* d, const char* what) {
    const LtPlan& plan = lt_plan(g);
    if (!plan.ok) return false;
    check(cublasLtMatmul(lt_, plan.desc, alpha, a, plan.la, b, plan.lb, beta, c, plan.lc, d, plan.lc, &plan.algo,
                         blas_ws_, kCublasWorkspaceBytes, stream_),
          what);
    return true;
  }
  const LtPlan& lt_plan(const LtProduct& g) {
    const auto key = g.key();
    auto it = lt_plans_.find(key);
    if (it != lt_plans_.end()) return it->second;
    const int m = to_int(g.m, "cuBLASLt m"), n = to_int(g.n, "cuBLASLt n"), k = to_int(g.k, "cuBLASLt k"),
              batch = to_int(g.batch, "cuBLASLt batch");
    LtPlan& p = lt_plans_[key];  // an entry that stays ok = false if anything below fails
    auto set_desc = [&](cublasLtMatmulDescAttributes_t attr, auto v) {
      check(cublasLtMatmulDescSetAttribute(p.desc, attr, &v, sizeof(v)), "cublasLtMatmulDescSetAttribute");
    };
    auto layout = [&](cublasLtMatrixLayout_t* l, int rows, int cols, int64_t ld, int64_t stride) {
      check(cublasLtMatrixLayoutCreate(l, g.bf16 ? CUDA_R_16BF : CUDA_R_32F, rows, cols, ld),
            "cublasLtMatrixLayoutCreate");
      const int32_t bc = batch;
      const uint32_t mode = g.pointer_array ? CUBLASLT_BATCH_MODE_POINTER_ARRAY : CUBLASLT_BATCH_MODE_STRIDED;
      check(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof(bc)),
            "cublasLtMatrixLayoutSetAttribute");
      check(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof(mode)),
            "cublasLtMatrixLayoutSetAttribute");
      if (!g.pointer_array)
        check(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                               sizeof(stride)),
              "cublasLtMatrixLayoutSetAttribute");
    };
    check(cublasLtMatmulDescCreate(&p.desc, g.bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F),
          "cublasLtMatmulDescCreate");
    set_desc(CUBLASLT_MATMUL_DESC_TRANSA, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N);
    set_desc(CUBLASLT_MATMUL_DESC_TRANSB, g.tb ? CUBLAS_OP_T : CUBLAS_OP_N);
    set_desc(CUBLASLT_MATMUL_DESC_POINTER_MODE, g.device_scalars ? CUBLASLT_POINTER_MODE_DEVICE
                                                                 : CUBLASLT_POINTER_MODE_HOST);
    layout(&p.la, g.ta ? k : m, g.ta ? m : k, g.lda, g.stride_a);
    layout(&p.lb, g.tb ? n : k, g.tb ? k : n, g.ldb, g.stride_b);
    layout(&p.lc, m, n, g.ldc, g.stride_c);
    cublasLtMatmulPreference_t pref = nullptr;
    check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t wsb = kCublasWorkspaceBytes;
    const uint32_t al[4] = {static_cast<uint32_t>(g.align_a), static_cast<uint32_t>(g.align_b),
                            static_cast<uint32_t>(g.align_c), static_cast<uint32_t>(g.align_c)};
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                                             sizeof(wsb));
    const cublasLtMatmulPreferenceAttributes_t al_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i)
      st = cublasLtMatmulPreferenceSetAttribute(pref, al_attr[i], &al[i], sizeof(al[i]));
    cublasLtMatmulHeuristicResult_t res[8];
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.la, p.lb, p.lc, p.lc, pref, 8, res, &found);
    (void)cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS) return p;  // no algorithm: the cuBLAS call
    int pick = -1;
    for (int i = 0; i < found; ++i) {
      if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > kCublasWorkspaceBytes) continue;
      uint32_t tile = 0;
      size_t written = 0;
      if (pick < 0) pick = i;
      if (g.bf16) break;
      if (cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile),
                                               &written) == CUBLAS_STATUS_SUCCESS &&
          tile == CUBLASLT_MATMUL_TILE_128x128) {
        pick = i;
        break;
      }
    }
    if (pick < 0) return p;
    p.algo = res[pick].algo;
    p.ok = true;
    return p;
  }
  void destroy_lt() noexcept {
    for (auto& kv : lt_plans_) {
      LtPlan& p = kv.second;
      if (p.la) (void)cublasLtMatrixLayoutDestroy(p.la);
      if (p.lb) (void)cublasLtMatrixLayoutDestroy(p.lb);
      if (p.lc) (void)cublasLtMatrixLayoutDestroy(p.lc);
      if (p.desc) (void)cublasLtMatmulDescDestroy(p.desc);
    }
    lt_plans_.clear();
    if (lt_) (void)cublasLtDestroy(lt_);
    lt_ = nullptr;
  }

  // cublasSetStream resets the workspace to cuBLAS's own pool, so the
  // preallocated one is set again after every stream change.
  void bind_stream() {
    check(cublasSetStream(blas_, stream_), "cublasSetStream");
    check(cublasSetWorkspace(blas_, blas_ws_, kCublasWorkspaceBytes), "cublasSetWorkspace");
    check(cusolverDnSetStream(solver_, stream_), "cusolverDnSetStream");
  }

  // Scratch of at least `bytes` in `slot`. Growing it is the only allocation
  // outside alloc(): it happens on the first call with a larger shape, drains
  // the stream (work already enqueued may still use the old buffer), and is
  // refused while the stream is being captured into a graph.
  void* scratch(Slot slot, size_t bytes) {
    Buffer& buf = scratch_[slot];
    if (bytes <= buf.bytes) return buf.p;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream_, &capture), "cudaStreamIsCapturing");
    DION_REQUIRE(capture == cudaStreamCaptureStatusNone, DION_ERROR_INVALID_USAGE,
                 "cuda backend: internal scratch must grow to %zu bytes while the stream is being captured into a "
                 "CUDA graph; run one step with the same shapes before capturing",
                 bytes);
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (scratch growth)");
    if (buf.p) {
      check(cudaFree(buf.p), "cudaFree (scratch)");
      buf.p = nullptr;
      buf.bytes = 0;
    }
    const size_t rounded = (bytes + 255) & ~size_t(255);
    buf.p = cuda::device_malloc(rounded, device_, "scratch");
    buf.bytes = rounded;
    return buf.p;
  }

  // cuSOLVER workspace sizes are host-side queries; cached per shape so a
  // steady-state step makes none.
  template <class Query>
  int cached_lwork(LworkOp op, int m, int n, const Query& query) {
    const auto key = std::make_tuple(static_cast<int>(op), m, n);
    auto it = lwork_.find(key);
    if (it != lwork_.end()) return it->second;
    int lwork = 0;
    check(query(&lwork), op == kOpGeqrf ? "cusolverDnSgeqrf_bufferSize"
                         : op == kOpOrgqr ? "cusolverDnSorgqr_bufferSize"
                                          : "cusolverDnSpotrf_bufferSize");
    lwork_.emplace(key, lwork);
    return lwork;
  }

  // Workspace (floats) of geqrf, and of orgqr too when `with_q`, for p x r.
  int qr_lwork(int P, int R, bool with_q) {
    float* cm = static_cast<float*>(scratch_[kMat].p);
    float* tau = static_cast<float*>(scratch_[kTau].p);
    int lwork = cached_lwork(kOpGeqrf, P, R,
                             [&](int* lw) { return cusolverDnSgeqrf_bufferSize(solver_, P, R, cm, P, lw); });
    if (with_q)
      lwork = std::max(lwork, cached_lwork(kOpOrgqr, P, R, [&](int* lw) {
                         return cusolverDnSorgqr_bufferSize(solver_, P, R, R, cm, P, tau, lw);
                       }));
    return std::max(lwork, 1);
  }

  // orth_fallback from fp32 P0, or from dense bf16 P0 (p16, of p0's shape).
  void fallback(MatBatch p, ConstMatBatch p0, const uint16_t* p16, const int32_t* info) {
    if (p.batch <= 0 || p.rows <= 0 || p.cols <= 0) return;
    DeviceScope ds(device_);
    ProfScope ps(prof_, "orth_fallback", stream_);
    void* s = scratch(kReduce, kernels::orth_fallback_scratch(ctx(), p));
    kernels::orth_fallback(ctx(), p, p0, p16, info, s);
  }

  // Free device memory now, and the memory taken since `before` (0 where it
  // grew: something else freed memory meanwhile). Measured around the
  // library handles' creation, which allocates device memory of its own that
  // no API reports; what other threads or processes allocate on the device
  // at that moment is counted too.
  static size_t free_device_memory() {
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return free;
  }
  static size_t taken_since(size_t before) {
    const size_t now = free_device_memory();
    return before > now ? before - now : 0;
  }
  // ---- qr_q's lanes ----
  // How many streams qr_q spreads a batch over: min(batch, DION_QR_STREAMS,
  // kQrLanesMax). The streams (non-blocking), their cuSOLVER handles and the
  // events that fork them from the current stream and join them back are
  // made as a call first needs them, outside a capture (like a scratch
  // buffer's growth); a capture then takes the forked work along. The
  // device memory each lane's creation takes (its cuSOLVER handle's, mostly)
  // is measured and counted in scratch_bytes() (handle_bytes_).
  int qr_lanes(int64_t batch) {
    const int n = static_cast<int>(std::min<int64_t>({batch, qr_lanes_max_, kQrLanesMax}));
    if (n <= 1) return 1;
    if (qr_made_ >= n) return n;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream_, &capture), "cudaStreamIsCapturing");
    DION_REQUIRE(capture == cudaStreamCaptureStatusNone, DION_ERROR_INVALID_USAGE,
                 "cuda backend: %d more QR streams are needed by a Householder QR that is being captured into a CUDA "
                 "graph; run one step with the same shapes before capturing",
                 n - qr_made_);
    if (!qr_fork_)
      check(cudaEventCreateWithFlags(&qr_fork_, cudaEventDisableTiming), "cudaEventCreateWithFlags (qr fork)");
    for (int i = qr_made_; i < n; ++i) {
      cudaEvent_t join = nullptr;
      cusolverDnHandle_t h = nullptr;
      cudaStream_t st = nullptr;
      const size_t free0 = free_device_memory();
      try {
        check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "cudaEventCreateWithFlags (qr join)");
        check(cusolverDnCreate(&h), "cusolverDnCreate (qr stream)");
        check(cusolverDnSetDeterministicMode(h, CUSOLVER_DETERMINISTIC_RESULTS),
              "cusolverDnSetDeterministicMode (qr stream)");
        check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (qr stream)");
        check(cusolverDnSetStream(h, st), "cusolverDnSetStream (qr stream)");
      } catch (...) {
        if (h) (void)cusolverDnDestroy(h);
        if (st) (void)cudaStreamDestroy(st);
        if (join) (void)cudaEventDestroy(join);
        throw;
      }
      qr_joins_[i] = join;
      qr_solvers_[i] = h;
      qr_streams_[i] = st;
      qr_made_ = i + 1;
      handle_bytes_ += taken_since(free0);
    }
    return n;
  }
  // Never throws (teardown).
  void destroy_qr_lanes() noexcept {
    for (int i = 0; i < qr_made_; ++i) {
      (void)cudaStreamSynchronize(qr_streams_[i]);
      (void)cusolverDnDestroy(qr_solvers_[i]);
      (void)cudaStreamDestroy(qr_streams_[i]);
      (void)cudaEventDestroy(qr_joins_[i]);
      qr_solvers_[i] = nullptr;
      qr_streams_[i] = nullptr;
      qr_joins_[i] = nullptr;
    }
    qr_made_ = 0;
    if (qr_fork_) (void)cudaEventDestroy(qr_fork_);
    qr_fork_ = nullptr;
  }
  void qr_fork(int lanes) {
    if (lanes <= 1) return;
    check(cudaEventRecord(qr_fork_, stream_), "cudaEventRecord (fork to the qr streams)");
    for (int i = 0; i < lanes; ++i)
      check(cudaStreamWaitEvent(qr_streams_[i], qr_fork_, 0), "cudaStreamWaitEvent (fork to a qr stream)");
  }
  // The step's stream waits for every lane (each one tried even after an
  // error, so the error path can join them all without throwing); the first
  // error, else cudaSuccess.
  cudaError_t qr_join(int lanes) noexcept {
    cudaError_t first = cudaSuccess;
    for (int i = 0; i < lanes && lanes > 1; ++i) {
      cudaError_t e = cudaEventRecord(qr_joins_[i], qr_streams_[i]);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, qr_joins_[i], 0);
      if (first == cudaSuccess) first = e;
    }
    return first;
  }

  void set_wait_guard(WaitGuard* guard) override { guard_ = guard; }

  // On the backend's own non-blocking stream, which never waits for the
  // caller's: lands even while the step's kernels are stuck.
  void poke_flag(int32_t* flag, int32_t value) override {
    DeviceScope ds(device_);
    poke_ = value;
    check(cudaMemcpyAsync(flag, &poke_, sizeof(int32_t), cudaMemcpyHostToDevice, own_), "cudaMemcpyAsync (poke_flag)");
    check(cudaStreamSynchronize(own_), "cudaStreamSynchronize (poke_flag)");
  }

  void wait_for_work() {
    wait_event(done_, "cudaEventSynchronize (last step)");
    // The caller's stream, the legacy default stream when none was given
    // (dion.h: NULL is that stream, not "no stream"): own_ is non-blocking,
    // so without this wait a blocking copy overtakes what the caller has
    // enqueued on the legacy stream and still writes (or reads) the same
    // memory, e.g. PyTorch's default stream reusing a freed buffer.
    check(cudaEventRecord(mark_, stream_ ? stream_ : cudaStreamLegacy), "cudaEventRecord (wait)");
    wait_event(mark_, "cudaStreamSynchronize");
    // A completed step ends with the caller's stream waiting for the comm
    // stream (done_ covers it); one that failed midway may not have.
    if (comm_) {
      check(cudaEventRecord(mark_, comm_), "cudaEventRecord (wait, comm stream)");
      wait_event(mark_, "cudaStreamSynchronize (comm stream)");
    }
  }

  // Without a guard, a plain blocking wait. With one (NCCL meshes), a poll
  // with a deadline: a peer that died leaves NCCL kernels spinning forever,
  // and the guard turns that into an error instead of a hang.
  void wait_event(cudaEvent_t ev, const char* what) {
    if (!guard_) {
      check(cudaEventSynchronize(ev), what);
      return;
    }
    using clock = std::chrono::steady_clock;
    const clock::time_point start = clock::now();
    for (long polls = 0;; ++polls) {
      const cudaError_t e = cudaEventQuery(ev);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) check(e, what);
      if (polls < 1000) continue;
      guard_->poll();
      const double waited = std::chrono::duration<double>(clock::now() - start).count();
      if (guard_->timeout_s > 0 && waited > guard_->timeout_s) {
        guard_->on_timeout();
        throw Error(DION_ERROR_NCCL,
                    format("the optimizer's work did not finish within %g s (DION_COMM_TIMEOUT): a rank of a mesh may "
                           "have died, hung or stopped calling the library; its NCCL communicators were aborted",
                           guard_->timeout_s));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  void destroy() noexcept {
    // Teardown never throws: errors here are ignored.
    int prev = -1;
    const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != device_ && cudaSetDevice(device_) == cudaSuccess;
    if (done_) (void)cudaEventSynchronize(done_);
    if (own_) (void)cudaStreamSynchronize(own_);
    if (comm_) (void)cudaStreamSynchronize(comm_);
    destroy_qr_lanes();
    if (fork_) (void)cudaEventDestroy(fork_);
    if (join_) (void)cudaEventDestroy(join_);
    fork_ = join_ = nullptr;
    for (cudaEvent_t& e : marks_) {
      if (e) (void)cudaEventDestroy(e);
      e = nullptr;
    }
    if (comm_) (void)cudaStreamDestroy(comm_);
    comm_ = nullptr;
    if (done_) (void)cudaEventDestroy(done_);
    if (mark_) (void)cudaEventDestroy(mark_);
    mark_ = nullptr;
    if (own_) (void)cudaStreamDestroy(own_);
    done_ = nullptr;
    own_ = nullptr;
    for (Buffer& b : scratch_)
      if (b.p) {
        (void)cudaFree(b.p);
        b = Buffer{};
      }
    if (blas_ws_) (void)cudaFree(blas_ws_);
    if (solver_) (void)cusolverDnDestroy(solver_);
    destroy_lt();
    if (blas_) (void)cublasDestroy(blas_);
    blas_ws_ = nullptr;
    solver_ = nullptr;
    blas_ = nullptr;
    (void)cudaGetLastError();
    if (switched) (void)cudaSetDevice(prev);
  }

  int device_;
  int sms_ = 1;
  cudaStream_t stream_ = nullptr;  // the current API call's stream; nullptr: the legacy default stream
  cudaStream_t own_ = nullptr;     // for blocking copies
  cudaEvent_t done_ = nullptr;     // recorded at the end of each step
  cudaEvent_t mark_ = nullptr;     // recorded on the caller's stream by a wait
  cudaStream_t comm_ = nullptr;    // the communication stream (make_comm_stream), else nullptr
  cudaEvent_t fork_ = nullptr;     // current stream -> comm stream
  cudaEvent_t join_ = nullptr;     // comm stream -> current stream
  cudaEvent_t marks_[kCommMarks] = {};
  // The device memory qr_q's lanes took when they were made (a step's
  // growth, like the scratch), counted in scratch_bytes(): on an H100 with
  // CUDA 13 each lane's cuSOLVER handle takes 96 MiB
  // (bench/micro/handle_memory.cu, docs/ENV.md), three times the 32 MiB
  // cuBLAS workspace cuSOLVER's documentation names. (The backend's own two
  // handles, made with the optimizer, are not counted.)
  size_t handle_bytes_ = 0;
  cudaStream_t qr_streams_[kQrLanesMax] = {};  // qr_q's lanes (qr_lanes), made as needed
  cusolverDnHandle_t qr_solvers_[kQrLanesMax] = {};
  cudaEvent_t qr_joins_[kQrLanesMax] = {};  // lane i -> current stream
  cudaEvent_t qr_fork_ = nullptr;           // current stream -> the lanes
  int qr_made_ = 0;                         // lanes 0 .. qr_made_ - 1 exist
  int64_t qr_lanes_max_ = env_int("DION_QR_STREAMS", kQrLanesMax);
  // qr_q's batched Householder QR (qr_q_batched) where its panels fit;
  // DION_QR_BATCHED=0: cuSOLVER's geqrf / orgqr matrix by matrix everywhere.
  bool qr_batched_ = env_int("DION_QR_BATCHED", 1) != 0;
  // Its panels over clusters of CTAs where the rows allow (Hopper;
  // kernels::householder_panel_cluster); DION_QR_PANEL_CLUSTER=0: one CTA
  // per matrix.
  bool qr_panel_cluster_ = env_int("DION_QR_PANEL_CLUSTER", 1) != 0;
  int smem_optin_ = 0;  // shared memory per block, opt-in (householder_init)
  // qr_q_batched's outer block width (DION_QR_BLOCK; a multiple of the panel width, at most kHouseholderBlock).
  int64_t qr_block_ = env_int("DION_QR_BLOCK", kernels::kHouseholderBlock);
  WaitGuard* guard_ = nullptr;
  int32_t poke_ = 0;
  Profiler prof_;
  // Largest n factored by potrfBatched (larger: potrf per matrix);
  // DION_POTRF_BATCHED_MAX overrides it (a tuning knob for the benchmarks).
  int64_t potrf_batched_max_ = env_int("DION_POTRF_BATCHED_MAX", kPotrfBatchedMaxN);
  // Gram matrices as split sums where that fills the device (gram).
  bool gram_split_ = env_int("DION_GRAM_SPLIT", 1) != 0;
  bool tf32_kmajor_ = env_int("DION_TF32_KMAJOR", 1) != 0;
  double tf32_kmajor_min_flop_ = 1e6 * static_cast<double>(env_int("DION_TF32_KMAJOR_MIN_MFLOP", 16000));
  // DION_TRSM_INVERSE=0 keeps cuBLAS's triangular solve for tall B too.
  bool trsm_via_inverse_ = env_int("DION_TRSM_INVERSE", 1) != 0;
  bool inverse_tf32_ = env_int("DION_INVERSE_TF32", 1) != 0;  // TrsmPart::precondition's inverses with TF32 GEMMs
  int64_t tri_blocks_ = env_int("DION_TRI_BLOCKS", 0);    // tri_product's block count (0: triangle_blocks' choice)
  int64_t gram_blocks_ = env_int("DION_GRAM_BLOCKS", 0);  // gram's block count (0: triangle_blocks' choice)
  int64_t trsm_inverse_rows_ = std::max<int64_t>(1, env_int("DION_TRSM_INVERSE_ROWS", 1));
  // via_inverse's largest n at FP32 below 4 n rows (DION_TRSM_INVERSE_FP32_MAX_N;
  // -1: none where gemm takes 3xTF32, else 1024).
  int64_t trsm_inverse_fp32_max_n_ = env_int("DION_TRSM_INVERSE_FP32_MAX_N", -1);
  // Largest n for the backend's own blocked Cholesky (blocked_cholesky;
  // cuSOLVER's potrf(Batched) above it): DION_OWN_CHOLESKY_MAX, default
  // kOwnCholeskyMaxN; DION_OWN_CHOLESKY=0 makes it 0 (cuSOLVER's for all).
  int64_t own_cholesky_max_ =
      env_int("DION_OWN_CHOLESKY", 1) != 0 ? env_int("DION_OWN_CHOLESKY_MAX", kOwnCholeskyMaxN) : 0;
  // The triangular inverse by levels where n allows it (tri_inverse_upper);
  // DION_TRI_INVERSE_LEVELS=0 keeps the recursion (for comparisons).
  bool tri_inverse_levels_ = env_int("DION_TRI_INVERSE_LEVELS", 1) != 0;
  // gemm_bf16_lower by blocks (sym_blocks); DION_SYM_PRODUCTS=0 keeps the full products.
  bool sym_products_ = env_int("DION_SYM_PRODUCTS", 1) != 0;
  int64_t sym_grid_ = env_int("DION_SYM_BLOCKS", 0);  // gemm_bf16_lower's nb x nb grid (0: sym_blocks' choice)
  cublasHandle_t blas_ = nullptr;
  cusolverDnHandle_t solver_ = nullptr;
  void* blas_ws_ = nullptr;
  Buffer scratch_[kSlotCount];
  std::map<std::tuple<int, int, int>, int> lwork_;
  // TF32 products through cuBLASLt, and bf16 ones with C apart from D
  // (lt_matmul): its handle, the switches, the plans per product
  cublasLtHandle_t lt_ = nullptr;
  bool lt_lowrank_ = env_int("DION_LT_LOWRANK", 1) != 0;
  // Dion's FP32 error feedback and update as three TF32 products of the
  // factors' split parts, promoted to fp32 (kernels::lowrank_tf32x3) where
  // the device runs it; DION_LOWRANK_3XTF32=0 keeps cuBLAS's SGEMM.
  bool lowrank_tf32x3_ = env_int("DION_LOWRANK_3XTF32", 1) != 0;
  // Its form for P = B Q and R = B^T P at FP32 (gemm_field:
  // kernels::field_tf32x3); DION_FIELD_3XTF32=0 keeps cuBLAS's SGEMM.
  bool field_tf32x3_ = env_int("DION_FIELD_3XTF32", 1) != 0;
  // And for gemm's FP32 products (gemm_x3); DION_GEMM_3XTF32=0 keeps SGEMM.
  bool gemm_tf32x3_ = env_int("DION_GEMM_3XTF32", 1) != 0;
  double gemm_x3_min_flop_ = 1e6 * static_cast<double>(env_int("DION_GEMM_3XTF32_MIN_MFLOP", kGemmX3MinMflop));
  bool lt_gemm_ = env_int("DION_LT_GEMM", 1) != 0;
  std::map<std::array<int64_t, 18>, LtPlan> lt_plans_;
};

}  // namespace

Backend* make_cuda_backend(int device) { return new CudaBackend(device); }

}  // namespace dion

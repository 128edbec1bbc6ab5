// SPDX-License-Identifier: MIT
// Shared testbed of the CUDA-backend suites (tests/gpu/test_cuda_*.cu): GPU
// detection and the skip rule, RAII for device memory, streams, graphs and
// optimizer handles, typed element access, per-dtype ulps, state snapshots and
// error-message assertions. Only the public header dion.h (and the CUDA
// runtime) is used, so these suites test the library as a caller sees it.
// The dtype conversions are the references' (tests/reference/ref_linalg.h,
// which depends on nothing but the standard library).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../reference/ref_linalg.h"
#include "dion.h"
#include "../hash_uniform.h"
#include "../scoped_env.h"

namespace dion_gpu_test {

// ------------------------------------------------------------------ GPU --

inline int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error for later calls
    return 0;
  }
  return n;
}
inline bool have_gpu() { return gpu_count() > 0; }

// Every test starts with this: the GPU suites run (and pass) on machines
// without a CUDA device by skipping.
#define DION_REQUIRE_GPU()                                                      \
  do {                                                                          \
    if (!::dion_gpu_test::have_gpu()) GTEST_SKIP() << "no CUDA device present"; \
  } while (0)

#define CUDA_ASSERT(expr)                                                                                      \
  do {                                                                                                         \
    const cudaError_t _ce = (expr);                                                                            \
    ASSERT_EQ(_ce, cudaSuccess) << #expr << ": " << cudaGetErrorName(_ce) << " - " << cudaGetErrorString(_ce); \
  } while (0)
#define CUDA_EXPECT(expr)                                                                                      \
  do {                                                                                                         \
    const cudaError_t _ce = (expr);                                                                            \
    EXPECT_EQ(_ce, cudaSuccess) << #expr << ": " << cudaGetErrorName(_ce) << " - " << cudaGetErrorString(_ce); \
  } while (0)

// A libdion call that must succeed; the failure message is the library's own.
#define DION_ASSERT_OK(handle, expr)                                                                              \
  do {                                                                                                            \
    const dion_status_t _ds = (expr);                                                                             \
    ASSERT_EQ(_ds, DION_SUCCESS) << #expr << ": " << dion_status_string(_ds) << " - " << dion_last_error(handle); \
  } while (0)
#define DION_EXPECT_OK(handle, expr)                                                                              \
  do {                                                                                                            \
    const dion_status_t _ds = (expr);                                                                             \
    EXPECT_EQ(_ds, DION_SUCCESS) << #expr << ": " << dion_status_string(_ds) << " - " << dion_last_error(handle); \
  } while (0)

// Device memory, freed on destruction. cudaMalloc returns 256-byte aligned
// pointers; tests that need a misaligned pointer offset into one.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { allocate(bytes); }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(p_, o.p_);
      std::swap(bytes_, o.bytes_);
    }
    return *this;
  }
  // At least one byte, so that an empty tensor still has a valid device pointer.
  cudaError_t allocate(size_t bytes) {
    reset();
    bytes_ = bytes;
    return cudaMalloc(&p_, std::max<size_t>(bytes, 1));
  }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return p_; }
  unsigned char* bytes_ptr() const { return static_cast<unsigned char*>(p_); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }
  // Waits for the device afterwards: a cudaMemcpy from pageable memory may
  // return before its DMA has landed, and the steps that read the buffer run
  // on non-blocking streams, which do not wait for the legacy stream.
  cudaError_t upload(const void* host, size_t n) {
    const cudaError_t e = cudaMemcpy(p_, host, n, cudaMemcpyHostToDevice);
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
  }
  cudaError_t upload(const std::vector<unsigned char>& host) { return upload(host.data(), host.size()); }
  cudaError_t download(void* host, size_t n) const { return cudaMemcpy(host, p_, n, cudaMemcpyDeviceToHost); }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> v(bytes_);
    if (bytes_) download(v.data(), bytes_);
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// A non-blocking stream (no implicit synchronisation with the legacy default
// stream, so a library that forgot to use the caller's stream is not rescued
// by the legacy stream's barriers).
class Stream {
 public:
  Stream() { cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }
  // dion_stream_t names the same struct as cudaStream_t.
  dion_stream_t dion() const { return reinterpret_cast<dion_stream_t>(s_); }
  cudaError_t sync() const { return cudaStreamSynchronize(s_); }

 private:
  cudaStream_t s_ = nullptr;
};

// ---------------------------------------------------------------- dtypes --

inline size_t elem_size(dion_dtype_t dt) { return dt == DION_DTYPE_FP32 ? 4 : 2; }
inline const char* dtype_name(dion_dtype_t dt) {
  return dt == DION_DTYPE_FP32 ? "FP32" : dt == DION_DTYPE_BF16 ? "BF16" : dt == DION_DTYPE_FP16 ? "FP16" : "?";
}

inline double load(const unsigned char* buf, dion_dtype_t dt, int64_t i) {
  if (dt == DION_DTYPE_FP32) {
    float f;
    std::memcpy(&f, buf + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, buf + 2 * i, 2);
  return dt == DION_DTYPE_BF16 ? dionref::bf16_bits_to_float(h) : dionref::f16_bits_to_float(h);
}
inline void store(unsigned char* buf, dion_dtype_t dt, int64_t i, double v) {
  const float f = static_cast<float>(v);
  if (dt == DION_DTYPE_FP32) {
    std::memcpy(buf + 4 * i, &f, 4);
    return;
  }
  const uint16_t h = dt == DION_DTYPE_BF16 ? dionref::float_to_bf16_bits(f) : dionref::float_to_f16_bits(f);
  std::memcpy(buf + 2 * i, &h, 2);
}
inline std::vector<double> to_values(const std::vector<unsigned char>& raw, dion_dtype_t dt) {
  std::vector<double> v(raw.size() / elem_size(dt));
  for (size_t i = 0; i < v.size(); ++i) v[i] = load(raw.data(), dt, static_cast<int64_t>(i));
  return v;
}

// Significand bits (implicit bit included) and the smallest positive value
// (the subnormal spacing) of each storage dtype.
inline int significand_bits(dion_dtype_t dt) { return dt == DION_DTYPE_FP32 ? 24 : dt == DION_DTYPE_BF16 ? 8 : 11; }
inline double min_spacing(dion_dtype_t dt) {
  return dt == DION_DTYPE_FP32   ? std::ldexp(1.0, -149)
         : dt == DION_DTYPE_BF16 ? std::ldexp(1.0, -133)
                                 : std::ldexp(1.0, -24);
}
// The spacing of dtype `dt` at |x| (one ulp): |x| in [2^(e-1), 2^e) has
// spacing 2^(e - p), p the significand bits; subnormals have min_spacing.
inline double ulp(dion_dtype_t dt, double x) {
  const double a = std::fabs(x);
  if (!(a > 0) || !std::isfinite(a)) return min_spacing(dt);
  int e = 0;
  std::frexp(a, &e);
  return std::max(std::ldexp(1.0, e - significand_bits(dt)), min_spacing(dt));
}
// The unit roundoff 2^-p of a dtype: rounding to it moves a value by at most
// this much relative.
inline double unit_roundoff(dion_dtype_t dt) { return std::ldexp(1.0, -significand_bits(dt)); }

using ::hash_uniform;  // tests/hash_uniform.h

// `n` elements of dtype `dt`, scale * hash_uniform(seed, i) rounded to dt.
inline std::vector<unsigned char> random_bytes(int64_t n, dion_dtype_t dt, uint64_t seed, double scale) {
  std::vector<unsigned char> v(static_cast<size_t>(n) * elem_size(dt));
  for (int64_t i = 0; i < n; ++i) store(v.data(), dt, i, scale * hash_uniform(seed, static_cast<uint64_t>(i)));
  return v;
}

inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}
inline std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  for (size_t i = 0; i < s.size(); ++i) o << (i ? "x" : "") << s[i];
  if (s.empty()) o << "scalar";
  return o.str();
}
// gtest parameter names must be [A-Za-z0-9_].
inline std::string sanitize(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

inline const char* algo_name(dion_algorithm_t a) {
  switch (a) {
    case DION_ALGO_DION:
      return "Dion";
    case DION_ALGO_DION2:
      return "Dion2";
    case DION_ALGO_MUON:
      return "Muon";
    case DION_ALGO_NORMUON:
      return "NorMuon";
    case DION_ALGO_NORDION2:
      return "NorDion2";
    case DION_ALGO_ADAMW:
      return "AdamW";
    case DION_ALGO_LION:
      return "Lion";
    default:
      return "Unknown";
  }
}

// ------------------------------------------------------------- handles --

inline dion_options_t options(dion_backend_t backend, uint64_t seed = 0, int32_t device = 0) {
  dion_options_t o;
  std::memset(&o, 0, sizeof o);
  dion_options_init(&o);
  o.backend = backend;
  o.device = device;
  o.seed = seed;
  return o;
}

inline dion_group_options_t group_options(dion_algorithm_t a) {
  dion_group_options_t g;
  std::memset(&g, 0, sizeof g);
  dion_group_options_init(&g, a);
  return g;
}

// Owns an optimizer handle; create() reports the library's message on failure.
class Optimizer {
 public:
  Optimizer() = default;
  ~Optimizer() { reset(); }
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  dion_status_t create(const dion_options_t& o) {
    reset();
    const dion_status_t s = dion_create(&h_, &o);
    EXPECT_EQ(s, DION_SUCCESS) << "dion_create (backend " << o.backend << "): " << dion_last_error(nullptr);
    return s;
  }
  void reset() {
    if (h_) EXPECT_EQ(dion_destroy(h_), DION_SUCCESS);
    h_ = nullptr;
  }
  // Gives up ownership (the caller destroys the handle itself).
  dion_optimizer_t release() {
    dion_optimizer_t h = h_;
    h_ = nullptr;
    return h;
  }
  dion_optimizer_t get() const { return h_; }
  operator dion_optimizer_t() const { return h_; }

 private:
  dion_optimizer_t h_ = nullptr;
};

// A tensor descriptor over given buffers.
inline dion_tensor_t descriptor(const char* name, void* param, const void* grad, dion_dtype_t dt,
                                const std::vector<int64_t>& shape, dion_layout_t layout = DION_LAYOUT_ROW_MAJOR) {
  dion_tensor_t t;
  std::memset(&t, 0, sizeof t);
  dion_tensor_init(&t);
  t.name = name;
  t.param = param;
  t.grad = grad;
  t.param_dtype = dt;
  t.grad_dtype = DION_DTYPE_UNSET;
  t.layout = layout;
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t d = 0; d < shape.size() && d < DION_MAX_DIMS; ++d) t.shape[d] = shape[d];
  return t;
}

// A parameter with its gradient in device memory, plus the host copies the
// test fills and reads back. Lives in a std::deque or behind a pointer so the
// device pointers handed to the library stay put.
struct DeviceTensor {
  std::string name;
  dion_dtype_t dtype = DION_DTYPE_FP32;
  dion_layout_t layout = DION_LAYOUT_ROW_MAJOR;
  std::vector<int64_t> shape;
  DeviceBuffer param, grad;

  int64_t numel() const { return dion_gpu_test::numel(shape); }
  size_t bytes() const { return static_cast<size_t>(numel()) * elem_size(dtype); }
  cudaError_t allocate() {
    cudaError_t e = param.allocate(bytes());
    if (e != cudaSuccess) return e;
    return grad.allocate(bytes());
  }
  dion_tensor_t desc() const { return descriptor(name.c_str(), param.get(), grad.get(), dtype, shape, layout); }
};

// ----------------------------------------------------------------- state --

struct StateData {
  dion_state_info_t info{};
  std::string name;
  std::vector<unsigned char> raw;
};

inline dion_state_info_t state_info(dion_optimizer_t opt, int32_t i) {
  dion_state_info_t info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT_EQ(dion_state_info(opt, i, &info), DION_SUCCESS) << dion_last_error(opt);
  return info;
}

// Every state of `opt` in enumeration order, read into host memory. The
// stream is synchronised afterwards as well: the comparisons built on this
// must not depend on whether dion_state_read completes before returning
// (test_cuda_api.cu asserts that separately).
inline std::vector<StateData> read_states(dion_optimizer_t opt, cudaStream_t stream = nullptr) {
  std::vector<StateData> out;
  int32_t n = -1;
  EXPECT_EQ(dion_state_count(opt, &n), DION_SUCCESS) << dion_last_error(opt);
  for (int32_t i = 0; i < n; ++i) {
    StateData s;
    s.info = state_info(opt, i);
    s.name = s.info.name ? s.info.name : "(null)";
    s.raw.assign(static_cast<size_t>(s.info.local_bytes), 0xA5);
    EXPECT_EQ(dion_state_read(opt, i, s.raw.data(), s.raw.size(), reinterpret_cast<dion_stream_t>(stream)),
              DION_SUCCESS)
        << dion_last_error(opt);
    out.push_back(std::move(s));
  }
  if (have_gpu()) cudaStreamSynchronize(stream);
  return out;
}

inline int64_t group_step(dion_optimizer_t opt, int32_t group) {
  int64_t s = -1;
  EXPECT_EQ(dion_group_get_step(opt, group, &s), DION_SUCCESS) << dion_last_error(opt);
  return s;
}

inline ::testing::AssertionResult same_bits(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  size_t first = a.size(), count = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      if (first == a.size()) first = i;
      ++count;
    }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << count << " of " << a.size() << " bytes differ, the first at byte " << first;
}

// Relative Frobenius difference ||a - b|| / ||b|| of two typed buffers (for
// failure messages of bit-exact comparisons).
inline double rel_diff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, dion_dtype_t dt) {
  const std::vector<double> x = to_values(a, dt), y = to_values(b, dt);
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Two optimizers' states agree bit for bit (same enumeration, same bytes).
inline void expect_same_states(const std::vector<StateData>& a, const std::vector<StateData>& b,
                               const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what << ": state counts differ";
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name) << what << ": state " << i;
    EXPECT_EQ(a[i].info.tensor, b[i].info.tensor) << what << ": state " << i;
    EXPECT_TRUE(same_bits(a[i].raw, b[i].raw))
        << what << ": state " << i << " (tensor " << a[i].info.tensor << ", " << a[i].name
        << ") differs; relative difference " << rel_diff(a[i].raw, b[i].raw, a[i].info.dtype);
  }
}

// ---------------------------------------------------------------- errors --

inline std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// `got` is `want`, and dion_last_error(handle) is non-empty and names every
// needle (case-insensitive). The message is read here, after `got`'s call ran.
inline ::testing::AssertionResult is_error(dion_status_t got, dion_status_t want, dion_optimizer_t handle,
                                           const std::vector<std::string>& needles) {
  const char* m = dion_last_error(handle);
  const std::string msg = m ? m : "";
  if (got != want)
    return ::testing::AssertionFailure() << "status " << got << " (" << dion_status_string(got) << "), expected "
                                         << want << " (" << dion_status_string(want) << "); message: \"" << msg << "\"";
  if (msg.empty()) return ::testing::AssertionFailure() << "the error message is empty";
  const std::string lm = lower(msg);
  for (const std::string& n : needles)
    if (lm.find(lower(n)) == std::string::npos)
      return ::testing::AssertionFailure() << "message \"" << msg << "\" does not name \"" << n << "\"";
  return ::testing::AssertionSuccess() << msg;
}

// ---------------------------------------------------------------- banner --

// Each suite binary first prints the library and the device it runs on.
class GpuBanner : public ::testing::Environment {
 public:
  void SetUp() override {
    const int32_t v = dion_version();
    std::printf("libdion %d.%d.%d (header %d.%d.%d, ABI %d), CUDA backend suite\n", v / 10000, v / 100 % 100, v % 100,
                DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH, DION_ABI_VERSION);
    const int n = gpu_count();
    if (n == 0) {
      std::printf("no CUDA device: every test of this suite skips\n");
      return;
    }
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess)
      std::printf("device 0 of %d: %s (sm_%d%d, %d SMs, %.1f GiB)\n", n, p.name, p.major, p.minor,
                  p.multiProcessorCount, static_cast<double>(p.totalGlobalMem) / (1ull << 30));
  }
};
// An inline variable, not one in an unnamed namespace: nvcc's generated
// kernel stubs cannot tell two unnamed namespaces apart once a suite says
// `using namespace dion_gpu_test`.
[[maybe_unused]] inline ::testing::Environment* const g_gpu_banner = ::testing::AddGlobalTestEnvironment(new GpuBanner);

}  // namespace dion_gpu_test

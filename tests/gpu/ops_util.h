// SPDX-License-Identifier: MIT
// Shared testbed of the backend-op suites (tests/gpu/ops_*.cu): each op runs
// on the CUDA backend and on the host backend with the same inputs and the
// results are compared. The suites link the library's sources (dion_internal)
// to reach the Backend classes, and skip themselves without a CUDA device.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "../scoped_env.h"

namespace dion_ops_test {

using namespace dion;

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// A device buffer mirroring a host vector.
template <class T>
class Dev {
 public:
  Dev() = default;
  explicit Dev(size_t n) : n_(n) { cuda_ok(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc"); }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { put(h); }
  ~Dev() {
    if (p_) cudaFree(p_);
  }
  Dev(Dev&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }
  Dev& operator=(Dev&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;

  void put(const std::vector<T>& h) {
    cuda_ok(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  // Waits for the device (the backend runs on the legacy stream) and reads back.
  std::vector<T> get() const {
    std::vector<T> h(n_);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_ok(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return h;
  }
  T* p() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// Padding (the elements between cols and ld, and between matrices) holds this
// value; ops must leave it alone, which the whole-buffer comparisons check.
constexpr float kPad = 777.0f;

// A batch of row-major matrices held twice: `h` for the host backend, `d` for CUDA.
struct Mat {
  int64_t rows = 0, cols = 0, ld = 0, stride = 0, batch = 0;
  std::vector<float> h;
  Dev<float> d;

  Mat() = default;
  Mat(int64_t r, int64_t c, int64_t ld_, int64_t stride_, int64_t b)
      : rows(r), cols(c), ld(ld_), stride(stride_), batch(b),
        h(static_cast<size_t>((stride_ ? stride_ * (b - 1) : 0) + r * ld_ + 1), kPad), d(h.size()) {
    d.put(h);
  }
  // A dense batch with `pad` extra columns per row and `gap` elements between matrices.
  static Mat padded(int64_t r, int64_t c, int64_t b, int64_t pad = 3, int64_t gap = 5) {
    return Mat(r, c, c + pad, r * (c + pad) + gap, b);
  }
  float& at(int64_t b, int64_t i, int64_t j) { return h[static_cast<size_t>(b * stride + i * ld + j)]; }
  template <class G>
  void fill(G gen) {
    for (int64_t b = 0; b < (stride ? batch : 1); ++b)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) at(b, i, j) = gen();
    d.put(h);
  }
  void sync() { d.put(h); }  // after editing h: the device copy follows
  MatBatch H() { return MatBatch{h.data(), rows, cols, ld, stride, batch}; }
  MatBatch D() { return MatBatch{d.p(), rows, cols, ld, stride, batch}; }
  std::vector<float> dev() const { return d.get(); }
};

// A CUDA backend created with one environment variable set (the backend
// reads its switches at creation), the variable restored after.
inline void cuda_backend_with(const char* name, const char* value, std::unique_ptr<Backend>* be) {
  ScopedEnv env(name, value);
  be->reset(make_cuda_backend(0));
}

class OpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device present";
    cuda.reset(make_cuda_backend(0));
    host.reset(make_host_backend());
  }
  float uni(float lo = -1.0f, float hi = 1.0f) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
  float gauss() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }
  std::vector<float> univ(size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = uni(lo, hi);
    return v;
  }

  std::unique_ptr<Backend> cuda, host;
  std::mt19937 rng{20240611u};
};

// |got - want| <= atol + rtol * |want| everywhere (NaN only where want is NaN).
inline ::testing::AssertionResult close(const std::vector<float>& want, const std::vector<float>& got, double rtol,
                                        double atol = 0.0) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << "sizes differ";
  size_t bad = 0, first = 0;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i], g = got[i];
    bool ok;
    if (std::isnan(w) || std::isnan(g))
      ok = std::isnan(w) && std::isnan(g);
    else if (std::isinf(w) || std::isinf(g))
      ok = w == g;
    else
      ok = std::fabs(w - g) <= atol + rtol * std::fabs(w);
    if (!ok) {
      if (!bad) first = i;
      ++bad;
      worst = std::max(worst, std::fabs(w - g));
    }
  }
  if (!bad) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << want.size() << " elements differ; first at " << first
                                       << ": want " << want[first] << ", got " << got[first] << " (worst |diff| "
                                       << worst << ", rtol " << rtol << ", atol " << atol << ")";
}

// Bit-for-bit equality (NaN payloads included).
template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& want, const std::vector<T>& got) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&want[i], &got[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << "element " << i << " differs: want " << +want[i] << ", got " << +got[i];
  return ::testing::AssertionSuccess();
}

inline double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v)
    if (x != kPad) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

}  // namespace dion_ops_test

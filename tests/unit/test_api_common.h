// SPDX-License-Identifier: MIT
// Shared testbed of the API-contract suites (tests/unit/test_api_*.cpp): host
// tensors in any dtype, optimizer RAII, state snapshots and error-message
// assertions. Only the public header is used, so these suites test the
// library exactly as a C caller or a binding sees it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dion.h"
#include "reference/ref_linalg.h"
#include "../hash_uniform.h"

namespace dion_test {

// ---------------------------------------------------------------- dtypes --

inline size_t elem_size(dion_dtype_t dt) { return dt == DION_DTYPE_FP32 ? 4 : 2; }

// The dtype conversions are the references' (tests/reference/ref_linalg.h).
inline uint32_t f2u(float f) { return dionref::float_bits(f); }
inline float u2f(uint32_t u) { return dionref::bits_float(u); }
inline uint16_t to_bf16(float f) { return dionref::float_to_bf16_bits(f); }
inline float from_bf16(uint16_t h) { return dionref::bf16_bits_to_float(h); }
inline uint16_t to_fp16(float f) { return dionref::float_to_f16_bits(f); }
inline float from_fp16(uint16_t h) { return dionref::f16_bits_to_float(h); }

inline float load(const std::vector<unsigned char>& buf, dion_dtype_t dt, int64_t i) {
  if (dt == DION_DTYPE_FP32) {
    float f;
    std::memcpy(&f, buf.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, buf.data() + 2 * i, 2);
  return dt == DION_DTYPE_BF16 ? from_bf16(h) : from_fp16(h);
}
inline void store(std::vector<unsigned char>& buf, dion_dtype_t dt, int64_t i, float v) {
  if (dt == DION_DTYPE_FP32) {
    std::memcpy(buf.data() + 4 * i, &v, 4);
  } else {
    uint16_t h = dt == DION_DTYPE_BF16 ? to_bf16(v) : to_fp16(v);
    std::memcpy(buf.data() + 2 * i, &h, 2);
  }
}

using ::hash_uniform;  // tests/hash_uniform.h

inline const char* algo_name(dion_algorithm_t a) {
  switch (a) {
    case DION_ALGO_DION: return "Dion";
    case DION_ALGO_DION2: return "Dion2";
    case DION_ALGO_MUON: return "Muon";
    case DION_ALGO_NORMUON: return "NorMuon";
    case DION_ALGO_NORDION2: return "NorDion2";
    case DION_ALGO_ADAMW: return "AdamW";
    case DION_ALGO_LION: return "Lion";
    default: return "Unknown";
  }
}
inline bool is_matrix_algo(dion_algorithm_t a) { return a != DION_ALGO_ADAMW && a != DION_ALGO_LION; }

inline const std::vector<dion_algorithm_t>& all_algorithms() {
  static const std::vector<dion_algorithm_t> v = {DION_ALGO_DION,     DION_ALGO_DION2, DION_ALGO_MUON, DION_ALGO_NORMUON,
                                                  DION_ALGO_NORDION2, DION_ALGO_ADAMW, DION_ALGO_LION};
  return v;
}

// ---------------------------------------------------------------- tensors --

// One parameter with its gradient, owned by the test. Buffers never move once
// created (Tensors live in a std::deque), so descriptors stay valid.
struct Tensor {
  std::string name;
  dion_dtype_t dtype = DION_DTYPE_FP32;
  dion_dtype_t grad_dtype = DION_DTYPE_UNSET;  // UNSET: same as dtype
  dion_layout_t layout = DION_LAYOUT_ROW_MAJOR;
  std::vector<int64_t> shape;
  std::vector<unsigned char> param, grad;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * elem_size(dtype); }
  dion_dtype_t gdtype() const { return grad_dtype == DION_DTYPE_UNSET ? dtype : grad_dtype; }
  size_t grad_bytes() const { return static_cast<size_t>(numel()) * elem_size(gdtype()); }
  void fill_param(uint64_t seed, float scale = 0.5f) {
    for (int64_t i = 0; i < numel(); ++i) store(param, dtype, i, scale * hash_uniform(seed, static_cast<uint64_t>(i)));
  }
  void fill_grad(uint64_t seed, float scale = 1.0f) {
    for (int64_t i = 0; i < numel(); ++i) store(grad, gdtype(), i, scale * hash_uniform(seed, static_cast<uint64_t>(i)));
  }
  dion_tensor_t desc() const {
    dion_tensor_t t;
    std::memset(&t, 0, sizeof t);
    EXPECT_EQ(dion_tensor_init(&t), DION_SUCCESS);
    t.name = name.c_str();
    t.param = const_cast<unsigned char*>(param.data());
    t.grad = grad.data();
    t.param_dtype = dtype;
    t.grad_dtype = grad_dtype;
    t.layout = layout;
    t.ndim = static_cast<int32_t>(shape.size());
    for (size_t d = 0; d < shape.size() && d < DION_MAX_DIMS; ++d) t.shape[d] = shape[d];
    return t;
  }
};

// A set of tensors and groups that can be turned into an optimizer, any
// number of times (identical optimizers for A/B comparisons).
struct Model {
  std::deque<Tensor> tensors;
  struct Group {
    dion_group_options_t opts;
    std::vector<int> members;
  };
  std::vector<Group> groups;

  Tensor& add_tensor(const std::string& name, dion_dtype_t dt, std::vector<int64_t> shape, uint64_t seed = 1,
                     dion_dtype_t grad_dt = DION_DTYPE_UNSET) {
    tensors.emplace_back();
    Tensor& t = tensors.back();
    t.name = name;
    t.dtype = dt;
    t.grad_dtype = grad_dt;
    t.shape = std::move(shape);
    t.param.assign(t.bytes(), 0);
    t.grad.assign(t.grad_bytes(), 0);
    t.fill_param(seed * 7919 + tensors.size());
    t.fill_grad(seed * 104729 + tensors.size());
    return t;
  }
  int add_group(const dion_group_options_t& o, std::vector<int> members) {
    groups.push_back({o, std::move(members)});
    return static_cast<int>(groups.size()) - 1;
  }
  // A copy whose buffers are fresh copies of these (params, grads).
  Model clone() const {
    Model m;
    m.tensors = tensors;
    m.groups = groups;
    return m;
  }
  // New gradients for every tensor, a pure function of (seed, step, tensor).
  void new_grads(uint64_t seed, int step) {
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].fill_grad(seed * 1000003ull + step * 1009ull + i);
  }
  std::vector<std::vector<unsigned char>> params() const {
    std::vector<std::vector<unsigned char>> v;
    for (const Tensor& t : tensors) v.push_back(t.param);
    return v;
  }
};

inline dion_group_options_t group_opts(dion_algorithm_t a) {
  dion_group_options_t o;
  std::memset(&o, 0, sizeof o);
  EXPECT_EQ(dion_group_options_init(&o, a), DION_SUCCESS);
  return o;
}

inline dion_options_t default_options() {
  dion_options_t o;
  std::memset(&o, 0, sizeof o);
  EXPECT_EQ(dion_options_init(&o), DION_SUCCESS);
  return o;
}

// Owns an optimizer handle.
class Optimizer {
 public:
  Optimizer() = default;
  explicit Optimizer(const dion_options_t* o) { create(o); }
  ~Optimizer() { reset(); }
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  dion_status_t create(const dion_options_t* o) {
    reset();
    dion_status_t s = dion_create(&h_, o);
    EXPECT_EQ(s, DION_SUCCESS) << dion_last_error(nullptr);
    return s;
  }
  void reset() {
    if (h_) {
      EXPECT_EQ(dion_destroy(h_), DION_SUCCESS);
    }
    h_ = nullptr;
  }
  dion_optimizer_t get() const { return h_; }
  operator dion_optimizer_t() const { return h_; }

 private:
  dion_optimizer_t h_ = nullptr;
};

inline dion_status_t add_group(dion_optimizer_t opt, const dion_group_options_t& o, const std::vector<Tensor*>& ts,
                               int32_t* index = nullptr) {
  std::vector<dion_tensor_t> d;
  for (Tensor* t : ts) d.push_back(t->desc());
  return dion_add_group(opt, &o, d.empty() ? nullptr : d.data(), d.size(), index);
}

// Adds every group of `m` to `opt` (which must be empty); true on success.
inline bool build(dion_optimizer_t opt, Model& m) {
  for (size_t g = 0; g < m.groups.size(); ++g) {
    std::vector<Tensor*> ts;
    for (int i : m.groups[g].members) ts.push_back(&m.tensors[static_cast<size_t>(i)]);
    int32_t gi = -1;
    dion_status_t s = add_group(opt, m.groups[g].opts, ts, &gi);
    EXPECT_EQ(s, DION_SUCCESS) << "group " << g << ": " << dion_last_error(opt);
    if (s != DION_SUCCESS) return false;
    EXPECT_EQ(gi, static_cast<int32_t>(g));
  }
  return true;
}

inline dion_status_t step(dion_optimizer_t opt) {
  dion_status_t s = dion_step(opt, nullptr);
  EXPECT_EQ(s, DION_SUCCESS) << dion_last_error(opt);
  return s;
}

// ---------------------------------------------------------------- states --

struct StateEntry {
  dion_state_info_t info;
  std::string name;
  std::vector<unsigned char> data;
};

inline dion_state_info_t state_info(dion_optimizer_t opt, int32_t i) {
  dion_state_info_t info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT_EQ(dion_state_info(opt, i, &info), DION_SUCCESS) << dion_last_error(opt);
  return info;
}

inline std::vector<StateEntry> read_states(dion_optimizer_t opt) {
  std::vector<StateEntry> out;
  int32_t n = -1;
  EXPECT_EQ(dion_state_count(opt, &n), DION_SUCCESS) << dion_last_error(opt);
  for (int32_t i = 0; i < n; ++i) {
    StateEntry e;
    e.info = state_info(opt, i);
    e.name = e.info.name ? e.info.name : "(null)";
    e.data.assign(static_cast<size_t>(e.info.local_bytes), 0xA5);
    EXPECT_EQ(dion_state_read(opt, i, e.data.data(), e.data.size(), nullptr), DION_SUCCESS) << dion_last_error(opt);
    out.push_back(std::move(e));
  }
  return out;
}

inline int32_t find_state(dion_optimizer_t opt, int32_t tensor, const char* name) {
  int32_t idx = -1;
  EXPECT_EQ(dion_state_find(opt, tensor, name, &idx), DION_SUCCESS) << dion_last_error(opt);
  return idx;
}

// Everything observable about an optimizer and its tensors, to show that a
// failed call changed nothing.
struct Snapshot {
  std::vector<std::vector<unsigned char>> params;
  std::vector<StateEntry> states;
  int32_t groups = -1, tensors = -1;
  std::vector<int64_t> steps;
  std::vector<std::array<double, 8>> hparams;
};

inline Snapshot snapshot(dion_optimizer_t opt, const Model& m) {
  Snapshot s;
  s.params = m.params();
  s.states = read_states(opt);
  EXPECT_EQ(dion_group_count(opt, &s.groups), DION_SUCCESS);
  EXPECT_EQ(dion_tensor_count(opt, &s.tensors), DION_SUCCESS);
  for (int32_t g = 0; g < s.groups; ++g) {
    int64_t st = -1;
    EXPECT_EQ(dion_group_get_step(opt, g, &st), DION_SUCCESS);
    s.steps.push_back(st);
    std::array<double, 8> hp;
    for (int h = 0; h < 8; ++h) {
      hp[h] = -12345.0;
      dion_group_get_hparam(opt, g, h, &hp[h]);
    }
    s.hparams.push_back(hp);
  }
  return s;
}

inline ::testing::AssertionResult same_bits(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return ::testing::AssertionFailure() << "first differing byte at " << i;
  return ::testing::AssertionSuccess();
}

inline void expect_same_states(const std::vector<StateEntry>& a, const std::vector<StateEntry>& b,
                               const char* what = "") {
  ASSERT_EQ(a.size(), b.size()) << what << ": state count changed";
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name) << what << " state " << i;
    EXPECT_EQ(a[i].info.tensor, b[i].info.tensor) << what << " state " << i;
    EXPECT_TRUE(same_bits(a[i].data, b[i].data))
        << what << ": state " << i << " (tensor " << a[i].info.tensor << ", " << a[i].name << ") differs";
  }
}

inline void expect_unchanged(const Snapshot& a, const Snapshot& b, const std::string& what) {
  EXPECT_EQ(a.groups, b.groups) << what << ": group count changed";
  EXPECT_EQ(a.tensors, b.tensors) << what << ": tensor count changed";
  EXPECT_EQ(a.steps, b.steps) << what << ": group steps changed";
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(same_bits(a.params[i], b.params[i])) << what << ": param of tensor " << i << " changed";
  expect_same_states(a.states, b.states, what.c_str());
  ASSERT_EQ(a.hparams.size(), b.hparams.size());
  for (size_t g = 0; g < a.hparams.size(); ++g)
    for (int h = 0; h < 8; ++h)
      EXPECT_EQ(0, std::memcmp(&a.hparams[g][h], &b.hparams[g][h], sizeof(double)))
          << what << ": hparam " << h << " of group " << g << " changed";
}

// ---------------------------------------------------------------- errors --

inline std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// `got` is `want` and `msg` is non-empty and contains every needle
// (case-insensitive).
inline ::testing::AssertionResult is_error_msg(dion_status_t got, dion_status_t want, const char* msg,
                                               const std::vector<std::string>& needles) {
  if (got != want)
    return ::testing::AssertionFailure() << "status " << got << " (" << dion_status_string(got) << "), expected "
                                         << want << " (" << dion_status_string(want) << "); message: \""
                                         << (msg ? msg : "(null)") << "\"";
  if (msg == nullptr) return ::testing::AssertionFailure() << "message is NULL";
  if (msg[0] == '\0') return ::testing::AssertionFailure() << "message is empty";
  std::string m = lower(msg);
  for (const std::string& n : needles)
    if (m.find(lower(n)) == std::string::npos)
      return ::testing::AssertionFailure() << "message \"" << msg << "\" does not name \"" << n << "\"";
  // DION_TEST_SHOW_MESSAGES=1 prints every checked message, to review their wording.
  if (std::getenv("DION_TEST_SHOW_MESSAGES")) std::printf("    [message] %s\n", msg);
  return ::testing::AssertionSuccess() << msg;
}

// The same, reading dion_last_error(handle) (NULL: the thread's). The message
// is read here, in the body, so after `got`'s call has run: function arguments
// are evaluated in an unspecified order, and the pointer dion_last_error
// returns dies at the next call on the handle.
inline ::testing::AssertionResult is_error(dion_status_t got, dion_status_t want, dion_optimizer_t handle,
                                           const std::vector<std::string>& needles) {
  const char* m = dion_last_error(handle);
  const std::string msg = m ? m : "(null)";
  return is_error_msg(got, want, m ? msg.c_str() : nullptr, needles);
}

// Like is_error, accepting any of several statuses.
inline ::testing::AssertionResult is_error_any(dion_status_t got, std::initializer_list<dion_status_t> want,
                                               dion_optimizer_t handle, const std::vector<std::string>& needles) {
  const char* m = dion_last_error(handle);
  const std::string msg = m ? m : "(null)";
  for (dion_status_t w : want)
    if (got == w) return is_error_msg(got, w, m ? msg.c_str() : nullptr, needles);
  std::ostringstream os;
  for (dion_status_t w : want) os << w << " ";
  return ::testing::AssertionFailure() << "status " << got << " (" << dion_status_string(got) << "), expected one of "
                                       << os.str() << "; message: \"" << msg << "\"";
}

// Each suite binary first prints the library it runs against (STYLE.md §D.18).
class VersionBanner : public ::testing::Environment {
 public:
  void SetUp() override {
    const int32_t v = dion_version();
    std::printf("libdion %d.%d.%d (header %d.%d.%d, ABI %d), host backend\n", v / 10000, v / 100 % 100, v % 100,
                DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH, DION_ABI_VERSION);
  }
};
namespace {
[[maybe_unused]] ::testing::Environment* const g_version_banner =
    ::testing::AddGlobalTestEnvironment(new VersionBanner);
}  // namespace

}  // namespace dion_test

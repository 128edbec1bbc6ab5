// SPDX-License-Identifier: MIT
//
// tests/reference/algorithm_testbed.h — the testbed of the algorithm suites
// (tests/unit/test_algorithms_*.cpp): it drives libdion's HOST backend through
// the public C API and the float64 references of reference.h side by side, and
// compares parameters and every named state after each step.
//
// Tolerance policy (STYLE.md §D.15). Each quantity is compared by a relative
// Frobenius error; for the parameter it is the error of the CHANGE X_t - X_0,
// which is what the algorithm computes (X_0 itself would hide a wrong update
// behind its own size). The bound is
//
//     tol = max(floor, kNaiveFactor * naive)
//
// where `naive` is the error of the very same reference run with T = float
// (and the same storage rounding) against the T = double run on the same
// inputs: the error a straightforward fp32 implementation actually makes on
// this input. kNaiveFactor = 10 leaves room for a different but equally sound
// fp32 evaluation order (BLAS blocking, RCQR instead of Householder, a fused
// kernel); the floor keeps cases whose naive error happens to be tiny from
// demanding more than fp32 can promise. The floors are chosen per algorithm
// family and dtype in default_tolerance() (refined for Polar Express on rank-1
// inputs in case_tolerance()) with the argument written there.
//
// DION_ALGO_TEST_VERBOSE=1 prints every comparison: error, naive error, bound.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dion.h"
#include "reference/reference.h"

namespace dion_algo_test {

using dionref::AdjustLr;
using dionref::Algo;
using dionref::Dtype;
using dionref::Dtypes;
using dionref::Hyper;
using dionref::Matrix;
using dionref::Ortho;

// ---------------------------------------------------------------------------
// Enum translation (reference <-> C API)
// ---------------------------------------------------------------------------

inline dion_dtype_t lib_dtype(Dtype d) {
  switch (d) {
    case Dtype::kF32:
      return DION_DTYPE_FP32;
    case Dtype::kBF16:
      return DION_DTYPE_BF16;
    case Dtype::kF16:
      return DION_DTYPE_FP16;
  }
  return DION_DTYPE_FP32;
}
inline Dtype ref_dtype(dion_dtype_t d) {
  return d == DION_DTYPE_BF16 ? Dtype::kBF16 : d == DION_DTYPE_FP16 ? Dtype::kF16 : Dtype::kF32;
}
inline dion_algorithm_t lib_algo(Algo a) {
  switch (a) {
    case Algo::kDion:
      return DION_ALGO_DION;
    case Algo::kDion2:
      return DION_ALGO_DION2;
    case Algo::kMuon:
      return DION_ALGO_MUON;
    case Algo::kNorMuon:
      return DION_ALGO_NORMUON;
    case Algo::kNorDion2:
      return DION_ALGO_NORDION2;
    case Algo::kAdamW:
      return DION_ALGO_ADAMW;
    case Algo::kLion:
      return DION_ALGO_LION;
  }
  return DION_ALGO_MUON;
}

// Options that choose HOW the library computes (not WHAT): the reference has no
// counterpart, and the result must not depend on them beyond rounding.
struct LibKnobs {
  dion_qr_method_t qr_method = DION_QR_RCQR;
  int32_t cqr_warmup_steps = 150;
  double oversample = 1.25;
  dion_dtype_t momentum_dtype = DION_DTYPE_UNSET;
  dion_dtype_t q_dtype = DION_DTYPE_UNSET;
  dion_dtype_t variance_dtype = DION_DTYPE_UNSET;
  dion_matmul_precision_t matmul_precision = DION_MATMUL_FP32;  // all the same on the host
};

// Group options with every mathematical field set from `h` (nothing is left to
// the library's defaults, so a default that drifts cannot hide here).
inline dion_group_options_t make_group_options(Algo algo, const Hyper& h, const LibKnobs& k = LibKnobs()) {
  dion_group_options_t g;
  dion_group_options_init(&g, lib_algo(algo));
  g.lr = h.lr;
  g.weight_decay = h.weight_decay;
  g.mu = h.mu;
  g.beta1 = h.beta1;
  g.beta2 = h.beta2;
  g.epsilon = h.epsilon;
  g.rank_fraction = h.rank_fraction;
  g.rank_multiple_of = h.rank_multiple_of;
  g.power_iters = h.power_iters;
  g.qr_method = k.qr_method;
  g.cqr_warmup_steps = k.cqr_warmup_steps;
  g.oversample = k.oversample;
  g.orthogonalizer = h.ortho == Ortho::kPolarExpress ? DION_ORTHO_POLAR_EXPRESS : DION_ORTHO_NEWTON_SCHULZ;
  g.ortho_steps = h.ortho_steps;
  g.nesterov = h.nesterov ? 1 : 0;
  g.adjust_lr = h.adjust_lr == AdjustLr::kSpectralNorm ? DION_ADJUST_LR_SPECTRAL_NORM
                : h.adjust_lr == AdjustLr::kRmsNorm    ? DION_ADJUST_LR_RMS_NORM
                                                       : DION_ADJUST_LR_NONE;
  g.cautious_wd = h.cautious_wd ? 1 : 0;
  g.fraction = h.fraction;
  g.ef_decay = h.ef_decay;
  g.muon_beta2 = h.muon_beta2;
  g.flatten = h.flatten ? 1 : 0;
  g.momentum_dtype = k.momentum_dtype;
  g.q_dtype = k.q_dtype;
  g.variance_dtype = k.variance_dtype;
  g.matmul_precision = k.matmul_precision;
  return g;
}

// Storage dtypes the library will use for a parameter of dtype `param`.
inline Dtypes resolve_dtypes(Dtype param, const LibKnobs& k) {
  Dtypes d = Dtypes::all(param);
  if (k.momentum_dtype != DION_DTYPE_UNSET) d.momentum = ref_dtype(k.momentum_dtype);
  if (k.q_dtype != DION_DTYPE_UNSET) d.q = ref_dtype(k.q_dtype);
  if (k.variance_dtype != DION_DTYPE_UNSET) d.variance = ref_dtype(k.variance_dtype);
  return d;
}

// ---------------------------------------------------------------------------
// Raw element access in any dtype
// ---------------------------------------------------------------------------

inline double load_elem(const unsigned char* base, Dtype d, int64_t i) {
  if (d == Dtype::kF32) {
    float f;
    std::memcpy(&f, base + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, base + 2 * i, 2);
  return d == Dtype::kBF16 ? dionref::bf16_bits_to_float(h) : dionref::f16_bits_to_float(h);
}
inline void store_elem(unsigned char* base, Dtype d, int64_t i, double v) {
  const float f = static_cast<float>(v);
  if (d == Dtype::kF32) {
    std::memcpy(base + 4 * i, &f, 4);
    return;
  }
  const uint16_t h = d == Dtype::kBF16 ? dionref::float_to_bf16_bits(f) : dionref::float_to_f16_bits(f);
  std::memcpy(base + 2 * i, &h, 2);
}

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  for (size_t i = 0; i < s.size(); ++i) o << (i ? "x" : "") << s[i];
  if (s.empty()) o << "scalar";
  return o.str();
}

// ---------------------------------------------------------------------------
// A parameter with its gradient, in host memory, in row- or column-major order
// ---------------------------------------------------------------------------

// Values cross this class in LOGICAL row-major order; for DION_LAYOUT_COL_MAJOR
// (2-D only) the buffers hold the same matrix column-major.
class HostTensor {
 public:
  // `grad_dtype` defaults to the parameter dtype.
  HostTensor(std::vector<int64_t> shape, Dtype dtype, dion_layout_t layout = DION_LAYOUT_ROW_MAJOR)
      : HostTensor(std::move(shape), dtype, layout, dtype) {}
  HostTensor(std::vector<int64_t> shape, Dtype dtype, dion_layout_t layout, Dtype grad_dtype)
      : shape_(std::move(shape)),
        dtype_(dtype),
        grad_dtype_(grad_dtype),
        layout_(layout),
        n_(dionref::numel(shape_)),
        param_(static_cast<size_t>(n_) * dionref::dtype_size(dtype)),
        grad_(static_cast<size_t>(n_) * dionref::dtype_size(grad_dtype)) {}

  HostTensor(const HostTensor&) = delete;  // the library keeps pointers into the buffers
  HostTensor& operator=(const HostTensor&) = delete;

  const std::vector<int64_t>& shape() const { return shape_; }
  Dtype dtype() const { return dtype_; }
  int64_t numel() const { return n_; }

  Dtype grad_dtype() const { return grad_dtype_; }

  void set_param(const std::vector<double>& logical) { put(param_, dtype_, logical); }
  void set_grad(const std::vector<double>& logical) { put(grad_, grad_dtype_, logical); }
  std::vector<double> param() const { return get(param_, dtype_); }
  // Overwrites one logical gradient element (NaN / Inf injection).
  void poke_grad(int64_t logical_index, double v) {
    store_elem(grad_.data(), grad_dtype_, storage_index(logical_index), v);
  }
  const std::vector<unsigned char>& param_bytes() const { return param_; }

  dion_tensor_t descriptor(bool with_grad = true) const {
    dion_tensor_t t;
    dion_tensor_init(&t);
    t.name = "algorithm_test_tensor";
    t.param = const_cast<unsigned char*>(param_.data());
    t.grad = with_grad ? grad_.data() : nullptr;
    t.param_dtype = lib_dtype(dtype_);
    t.grad_dtype = lib_dtype(grad_dtype_);
    t.layout = layout_;
    t.ndim = static_cast<int32_t>(shape_.size());
    for (size_t i = 0; i < shape_.size(); ++i) t.shape[i] = shape_[i];
    return t;
  }

 private:
  int64_t storage_index(int64_t logical) const {
    if (layout_ != DION_LAYOUT_COL_MAJOR) return logical;
    const int64_t rows = shape_[0], cols = shape_[1];
    return (logical % cols) * rows + logical / cols;
  }
  void put(std::vector<unsigned char>& buf, Dtype d, const std::vector<double>& logical) {
    for (int64_t i = 0; i < n_; ++i) store_elem(buf.data(), d, storage_index(i), logical[static_cast<size_t>(i)]);
  }
  std::vector<double> get(const std::vector<unsigned char>& buf, Dtype d) const {
    std::vector<double> out(static_cast<size_t>(n_));
    for (int64_t i = 0; i < n_; ++i) out[static_cast<size_t>(i)] = load_elem(buf.data(), d, storage_index(i));
    return out;
  }

  std::vector<int64_t> shape_;
  Dtype dtype_;
  Dtype grad_dtype_;
  dion_layout_t layout_;
  int64_t n_;
  std::vector<unsigned char> param_;
  std::vector<unsigned char> grad_;
};

// ---------------------------------------------------------------------------
// The optimizer handle
// ---------------------------------------------------------------------------

// One state buffer as read back: values in logical row-major order.
struct StateBuffer {
  dion_state_info_t info{};
  std::vector<int64_t> shape;  // global shape
  std::vector<double> values;
};

class LibOptimizer {
 public:
  explicit LibOptimizer(uint64_t seed = 0, int32_t skip_nonfinite = 1) {
    dion_options_t o;
    dion_options_init(&o);
    o.backend = DION_BACKEND_HOST;
    o.seed = seed;
    o.skip_nonfinite = skip_nonfinite;
    status_ = dion_create(&h_, &o);
    if (status_ != DION_SUCCESS) create_error_ = dion_last_error(nullptr);
  }
  ~LibOptimizer() { dion_destroy(h_); }
  LibOptimizer(const LibOptimizer&) = delete;
  LibOptimizer& operator=(const LibOptimizer&) = delete;

  dion_optimizer_t get() const { return h_; }
  dion_status_t create_status() const { return status_; }
  std::string create_error() const { return create_error_; }
  std::string error() const { return dion_last_error(h_); }

  dion_status_t add_group(const dion_group_options_t& g, const std::vector<const HostTensor*>& tensors,
                          int32_t* group_index, const std::vector<bool>& with_grad = {}) {
    std::vector<dion_tensor_t> descs;
    for (size_t i = 0; i < tensors.size(); ++i)
      descs.push_back(tensors[i]->descriptor(with_grad.empty() ? true : static_cast<bool>(with_grad[i])));
    return dion_add_group(h_, &g, descs.data(), descs.size(), group_index);
  }

  dion_status_t step() { return dion_step(h_, nullptr); }

  dion_status_t read_state(int32_t tensor, const char* name, StateBuffer* out) const {
    int32_t idx = -1;
    dion_status_t st = dion_state_find(h_, tensor, name, &idx);
    if (st != DION_SUCCESS) return st;
    out->info = dion_state_info_t{};
    out->info.struct_size = sizeof(dion_state_info_t);
    st = dion_state_info(h_, idx, &out->info);
    if (st != DION_SUCCESS) return st;
    const dion_state_info_t& in = out->info;
    out->shape.assign(in.global_shape, in.global_shape + in.ndim);
    std::vector<unsigned char> raw(static_cast<size_t>(in.local_bytes));
    st = dion_state_read(h_, idx, raw.data(), in.local_bytes, nullptr);
    if (st != DION_SUCCESS) return st;
    const Dtype d = ref_dtype(in.dtype);
    int64_t n = 1;
    for (int32_t i = 0; i < in.ndim; ++i) n *= in.local_shape[i];
    out->values.resize(static_cast<size_t>(n));
    const bool col_major = in.layout == DION_LAYOUT_COL_MAJOR && in.ndim == 2;
    for (int64_t i = 0; i < n; ++i) {
      int64_t src = i;
      if (col_major) {
        const int64_t rows = in.local_shape[0], cols = in.local_shape[1];
        src = (i % cols) * rows + i / cols;
      }
      out->values[static_cast<size_t>(i)] = load_elem(raw.data(), d, src);
    }
    return DION_SUCCESS;
  }

  int64_t group_step(int32_t group) const {
    int64_t s = -1;
    dion_group_get_step(h_, group, &s);
    return s;
  }
  void skipped(int64_t* skipped, int32_t* last) const { dion_get_skipped_steps(h_, skipped, last, nullptr); }

 private:
  dion_optimizer_t h_ = nullptr;
  dion_status_t status_ = DION_SUCCESS;
  std::string create_error_;
};

// gtest helpers: fail with the library's own message.
#define DION_EXPECT_OK(opt, expr)                                                                       \
  do {                                                                                                  \
    const dion_status_t _st = (expr);                                                                   \
    EXPECT_EQ(_st, DION_SUCCESS) << #expr << ": " << dion_status_string(_st) << " — " << (opt).error(); \
  } while (0)
#define DION_ASSERT_OK(opt, expr)                                                                       \
  do {                                                                                                  \
    const dion_status_t _st = (expr);                                                                   \
    ASSERT_EQ(_st, DION_SUCCESS) << #expr << ": " << dion_status_string(_st) << " — " << (opt).error(); \
  } while (0)

// ---------------------------------------------------------------------------
// Random inputs and comparisons
// ---------------------------------------------------------------------------

// Fixed-seed Gaussian data, rounded to `d` (so library and reference see the
// same values).
inline std::vector<double> randn(std::mt19937_64& rng, int64_t n, double scale, Dtype d) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = dionref::round_to(d, scale * nd(rng));
  return v;
}

// ||a - b||_F / ||b||_F (absolute when b == 0).
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Error of the change: ||(a - x0) - (b - x0)|| / ||b - x0||.
inline double rel_change_error(const std::vector<double>& a, const std::vector<double>& b,
                               const std::vector<double>& x0) {
  std::vector<double> da(a.size()), db(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    da[i] = a[i] - x0[i];
    db[i] = b[i] - x0[i];
  }
  return rel_error(da, db);
}

// The columns of `a` (rows x cols, row-major) flipped to agree in sign with `ref`
// (Dion's Q is defined up to column signs, spec §1.3).
inline std::vector<double> align_column_signs(const std::vector<double>& a, const std::vector<double>& ref,
                                              int64_t rows, int64_t cols) {
  std::vector<double> out = a;
  for (int64_t j = 0; j < cols; ++j) {
    double dot = 0;
    for (int64_t i = 0; i < rows; ++i)
      dot += a[static_cast<size_t>(i * cols + j)] * ref[static_cast<size_t>(i * cols + j)];
    if (dot < 0)
      for (int64_t i = 0; i < rows; ++i)
        out[static_cast<size_t>(i * cols + j)] = -out[static_cast<size_t>(i * cols + j)];
  }
  return out;
}

// The largest element-wise differences, for failure messages (STYLE.md §D.15).
inline std::string worst_elements(const std::vector<double>& got, const std::vector<double>& want, size_t count = 5) {
  std::vector<size_t> idx(got.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  auto diff = [&](size_t i) {
    const double d = std::abs(got[i] - want[i]);
    return std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
  };
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(std::min(count, idx.size())), idx.end(),
                    [&](size_t a, size_t b) { return diff(a) > diff(b); });
  std::ostringstream o;
  o.precision(9);
  o << "worst elements (flat index: got vs want):";
  for (size_t k = 0; k < std::min(count, idx.size()); ++k)
    o << " [" << idx[k] << "] " << got[idx[k]] << " vs " << want[idx[k]] << ";";
  return o.str();
}

// ---------------------------------------------------------------------------
// Tolerances
// ---------------------------------------------------------------------------

struct Tolerance {
  double floor;
  double factor;
  double bound(double naive) const { return std::max(floor, factor * naive); }
};

constexpr double kNaiveFactor = 10.0;

// Floors, per algorithm family and parameter dtype (see the file comment for
// how they combine with the measured naive-fp32 error).
//  * fp32, element-wise (AdamW, Lion): a handful of fp32 roundings per element
//    per step, each <= 6e-8 relative; over 5 steps the relative error of the
//    change stays ~1e-6 (measured naive: 3e-7..8e-7), so 5e-6.
//  * fp32, orthogonalizing (Dion, Muon family): every entry of the update is a
//    sum of O(n) products, repeated through 5 polynomial steps (PE/NS) or a QR
//    whose sensitivity is the condition number of P = B Q (random Q is
//    Gaussian, cond ~ 10..100); measured naive errors are 6e-7..2e-5 on the
//    suite's shapes. Floor 5e-5: far below any algorithmic mistake (a wrong
//    coefficient, eps placement, transposition or sign moves the update by
//    >= 1e-3 relative). Polar Express on rank-1 inputs: see case_tolerance().
//  * bf16: X and the states are stored with 8 significant bits (relative
//    spacing 2^-8 = 3.9e-3). The reference rounds at the same places, so most
//    stored values agree bit for bit, but wherever the library's fp32 value and
//    the fp64 value straddle a rounding boundary they differ by one bf16 ulp.
//    The measured naive errors reach 1.7e-3; 1e-2 is the bf16 level and still
//    10-100x below a wrong update.
//  * fp16 (11 bits): 2e-3 by the same argument.
inline Tolerance default_tolerance(Algo algo, Dtype dtype) {
  switch (dtype) {
    case Dtype::kBF16:
      return {1e-2, kNaiveFactor};
    case Dtype::kF16:
      return {2e-3, kNaiveFactor};
    case Dtype::kF32:
      break;
  }
  return dionref::is_matrix_algo(algo) ? Tolerance{5e-5, kNaiveFactor} : Tolerance{5e-6, kNaiveFactor};
}

// Does some matrix that the Muon-family orthogonalizer sees have a side of 1
// (a rank-1 input)?
inline bool orthogonalizes_rank1(Algo algo, const Hyper& h, const std::vector<int64_t>& shape) {
  if (algo != Algo::kMuon && algo != Algo::kNorMuon && algo != Algo::kDion2 && algo != Algo::kNorDion2) return false;
  const dionref::MatrixView mv = dionref::matrix_view(shape, h.flatten);
  if (std::min(mv.rows, mv.cols) == 1) return true;
  if (algo == Algo::kMuon || algo == Algo::kNorMuon) return false;
  const bool rows = algo == Algo::kNorDion2 || mv.rows <= mv.cols;
  return dionref::dion2_k(h.fraction, rows ? mv.rows : mv.cols) == 1;
}

// Polar Express on a rank-1 input. The normalised singular value is then
// sigma = 1/1.02 (all the energy is in one direction), which is where the
// composition of the 5 PE polynomials has its worst relative condition number:
// d log p(sigma) / d log sigma = -175 (max 212 at sigma = 0.980; quintic NS
// stays below 7 everywhere, and PE's slope at sigma <= 0.5 is below 17). A
// few fp32 ulps (6e-8 each) in the normalisation thus move the update by
// ~1e-5..5e-5 relative and variance_neuron (a mean of squares) by twice that
// (the library measured 4.5e-5 on 1x5). Floor 2e-4 for those cases (fp32);
// bf16 floors already cover it.
inline Tolerance case_tolerance(Algo algo, Dtype dtype, const Hyper& h,
                                const std::vector<std::vector<int64_t>>& shapes) {
  Tolerance t = default_tolerance(algo, dtype);
  if (dtype == Dtype::kF32 && h.ortho == Ortho::kPolarExpress)
    for (const auto& s : shapes)
      if (orthogonalizes_rank1(algo, h, s)) t.floor = std::max(t.floor, 2e-4);
  return t;
}

// ---------------------------------------------------------------------------
// The side-by-side driver
// ---------------------------------------------------------------------------

// One test case: a group of tensors of one algorithm, stepped `steps` times with
// random gradients, compared after every step.
struct CaseSpec {
  Algo algo = Algo::kMuon;
  std::vector<std::vector<int64_t>> shapes;  // one tensor per shape, all in one group
  Dtype dtype = Dtype::kF32;
  bool fp32_grads = false;  // gradients in fp32 whatever the parameter dtype
  Hyper hyper;
  LibKnobs knobs;
  dion_layout_t layout = DION_LAYOUT_ROW_MAJOR;
  int steps = 4;
  uint64_t seed = 20240611;  // data seed (std::mt19937_64)
  uint64_t lib_seed = 0;     // the library's generator seed (Dion's Q)
  double x_scale = 0.1;      // X_0 ~ x_scale N(0, 1)
  double g_scale = 1.0;      // G_t ~ g_scale N(0, 1)
  bool zero_grad = false;    // the gradients are exactly 0 (weight decay only)
  Tolerance tol{0, 0};       // {0, 0}: case_tolerance(algo, dtype, hyper, shapes)
  // Steps (1-based, counting every dion_step call) whose gradient gets a
  // non-finite value; the library must skip them and the reference does not step.
  std::map<int, double> nonfinite_steps;
  // Called before each step (1-based): change hyperparameters of the library
  // group and of the references (`refs` to be edited in place).
  std::function<void(int call, LibOptimizer& opt, int32_t group, std::vector<Hyper*>& refs)> before_step;
};

inline std::string describe(const CaseSpec& c) {
  std::ostringstream o;
  o << dionref::algo_name(c.algo) << " " << dionref::dtype_name(c.dtype) << " shapes";
  for (const auto& s : c.shapes) o << " " << shape_str(s);
  if (c.layout == DION_LAYOUT_COL_MAJOR) o << " col-major";
  if (c.fp32_grads) o << " fp32-grads";
  return o.str();
}

// Names of the states of an algorithm (dion.h "Optimizer state").
inline std::vector<std::string> state_names(Algo a) {
  switch (a) {
    case Algo::kDion:
      return {"momentum", "Q"};
    case Algo::kNorMuon:
    case Algo::kNorDion2:
      return {"momentum", "variance_neuron"};
    case Algo::kAdamW:
      return {"momentum", "variance"};
    default:
      return {"momentum"};
  }
}

class CaseRunner {
 public:
  explicit CaseRunner(CaseSpec spec) : spec_(std::move(spec)), rng_(spec_.seed) {
    if (spec_.tol.floor == 0 && spec_.tol.factor == 0)
      spec_.tol = case_tolerance(spec_.algo, spec_.dtype, spec_.hyper, spec_.shapes);
  }

  // Creates the optimizer, the group and the references. ASSERT-style: check
  // HasFatalFailure() after it.
  void setup() {
    opt_.reset(new LibOptimizer(spec_.lib_seed));
    ASSERT_EQ(opt_->create_status(), DION_SUCCESS) << opt_->create_error();
    const Dtypes dts = resolve_dtypes(spec_.dtype, spec_.knobs);
    std::vector<const HostTensor*> ptrs;
    for (const auto& shape : spec_.shapes) {
      tensors_.emplace_back(new HostTensor(shape, spec_.dtype, spec_.layout, grad_dtype()));
      x0_.push_back(randn(rng_, dionref::numel(shape), spec_.x_scale, spec_.dtype));
      tensors_.back()->set_param(x0_.back());
      ptrs.push_back(tensors_.back().get());
    }
    param_bound_.assign(tensors_.size(), 0.0);
    const dion_group_options_t g = make_group_options(spec_.algo, spec_.hyper, spec_.knobs);
    DION_ASSERT_OK(*opt_, opt_->add_group(g, ptrs, &group_));
    for (size_t t = 0; t < spec_.shapes.size(); ++t) {
      Matrix<double> q0;
      if (spec_.algo == Algo::kDion) {
        StateBuffer q;
        DION_ASSERT_OK(*opt_, opt_->read_state(static_cast<int32_t>(t), "Q", &q));
        int64_t b = 0, r = 0;
        dionref::dion_q_shape(spec_.shapes[t][0], spec_.shapes[t][1], spec_.hyper.rank_fraction,
                              spec_.hyper.rank_multiple_of, &b, &r);
        ASSERT_EQ(q.shape, (std::vector<int64_t>{b, r})) << "Dion Q global shape, " << describe(spec_);
        q0 = Matrix<double>(b, r);
        q0.v = q.values;
      }
      q0_.push_back(q0.v);
      r64_.emplace_back(
          new dionref::TensorReference<double>(spec_.algo, spec_.hyper, spec_.shapes[t], dts, x0_[t], q0));
      r32_.emplace_back(new dionref::TensorReference<float>(spec_.algo, spec_.hyper, spec_.shapes[t], dts, x0_[t], q0));
      // The naive run of a CQR case is a textbook fp32 Cholesky QR after the
      // same warm-up: CQR's loss of orthogonality (up to u cond(P)^2) is the
      // method's own, which no Householder run shows.
      if (spec_.algo == Algo::kDion && spec_.knobs.qr_method == DION_QR_CQR)
        r32_.back()->use_cholesky_qr_after(spec_.knobs.cqr_warmup_steps);
    }
  }

  // Runs every step, comparing after each one.
  void run() {
    setup();
    if (::testing::Test::HasFatalFailure()) return;
    int applied = 0;
    for (int call = 1; call <= spec_.steps; ++call) {
      if (spec_.before_step) {
        std::vector<dionref::Hyper*> hs;
        for (auto& r : r64_) hs.push_back(&r->hyper());
        for (auto& r : r32_) hs.push_back(&r->hyper());
        spec_.before_step(call, *opt_, group_, hs);
        if (::testing::Test::HasFatalFailure()) return;
      }
      std::vector<std::vector<double>> grads;
      for (auto& t : tensors_) {
        grads.push_back(spec_.zero_grad ? std::vector<double>(static_cast<size_t>(t->numel()), 0.0)
                                        : randn(rng_, t->numel(), spec_.g_scale, grad_dtype()));
        t->set_grad(grads.back());
      }
      auto bad = spec_.nonfinite_steps.find(call);
      if (bad != spec_.nonfinite_steps.end()) {
        nonfinite_step(call, bad->second);
        if (::testing::Test::HasFatalFailure()) return;
        continue;
      }
      DION_ASSERT_OK(*opt_, opt_->step());
      ++applied;
      for (size_t t = 0; t < tensors_.size(); ++t) {
        r64_[t]->step(grads[t]);
        r32_[t]->step(grads[t]);
      }
      EXPECT_EQ(opt_->group_step(group_), applied) << "group step counter after " << call << " calls";
      compare(call);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }

  LibOptimizer& optimizer() { return *opt_; }
  HostTensor& tensor(size_t i) { return *tensors_[i]; }
  const std::vector<double>& x0(size_t i) const { return x0_[i]; }
  // Dion: the initial Q read from the library (row-major (b, r)); else empty.
  const std::vector<double>& q0(size_t i) const { return q0_[i]; }
  // The bound the last step's parameter change of tensor i was held to.
  double param_bound(size_t i) const { return param_bound_.at(i); }
  const dionref::TensorReference<double>& reference(size_t i) const { return *r64_[i]; }
  int32_t group() const { return group_; }
  const CaseSpec& spec() const { return spec_; }

  // The largest relative error of the parameter change seen so far, over all
  // tensors and steps (for reporting).
  double worst_x_error() const { return worst_x_; }
  // The largest error / tolerance ratio of any comparison so far (< 1: pass).
  double worst_ratio() const { return worst_ratio_; }

  // DION_ALGO_TEST_VERBOSE=1 prints every comparison (error, naive error, bound).
  static bool verbose() {
    const char* v = std::getenv("DION_ALGO_TEST_VERBOSE");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }

 private:
  Dtype grad_dtype() const { return spec_.fp32_grads ? Dtype::kF32 : spec_.dtype; }

  // A gradient with a NaN/Inf somewhere: nothing may change, the counter stays.
  void nonfinite_step(int call, double value) {
    const size_t t = static_cast<size_t>(call) % tensors_.size();
    tensors_[t]->poke_grad(tensors_[t]->numel() / 2, value);
    std::vector<std::vector<unsigned char>> before;
    for (auto& x : tensors_) before.push_back(x->param_bytes());
    std::vector<std::vector<StateBuffer>> states_before = read_all_states();
    const int64_t step_before = opt_->group_step(group_);
    int64_t skipped_before = 0, skipped_after = 0;
    int32_t last = 0;
    opt_->skipped(&skipped_before, &last);
    DION_ASSERT_OK(*opt_, opt_->step());
    opt_->skipped(&skipped_after, &last);
    EXPECT_EQ(skipped_after, skipped_before + 1) << "dion_get_skipped_steps after a non-finite gradient, call " << call;
    EXPECT_EQ(last, 1) << "last_skipped after a non-finite gradient, call " << call;
    EXPECT_EQ(opt_->group_step(group_), step_before) << "the step counter must not advance on a skipped step";
    for (size_t i = 0; i < tensors_.size(); ++i)
      EXPECT_TRUE(before[i] == tensors_[i]->param_bytes())
          << "tensor " << i << " changed by a skipped step (call " << call << ", " << describe(spec_) << ")";
    std::vector<std::vector<StateBuffer>> states_after = read_all_states();
    for (size_t i = 0; i < states_before.size(); ++i)
      for (size_t k = 0; k < states_before[i].size(); ++k)
        EXPECT_TRUE(states_before[i][k].values == states_after[i][k].values)
            << "state " << state_names(spec_.algo)[k] << " of tensor " << i << " changed by a skipped step";
  }

  std::vector<std::vector<StateBuffer>> read_all_states() {
    std::vector<std::vector<StateBuffer>> out(tensors_.size());
    for (size_t t = 0; t < tensors_.size(); ++t)
      for (const std::string& name : state_names(spec_.algo)) {
        StateBuffer b;
        DION_EXPECT_OK(*opt_, opt_->read_state(static_cast<int32_t>(t), name.c_str(), &b));
        out[t].push_back(b);
      }
    return out;
  }

  void check(const char* what, size_t t, int call, double err, double naive, const std::vector<double>& got,
             const std::vector<double>& want) {
    const double bound = spec_.tol.bound(naive);
    worst_ratio_ = std::max(worst_ratio_, err / bound);
    if (verbose())
      std::printf("  [%s] %s t%zu step %d: err %.3g naive %.3g bound %.3g\n", describe(spec_).c_str(), what, t, call,
                  err, naive, bound);
    EXPECT_LE(err, bound) << what << " of tensor " << t << " after step " << call << " (" << describe(spec_)
                          << "): relative error " << err << " > tolerance " << bound << " (naive fp32 " << naive
                          << ")\n  " << worst_elements(got, want);
  }

  void compare(int call) {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const dionref::TensorState& s64 = r64_[t]->state();
      const dionref::TensorState& s32 = r32_[t]->state();
      const std::vector<double> x = tensors_[t]->param();
      const double ex = rel_change_error(x, s64.x, x0_[t]);
      worst_x_ = std::max(worst_x_, ex);
      const double naive_x = rel_change_error(s32.x, s64.x, x0_[t]);
      check("parameter change", t, call, ex, naive_x, x, s64.x);
      param_bound_[t] = spec_.tol.bound(naive_x);

      for (const std::string& name : state_names(spec_.algo)) {
        StateBuffer b;
        DION_EXPECT_OK(*opt_, opt_->read_state(static_cast<int32_t>(t), name.c_str(), &b));
        const std::vector<double>* want = nullptr;
        const std::vector<double>* naive = nullptr;
        if (name == "momentum") want = &s64.momentum, naive = &s32.momentum;
        if (name == "variance") want = &s64.variance, naive = &s32.variance;
        if (name == "variance_neuron") want = &s64.variance_neuron, naive = &s32.variance_neuron;
        if (name == "Q") want = &s64.q.v, naive = &s32.q.v;
        ASSERT_EQ(b.values.size(), want->size()) << "size of state " << name << " of tensor " << t;
        if (name == "variance_neuron" && !spec_.hyper.flatten) {
          std::vector<int64_t> expect = spec_.shapes[t];
          expect.back() = 1;  // (..., rows, 1)
          EXPECT_EQ(b.shape, expect) << "global shape of variance_neuron";
        }
        if (name == "momentum" || name == "variance") {
          EXPECT_EQ(b.shape, spec_.shapes[t]) << "shape of " << name;
        }
        std::vector<double> got = b.values;
        std::vector<double> naive_v = *naive;
        if (name == "Q") {  // defined up to column signs
          got = align_column_signs(got, *want, s64.q.rows, s64.q.cols);
          naive_v = align_column_signs(naive_v, *want, s64.q.rows, s64.q.cols);
        }
        check(("state " + name).c_str(), t, call, rel_error(got, *want), rel_error(naive_v, *want), got, *want);
      }
    }
  }

  CaseSpec spec_;
  std::mt19937_64 rng_;
  std::unique_ptr<LibOptimizer> opt_;
  std::vector<std::unique_ptr<HostTensor>> tensors_;
  std::vector<std::vector<double>> x0_;
  std::vector<std::vector<double>> q0_;
  std::vector<std::unique_ptr<dionref::TensorReference<double>>> r64_;
  std::vector<std::unique_ptr<dionref::TensorReference<float>>> r32_;
  int32_t group_ = -1;
  double worst_x_ = 0;
  double worst_ratio_ = 0;
  std::vector<double> param_bound_;
};

// Runs a case to completion (the common one-liner of the suites).
inline void run_case(const CaseSpec& spec) {
  CaseRunner runner(spec);
  runner.run();
}

// gtest parameter names must be [A-Za-z0-9_].
inline std::string sanitize(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

}  // namespace dion_algo_test

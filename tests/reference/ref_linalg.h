// SPDX-License-Identifier: MIT
//
// tests/reference/ref_linalg.h — building blocks of the "textbook" reference
// optimizers in tests/reference/: storage dtypes (fp32 / bf16 / fp16 rounding),
// a small dense row-major matrix, products, norms and a Householder QR.
//
// Everything here is written for clarity, not speed: plain triple loops. The
// scalar type T of the computation is a template parameter. The oracles run with
// T = double; the suites also run the very same code with T = float to measure
// how far a naive fp32 implementation lands from fp64 on a given input, which is
// what the tolerances are scaled by (STYLE.md §D.15: "error against fp64 must be
// <= k x that of a naive same-precision implementation").
//
// Nothing here includes dion.h: the references are independent of the library.
#pragma once

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace dionref {

// ---------------------------------------------------------------------------
// Storage dtypes
// ---------------------------------------------------------------------------

// How a value is stored between steps (parameters and optimizer states). The
// library computes in fp32 and rounds once on store; the references compute in
// T and round on store in exactly the same places (see round_to).
enum class Dtype { kF32, kBF16, kF16 };

inline const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::kF32:
      return "FP32";
    case Dtype::kBF16:
      return "BF16";
    case Dtype::kF16:
      return "FP16";
  }
  return "?";
}

inline size_t dtype_size(Dtype d) { return d == Dtype::kF32 ? 4 : 2; }

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 = the upper 16 bits of an fp32, rounded to nearest even. NaN stays a
// (quiet) NaN; overflow carries into the exponent and gives +-Inf, as it should.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// IEEE binary16, round to nearest even (subnormals, overflow to Inf, NaN kept).
inline uint16_t float_to_f16_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (a < 0x38800000u) {                               // below 2^-14: a half subnormal (multiple of 2^-24) or zero
    const float scaled = bits_float(a) * 16777216.0f;  // exact: a power-of-two scale
    const uint32_t mant = static_cast<uint32_t>(std::nearbyint(scaled));  // default mode: to nearest even
    return static_cast<uint16_t>(sign | mant);  // mant == 0x400 encodes the smallest normal, correctly
  }
  uint32_t h = ((((a >> 23) - 127u + 15u)) << 10) | ((a & 0x7fffffu) >> 13);
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is correct
  return static_cast<uint16_t>(sign | h);
}
inline float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((e - 15u + 127u) << 23) | (mant << 13));
}

// The value `v` takes once stored in dtype `d`. The library's arithmetic is fp32,
// so a value is first an fp32 and then (for bf16/fp16) rounded again: the
// reference does the same double rounding, double -> float -> 16-bit.
inline double round_to(Dtype d, double v) {
  const float f = static_cast<float>(v);
  switch (d) {
    case Dtype::kF32:
      return f;
    case Dtype::kBF16:
      return bf16_bits_to_float(float_to_bf16_bits(f));
    case Dtype::kF16:
      return f16_bits_to_float(float_to_f16_bits(f));
  }
  return f;
}

inline void round_all(Dtype d, std::vector<double>& v) {
  for (double& x : v) x = round_to(d, x);
}

// ---------------------------------------------------------------------------
// Dense row-major matrices
// ---------------------------------------------------------------------------

template <class T>
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<T> v;  // row-major, rows * cols

  Matrix() = default;
  Matrix(int64_t r, int64_t c, T fill = T(0)) : rows(r), cols(c), v(static_cast<size_t>(r * c), fill) {}

  T& operator()(int64_t i, int64_t j) { return v[static_cast<size_t>(i * cols + j)]; }
  const T& operator()(int64_t i, int64_t j) const { return v[static_cast<size_t>(i * cols + j)]; }
  int64_t size() const { return rows * cols; }
};

// Converts between scalar types (e.g. the stored double values to float).
template <class To, class From>
Matrix<To> matrix_cast(const Matrix<From>& a) {
  Matrix<To> out(a.rows, a.cols);
  for (size_t i = 0; i < a.v.size(); ++i) out.v[i] = static_cast<To>(a.v[i]);
  return out;
}

// The (rows x cols) matrix starting at element `offset` of a flat row-major array.
template <class T>
Matrix<T> matrix_from(const std::vector<double>& flat, int64_t offset, int64_t rows, int64_t cols) {
  Matrix<T> out(rows, cols);
  for (int64_t i = 0; i < rows * cols; ++i) out.v[static_cast<size_t>(i)] = static_cast<T>(flat[offset + i]);
  return out;
}

template <class T>
Matrix<T> transpose(const Matrix<T>& a) {
  Matrix<T> t(a.cols, a.rows);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < a.cols; ++j) t(j, i) = a(i, j);
  return t;
}

// C = A B, accumulated in T.
template <class T>
Matrix<T> matmul(const Matrix<T>& a, const Matrix<T>& b) {
  assert(a.cols == b.rows);
  Matrix<T> c(a.rows, b.cols);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t k = 0; k < a.cols; ++k) {
      const T aik = a(i, k);
      for (int64_t j = 0; j < b.cols; ++j) c(i, j) += aik * b(k, j);
    }
  return c;
}

// C = A^T B.
template <class T>
Matrix<T> matmul_tn(const Matrix<T>& a, const Matrix<T>& b) {
  return matmul(transpose(a), b);
}

// C = A B^T.
template <class T>
Matrix<T> matmul_nt(const Matrix<T>& a, const Matrix<T>& b) {
  return matmul(a, transpose(b));
}

// alpha * A + beta * B (same shapes).
template <class T>
Matrix<T> axpby(T alpha, const Matrix<T>& a, T beta, const Matrix<T>& b) {
  assert(a.rows == b.rows && a.cols == b.cols);
  Matrix<T> c(a.rows, a.cols);
  for (size_t i = 0; i < a.v.size(); ++i) c.v[i] = alpha * a.v[i] + beta * b.v[i];
  return c;
}

template <class T>
T frobenius(const Matrix<T>& a) {
  T s = 0;
  for (T x : a.v) s += x * x;
  return std::sqrt(s);
}

// ---------------------------------------------------------------------------
// Householder QR
// ---------------------------------------------------------------------------

// The thin Q factor of a (p x r) matrix with p >= r, normalised so that the
// diagonal of R is non-negative (then Q is unique for a full-column-rank input).
// A column that is zero (exact rank deficiency) contributes an identity
// reflector; the references never feed such inputs except through the all-zero
// path, which does not call this.
template <class T>
Matrix<T> householder_q(const Matrix<T>& input) {
  const int64_t p = input.rows, r = input.cols;
  if (p < r) throw std::invalid_argument("householder_q: needs rows >= cols");
  Matrix<T> a = input;
  std::vector<std::vector<T>> reflectors(static_cast<size_t>(r));
  std::vector<T> diag(static_cast<size_t>(r), T(0));
  for (int64_t k = 0; k < r; ++k) {
    T norm = 0;
    for (int64_t i = k; i < p; ++i) norm += a(i, k) * a(i, k);
    norm = std::sqrt(norm);
    std::vector<T>& v = reflectors[static_cast<size_t>(k)];
    v.assign(static_cast<size_t>(p - k), T(0));
    if (norm == T(0)) {  // nothing to eliminate: H = I
      diag[static_cast<size_t>(k)] = 0;
      continue;
    }
    const T alpha = a(k, k) >= 0 ? -norm : norm;  // avoids cancellation in v0
    for (int64_t i = k; i < p; ++i) v[static_cast<size_t>(i - k)] = a(i, k);
    v[0] -= alpha;
    T vnorm = 0;
    for (T x : v) vnorm += x * x;
    vnorm = std::sqrt(vnorm);
    for (T& x : v) x /= vnorm;
    // A[k:, k:] -= 2 v (v^T A[k:, k:])
    for (int64_t j = k; j < r; ++j) {
      T dot = 0;
      for (int64_t i = k; i < p; ++i) dot += v[static_cast<size_t>(i - k)] * a(i, j);
      for (int64_t i = k; i < p; ++i) a(i, j) -= T(2) * v[static_cast<size_t>(i - k)] * dot;
    }
    diag[static_cast<size_t>(k)] = a(k, k);  // == alpha
  }
  // Q = H_0 H_1 ... H_{r-1} [I_r; 0]: apply the reflectors in reverse order.
  Matrix<T> q(p, r);
  for (int64_t j = 0; j < r; ++j) q(j, j) = 1;
  for (int64_t k = r - 1; k >= 0; --k) {
    const std::vector<T>& v = reflectors[static_cast<size_t>(k)];
    bool identity = true;
    for (T x : v) identity = identity && x == T(0);
    if (identity) continue;
    for (int64_t j = 0; j < r; ++j) {
      T dot = 0;
      for (int64_t i = k; i < p; ++i) dot += v[static_cast<size_t>(i - k)] * q(i, j);
      for (int64_t i = k; i < p; ++i) q(i, j) -= T(2) * v[static_cast<size_t>(i - k)] * dot;
    }
  }
  // Make diag(R) >= 0: flip the matching columns of Q.
  for (int64_t j = 0; j < r; ++j)
    if (diag[static_cast<size_t>(j)] < 0)
      for (int64_t i = 0; i < p; ++i) q(i, j) = -q(i, j);
  return q;
}

// Cholesky QR as a textbook (Stathopoulos & Wu 2002): R = the upper Cholesky
// factor of P^T P, Q = P R^{-1} by substitution, all in T. Not an oracle:
// its loss of orthogonality grows with u cond(P)^2, so the testbed runs it in
// fp32 as the naive counterpart of the library's CQR (the error that method
// has by itself at the input's conditioning). A non-positive pivot throws.
template <class T>
Matrix<T> cholesky_qr(const Matrix<T>& p) {
  const Matrix<T> g = matmul_tn(p, p);
  const int64_t n = g.rows;
  Matrix<T> r(n, n);
  for (int64_t k = 0; k < n; ++k) {
    T d = g(k, k);
    for (int64_t i = 0; i < k; ++i) d -= r(i, k) * r(i, k);
    if (!(d > T(0))) throw std::runtime_error("cholesky_qr: the Gram matrix is not positive definite");
    r(k, k) = std::sqrt(d);
    for (int64_t j = k + 1; j < n; ++j) {
      T s = g(k, j);
      for (int64_t i = 0; i < k; ++i) s -= r(i, k) * r(i, j);
      r(k, j) = s / r(k, k);
    }
  }
  Matrix<T> q(p.rows, n);
  for (int64_t row = 0; row < p.rows; ++row)
    for (int64_t j = 0; j < n; ++j) {
      T s = p(row, j);
      for (int64_t i = 0; i < j; ++i) s -= q(row, i) * r(i, j);
      q(row, j) = s / r(j, j);
    }
  return q;
}

// ---------------------------------------------------------------------------
// Flat-array helpers
// ---------------------------------------------------------------------------

inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace dionref

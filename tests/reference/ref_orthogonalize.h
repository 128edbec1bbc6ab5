// SPDX-License-Identifier: MIT
//
// tests/reference/ref_orthogonalize.h — the two "Newton–Schulz slot"
// orthogonalizers of the Muon family (spec §1.2), written as plain matrix
// polynomials:
//
//   Polar Express (arXiv 2505.16932, microsoft/dion polar_express.py):
//     X := U / (1.02 ||U||_F + eps)
//     per (a, b, c):  rows > cols:  A = X^T X,  X = a X + X (b A + c A^2)
//                     otherwise:    A = X X^T,  X = a X + (b A + c A^2) X
//   quintic Newton–Schulz (zeropower_via_newtonschulz5):
//     transpose a tall U to wide, X := U / (||U||_F + eps),
//     per (a, b, c):  A = X X^T,  X = a X + (b A + c A^2) X,  transpose back.
//
// Steps past the 5 tuned triples reuse the last triple (libdion's ortho_steps).
// Unlike upstream (which runs in bf16) these run in T (double for the oracle),
// which is what the library's fp32 host path approximates.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ref_linalg.h"

namespace dionref {

enum class Ortho { kPolarExpress, kNewtonSchulz };

// Polar Express coefficients: 5 iterations, safety factor 2e-2, cushion 2.
constexpr double kPolarExpressCoeffs[5][3] = {{8.156554524902461, -22.48329292557795, 15.878769915207462},
                                              {4.042929935166739, -2.808917465908714, 0.5000178451051316},
                                              {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
                                              {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
                                              {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};

// The five tuned quintic Newton–Schulz triples of zeropower_via_newtonschulz5.
constexpr double kNewtonSchulzCoeffs[5][3] = {{4.0848, -6.8946, 2.9270},
                                              {3.9505, -6.3029, 2.6377},
                                              {3.7418, -5.5913, 2.3037},
                                              {2.8769, -3.1427, 1.2046},
                                              {2.8366, -3.0525, 1.2012}};

// One step X := a X + (b A + c A^2) X with A = X X^T (left form, X wide or square).
template <class T>
Matrix<T> quintic_left(const Matrix<T>& x, const double* abc) {
  const Matrix<T> a = matmul_nt(x, x);
  const Matrix<T> poly = axpby(static_cast<T>(abc[1]), a, static_cast<T>(abc[2]), matmul(a, a));
  return axpby(static_cast<T>(abc[0]), x, T(1), matmul(poly, x));
}

// One step X := a X + X (b A + c A^2) with A = X^T X (right form, X tall).
template <class T>
Matrix<T> quintic_right(const Matrix<T>& x, const double* abc) {
  const Matrix<T> a = matmul_tn(x, x);
  const Matrix<T> poly = axpby(static_cast<T>(abc[1]), a, static_cast<T>(abc[2]), matmul(a, a));
  return axpby(static_cast<T>(abc[0]), x, T(1), matmul(x, poly));
}

template <class T>
Matrix<T> polar_express(const Matrix<T>& u, int steps, double eps) {
  Matrix<T> x = u;
  const T denom = static_cast<T>(1.02) * frobenius(u) + static_cast<T>(eps);
  for (T& e : x.v) e /= denom;
  for (int s = 0; s < steps; ++s) {
    const double* abc = kPolarExpressCoeffs[std::min(s, 4)];
    x = x.rows > x.cols ? quintic_right(x, abc) : quintic_left(x, abc);
  }
  return x;
}

template <class T>
Matrix<T> newton_schulz(const Matrix<T>& u, int steps, double eps) {
  const bool tall = u.rows > u.cols;
  Matrix<T> x = tall ? transpose(u) : u;
  const T denom = frobenius(x) + static_cast<T>(eps);
  for (T& e : x.v) e /= denom;
  for (int s = 0; s < steps; ++s) x = quintic_left(x, kNewtonSchulzCoeffs[std::min(s, 4)]);
  return tall ? transpose(x) : x;
}

template <class T>
Matrix<T> orthogonalize(Ortho method, const Matrix<T>& u, int steps, double eps) {
  return method == Ortho::kPolarExpress ? polar_express(u, steps, eps) : newton_schulz(u, steps, eps);
}

}  // namespace dionref

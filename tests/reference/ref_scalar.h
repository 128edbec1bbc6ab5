// SPDX-License-Identifier: MIT
//
// tests/reference/ref_scalar.h — the element-wise optimizers of spec §1.4, any
// shape, with optional cautious weight decay (arXiv 2510.12402):
//
// AdamW (legacy form; t = the group step counter after this step's increment):
//   M := beta1 M + (1 - beta1) G;   V := beta2 V + (1 - beta2) G^2
//   bc1 := 1 - beta1^t;  bc2 := 1 - beta2^t;  denom := sqrt(V) / sqrt(bc2) + eps
//   X := (1 - lr wd) X   or, cautious,  X := X - lr wd X [M X >= 0]
//   X := X - (lr / bc1) M / denom
// Lion:
//   U := sign(beta1 M + (1 - beta1) G)   (sign(0) = 0);   M := beta2 M + (1 - beta2) G
//   X := (1 - lr wd) X   or, cautious,  X := X - lr wd X [X U >= 0]
//   X := X - lr U
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "ref_common.h"

namespace dionref {

template <class T>
void adamw_step(TensorState& s, const std::vector<double>& g, const Hyper& h, const Dtypes& dt, int64_t t) {
  const T b1 = static_cast<T>(h.beta1), b2 = static_cast<T>(h.beta2);
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(t));
  const T step_size = static_cast<T>(h.lr / bc1);
  const T sqrt_bc2 = static_cast<T>(std::sqrt(bc2));
  const T eps = static_cast<T>(h.epsilon);
  const T lr_wd = static_cast<T>(h.lr * h.weight_decay);
  const T decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  for (size_t i = 0; i < s.x.size(); ++i) {
    const T gi = static_cast<T>(g[i]);
    // Working values m, v; the stored copies are rounded (library convention).
    const T m = b1 * static_cast<T>(s.momentum[i]) + (T(1) - b1) * gi;
    const T v = b2 * static_cast<T>(s.variance[i]) + (T(1) - b2) * gi * gi;
    s.momentum[i] = round_to(dt.momentum, static_cast<double>(m));
    s.variance[i] = round_to(dt.variance, static_cast<double>(v));
    const T x = static_cast<T>(s.x[i]);
    const T denom = std::sqrt(v) / sqrt_bc2 + eps;
    T nx = h.cautious_wd ? x - lr_wd * x * ((m * x >= T(0)) ? T(1) : T(0)) : decay * x;
    nx -= step_size * m / denom;
    s.x[i] = round_to(dt.param, static_cast<double>(nx));
  }
}

template <class T>
void lion_step(TensorState& s, const std::vector<double>& g, const Hyper& h, const Dtypes& dt) {
  const T b1 = static_cast<T>(h.beta1), b2 = static_cast<T>(h.beta2);
  const T lr = static_cast<T>(h.lr);
  const T lr_wd = static_cast<T>(h.lr * h.weight_decay);
  const T decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  for (size_t i = 0; i < s.x.size(); ++i) {
    const T gi = static_cast<T>(g[i]);
    const T m = static_cast<T>(s.momentum[i]);
    const T c = b1 * m + (T(1) - b1) * gi;
    const T u = c > T(0) ? T(1) : (c < T(0) ? T(-1) : T(0));
    s.momentum[i] = round_to(dt.momentum, static_cast<double>(b2 * m + (T(1) - b2) * gi));
    const T x = static_cast<T>(s.x[i]);
    T nx = h.cautious_wd ? x - lr_wd * x * ((x * u >= T(0)) ? T(1) : T(0)) : decay * x;
    nx -= lr * u;
    s.x[i] = round_to(dt.param, static_cast<double>(nx));
  }
}

}  // namespace dionref

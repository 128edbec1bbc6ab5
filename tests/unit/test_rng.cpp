// SPDX-License-Identifier: MIT
// The counter-based normals of src/core/rng.hpp, which both backends draw
// (the device's equality with the host is tests/gpu/test_rng_device.cu).
// Their logarithm and cosine are float polynomials (no libm): checked here
// against the double-precision libm functions on every input the generator
// can produce, and the normals against a double Box-Muller of the same
// uniforms and against the moments of N(0, 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/rng.hpp"

namespace {

// Every u1 = (k + 1) / 2^24, k < 2^24: within 3 float ulps of ln(u1).
TEST(Rng, LogfOnEveryUniformIsWithinThreeUlps) {
  double worst = 0;
  for (uint32_t k = 0; k < (1u << 24); ++k) {
    const float u = static_cast<float>(k + 1) * (1.0f / 16777216.0f);
    const double ref = std::log(static_cast<double>(u));
    const double got = dion::rng_logf(u);
    const double ulp = ref == 0 ? 0x1p-149 : std::ldexp(1.0, std::ilogb(ref) - 23);
    const double e = std::fabs(got - ref) / ulp;
    if (e > worst) worst = e;
    if (k == 0 || k + 1 == (1u << 24)) EXPECT_LE(e, 3) << "u = " << u;
  }
  EXPECT_LE(worst, 3.0) << "largest error in float ulps of ln(u)";
}

// The largest |f(v) - ref(2 pi v)| over every v = k / 2^24, k < 2^24 (every
// u2 the generator can produce).
template <class F, class Ref>
double worst_on_every_uniform(F f, Ref ref) {
  const double two_pi = 6.283185307179586476925286766559;
  double worst = 0;
  for (uint32_t k = 0; k < (1u << 24); ++k) {
    const float v = static_cast<float>(k) * (1.0f / 16777216.0f);
    worst = std::max(worst, std::fabs(static_cast<double>(f(v)) - ref(two_pi * static_cast<double>(v))));
  }
  return worst;
}

// Every v = k / 2^24, k < 2^24: within 2^-23 (one ulp at 1) of cos(2 pi v)
// and of sin(2 pi v).
TEST(Rng, Cos2piOnEveryUniformIsWithinTwoToTheMinus23) {
  EXPECT_LE(worst_on_every_uniform(dion::rng_cos2pi, [](double x) { return std::cos(x); }), 0x1p-23);
}
TEST(Rng, Sin2piOnEveryUniformIsWithinTwoToTheMinus23) {
  EXPECT_LE(worst_on_every_uniform(dion::rng_sin2pi, [](double x) { return std::sin(x); }), 0x1p-23);
}

// The textbook Box-Muller in double of the uniforms of element `index`'s
// Philox block: words (0, 1) give elements 0 and 1 of the block (cos, sin),
// words (2, 3) elements 2 and 3.
double reference_normal(const dion::PhiloxKey& k, uint64_t index) {
  uint32_t ctr[4];
  dion::philox_block(k, index / 4, ctr);
  const int q = static_cast<int>(index % 4), p = q / 2;
  const double u1 = ((ctr[2 * p] >> 8) + 1.0) / 16777216.0, u2 = (ctr[2 * p + 1] >> 8) / 16777216.0;
  const double a = 6.283185307179586476925286766559 * u2;
  return std::sqrt(-2.0 * std::log(u1)) * (q % 2 == 0 ? std::cos(a) : std::sin(a));
}

// The float normals equal the double Box-Muller of the same uniforms to
// float accuracy (|x| <= 5.8, so a few float ulps of 4 are about 1e-6), and
// 4M of them have the mean, variance and fourth moment of N(0, 1) within
// five standard errors (1/sqrt(N), sqrt(2/N), sqrt(96/N)).
TEST(Rng, NormalsMatchDoubleBoxMullerAndTheMomentsOfN01) {
  const int64_t n = int64_t(1) << 22;
  double s1 = 0, s2 = 0, s4 = 0, worst = 0;
  int64_t i = 0;
  for (uint32_t tensor : {0u, 7u})
    for (uint64_t step : {uint64_t(1), uint64_t(1) << 40})
      for (int64_t j = 0; j < n / 4; ++j, ++i) {
        const dion::PhiloxKey key{0x1234567890abcdefull, dion::kRngSketch, tensor, step};
        const uint64_t index = static_cast<uint64_t>(j) * 2654435761u;
        const double x = dion::philox_normal(key, index);
        const double e = std::fabs(x - reference_normal(key, index));
        if (e > worst) worst = e;
        s1 += x;
        s2 += x * x;
        s4 += x * x * x * x;
      }
  EXPECT_LE(worst, 2e-6) << "largest difference from the double Box-Muller";
  const double N = static_cast<double>(i), mean = s1 / N, var = s2 / N - mean * mean, m4 = s4 / N;
  EXPECT_LT(std::fabs(mean), 5 / std::sqrt(N));
  EXPECT_LT(std::fabs(var - 1), 5 * std::sqrt(2 / N));
  EXPECT_LT(std::fabs(m4 - 3), 5 * std::sqrt(96 / N));
}

// The four normals of one block (the cos and sin of one radius, and the two
// pairs) and neighbouring blocks are uncorrelated: over 4M consecutive
// elements, the sample correlation of x_i with x_{i+d} for d = 1, 2, 3, 4
// and 5 is within five standard errors (1/sqrt(N)) of zero, as is that of
// x_i^2 with x_{i+1}^2 (the cos and sin of one pair share their radius: a
// dependence that correlates the squares would show here).
TEST(Rng, NeighbouringNormalsAreUncorrelated) {
  const int64_t n = int64_t(1) << 22;
  const dion::PhiloxKey key{42, dion::kRngSketch, 3, 5};
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = dion::philox_normal(key, static_cast<uint64_t>(i));
  for (int d = 1; d <= 5; ++d) {
    double s = 0;
    for (int64_t i = 0; i + d < n; ++i)
      s += static_cast<double>(x[static_cast<size_t>(i)]) * x[static_cast<size_t>(i + d)];
    EXPECT_LT(std::fabs(s / static_cast<double>(n - d)), 5 / std::sqrt(static_cast<double>(n))) << "lag " << d;
  }
  // corr(x_i^2, x_{i+1}^2) over the (cos, sin) pairs i = 4 g, 4 g + 2:
  // Var(x^2) = 2, so the covariance's standard error is 2 / sqrt(pairs).
  double s = 0;
  int64_t pairs = 0;
  for (int64_t i = 0; i + 1 < n; i += 2, ++pairs) {
    const double a = x[static_cast<size_t>(i)], b = x[static_cast<size_t>(i + 1)];
    s += (a * a - 1) * (b * b - 1);
  }
  EXPECT_LT(std::fabs(s / static_cast<double>(pairs)), 5 * 2 / std::sqrt(static_cast<double>(pairs)));
}

}  // namespace

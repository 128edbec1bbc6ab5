// SPDX-License-Identifier: MIT
// The counter-based normals of src/core/rng.hpp, which both backends draw
// (the device's equality with the host is tests/gpu/test_rng_device.cu).
// Their logarithm and cosine are float polynomials (no libm): checked here
// against the double-precision libm functions on every input the generator
// can produce, and the normals against a double Box-Muller of the same
// uniforms and against the moments of N(0, 1).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

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

// Every v = k / 2^24, k < 2^24: within 2^-23 of cos(2 pi v) (one ulp at 1).
TEST(Rng, Cos2piOnEveryUniformIsWithinTwoToTheMinus23) {
  const double two_pi = 6.283185307179586476925286766559;
  double worst = 0;
  for (uint32_t k = 0; k < (1u << 24); ++k) {
    const float v = static_cast<float>(k) * (1.0f / 16777216.0f);
    const double e = std::fabs(static_cast<double>(dion::rng_cos2pi(v)) - std::cos(two_pi * static_cast<double>(v)));
    if (e > worst) worst = e;
  }
  EXPECT_LE(worst, 0x1p-23);
}

double reference_normal(const dion::PhiloxKey& k, uint64_t index) {
  uint32_t ctr[4];
  dion::philox_block(k, index, ctr);
  const double u1 = ((ctr[0] >> 8) + 1.0) / 16777216.0, u2 = (ctr[1] >> 8) / 16777216.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925286766559 * u2);
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

}  // namespace

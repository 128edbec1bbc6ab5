// SPDX-License-Identifier: MIT
// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11), shared by
// the host and CUDA backends so both draw the same numbers (tests/gpu/
// test_rng_device.cu). The normals use no libm: their logarithm and cosine are
// polynomials in IEEE float operations, so host and device agree bit for bit
// and the device draws at float speed (the double log and cos they replace
// took about 5 ms of gpt-1.3b's Dion step on an H100).
//
// A random matrix is a pure function of (seed, stream, tensor, step, global
// element index): every rank holding a slice of a global random matrix draws
// its slice without communication, and a sharded run reproduces a
// single-device run exactly (DESIGN.md §4; spec §13.2 invariants I1, I2).
#pragma once
#include <cmath>
#include <cstdint>

#include "dtype.hpp"

namespace dion {

enum RngStream : uint32_t {
  kRngInitQ = 1,   // Dion's initial Q
  kRngSketch = 2,  // RCQR sketch matrices
};

struct PhiloxKey {
  uint64_t seed;
  uint32_t stream;
  uint32_t tensor;
  uint64_t step;
};

DION_HD void philox4x32_10(uint32_t ctr[4], uint32_t key0, uint32_t key1) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(M0) * ctr[0];
    uint64_t p1 = static_cast<uint64_t>(M1) * ctr[2];
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    uint32_t n0 = hi1 ^ ctr[1] ^ key0;
    uint32_t n2 = hi0 ^ ctr[3] ^ key1;
    ctr[0] = n0;
    ctr[1] = lo1;
    ctr[2] = n2;
    ctr[3] = lo0;
    key0 += W0;
    key1 += W1;
  }
}

// Philox block number `block` (that of global elements 4 block .. 4 block + 3,
// see philox_normal4): the key folds (seed, stream, tensor), the counter
// holds (block, step).
DION_HD void philox_block(const PhiloxKey& k, uint64_t block, uint32_t ctr[4]) {
  ctr[0] = static_cast<uint32_t>(block);
  ctr[1] = static_cast<uint32_t>(block >> 32);
  ctr[2] = static_cast<uint32_t>(k.step);
  ctr[3] = static_cast<uint32_t>(k.step >> 32) ^ (k.stream << 24);
  philox4x32_10(ctr, static_cast<uint32_t>(k.seed) ^ (k.tensor * 0x85EBCA6Bu),
                static_cast<uint32_t>(k.seed >> 32) ^ (k.stream * 0xC2B2AE35u));
}

// ln(x) for x in [2^-24, 1] in float, from IEEE +, -, *, / and bit
// operations only (no libm): x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, summed to s^9
// (the next term is below 2^-31 of the sum). A few float ulps from the true
// value; the same bits on the host and on the device (the CUDA code is built
// with -fmad=false, so no product is fused into an addition on either side).
DION_HD float rng_logf(float x) {
  const uint32_t b = float_bits(x);
  int e = static_cast<int>((b >> 23) & 0xffu) - 127;
  float m = bits_float((b & 0x7fffffu) | 0x3f800000u);
  if (m > 1.41421356f) {
    m = m * 0.5f;
    e += 1;
  }
  const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
  float p = s2 * (1.0f / 9.0f) + (1.0f / 7.0f);
  p = s2 * p + 0.2f;
  p = s2 * p + (1.0f / 3.0f);
  p = s2 * p + 1.0f;
  // e ln 2 with ln 2 split in two (the high part has 16 significant bits, so
  // e times it is exact for |e| <= 128).
  const float fe = static_cast<float>(e);
  return fe * 0.693145751953125f + ((2.0f * s) * p + fe * 1.42860677e-06f);
}

// cos(2 pi v) for v in [0, 1) in float, from IEEE operations only: v is
// reflected exactly (it has at most 24 significant bits) into z in [0, 1/8]
// for cos or sin of 2 pi z <= pi / 4, each a Taylor polynomial whose first
// omitted term is below 2^-25 there.
DION_HD float rng_cos2pi(float v) {
  float w = v < 0.5f ? v : 1.0f - v;  // cos(2 pi v) = cos(2 pi w), w in [0, 1/2]
  float sign = 1.0f;
  if (w > 0.25f) {  // cos(2 pi w) = -cos(2 pi (1/2 - w))
    w = 0.5f - w;
    sign = -1.0f;
  }
  const bool use_sin = w > 0.125f;  // cos(2 pi w) = sin(2 pi (1/4 - w))
  const float z = use_sin ? 0.25f - w : w;
  const float x = 6.28318548f * z, x2 = x * x;
  float r;
  if (use_sin) {
    float p = x2 * (1.0f / 362880.0f) - (1.0f / 5040.0f);
    p = x2 * p + (1.0f / 120.0f);
    p = x2 * p - (1.0f / 6.0f);
    r = x * (x2 * p) + x;
  } else {
    float p = x2 * (1.0f / 40320.0f) - (1.0f / 720.0f);
    p = x2 * p + (1.0f / 24.0f);
    p = x2 * p - 0.5f;
    r = x2 * p + 1.0f;
  }
  return sign * r;
}

// sin(2 pi v) for v in [0, 1) in float: cos(2 pi (v - 1/4)), the argument
// reflected into [0, 1) exactly (v has at most 24 significant bits, and so
// have v - 1/4 and v + 3/4 in the ranges they are taken in).
DION_HD float rng_sin2pi(float v) { return rng_cos2pi(v < 0.25f ? v + 0.75f : v - 0.25f); }

// The four standard normals of Philox block `block`, those of global elements
// 4 block .. 4 block + 3: Box-Muller on the block's two pairs of words (the
// first of a pair gives u1 in (0, 1], the second u2 in [0, 1), 24 bits
// each), both normals of each pair (radius times cos and sin of 2 pi u2), in
// float with rng_logf, rng_cos2pi and rng_sin2pi. One block serves four
// elements, so a device draws a random matrix at about its write bandwidth.
DION_HD void philox_normal4(const PhiloxKey& k, uint64_t block, float z[4]) {
  uint32_t ctr[4];
  philox_block(k, block, ctr);
  for (int p = 0; p < 2; ++p) {
    const float u1 = static_cast<float>((ctr[2 * p] >> 8) + 1u) * (1.0f / 16777216.0f);  // (0, 1], exact
    const float u2 = static_cast<float>(ctr[2 * p + 1] >> 8) * (1.0f / 16777216.0f);     // [0, 1), exact
    const float radius = sqrtf(-2.0f * rng_logf(u1));
    z[2 * p] = radius * rng_cos2pi(u2);
    z[2 * p + 1] = radius * rng_sin2pi(u2);
  }
}

// The standard normal of global element `index` (one of philox_normal4's).
DION_HD float philox_normal(const PhiloxKey& k, uint64_t index) {
  float z[4];
  philox_normal4(k, index >> 2, z);
  return z[index & 3];
}

}  // namespace dion

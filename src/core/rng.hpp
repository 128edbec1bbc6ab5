// SPDX-License-Identifier: MIT
// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11), shared by
// the host and CUDA backends so both draw the same numbers (tests/gpu/
// test_rng_device.cu: bit-identical on an H100 over 1.2M draws; the device's
// log/cos may in principle differ from the host libm's in the last bit).
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

// One standard normal for global element `index` (Box-Muller on two uniforms
// in (0, 1]). The key folds (seed, stream, tensor); the counter holds
// (index, step).
DION_HD float philox_normal(const PhiloxKey& k, uint64_t index) {
  uint32_t ctr[4] = {static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                     static_cast<uint32_t>(k.step), static_cast<uint32_t>(k.step >> 32) ^ (k.stream << 24)};
  uint32_t key0 = static_cast<uint32_t>(k.seed) ^ (k.tensor * 0x85EBCA6Bu);
  uint32_t key1 = static_cast<uint32_t>(k.seed >> 32) ^ (k.stream * 0xC2B2AE35u);
  philox4x32_10(ctr, key0, key1);
  // 24-bit uniforms in (0, 1]; computed in double for a portable result.
  double u1 = (static_cast<double>(ctr[0] >> 8) + 1.0) * (1.0 / 16777216.0);
  double u2 = static_cast<double>(ctr[1] >> 8) * (1.0 / 16777216.0);
  double r = sqrt(-2.0 * log(u1));
  return static_cast<float>(r * cos(6.283185307179586476925286766559 * u2));
}

}  // namespace dion

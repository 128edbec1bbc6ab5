// SPDX-License-Identifier: MIT
// The tests' deterministic data: a splitmix64 hash of (seed, i) mapped to a
// float uniform in [-1, 1) (23 bits), the same on every rank, every backend
// and every run. The GPU tests' fill kernel computes the same values on the
// device (tests/gpu).
#pragma once
#include <cstdint>

inline float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 23) - 1.0);
}

// SPDX-License-Identifier: MIT
// Storage dtypes and their conversions to and from fp32. Everything the
// optimizers compute is done in fp32 (or wider); parameters, gradients and
// states are loaded and stored in their own dtype, rounding to nearest even.
// The functions are usable from host and device code.
#pragma once
#include <cstdint>
#include <cstring>

#include "dion.h"

#if defined(__CUDACC__)
#define DION_HD __host__ __device__ __forceinline__
#else
#define DION_HD inline
#endif

namespace dion {

DION_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

DION_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// bfloat16: the upper half of an fp32, rounded to nearest even; NaN stays NaN.
DION_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
DION_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// IEEE binary16, round to nearest even, with subnormals, overflow to inf.
DION_HD uint16_t float_to_fp16(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (incl. rounding) -> inf
  if (absx < 0x38800000u) {                                                // subnormal or zero in fp16
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);         // rounds to 0
    uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
    int shift = 113 - static_cast<int>(absx >> 23) + 13;  // 126 - exp + 13 ... aligns to 2^-24 units
    uint32_t half = 1u << (shift - 1);
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t q = mant >> shift;
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t exp = (absx >> 23) - 112;  // rebias 127 -> 15
  uint32_t mant = absx & 0x7fffffu;
  uint32_t q = (exp << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}
DION_HD float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // subnormal: value = mant * 2^-24
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// v as stored in dt and loaded back (store_elem's rounding).
DION_HD float round_to(dion_dtype_t dt, float v) {
  if (dt == DION_DTYPE_BF16) return bf16_to_float(float_to_bf16(v));
  if (dt == DION_DTYPE_FP16) return fp16_to_float(float_to_fp16(v));
  return v;
}

DION_HD float load_elem(const void* p, dion_dtype_t dt, int64_t i) {
  switch (dt) {
    case DION_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DION_DTYPE_FP16: return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
DION_HD void store_elem(void* p, dion_dtype_t dt, int64_t i, float v) {
  switch (dt) {
    case DION_DTYPE_BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    case DION_DTYPE_FP16: static_cast<uint16_t*>(p)[i] = float_to_fp16(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

inline size_t dtype_size(dion_dtype_t dt) { return dt == DION_DTYPE_FP32 ? 4 : 2; }
inline bool dtype_valid(dion_dtype_t dt) { return dt == DION_DTYPE_FP32 || dt == DION_DTYPE_BF16 || dt == DION_DTYPE_FP16; }
inline const char* dtype_name(dion_dtype_t dt) {
  switch (dt) {
    case DION_DTYPE_FP32: return "fp32";
    case DION_DTYPE_BF16: return "bf16";
    case DION_DTYPE_FP16: return "fp16";
    default: return "invalid";
  }
}

}  // namespace dion

// bfloat16 and float16: conversions to and from float32.
//
// float32 -> bfloat16 / float16 rounds to nearest, ties to even (as ml_dtypes and numpy
// do); overflow gives infinity, subnormal results are kept (no flush to zero), NaN stays a
// quiet NaN of the same sign. The other way is exact.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace recurra {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // NaN
  x += 0x7fffu + ((x >> 16) & 1u);  // ties to even; a carry into the exponent is right
  return static_cast<uint16_t>(x >> 16);
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));  // NaN
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: infinity
  if (x < 0x38800000u) {
    // Below 2^-14: a subnormal float16 (or zero). Adding 0.5 puts the value where one float32
    // ulp is 2^-24, the float16 subnormal step, so the add rounds it (to nearest even); the
    // low bits then count steps (2^10 steps: the smallest normal, encoded the same way).
    const float r = bits_f32(x) + 0.5f;
    return static_cast<uint16_t>(sign | (f32_bits(r) - 0x3f000000u));
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);  // exponent bias 127 -> 15, round to nearest even
  return static_cast<uint16_t>(sign | (x >> 13));
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float32
    const float v = static_cast<float>(m) * bits_f32(0x33800000u);
    return bits_f32(sign | f32_bits(v));
  }
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// n elements of dtype `t` (bf16 or f16) at `src` -> float32, and back.
inline void half_to_f32(DType t, const uint16_t* src, float* dst, int64_t n) {
  if (t == DType::bf16)
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
inline void f32_to_half(DType t, const float* src, uint16_t* dst, int64_t n) {
  if (t == DType::bf16)
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

}  // namespace recurra

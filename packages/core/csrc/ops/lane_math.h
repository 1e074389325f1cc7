// Scalar float maths written so that a loop over it vectorizes (libm's expf, log1pf, tanhf
// are calls GCC cannot vectorize without -ffast-math): use them inside RC_SIMD loops over
// contiguous arrays, where each target clone gets AVX-512 / AVX2 / SSE code.
//
// The rules that keep GCC vectorizing under -ftrapping-math: no float->int conversions
// (integers are read from the mantissa of x + 1.5 * 2^23), and every value a select chooses
// between is computed unconditionally first; out-of-range lanes are patched at the end.
// Accuracy (measured against float64 over the whole float range, tests/core): exp within
// 2 ulp including denormal results; the others within a few ulp or 1e-7 absolute.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace recurra {

inline uint32_t lane_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline float lane_float(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
// 2^k for k in [-126, 127], built in the exponent bits.
inline float lane_pow2(int32_t k) { return lane_float(static_cast<uint32_t>(k + 127) << 23); }
// m ? a : b lane by lane, m all ones or all zeros.
inline float lane_select(uint32_t m, float a, float b) {
  return lane_float((lane_bits(a) & m) | (lane_bits(b) & ~m));
}
inline uint32_t lane_mask(bool c) { return 0u - static_cast<uint32_t>(c); }
inline float abs_lane(float x) { return lane_float(lane_bits(x) & 0x7FFFFFFFu); }

// x = k ln2 + r, |r| <= ln2 / 2: returns r and sets k (|x| < 2^21 for a meaningful k).
inline float lane_reduce_ln2(float x, int32_t& k) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = x * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  k = static_cast<int32_t>(lane_bits(t) - lane_bits(kRound));
  const float r = x - n * 0.693145751953125f;  // ln2 in two parts: n * hi is exact
  return r - n * 1.42860682030941723e-6f;
}

// c[0] x^(N-1) + ... + c[N-1] by Horner's rule (the loop unrolls: N is a constant).
template <size_t N>
inline float horner(float x, const float (&c)[N]) {
  float p = c[0];
  for (size_t i = 1; i < N; ++i) p = p * x + c[i];
  return p;
}

// (e^r - 1) / r for |r| <= ln2 / 2: the degree-7 Taylor polynomial of e^r less its 1, over
// r (truncation below 1e-8 relative).
inline float lane_expm1_over_r(float r) {
  static constexpr float c[] = {1.0f / 40320, 1.0f / 5040, 1.0f / 720, 1.0f / 120,
                                1.0f / 24,    1.0f / 6,    0.5f,       1.0f};
  return horner(r, c);
}

// exp(x): +inf above ln(FLT_MAX), 0 below -104 (where the true value rounds to 0),
// denormal results in between, NaN stays NaN. 2^k is applied as two factors so that
// results below 2^-126 come out as denormals instead of zero.
inline float exp_lane(float x) {
  int32_t k;
  const float r = lane_reduce_ln2(x, k);
  const float p = lane_expm1_over_r(r) * r + 1.0f;
  const int32_t k1 = k >> 1;  // k in [-150, 128] in range: both halves are normal scales
  const float y = p * lane_pow2(k1) * lane_pow2(k - k1);
  const uint32_t over = lane_mask(x > 89.0f), under = lane_mask(x < -104.0f);
  return lane_float((lane_bits(y) & ~(over | under)) | (over & 0x7F800000u));
}

// exp(x), but 0 below -87 instead of a denormal (which would slow every later multiply):
// for sums of exponentials (softmax), where such terms do not matter.
inline float exp_ftz_lane(float x) { return lane_select(lane_mask(x < -87.0f), 0.0f, exp_lane(x)); }

// exp(x) - 1 for x <= 0, accurate near 0 (exactly the polynomial where k = 0, no
// cancellation); -1 below -104.
inline float expm1_neg_lane(float x) {
  int32_t k;
  const float r = lane_reduce_ln2(x, k);
  const float q = lane_expm1_over_r(r) * r;  // e^r - 1
  const float s = lane_pow2(k < -126 ? -126 : k);  // below 2^-24, s * e^r - 1 rounds to -1
  return lane_select(lane_mask(x < -104.0f), -1.0f, s * q + (s - 1.0f));
}

// 1 / (1 + exp(-x)), as e / (1 + e) with e = exp(x) for negative x (denormal results
// there instead of 1 / inf). The choice is a lane_select: GCC kept `x < 0 ? e * r : r` as
// control flow, and no loop over it vectorized (silu ran ~10x slower than exp).
inline float sigmoid_lane(float x) {
  const float e = exp_lane(-abs_lane(x));
  const float r = 1.0f / (1.0f + e);
  return lane_select(lane_mask(x < 0.0f), e * r, r);
}

// log1p(w) for w in [0, 1]: 2 atanh(s), s = w / (2 + w) <= 1/3, by its odd series to s^15
// (no rounding of 1 + w, so tiny w stays exact).
inline float log1p_unit_lane(float w) {
  static constexpr float c[] = {1.0f / 15, 1.0f / 13, 1.0f / 11, 1.0f / 9,
                                1.0f / 7,  1.0f / 5,  1.0f / 3,  1.0f};
  const float s = w / (w + 2.0f);
  return 2.0f * s * horner(s * s, c);
}

// log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)); x itself above 20 (like PyTorch).
inline float softplus_lane(float x) {
  const float pos = lane_float(lane_bits(x) & lane_mask(x > 0.0f));  // max(x, 0), NaN kept below
  const float r = pos + log1p_unit_lane(exp_lane(-abs_lane(x)));
  return lane_select(lane_mask(x > 20.0f), x, r);
}

// tanh(x) = -expm1(-2|x|) / (2 + expm1(-2|x|)) with the sign of x.
inline float tanh_lane(float x) {
  const uint32_t sign = lane_bits(x) & 0x80000000u;
  const float ax = abs_lane(x);
  const float e = expm1_neg_lane(-2.0f * ax);
  const float t = -e / (e + 2.0f);
  return lane_float(lane_bits(t) | sign);
}

}  // namespace recurra

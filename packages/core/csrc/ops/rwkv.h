// Shared pieces of the RWKV-family recurrent kernels (rwkv_wkv6.cpp, rwkv_wkv7.cpp,
// gated_linear_attn.cpp): vector helpers, input validation, work splitting, scratch memory.
//
// Shape legend (numpy order): T tokens in all = N sequences (runs) of n tokens each, H heads,
// S head size. Per-token inputs are (T, H, S), states (N, H, S, S). Every op returns one packed
// 1-D output: y (T, H, S) then the final states (N, H, S, S); its backward op returns the
// gradients of all its sources packed the same way, in source order.
//
// Kernels copy a state (or a block of it) into scratch with its vectorised axis padded to Sp,
// a multiple of kL lanes, and zeros in the padding. The padding stays zero through every
// update (the padded token vectors are zero too), so one vector code path is exact for every
// head size, 1, 3 and 17 included.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
// 64-byte vector arguments of always-inline helpers: no ABI crosses a library boundary here.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>  // non-temporal stores (SSE2: every x86-64 clone has them)
#endif

#include "../graph.h"
#include "../memory.h"
#include "kernel_util.h"

namespace recurra {

void register_wkv6_ops(OpTable& t);  // rwkv_wkv6.cpp
void register_wkv7_ops(OpTable& t);  // rwkv_wkv7.cpp
void register_gla_ops(OpTable& t);   // gated_linear_attn.cpp

namespace rwkv {

#define RWKV_INLINE inline __attribute__((always_inline))

// One vector of kL floats. GCC lowers it to one zmm, two ymm or four xmm registers in the
// avx512f, avx2 and default clones of an RC_SIMD function; helpers are always inlined so that
// they are compiled for the clone that calls them.
constexpr int64_t kL = 16;
typedef float vf __attribute__((vector_size(kL * sizeof(float))));

RWKV_INLINE vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
RWKV_INLINE void vstore(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }
// Stores v at p, 16-byte aligned, bypassing the caches where the CPU can: for outputs written
// once and not read again soon (y), which then cost no read of the line before the write.
RWKV_INLINE void vstream(float* p, const vf& v) {
#if defined(__SSE2__)
  for (int q = 0; q < static_cast<int>(kL / 4); ++q) {
    __m128 x;
    std::memcpy(&x, reinterpret_cast<const char*>(&v) + 16 * q, sizeof x);
    _mm_stream_ps(p + 4 * q, x);
  }
#else
  vstore(p, v);
#endif
}
// Orders this thread's streaming stores before what follows (the end of a task).
RWKV_INLINE void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}
// Whether y can be written with vstream.
inline bool stream_aligned(const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A vector of kL copies of scalar s. A macro, not a function: GCC lowers a scalar-to-vector
// conversion inside a separate (default-target) function lane by lane, even once inlined.
#define RWKV_SPLAT(s) (static_cast<float>(s) - vf{})

RWKV_INLINE float hsum(const vf& x) {
  vf v = x;
#if defined(__clang__)
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  typedef int32_t vi __attribute__((vector_size(kL * sizeof(int32_t))));
  v += __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#endif
  return v[0];
}

// The sizes of one call.
struct Dims {
  int64_t T = 0, H = 0, S = 0, N = 0;
  int64_t n = 0;   // tokens per sequence, T / N
  int64_t Sp = 0;  // S rounded up to a multiple of kL
  int64_t G = 0;   // Sp / kL lane groups
  int64_t ths() const { return T * H * S; }
  int64_t nhss() const { return N * H * S * S; }
  int64_t token(int64_t q, int64_t t, int64_t h) const { return ((q * n + t) * H + h) * S; }
  int64_t state(int64_t q, int64_t h) const { return (q * H + h) * S * S; }
};

// out[r] = the sum of the kL floats part[r * kL, (r + 1) * kL), for r < R: the horizontal sums
// of R vectors, 16 at a time by a butterfly of two-source shuffles (15 shuffle-add steps per 16
// rows instead of 4 dependent steps each). Rows pair as r / r + 8, then r / r + 4, r / r + 2,
// r / r + 1, so the last step leaves row r's sum in lane r.
RWKV_INLINE void hsum_rows(const float* part, int64_t R, float* out) {
  static_assert(kL == 16, "the butterfly is written for 16 lanes");
#if defined(__clang__)
#define RWKV_SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
  typedef int32_t vi __attribute__((vector_size(kL * sizeof(int32_t))));
#define RWKV_SHUF2(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif
  for (int64_t r0 = 0; r0 < R; r0 += kL) {
    const int64_t nr = std::min(kL, R - r0);
    vf p[kL];
    for (int64_t r = 0; r < kL; ++r) p[r] = r < nr ? vload(part + (r0 + r) * kL) : vf{};
    vf q[8], u[4], w[2];
    for (int r = 0; r < 8; ++r)
      q[r] = RWKV_SHUF2(p[r], p[r + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             RWKV_SHUF2(p[r], p[r + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                        31);
    for (int r = 0; r < 4; ++r)
      u[r] = RWKV_SHUF2(q[r], q[r + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
             RWKV_SHUF2(q[r], q[r + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                        31);
    for (int r = 0; r < 2; ++r)
      w[r] = RWKV_SHUF2(u[r], u[r + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
             RWKV_SHUF2(u[r], u[r + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                        31);
    const vf sums =
        RWKV_SHUF2(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
        RWKV_SHUF2(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    if (nr == kL) {
      vstore(out + r0, sums);
    } else {
      for (int64_t r = 0; r < nr; ++r) out[r0 + r] = sums[r];
    }
  }
#undef RWKV_SHUF2
}

// sum_i a[i] * b[i] with vector partial sums (a fixed order: deterministic).
RWKV_INLINE float dot(const float* a, const float* b, int64_t n) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + kL <= n; i += kL) acc += vload(a + i) * vload(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// sum_i a[i] * b[i] * c[i].
RWKV_INLINE float dot3(const float* a, const float* b, const float* c, int64_t n) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + kL <= n; i += kL) acc += vload(a + i) * vload(b + i) * vload(c + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i] * c[i];
  return s;
}

// dst[0, len) = src[0, len), dst[len, padded) = 0.
RWKV_INLINE void load_padded(float* dst, const float* src, int64_t len, int64_t padded) {
  std::memcpy(dst, src, static_cast<size_t>(len) * sizeof(float));
  std::memset(dst + len, 0, static_cast<size_t>(padded - len) * sizeof(float));
}

// dst[0, n) = src[0, n) in vectors (short copies, where a memcpy call costs more).
RWKV_INLINE void copy_floats(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + kL <= n; i += kL) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

#ifndef RWKV_PREFETCH_LOCALITY
#define RWKV_PREFETCH_LOCALITY 3
#endif
#ifndef RWKV_PREFETCH_TOKENS
#define RWKV_PREFETCH_TOKENS 4
#endif
// Prefetches the n floats at p. Consecutive tokens of one head lie H * S floats apart, often
// a page or more, where the hardware prefetcher stops: the kernels ask a few tokens ahead.
RWKV_INLINE void prefetch(const float* p, int64_t n, bool for_write = false) {
  for (int64_t i = 0; i < n; i += 64 / static_cast<int64_t>(sizeof(float))) {
    if (for_write)
      __builtin_prefetch(p + i, 1);
    else
      __builtin_prefetch(p + i, 0, RWKV_PREFETCH_LOCALITY);
  }
}
constexpr int64_t kPrefetchTokens = RWKV_PREFETCH_TOKENS;  // how far ahead

// src itself when it needs no padding (len == padded_len), else a zero-padded copy in buf.
RWKV_INLINE const float* padded(float* buf, const float* src, int64_t len, int64_t padded_len) {
  if (len == padded_len) return src;
  load_padded(buf, src, len, padded_len);
  return buf;
}

// Calls FN<nv>(args...) for a run-time nv in 1..4 (the lane groups of one register block).
#define RWKV_DISPATCH_NV(nv, FN, ...)  \
  switch (nv) {                        \
    case 1: FN<1>(__VA_ARGS__); break; \
    case 2: FN<2>(__VA_ARGS__); break; \
    case 3: FN<3>(__VA_ARGS__); break; \
    default: FN<4>(__VA_ARGS__); break; \
  }
constexpr int64_t kMaxNV = 4;  // lane groups kept in registers at once

// One token of the decay-plus-outer-product update on NV lane groups of a transposed state
// block (R rows j, row stride Sp): dst[j][:] = w * src[j][:] + v[j] * k. dst may be src.
template <int NV>
RWKV_INLINE void decay_step_rows(float* dst, const float* src, int64_t R, int64_t Sp,
                                 const float* k, const float* w, const float* v) {
  vf kk[NV], ww[NV];
  for (int c = 0; c < NV; ++c) {
    kk[c] = vload(k + c * kL);
    ww[c] = vload(w + c * kL);
  }
  for (int64_t j = 0; j < R; ++j) {
    const vf vj = RWKV_SPLAT(v[j]);
    for (int c = 0; c < NV; ++c)
      vstore(dst + j * Sp + c * kL, ww[c] * vload(src + j * Sp + c * kL) + vj * kk[c]);
  }
}

// The same over all Sp lanes (wkv6: w = td; GLA: w = g).
RWKV_INLINE void decay_step_t(float* dst, const float* src, int64_t R, int64_t Sp,
                              const float* k, const float* w, const float* v) {
  for (int64_t c = 0; c < Sp; c += kMaxNV * kL) {
    const int64_t nv = std::min(kMaxNV, (Sp - c) / kL);
    RWKV_DISPATCH_NV(nv, decay_step_rows, dst + c, src + c, R, Sp, k + c, w + c, v)
  }
}

// ---- forward of the decay-plus-outer-product recurrences (wkv6 and GLA) ------------------
//
// Both update S[i, :] = w_i S[i, :] + k_i v per token and read y = s (sum_i c_i S[i, :] +
// alpha v) with the state before the update: wkv6 with c = r, alpha = sum r u k, s = 1; GLA,
// which reads after the update, with c = q w, alpha = q . k, s = scale. Tokens go in pairs
// (a, b), one pass over the state for both:
//   S'' = (w_a w_b) S + (w_b k_a) v_a + k_b v_b
//   y_a = s (sum_i c_a,i S_i + alpha_a v_a),  y_b = s (sum_i c'_b,i S_i + beta v_a + gamma v_b)
// with c'_b = c_b w_a: five vector operations per state element for two tokens instead of six
// (no divisions: products of two decays only).

// The inputs of a decay recurrence: the (T, H, S) arrays, and for a task's head the bonus.
struct DecayIn {
  const float *r, *k, *v, *w;  // wkv6: r, k, v, td; GLA: q, k, v, g
  const float* u;              // wkv6's bonus: tf (H, S), tf[h] within a task; null for GLA
  float scale;                 // GLA's scale; 1 for wkv6
};

// One row of one token: acc += c_i S[i, :], then S[i, :] = w_i S[i, :] + k_i v.
template <int NV>
RWKV_INLINE void decay_forward_row(float* row, const vf* vv, float c, float w, float k,
                                   vf* acc) {
  const vf ci = RWKV_SPLAT(c), wi = RWKV_SPLAT(w), ki = RWKV_SPLAT(k);
  for (int g = 0; g < NV; ++g) {
    const vf x = vload(row + g * kL);
    acc[g] += ci * x;
    vstore(row + g * kL, wi * x + ki * vv[g]);
  }
}

// One token over NV lane groups of the state block (S rows, row stride ld): y = s (sum_i c_i
// S[i, :] + alpha v) and the update. Even and odd rows are summed apart (two dependency
// chains instead of one).
template <int NV>
RWKV_INLINE void decay_forward_rows(float* st, int64_t ld, int64_t S, const float* c,
                                    const float* w, const float* k, const float* v, float alpha,
                                    float s, float* y, bool stream) {
  vf acc0[NV], acc1[NV], vv[NV];
  for (int g = 0; g < NV; ++g) {
    acc0[g] = acc1[g] = vf{};
    vv[g] = vload(v + g * kL);
  }
  int64_t i = 0;
  for (; i + 1 < S; i += 2) {
    decay_forward_row<NV>(st + i * ld, vv, c[i], w[i], k[i], acc0);
    decay_forward_row<NV>(st + (i + 1) * ld, vv, c[i + 1], w[i + 1], k[i + 1], acc1);
  }
  if (i < S) decay_forward_row<NV>(st + i * ld, vv, c[i], w[i], k[i], acc0);
  const vf a = RWKV_SPLAT(alpha), sc = RWKV_SPLAT(s);
  for (int g = 0; g < NV; ++g) {
    const vf out = sc * ((acc0[g] + acc1[g]) + a * vv[g]);
    if (stream)
      vstream(y + g * kL, out);
    else
      vstore(y + g * kL, out);
  }
}

// Coefficients of a token pair: c1 = c_a, c2 = c'_b, c3 = w_a w_b, c4 = w_b k_a, c5 = k_b.
struct PairCoef {
  const float *c1, *c2, *c3, *c4, *c5;
  float alpha, beta, gamma, s;
};

// Two tokens over NV lane groups (see above).
template <int NV>
RWKV_INLINE void decay_forward_pair_rows(float* st, int64_t ld, int64_t S, const PairCoef& p,
                                         const float* va, const float* vb, float* ya, float* yb,
                                         bool stream) {
  vf acc_a[NV], acc_b[NV], v1[NV], v2[NV];
  for (int g = 0; g < NV; ++g) {
    acc_a[g] = acc_b[g] = vf{};
    v1[g] = vload(va + g * kL);
    v2[g] = vload(vb + g * kL);
  }
  for (int64_t i = 0; i < S; ++i) {
    const vf c1 = RWKV_SPLAT(p.c1[i]), c2 = RWKV_SPLAT(p.c2[i]), c3 = RWKV_SPLAT(p.c3[i]);
    const vf c4 = RWKV_SPLAT(p.c4[i]), c5 = RWKV_SPLAT(p.c5[i]);
    float* row = st + i * ld;
    for (int g = 0; g < NV; ++g) {
      const vf x = vload(row + g * kL);
      acc_a[g] += c1 * x;
      acc_b[g] += c2 * x;
      vstore(row + g * kL, c3 * x + c4 * v1[g] + c5 * v2[g]);
    }
  }
  const vf al = RWKV_SPLAT(p.alpha), be = RWKV_SPLAT(p.beta), ga = RWKV_SPLAT(p.gamma);
  const vf sc = RWKV_SPLAT(p.s);
  for (int g = 0; g < NV; ++g) {
    const vf oa = sc * (acc_a[g] + al * v1[g]);
    const vf ob = sc * (acc_b[g] + be * v1[g] + ga * v2[g]);
    if (stream) {
      vstream(ya + g * kL, oa);
      vstream(yb + g * kL, ob);
    } else {
      vstore(ya + g * kL, oa);
      vstore(yb + g * kL, ob);
    }
  }
}

// Scratch floats of decay_forward_task besides the state block.
inline int64_t decay_forward_buf(int64_t S, int64_t W) { return 4 * W + 6 * S; }

// One forward task: run q, head h, value lanes [j0, j0 + W) (W a multiple of kL) of a
// decay recurrence. `st` (S rows of W lanes) holds the state block on entry and the final one
// on return; `buf` has decay_forward_buf(S, W) floats. Inlined into decay_forward_block
// (rwkv_decay_forward.cpp), the one RC_SIMD function that wkv6 and GLA both run.
RWKV_INLINE void decay_forward_task(const DecayIn& in, const Dims& d, int64_t q, int64_t h,
                                    int64_t j0, int64_t W, float* st, float* buf, float* y) {
  const int64_t S = d.S, jn = std::min(W, S - j0);
  const bool direct = jn == W;  // no padding in this block: v read, y written in place
  const bool after = in.u == nullptr;  // GLA: reads the updated state
  float* vpad = buf;                   // 2 W
  float* ypad = buf + 2 * W;           // 2 W
  float* cb = buf + 4 * W;             // 6 S: coefficient arrays
  for (int64_t t = 0; t < d.n; t += 2) {
    const bool pair = t + 1 < d.n;
    for (int64_t x = t + kPrefetchTokens; x < std::min(d.n, t + kPrefetchTokens + 2); ++x) {
      const int64_t ahead = d.token(q, x, h);
      for (const float* p : {in.r, in.k, in.w}) prefetch(p + ahead, S);
      prefetch(in.v + ahead + j0, jn);
    }
    const int64_t ta = d.token(q, t, h), tb = pair ? d.token(q, t + 1, h) : ta;
    const float *va = in.v + ta + j0, *vb = in.v + tb + j0;
    float* ya = direct ? y + ta + j0 : ypad;
    float* yb = direct ? y + tb + j0 : ypad + W;
    if (!direct) {
      load_padded(vpad, va, jn, W);
      load_padded(vpad + W, vb, jn, W);
      va = vpad;
      vb = vpad + W;
    }
    const bool stream = direct && stream_aligned(ya) && stream_aligned(yb);
    const float *ra = in.r + ta, *ka = in.k + ta, *wa = in.w + ta;
    if (!pair) {
      const float* c = ra;
      float alpha;
      if (after) {
        for (int64_t i = 0; i < S; ++i) cb[i] = ra[i] * wa[i];
        c = cb;
        alpha = dot(ra, ka, S);
      } else {
        alpha = dot3(ra, in.u, ka, S);
      }
      for (int64_t g = 0; g < W; g += kMaxNV * kL) {
        const int64_t nv = std::min(kMaxNV, (W - g) / kL);
        RWKV_DISPATCH_NV(nv, decay_forward_rows, st + g, W, S, c, wa, ka, va + g, alpha,
                         in.scale, ya + g, stream)
      }
    } else {
      const float *rb = in.r + tb, *kb = in.k + tb, *wb = in.w + tb;
      float *c1 = cb, *c2 = cb + S, *c3 = cb + 2 * S, *c4 = cb + 3 * S;
      for (int64_t i = 0; i < S; ++i) {
        c3[i] = wa[i] * wb[i];
        c4[i] = wb[i] * ka[i];
      }
      PairCoef p{ra, c2, c3, c4, kb, 0.0f, 0.0f, 0.0f, in.scale};
      if (after) {  // c = q w: c_a = q_a w_a, c'_b = q_b w_b w_a
        for (int64_t i = 0; i < S; ++i) {
          c1[i] = ra[i] * wa[i];
          c2[i] = rb[i] * c3[i];
        }
        p.c1 = c1;
        p.alpha = dot(ra, ka, S);
        p.beta = dot(rb, c4, S);
        p.gamma = dot(rb, kb, S);
      } else {  // c = r: c_a = r_a, c'_b = r_b w_a
        for (int64_t i = 0; i < S; ++i) c2[i] = rb[i] * wa[i];
        p.alpha = dot3(ra, in.u, ka, S);
        p.beta = dot(rb, ka, S);
        p.gamma = dot3(rb, in.u, kb, S);
      }
      for (int64_t g = 0; g < W; g += kMaxNV * kL) {
        const int64_t nv = std::min(kMaxNV, (W - g) / kL);
        RWKV_DISPATCH_NV(nv, decay_forward_pair_rows, st + g, W, S, p, va + g, vb + g, ya + g,
                         yb + g, stream)
      }
    }
    if (!direct) {
      copy_floats(y + ta + j0, ypad, jn);
      if (pair) copy_floats(y + tb + j0, ypad + W, jn);
    }
  }
  stream_fence();
}

// Runs a decay recurrence's forward (wkv6 and GLA; rwkv_decay_forward.cpp): tasks (run,
// head, block of value lane groups; the value columns are independent), each through
// decay_forward_task compiled once for both ops. `in` holds the input base pointers; the
// output is packed y, states.
void decay_forward(KernelCtx& c, const Dims& d, const DecayIn& in, const float* s0);

// Backward pass 1 for a decay-plus-outer-product state (wkv6: w = td; GLA: w = g) on the
// transposed block of rows [j0, j0 + R) of run q, head h: ck[c] = the state before token c K,
// for c < nck; ck[0] holds the initial state on entry. A chunk's first token reads its
// checkpoint, its last writes the next one, the tokens between update st in place.
RWKV_INLINE void decay_checkpoints(float* ck, float* st, const Dims& d, int64_t q, int64_t h,
                                   int64_t j0, int64_t R, int64_t K, int64_t nck, const float* k,
                                   const float* w, const float* v, float* kb, float* wb) {
  const int64_t S = d.S, Sp = d.Sp, RS = R * Sp;
  for (int64_t t = 0; t < (nck - 1) * K; ++t) {
    const float* src = t % K == 0 ? ck + (t / K) * RS : st;
    float* dst = t % K == K - 1 ? ck + (t / K + 1) * RS : st;
    const int64_t base = d.token(q, t, h);
    if (t + kPrefetchTokens < d.n) {
      const int64_t ahead = d.token(q, t + kPrefetchTokens, h);
      prefetch(k + ahead, S);
      prefetch(w + ahead, S);
      prefetch(v + ahead + j0, R);
    }
    decay_step_t(dst, src, R, Sp, padded(kb, k + base, S, Sp), padded(wb, w + base, S, Sp),
                 v + base + j0);
  }
}

// Backward pass 2, the recomputation of one chunk [t0, t1): chunk[x] = the state before token
// t0 + x, from the chunk's checkpoint ck_c.
RWKV_INLINE void decay_recompute(float* chunk, const float* ck_c, const Dims& d, int64_t q,
                                 int64_t h, int64_t j0, int64_t R, int64_t t0, int64_t t1,
                                 const float* k, const float* w, const float* v, float* kb,
                                 float* wb) {
  const int64_t S = d.S, Sp = d.Sp, RS = R * Sp;
  std::memcpy(chunk, ck_c, static_cast<size_t>(RS) * sizeof(float));
  for (int64_t t = t0; t + 1 < t1; ++t) {
    const int64_t base = d.token(q, t, h);
    decay_step_t(chunk + (t - t0 + 1) * RS, chunk + (t - t0) * RS, R, Sp,
                 padded(kb, k + base, S, Sp), padded(wb, w + base, S, Sp), v + base + j0);
  }
}

// Transposed, zero-padded copies of rows [j0, j0 + R) of two (S, S) matrices: dst[j][i] =
// src[i][j0 + j] (the initial state and the final state's gradient of a backward task).
RWKV_INLINE void load_transposed(float* dst_a, const float* src_a, float* dst_b,
                                 const float* src_b, int64_t S, int64_t Sp, int64_t j0,
                                 int64_t R) {
  std::memset(dst_a, 0, static_cast<size_t>(R * Sp) * sizeof(float));
  std::memset(dst_b, 0, static_cast<size_t>(R * Sp) * sizeof(float));
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < R; ++j) {
      dst_a[j * Sp + i] = src_a[i * S + j0 + j];
      dst_b[j * Sp + i] = src_b[i * S + j0 + j];
    }
}

// ---- backward of the decay-plus-outer-product recurrences (wkv6 and GLA; rwkv_wkv6.cpp) --
//
// With lam_t = dL/dS_t walked from the last token, mu_t the whole gradient of S_t and
// gv_t = gy_t . v_t, both get dc (their readout: r or q), dk, dv, dw (the decay) and
// d(state) = lam_0. wkv6 (u = its bonus tf, given) reads the state before the update,
// mu_t = lam_t, lam_{t-1} = w_t mu_t + r_t gy_t^T, and also gets du; GLA (u null) reads after
// it, mu_t = lam_t + scale q_t gy_t^T, lam_{t-1} = w_t mu_t.
struct DecayBackIn {
  const float *k, *v, *c, *w;  // (T, H, S)
  const float* u;              // (H, S), or nullptr
  float scale;                 // GLA's output scale (1 for wkv6)
  const float *s0, *gy;        // initial states; packed gradient of (y, final states)
};
struct DecayGrad {
  float *dk, *dv, *dc, *dw;  // (T, H, S)
  float* du;                 // (H, S) when u is given
  float* ds;                 // d(initial state), (N, H, S, S)
};
void decay_backward(KernelCtx& c, const Dims& d, const DecayBackIn& in, const DecayGrad& out);

Dims make_dims(int64_t T, int64_t H, int64_t S, int64_t N);

// Validates the sources of a recurrent op (or, with `grad`, of its backward op whose last
// source is the packed gradient of the forward output) and returns the sizes. `tok` are the
// indices of the (T, H, S) inputs, `hs` of an (H, S) input or -1, `st` of the state.
// Throws ValueError (counts, shapes) or TypeError (dtypes) naming the op and the shapes.
Dims check_sources(const Graph& g, const Node& n, const std::vector<int>& tok, int hs, int st,
                   const char* signature, bool grad);

// Work split: tasks are (sequence, head, block); heads are cut into blocks only when there
// are fewer than kMinTasks (sequence, head) pairs. The split depends on the sizes alone, never
// on the thread count, so results are bitwise the same for any number of threads.
constexpr int64_t kMinTasks = 8;
inline int64_t n_blocks(int64_t units, int64_t max_blocks) {
  return std::max<int64_t>(1, std::min<int64_t>(max_blocks, (kMinTasks + units - 1) / units));
}
inline int64_t block_begin(int64_t b, int64_t nb, int64_t total) { return b * total / nb; }
// Runs fn(q, h, lo, W, n, tid) for every forward task: sequence q, head h and the block of
// value lanes [lo, lo + W) (W a multiple of kL; n = the lanes of it below S), on `pool`.
template <class Pool, class Fn>
void for_each_head_block(Pool& pool, const Dims& d, Fn&& fn) {
  const int64_t nb = n_blocks(d.N * d.H, d.G);
  pool.run(d.N * d.H * nb, [&](int64_t task, int tid) {
    const int64_t b = task % nb, qh = task / nb;
    const int64_t g0 = block_begin(b, nb, d.G), g1 = block_begin(b + 1, nb, d.G);
    const int64_t lo = g0 * kL, W = (g1 - g0) * kL;
    fn(qh / d.H, qh % d.H, lo, W, std::min(W, d.S - lo), tid);
  });
}
// The backward splits a head into at most two blocks: each block's sums over its rows go to a
// partial buffer the size of the gradients they belong to, so at most twice that memory.
inline int64_t backward_blocks(int64_t units, int64_t rows) {
  return std::min<int64_t>(2, n_blocks(units, rows));
}

// Checkpoint interval of the backward kernels: the state is saved every K tokens and the
// states in between recomputed one chunk at a time, so a task holds ceil(n/K) + K states
// (O(sqrt(n)) instead of n).
inline int64_t checkpoint_interval(int64_t n) {
  return std::max<int64_t>(16, static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n)))));
}

// Per-thread scratch memory, 64-byte aligned, grown on demand and reused across the tasks of
// one kernel call.
class Scratch {
 public:
  explicit Scratch(int n_threads) : bufs_(static_cast<size_t>(std::max(1, n_threads))) {}
  float* get(int tid, size_t n_floats) {
    Buf& b = bufs_[static_cast<size_t>(tid)];
    if (b.n < n_floats) {
      const size_t bytes = (n_floats * sizeof(float) + 63) / 64 * 64;
      b.p.reset(static_cast<float*>(host_alloc(bytes)));
      b.n = n_floats;
    }
    return b.p.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { host_free(p); }
  };
  struct Buf {
    std::unique_ptr<float, Free> p;
    size_t n = 0;
  };
  std::vector<Buf> bufs_;
};

// Sums nb partial results part[b * len + i] into out[i] in block order (deterministic).
void reduce_blocks(ThreadPool& pool, float* out, const float* part, int64_t nb, int64_t len);

// Registers `name` (forward) and `name`_back (its backward) with the packed gradients cut
// back into one gradient per source. `n_src` sources, the (T, H, S) ones listed in `tok`.
struct RecurrentOp {
  const char* name;
  const char* signature;  // for error messages, e.g. "(k, v, r, tf, td, state)"
  int n_src;
  std::vector<int> tok;
  int hs;  // index of the (H, S) source, or -1
  int st;  // index of the state
  int n_fp;
  std::function<void(KernelCtx&, const Dims&)> forward;
  std::function<void(KernelCtx&, const Dims&)> backward;
};
void register_recurrent(OpTable& t, const RecurrentOp& op);

}  // namespace rwkv
}  // namespace recurra

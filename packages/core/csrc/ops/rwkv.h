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

#include "../graph.h"
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
  typedef int32_t vi __attribute__((vector_size(kL * sizeof(int32_t))));
#if defined(__clang__)
#define RWKV_SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
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

// Prefetches the n floats at p. Consecutive tokens of one head lie H * S floats apart, often
// a page or more, where the hardware prefetcher stops: the kernels ask a few tokens ahead.
RWKV_INLINE void prefetch(const float* p, int64_t n, bool for_write = false) {
  for (int64_t i = 0; i < n; i += 64 / static_cast<int64_t>(sizeof(float))) {
    if (for_write)
      __builtin_prefetch(p + i, 1);
    else
      __builtin_prefetch(p + i, 0);
  }
}
#ifndef RWKV_PREFETCH_TOKENS
#define RWKV_PREFETCH_TOKENS 4
#endif
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

// dst[0, n) = src[0, n) in vectors (short copies, where a memcpy call costs more).
RWKV_INLINE void copy_floats(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + kL <= n; i += kL) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

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
      b.p.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      if (!b.p) throw std::bad_alloc();
      b.n = n_floats;
    }
    return b.p.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
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

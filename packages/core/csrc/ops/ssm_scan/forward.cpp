// ssm_scan, the forward: rows layout (P > 1), heads layout (P == 1), and one token at a time
// for generation (any P), with the checkpoints a forward saves when asked (see scan.h).
#include "scan.h"

namespace recurra {
namespace ssm {
namespace scan {

namespace {

// ======================================================================================
// Forward, rows layout: one (sequence, head, block of L channels).
// ======================================================================================

// ---- One token (T == 1: a generation step) ----
// The rows kernels' transposed, scaled state would cost two passes more over it than the
// token itself; here each row [p][:] of a (sequence, head) state is read once and written
// once, vectorized along n: S'[p][n] = a[n] S[p][n] + B[n] dtp x[p], y[p] = C . S'[p]. The
// output may be the state itself (written in place): each vector is loaded before it is
// stored.

// out[n] = exp(d * A[n]) for n < N (zeros up to the next multiple of 16): the decays of one
// head of a step. GCC's vector-extension vexp keeps its clamps in scalar code in the AVX2
// clone of step_heads (a store-forwarding stall per lane: most of a Mamba-1 step), so on
// AVX2 + FMA this is vexp's arithmetic written with intrinsics, 8 lanes at a time.
using DecayRow = void (*)(const float* A, float d, int64_t N, float* out);

#if defined(__x86_64__) && defined(__GNUC__)
// exp(x) of 8 lanes: vexp's arithmetic with intrinsics (lanes below -87 give 0), inlined.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp8_avx2(__m256 x) {
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));
  const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 k = _mm256_sub_ps(t, magic);
  const __m256i ki = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440054690583e-4f), r);
  __m256 p = _mm256_set1_ps(1.3836826e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3748158e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1668225e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666420e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.9999991e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(ki, _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

__attribute__((target("avx2,fma"))) void decay_row_avx2(const float* A, float d, int64_t N, float* out) {
  const __m256 dv = _mm256_set1_ps(d);
  const int64_t Np = (N + 15) / 16 * 16;
  for (int64_t n = 0; n < Np; n += 8) {
    __m256 x;
    if (n + 8 <= N) {
      x = _mm256_mul_ps(_mm256_loadu_ps(A + n), dv);
    } else {
      alignas(32) float t[8] = {};
      for (int64_t l = 0; l < N - n; ++l) t[l] = A[n + l];
      x = _mm256_mul_ps(_mm256_load_ps(t), dv);
    }
    __m256 res = exp8_avx2(x);
    if (n + 8 > N) {  // lanes past N: 0, as exp_row leaves them
      alignas(32) float t[8];
      _mm256_store_ps(t, res);
      for (int64_t l = std::max<int64_t>(0, N - n); l < 8; ++l) t[l] = 0.0f;
      res = _mm256_load_ps(t);
    }
    _mm256_storeu_ps(out + n, res);
  }
}
#endif

void decay_row_plain(const float* A, float d, int64_t N, float* out) { exp_row(A, d, N, (N + 15) / 16 * 16, out); }

DecayRow best_decay_row() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return decay_row_avx2;
#endif
  return decay_row_plain;
}

#if defined(__x86_64__) && defined(__GNUC__)
// Sums of 8 vectors, one lane each: out[j] = sum of v[j]'s lanes.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 hsum8x8_avx2(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  // ab = [v0 v1 v2 v3 (low halves) | v0 v1 v2 v3 (high halves)], cd likewise for v4..v7
  const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
  return _mm256_add_ps(lo, hi);
}

// The dot products of consecutive rows y[r], y[r + 1], ... as 8-lane partial sums, reduced
// 8 rows at a time (hsum8x8_avx2) and stored.
struct RowSums8 {
  float* y;  // where the next row's sum goes
  __m256 part[8] = {};
  int np = 0;

  __attribute__((target("avx2,fma"), always_inline)) inline void add(__m256 v) {
    part[np] = v;
    if (++np == 8) {
      _mm256_storeu_ps(y, hsum8x8_avx2(part));
      y += 8;
      np = 0;
    }
  }
  __attribute__((target("avx2,fma"), always_inline)) inline void finish() {
    if (!np) return;
    for (int k = np; k < 8; ++k) part[k] = _mm256_setzero_ps();
    alignas(32) float t[8];
    _mm256_store_ps(t, hsum8x8_avx2(part));
    for (int k = 0; k < np; ++k) y[k] = t[k];
  }
};
#endif

struct StepFwd {
  Dims d;
  const float *s, *x, *dt, *A, *B, *C;
  const int32_t* ids;
  float* y;
  float* sout;  // nullptr: in place
  float* ck;    // the state entering the token, or nullptr
  DecayRow decay;
};

// What head ih = (sequence i, head h of group g) of a step reads and writes; copies the
// state entering the token to the checkpoints when they are asked for.
struct StepHead {
  const float *B, *C, *s0, *x;
  float* s1;
};

inline StepHead step_head(const StepFwd& f, int64_t i, int64_t h, int64_t g, int64_t ih) {
  const Dims& d = f.d;
  const int64_t pn = d.P * d.N;
  const float* s0 = f.s + (f.ids[i] * d.H + h) * pn;
  if (f.ck) std::copy(s0, s0 + pn, f.ck + ih * pn);  // the state entering chunk 0
  return {f.B + (i * d.G + g) * d.N, f.C + (i * d.G + g) * d.N, s0, f.x + ih * d.P,
          f.sout ? f.sout + ih * pn : const_cast<float*>(s0)};
}

// Heads [h0, h1) of the flat (sequence, head) index, all in one function: per head one
// softplus, its decays (one vector per 16 states, or one exp for a per-head decay), then
// its P rows; the rows' dot products C . S' are kept as 16-lane partial sums and reduced
// 16 rows at a time (hsum16x16), which is what makes Mamba-1's 1536 heads of one 16-state
// row cheap. `an` holds Np floats, `acc` 16 rows of 16, `dtp` h1 - h0 rounded up to 16.
RC_SIMD void step_heads(const StepFwd& f, int64_t h0, int64_t h1, float* __restrict an, float* __restrict acc,
                        float* __restrict dtps) {
  const Dims& d = f.d;
  // dt of heads h0..h1 are contiguous (dt is (S, 1, H)): their softplus 16 at a time
  dt_column(f.dt + h0, 1, h1 - h0, 0.0f, dtps, nullptr, nullptr);
  const int64_t N = d.N, P = d.P, nfull = N / 16 * 16, tail = N - nfull;
  int64_t rb = h0 * P;  // first row of the pending partial sums
  int nacc = 0;
  auto flush = [&]() {
    const vf r = hsum16x16(acc);
    if (nacc == 16)
      vstore(f.y + rb, r);
    else
      vstore_part(f.y + rb, r, nacc);
    rb += nacc;
    nacc = 0;
  };
  // (sequence i, head h, group g) of ih, counted along (no divisions per head)
  int64_t i = h0 / d.H, h = h0 % d.H, g = h / d.hpg, hg = h % d.hpg;
  for (int64_t ih = h0; ih < h1; ++ih, ++h, ++hg) {
    if (h == d.H) h = 0, hg = 0, g = 0, ++i;
    if (hg == d.hpg) hg = 0, ++g;
    const float dtp = dtps[ih - h0];
    const float* Ah = f.A + h * d.NA;
    if (d.per_n) {
      f.decay(Ah, dtp, N, an);
    } else {
      const vf a = vsplat(std::exp(dtp * Ah[0]));
      for (int64_t n = 0; n < N; n += 16) vstore(an + n, a);
    }
    const StepHead sh = step_head(f, i, h, g, ih);
    const float *Bi = sh.B, *Ci = sh.C, *s0 = sh.s0, *xh = sh.x;
    float* s1 = sh.s1;
    for (int64_t p = 0; p < P; ++p) {
      const float bu = dtp * xh[p];
      const float* sr = s0 + p * N;
      float* orow = s1 + p * N;
      vf e = {}, o = {};
      int64_t n = 0;
      for (; n + 32 <= nfull; n += 32) {
        const vf v0 = vload(an + n) * vload(sr + n) + vload(Bi + n) * bu;
        const vf v1 = vload(an + n + 16) * vload(sr + n + 16) + vload(Bi + n + 16) * bu;
        vstore(orow + n, v0);
        vstore(orow + n + 16, v1);
        e += vload(Ci + n) * v0;
        o += vload(Ci + n + 16) * v1;
      }
      if (n < nfull) {
        const vf v = vload(an + n) * vload(sr + n) + vload(Bi + n) * bu;
        vstore(orow + n, v);
        e += vload(Ci + n) * v;
      }
      if (tail) {
        const vf v = vload_part(an + nfull, tail) * vload_part(sr + nfull, tail) +
                     vload_part(Bi + nfull, tail) * bu;
        vstore_part(orow + nfull, v, tail);
        o += vload_part(Ci + nfull, tail) * v;
      }
      vstore(acc + nacc * 16, e + o);
      if (++nacc == 16) flush();
    }
  }
  if (nacc) {
    for (int k = nacc; k < 16; ++k) vstore(acc + k * 16, vf{});
    flush();
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// step_heads for one row of 16 states per head (P == 1, N == 16: Mamba-1's d_state 16),
// written for AVX2 + FMA: a head's state is two 8-lane vectors, its decays two inlined
// exps (nothing stored and reloaded, no call per head), and the dot products C . S' of 8
// heads are reduced together. Same arithmetic as step_heads' decays; the state update is
// one FMA per vector, S' = a S + (B dtp x).
__attribute__((target("avx2,fma"))) void step_heads_p1n16(const StepFwd& f, int64_t h0, int64_t h1,
                                                         float* __restrict dtps) {
  const Dims& d = f.d;
  dt_column(f.dt + h0, 1, h1 - h0, 0.0f, dtps, nullptr, nullptr);
  int64_t i = h0 / d.H, h = h0 % d.H, g = h / d.hpg, hg = h % d.hpg;
  RowSums8 sums{f.y + h0};
  for (int64_t ih = h0; ih < h1; ++ih, ++h, ++hg) {
    if (h == d.H) h = 0, hg = 0, g = 0, ++i;
    if (hg == d.hpg) hg = 0, ++g;
    const float dtp = dtps[ih - h0];
    const float* Ah = f.A + h * 16;
    const StepHead sh = step_head(f, i, h, g, ih);
    const float *Bi = sh.B, *Ci = sh.C, *s0 = sh.s0;
    float* s1 = sh.s1;
    const __m256 dv = _mm256_set1_ps(dtp), bu = _mm256_set1_ps(dtp * sh.x[0]);
    const __m256 a0 = exp8_avx2(_mm256_mul_ps(_mm256_loadu_ps(Ah), dv));
    const __m256 a1 = exp8_avx2(_mm256_mul_ps(_mm256_loadu_ps(Ah + 8), dv));
    const __m256 v0 = _mm256_fmadd_ps(a0, _mm256_loadu_ps(s0), _mm256_mul_ps(_mm256_loadu_ps(Bi), bu));
    const __m256 v1 = _mm256_fmadd_ps(a1, _mm256_loadu_ps(s0 + 8), _mm256_mul_ps(_mm256_loadu_ps(Bi + 8), bu));
    _mm256_storeu_ps(s1, v0);
    _mm256_storeu_ps(s1 + 8, v1);
    sums.add(_mm256_fmadd_ps(_mm256_loadu_ps(Ci + 8), v1, _mm256_mul_ps(_mm256_loadu_ps(Ci), v0)));
  }
  sums.finish();
}

// step_heads for one decay per head (Mamba-2) and N a multiple of 8, written for AVX2 +
// FMA: the decay and B dtp x[p] are broadcast registers, each row of the state runs in
// 8-lane vectors (S' = a S + B (dtp x[p]), y[p] = C . S'), and the dot products of 8 rows
// are reduced together. GCC's 16-lane vector-extension code of step_heads broadcast a
// scalar into 16 lanes through memory there: ~4x the work per state.
__attribute__((target("avx2,fma"))) void step_heads_rows8(const StepFwd& f, int64_t h0, int64_t h1,
                                                         float* __restrict dtps) {
  const Dims& d = f.d;
  dt_column(f.dt + h0, 1, h1 - h0, 0.0f, dtps, nullptr, nullptr);
  const int64_t N = d.N, P = d.P, n16 = N & ~int64_t{15};
  RowSums8 sums{f.y + h0 * P};
  int64_t i = h0 / d.H, h = h0 % d.H, g = h / d.hpg, hg = h % d.hpg;
  for (int64_t ih = h0; ih < h1; ++ih, ++h, ++hg) {
    if (h == d.H) h = 0, hg = 0, g = 0, ++i;
    if (hg == d.hpg) hg = 0, ++g;
    const float dtp = dtps[ih - h0];
    const __m256 av = _mm256_set1_ps(std::exp(dtp * f.A[h * d.NA]));
    const StepHead sh = step_head(f, i, h, g, ih);
    const float *Bi = sh.B, *Ci = sh.C, *s0 = sh.s0, *xh = sh.x;
    float* s1 = sh.s1;
    for (int64_t p = 0; p < P; ++p) {
      const __m256 bu = _mm256_set1_ps(dtp * xh[p]);
      const float* sr = s0 + p * N;
      float* orow = s1 + p * N;
      __m256 e = _mm256_setzero_ps(), o = e;
      int64_t n = 0;
      for (; n < n16; n += 16) {
        const __m256 v0 = _mm256_fmadd_ps(av, _mm256_loadu_ps(sr + n), _mm256_mul_ps(_mm256_loadu_ps(Bi + n), bu));
        const __m256 v1 =
            _mm256_fmadd_ps(av, _mm256_loadu_ps(sr + n + 8), _mm256_mul_ps(_mm256_loadu_ps(Bi + n + 8), bu));
        _mm256_storeu_ps(orow + n, v0);
        _mm256_storeu_ps(orow + n + 8, v1);
        e = _mm256_fmadd_ps(_mm256_loadu_ps(Ci + n), v0, e);
        o = _mm256_fmadd_ps(_mm256_loadu_ps(Ci + n + 8), v1, o);
      }
      if (n < N) {  // N % 16 == 8
        const __m256 v0 = _mm256_fmadd_ps(av, _mm256_loadu_ps(sr + n), _mm256_mul_ps(_mm256_loadu_ps(Bi + n), bu));
        _mm256_storeu_ps(orow + n, v0);
        e = _mm256_fmadd_ps(_mm256_loadu_ps(Ci + n), v0, e);
      }
      sums.add(_mm256_add_ps(e, o));
    }
  }
  sums.finish();
}

bool step_rows8_ok(const Dims& d) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return avx2 && !d.per_n && d.N % 8 == 0 && d.P > 1;
}

bool step_p1n16_ok(const Dims& d, const float* ck) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return avx2 && d.P == 1 && d.N == 16 && d.per_n && ck == nullptr;
}
#else
void step_heads_p1n16(const StepFwd&, int64_t, int64_t, float*) {}
bool step_p1n16_ok(const Dims&, const float*) { return false; }
void step_heads_rows8(const StepFwd&, int64_t, int64_t, float*) {}
bool step_rows8_ok(const Dims&) { return false; }
#endif

struct RowsFwd {
  const float* s0;   // s[row, h, p0, 0]: (p, n) at s0[p * N + n]
  const float* x;    // x[i, 0, h, p0]: token stride xs
  const float* dtp;  // softplus(dt[i, :, h]), T
  const float* a;    // exp(dtp * A[h]) per token (one decay per head), else nullptr
  const float* Ah;   // A[h, :] (per-state decay)
  const float* B;    // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* y;     // y[i, 0, h, p0]: token stride xs
  float* sout;  // final state [i, h, p0, 0]
  float* ck;    // checkpoints [i, h, 0, p0, 0] (chunk stride P * N), or nullptr
  int64_t T, N, pl, xs, bs, ck_stride;
  float* St;       // [N][L]: S / P (kept between chunks)
  float* Pv;       // Np: accumulated per-state decay (per-state A)
  float* scratch;  // 4 * Np
  float P;         // accumulated decay (one decay per head)
};

// One token: S[n][:] += b[n] u; out = sum_n c[n] S[n][:]. Even and odd n use separate
// accumulators so that the FMA latency (4 cycles) never limits the loop.
template <int V>
RC_INLINE void rows_fwd_token(float* __restrict St, const float* __restrict b, const float* __restrict c,
                              const vf* u, vf* out, int64_t N) {
  constexpr int L = 16 * V;
  vf e[V], o[V];
  for (int v = 0; v < V; ++v) e[v] = o[v] = vf{};
  int64_t n = 0;
  for (; n + 2 <= N; n += 2) {
    float* sp = St + n * L;
    const float b0 = b[n], c0 = c[n], b1 = b[n + 1], c1 = c[n + 1];
    for (int v = 0; v < V; ++v) {
      vf s0 = vload(sp + 16 * v) + b0 * u[v];
      vf s1 = vload(sp + L + 16 * v) + b1 * u[v];
      vstore(sp + 16 * v, s0);
      vstore(sp + L + 16 * v, s1);
      e[v] += c0 * s0;
      o[v] += c1 * s1;
    }
  }
  if (n < N) {
    float* sp = St + n * L;
    for (int v = 0; v < V; ++v) {
      vf s0 = vload(sp + 16 * v) + b[n] * u[v];
      vstore(sp + 16 * v, s0);
      e[v] += c[n] * s0;
    }
  }
  for (int v = 0; v < V; ++v) out[v] = e[v] + o[v];
}

// M tokens per sweep over the state: each element is loaded and stored once for all M,
// which takes the load/store traffic off the critical path (M FMAs pairs per element).
template <int V, int M>
RC_INLINE void rows_fwd_tokens(float* __restrict St, const float* const* b, const float* const* c,
                               const vf (*u)[V], vf (*out)[V], int64_t N) {
  constexpr int L = 16 * V;
  vf e[M][V], o[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) e[m][v] = o[m][v] = vf{};
  int64_t n = 0;
  for (; n + 2 <= N; n += 2) {
    float* sp = St + n * L;
    for (int v = 0; v < V; ++v) {
      vf s0 = vload(sp + 16 * v), s1 = vload(sp + L + 16 * v);
      for (int m = 0; m < M; ++m) {
        s0 += b[m][n] * u[m][v];
        s1 += b[m][n + 1] * u[m][v];
        e[m][v] += c[m][n] * s0;
        o[m][v] += c[m][n + 1] * s1;
      }
      vstore(sp + 16 * v, s0);
      vstore(sp + L + 16 * v, s1);
    }
  }
  if (n < N) {
    float* sp = St + n * L;
    for (int v = 0; v < V; ++v) {
      vf s0 = vload(sp + 16 * v);
      for (int m = 0; m < M; ++m) {
        s0 += b[m][n] * u[m][v];
        e[m][v] += c[m][n] * s0;
      }
      vstore(sp + 16 * v, s0);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) out[m][v] = e[m][v] + o[m][v];
}

// rows_fwd_tokens for one 16-lane vector (V = 1) on AVX2, from x to y: two passes of 8
// lanes. The 16-float version keeps 16 vectors of two registers each live and spills on
// every element; here 8 + 4 broadcasts of 16 registers. Lane for lane the same operations
// in the same order: u = x us, S[n][:] += b[n] u, y = ys sum_n c[n] S[n][:].
template <int M>
RC_INLINE void rows_fwd_tokens_half(float* __restrict St, const float* const* b, const float* const* c,
                                    const float* const* x, const float* us, float* const* y, const float* ys,
                                    int64_t pl, int64_t N) {
  constexpr int L = 16;
  for (int64_t h = 0; h < 16; h += 8) {
    v8 uv[M], e[M], o[M];
    for (int m = 0; m < M; ++m) {
      uv[m] = row8_at(x[m], h, pl) * us[m];
      e[m] = o[m] = v8{};
    }
    int64_t n = 0;
    for (; n + 2 <= N; n += 2) {
      float* sp = St + n * L + h;
      v8 s0 = v8load(sp), s1 = v8load(sp + L);
      for (int m = 0; m < M; ++m) {
        s0 += b[m][n] * uv[m];
        s1 += b[m][n + 1] * uv[m];
        e[m] += c[m][n] * s0;
        o[m] += c[m][n + 1] * s1;
      }
      v8store(sp, s0);
      v8store(sp + L, s1);
    }
    if (n < N) {
      float* sp = St + n * L + h;
      v8 s0 = v8load(sp);
      for (int m = 0; m < M; ++m) {
        s0 += b[m][n] * uv[m];
        e[m] += c[m][n] * s0;
      }
      v8store(sp, s0);
    }
    for (int m = 0; m < M; ++m) row8_put(y[m], h, pl, (e[m] + o[m]) * ys[m], false);
  }
}

template <int V>
RC_INLINE void load_u(const float* xt, int64_t pl, float scale, vf* u) {
  for (int v = 0; v < V; ++v) {
    const int64_t m = std::min<int64_t>(16, pl - 16 * v);
    u[v] = (m >= 16 ? vload(xt + 16 * v) : m > 0 ? vload_part(xt + 16 * v, m) : vf{}) * scale;
  }
}

template <int V>
RC_INLINE void store_y(float* yt, int64_t pl, float scale, const vf* acc) {
  for (int v = 0; v < V; ++v) {
    const int64_t m = std::min<int64_t>(16, pl - 16 * v);
    if (m >= 16)
      vstore(yt + 16 * v, acc[v] * scale);
    else if (m > 0)
      vstore_part(yt + 16 * v, acc[v] * scale, m);
  }
}

template <int V>
void rows_fwd_begin(RowsFwd& f) {
  constexpr int L = 16 * V;
  const int64_t N = f.N, Np = (N + 15) / 16 * 16;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t l = 0; l < L; ++l) f.St[n * L + l] = l < f.pl ? f.s0[l * N + n] : 0.0f;
  for (int64_t n = 0; n < Np; ++n) f.Pv[n] = 1.0f;
  f.P = 1.0f;
}

// The state entering chunk t / kCkChunk into the checkpoints (one decay per head).
template <int V>
void rows_fwd_save(const RowsFwd& f, int64_t t) {
  constexpr int L = 16 * V;
  float* o = f.ck + t / kCkChunk * f.ck_stride;
  for (int64_t l = 0; l < f.pl; ++l)
    for (int64_t n = 0; n < f.N; ++n) o[l * f.N + n] = f.St[n * L + l] * f.P;
}

template <int V>
void rows_fwd_end(const RowsFwd& f) {
  constexpr int L = 16 * V;
  for (int64_t l = 0; l < f.pl; ++l)
    for (int64_t n = 0; n < f.N; ++n) f.sout[l * f.N + n] = f.St[n * L + l] * (f.a ? f.P : f.Pv[n]);
}

// Advances one unit over tokens [t0, t1).
template <int V>
RC_INLINE void rows_fwd_run(RowsFwd& f, int64_t t0, int64_t t1) {
  constexpr int L = 16 * V;
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl, T = f.T;
  float* St = f.St;
  float* Pv = f.Pv;
  float* pn = f.scratch;
  float* an = pn + Np;
  float* bt = an + Np;
  float* ct = bt + Np;
  float P = f.P;
  vf u0[V], o0[V];
  for (int64_t t = t0; t < t1;) {
    for (int64_t k = 0; k < 4; ++k)
      if (t + 2 * kPrefetch + k < T) {
        prefetch_row(f.x + (t + 2 * kPrefetch + k) * f.xs, pl, false);
        prefetch_row(f.y + (t + 2 * kPrefetch + k) * f.xs, pl, true);
      }
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    const float* xt = f.x + t * f.xs;
    float* yt = f.y + t * f.xs;
    if (f.a) {
      // The common case: kM tokens in one sweep, when no renormalisation falls inside.
      constexpr int kM = 2;
      if (t + kM <= t1) {
        float pm[kM];
        bool ok = true;
        float q = P;
        for (int m = 0; m < kM; ++m) {
          q *= f.a[t + m];
          pm[m] = q;
          ok &= in_range(q);
        }
        if (ok && V == 1 && !wide_registers()) {
          const float *bm[kM], *cm[kM], *xm[kM];
          float* ym[kM];
          float us[kM];
          for (int m = 0; m < kM; ++m) {
            bm[m] = Bt + m * f.bs;
            cm[m] = Ct + m * f.bs;
            xm[m] = xt + m * f.xs;
            ym[m] = yt + m * f.xs;
            us[m] = f.dtp[t + m] / pm[m];
          }
          rows_fwd_tokens_half<kM>(St, bm, cm, xm, us, ym, pm, pl, N);
          P = pm[kM - 1];
          t += kM;
          continue;
        }
        if (ok) {
          vf um[kM][V], om[kM][V];
          const float* bm[kM];
          const float* cm[kM];
          for (int m = 0; m < kM; ++m) {
            load_u<V>(xt + m * f.xs, pl, f.dtp[t + m] / pm[m], um[m]);
            bm[m] = Bt + m * f.bs;
            cm[m] = Ct + m * f.bs;
          }
          rows_fwd_tokens<V, kM>(St, bm, cm, um, om, N);
          for (int m = 0; m < kM; ++m) store_y<V>(yt + m * f.xs, pl, pm[m], om[m]);
          P = pm[kM - 1];
          t += kM;
          continue;
        }
      }
      const float p0 = P * f.a[t];
      if (!in_range(p0)) {  // multiply the state out (also catches a == 0 and NaN)
        for (int64_t k = 0; k < N * L; ++k) St[k] *= p0;
        P = 1.0f;
      } else {
        P = p0;
      }
      load_u<V>(xt, pl, f.dtp[t] / P, u0);
      rows_fwd_token<V>(St, Bt, Ct, u0, o0, N);
      store_y<V>(yt, pl, P, o0);
    } else {
      exp_row(f.Ah, f.dtp[t], N, Np, an);
      bool renorm = false;
      for (int64_t n = 0; n < N; ++n) {
        pn[n] = Pv[n] * an[n];
        renorm |= !in_range(pn[n]);
      }
      if (renorm) {
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t l = 0; l < L; ++l) St[n * L + l] *= pn[n];
          Pv[n] = 1.0f;
        }
      } else {
        for (int64_t n = 0; n < N; ++n) Pv[n] = pn[n];
      }
      for (int64_t n = 0; n < N; ++n) {
        bt[n] = Bt[n] / Pv[n];
        ct[n] = Ct[n] * Pv[n];
      }
      load_u<V>(xt, pl, f.dtp[t], u0);
      rows_fwd_token<V>(St, bt, ct, u0, o0, N);
      store_y<V>(yt, pl, 1.0f, o0);
    }
    t += 1;
  }
  f.P = P;
}

RC_SIMD void rows_fwd_run16(RowsFwd& f, int64_t t0, int64_t t1) { rows_fwd_run<1>(f, t0, t1); }
RC_SIMD void rows_fwd_run32(RowsFwd& f, int64_t t0, int64_t t1) { rows_fwd_run<2>(f, t0, t1); }

// ======================================================================================
// Forward, heads layout (P == 1): 16 heads of one group per vector.
// ======================================================================================

struct HeadsFwd {
  const float* x;  // x[i, 0, h0, 0]: token stride H (also dt, y)
  const float* dt;
  const float* B;  // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* y;
  int64_t T, N, NA, nl, H, bs;
  float* St;  // [N][16] (kept between chunks)
  float* AT;  // [N][16]: A of the 16 heads
};

// Advances one block of 16 heads over tokens [t0, t1), t1 - t0 <= kChunk. The softplus
// and the exps of the whole chunk come first, in batches: inside the token loop their
// latency would sit on the critical path of every token. `abuf` holds
// kChunk * max(N, 1) rows of 16.
RC_SIMD void heads_fwd_run(const HeadsFwd& f, int64_t t0, int64_t t1, float* abuf) {
  const int64_t N = f.N, nl = f.nl, na = f.NA == 1 ? 1 : N;
  float* St = f.St;
  alignas(64) float dbuf[kChunk * 16], ubuf[kChunk * 16];
  heads_stage(f.dt, f.x, f.y, f.AT, f.T, f.H, nl, na, t0, t1, dbuf, ubuf, abuf);
  for (int64_t t = t0; t < t1; ++t) {
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    const float* at = abuf + (t - t0) * na * 16;
    const vf u = vload(ubuf + (t - t0) * 16);
    vf acc0 = {}, acc1 = {};
    const int64_t as = na == 1 ? 0 : 16;  // one decay for all n, or one per n
    int64_t n = 0;
    for (; n + 2 <= N; n += 2) {
      vf s0 = vload(St + n * 16) * vload(at + n * as) + Bt[n] * u;
      vf s1 = vload(St + n * 16 + 16) * vload(at + (n + 1) * as) + Bt[n + 1] * u;
      vstore(St + n * 16, s0);
      vstore(St + n * 16 + 16, s1);
      acc0 += Ct[n] * s0;
      acc1 += Ct[n + 1] * s1;
    }
    if (n < N) {
      vf s0 = vload(St + n * 16) * vload(at + n * as) + Bt[n] * u;
      vstore(St + n * 16, s0);
      acc0 += Ct[n] * s0;
    }
    float* yt = f.y + t * f.H;
    if (nl == 16)
      vstore(yt, acc0 + acc1);
    else
      vstore_part(yt, acc0 + acc1, nl);
  }
}

// Rows layout: channels per unit (the state block stays within L1/L2). 32 lanes are two
// 16-float vectors per row of the state: one register each with AVX-512's 32 registers;
// with AVX2's 16 (each vector two registers) the token loops of 32 lanes spill to the
// stack on every element, so there a unit is 16 lanes (5x faster on an AVX2 CPU).
int64_t rows_lanes(const Dims& d) { return d.P <= 16 || !wide_registers() ? 16 : 32; }

}  // namespace

void scan_forward(KernelCtx& c) {
  const Dims d = dims_of(c.src, 0);
  const float* s = c.src[0].f32();
  const float* x = c.src[1].f32();
  const float* dt = c.src[2].f32();
  const float* A = c.src[3].f32();
  const float* B = c.src[4].f32();
  const float* C = c.src[5].f32();
  const int32_t* ids = c.src[6].i32();
  check_ids(ids, d, "ssm_scan");
  float* y = c.dst.f32();
  const bool in_place = state_in_place(c.node.ip);
  float* sout = in_place ? nullptr : y + d.S * d.T * d.H * d.P;
  float* ck = saves_checkpoints(c.node.ip) ? sout + d.S * d.H * d.P * d.N : nullptr;
  const int64_t Np = (d.N + 15) / 16 * 16;
  if (in_place) {  // the rows ids[i] are written: no row twice (infer checked T == 1)
    std::vector<char> seen(d.R, 0);
    for (int64_t i = 0; i < d.S; ++i) {
      if (seen[ids[i]]) throw ValueError("ssm_scan: writing the state in place needs distinct ids");
      seen[ids[i]] = 1;
    }
  }
  std::vector<Work> work(c.pool.size());
  if (d.T == 1) {  // one token: see step_heads
    const StepFwd f{d, s, x, dt, A, B, C, ids, y, in_place ? nullptr : sout, ck, best_decay_row()};
    // Tasks of whole heads, about 1024 states each and 16 rows at least: Mamba-1's 1536
    // heads of one 16-state row make 24 tasks (one per head cost more in handing out than
    // in work). A small step runs on the calling thread alone.
    const int64_t heads = d.S * d.H;
    const int64_t hpt = std::max<int64_t>(1, 1024 / std::max<int64_t>(1, d.P * d.N));
    const int64_t ntask = (heads + hpt - 1) / hpt;
    const bool p1n16 = step_p1n16_ok(d, ck), rows8 = step_rows8_ok(d);
    auto task = [&](int64_t k, int tid) {
      float* an = work[tid].get(Np + 16 * 16 + (hpt + 15) / 16 * 16);
      if (p1n16)
        step_heads_p1n16(f, k * hpt, std::min(heads, (k + 1) * hpt), an + Np + 16 * 16);
      else if (rows8)
        step_heads_rows8(f, k * hpt, std::min(heads, (k + 1) * hpt), an + Np + 16 * 16);
      else
        step_heads(f, k * hpt, std::min(heads, (k + 1) * hpt), an, an + Np, an + Np + 16 * 16);
    };
    // Mamba-1's kernel does the 130M preset's 24576 states in ~30 us on one thread: there
    // the pool's worker is better left to prefetch the next product's weights (gemv.cpp).
    const int64_t serial = p1n16 ? int64_t{32} << 10 : int64_t{16} << 10;
    if (heads * d.P * d.N <= serial || c.pool.size() == 1) {
      for (int64_t k = 0; k < ntask; ++k) task(k, 0);
    } else {
      c.pool.run(ntask, task);
    }
    return;
  }
  if (d.P == 1) {
    const int64_t nbg = (d.hpg + 15) / 16;  // 16-head blocks per group
    const int64_t bpt = 8;                  // blocks per task
    const int64_t ntg = (nbg + bpt - 1) / bpt;
    c.pool.run(d.S * d.G * ntg, [&](int64_t task, int tid) {
      const int64_t i = task / (d.G * ntg), g = task / ntg % d.G, b0 = task % ntg * bpt;
      const int64_t nb = std::min(bpt, nbg - b0);
      float* wk = work[tid].get((nb * 2 + kChunk) * d.N * 16);
      float* abuf = wk + nb * 2 * d.N * 16;
      std::vector<HeadsFwd> fs(nb);
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t h0 = g * d.hpg + (b0 + k) * 16;
        HeadsFwd& f = fs[k];
        f.x = x + (i * d.T * d.H + h0);
        f.dt = dt + (i * d.T * d.H + h0);
        f.B = B + (i * d.T * d.G + g) * d.N;
        f.C = C + (i * d.T * d.G + g) * d.N;
        f.y = y + (i * d.T * d.H + h0);
        f.T = d.T;
        f.N = d.N;
        f.NA = d.NA;
        f.nl = std::min<int64_t>(16, d.hpg - (b0 + k) * 16);
        f.H = d.H;
        f.bs = d.G * d.N;
        f.St = wk + k * 2 * d.N * 16;
        f.AT = f.St + d.N * 16;
        const float* s0 = s + (ids[i] * d.H + h0) * d.N;
        for (int64_t n = 0; n < d.N; ++n)
          for (int64_t l = 0; l < 16; ++l) {
            f.St[n * 16 + l] = l < f.nl ? s0[l * d.N + n] : 0.0f;
            f.AT[n * 16 + l] = l < f.nl ? A[(h0 + l) * d.NA + (d.NA == 1 ? 0 : n)] : 0.0f;
          }
      }
      const int64_t K = heads_seg_len(d.T), nseg = heads_n_seg(d.T);
      auto save = [&](int64_t sg) {  // the state before segment sg, as ck[i, sg, h, :]
        for (int64_t k = 0; k < nb; ++k) {
          float* o = ck + ((i * nseg + sg) * d.H + g * d.hpg + (b0 + k) * 16) * d.N;
          for (int64_t l = 0; l < fs[k].nl; ++l)
            for (int64_t n = 0; n < d.N; ++n) o[l * d.N + n] = fs[k].St[n * 16 + l];
        }
      };
      if (ck && d.T > 0) save(0);
      for (int64_t t0 = 0; t0 < d.T;) {
        int64_t t1 = std::min(d.T, t0 + kChunk);
        if (ck) t1 = std::min(t1, (t0 / K + 1) * K);  // chunks never straddle a checkpoint
        for (int64_t k = 0; k < nb; ++k) heads_fwd_run(fs[k], t0, t1, abuf);
        if (ck && t1 % K == 0 && t1 < d.T) save(t1 / K);
        t0 = t1;
      }
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t h0 = g * d.hpg + (b0 + k) * 16;
        float* so = sout + (i * d.H + h0) * d.N;
        for (int64_t l = 0; l < fs[k].nl; ++l)
          for (int64_t n = 0; n < d.N; ++n) so[l * d.N + n] = fs[k].St[n * 16 + l];
      }
    });
    return;
  }
  const int64_t L = rows_lanes(d), npb = (d.P + L - 1) / L;
  const int64_t hpt = std::max<int64_t>(1, 4 / npb);  // heads per task: about 4 units
  const int64_t nth = (d.H + hpt - 1) / hpt;
  const int64_t unit_floats = d.N * L + 5 * Np + 2 * d.T;
  c.pool.run(d.S * nth, [&](int64_t task, int tid) {
    const int64_t i = task / nth, h0 = task % nth * hpt, nh = std::min(hpt, d.H - h0);
    float* wk = work[tid].get(nh * npb * unit_floats);
    std::vector<RowsFwd> fs(nh * npb);
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = h0 + hh, g = h / d.hpg;
      float* dtp = wk + hh * npb * unit_floats + d.N * L + 5 * Np;  // shared by the head's units
      float* a = dtp + d.T;
      dt_column(dt + i * d.T * d.H + h, d.H, d.T, A[h * d.NA], dtp, d.per_n ? nullptr : a, nullptr);
      for (int64_t pb = 0; pb < npb; ++pb) {
        const int64_t p0 = pb * L;
        RowsFwd& f = fs[hh * npb + pb];
        float* uw = wk + (hh * npb + pb) * unit_floats;
        f.s0 = s + ((ids[i] * d.H + h) * d.P + p0) * d.N;
        f.x = x + (i * d.T * d.H + h) * d.P + p0;
        f.dtp = dtp;
        f.a = d.per_n ? nullptr : a;
        f.Ah = A + h * d.NA;
        f.B = B + (i * d.T * d.G + g) * d.N;
        f.C = C + (i * d.T * d.G + g) * d.N;
        f.y = y + (i * d.T * d.H + h) * d.P + p0;
        f.sout = sout + ((i * d.H + h) * d.P + p0) * d.N;
        f.ck_stride = d.P * d.N;
        f.ck = ck ? ck + ((i * d.H + h) * ((d.T + kCkChunk - 1) / kCkChunk) * d.P + p0) * d.N : nullptr;
        f.T = d.T;
        f.N = d.N;
        f.pl = std::min(L, d.P - p0);
        f.xs = d.H * d.P;
        f.bs = d.G * d.N;
        f.St = uw;
        f.Pv = uw + d.N * L;
        f.scratch = f.Pv + Np;
        if (L == 16)
          rows_fwd_begin<1>(f);
        else
          rows_fwd_begin<2>(f);
      }
    }
    static_assert(kCkChunk % kChunk == 0, "a checkpoint falls on a chunk start");
    for (int64_t t0 = 0; t0 < d.T; t0 += kChunk)
      for (RowsFwd& f : fs) {
        if (f.ck && t0 % kCkChunk == 0) {
          if (L == 16)
            rows_fwd_save<1>(f, t0);
          else
            rows_fwd_save<2>(f, t0);
        }
        if (L == 16)
          rows_fwd_run16(f, t0, std::min(d.T, t0 + kChunk));
        else
          rows_fwd_run32(f, t0, std::min(d.T, t0 + kChunk));
      }
    for (RowsFwd& f : fs) {
      if (L == 16)
        rows_fwd_end<1>(f);
      else
        rows_fwd_end<2>(f);
    }
  });
}

}  // namespace scan
}  // namespace ssm
}  // namespace recurra

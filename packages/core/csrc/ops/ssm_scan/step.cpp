// ssm_scan, the forward of one token (T == 1: a generation step): the kernels that
// forward.cpp's scan_forward runs per task of heads (see scan.h: StepFwd, step_kernel).
#include "scan.h"

namespace recurra {
namespace ssm {
namespace scan {

namespace {

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

}  // namespace

StepKernel step_kernel(const Dims& d, const float* ck) {
  if (step_p1n16_ok(d, ck)) return StepKernel::p1n16;
  if (step_rows8_ok(d)) return StepKernel::rows8;
  return StepKernel::generic;
}

DecayRow step_decay_row() { return best_decay_row(); }

void step_heads_run(StepKernel k, const StepFwd& f, int64_t h0, int64_t h1, float* an, float* acc, float* dtps) {
  switch (k) {
    case StepKernel::p1n16: return step_heads_p1n16(f, h0, h1, dtps);
    case StepKernel::rows8: return step_heads_rows8(f, h0, h1, dtps);
    case StepKernel::generic: return step_heads(f, h0, h1, an, acc, dtps);
  }
}

}  // namespace scan
}  // namespace ssm
}  // namespace recurra

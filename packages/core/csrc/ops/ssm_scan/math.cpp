// ssm_scan, shared vector math: batched exps for the heads layout, the softplus column of a
// head, a row of per-state decays, and the dims of a call (see scan.h).
#include "scan.h"

namespace recurra {
namespace ssm {
namespace scan {

namespace {

// x[j] = exp(x[j]) for four vectors, step by step interleaved. A lone exp is a chain of
// ~20 dependent operations; interleaving four keeps both vector ports busy instead of
// waiting on latency. Same arithmetic as vexp.
RC_INLINE void vexp4(vf* x) {
  const vf lo = vsplat(-87.0f), hi = vsplat(88.0f);
  const float magic = 12582912.0f;
  vi under[4], ni[4];
  vf n[4], r[4], p[4];
  for (int j = 0; j < 4; ++j) {
    under[j] = x[j] < lo;
    x[j] = lo > x[j] ? lo : x[j];
    x[j] = hi < x[j] ? hi : x[j];
  }
  for (int j = 0; j < 4; ++j) {
    vf t = x[j] * 1.44269504088896341f + magic;
    n[j] = t - magic;
    ni[j] = (vi)t - (vi)vsplat(magic);
  }
  for (int j = 0; j < 4; ++j) r[j] = x[j] - n[j] * 0.693359375f;
  for (int j = 0; j < 4; ++j) r[j] = r[j] - n[j] * -2.12194440054690583e-4f;
  for (int j = 0; j < 4; ++j) p[j] = r[j] * 1.3836826e-3f + 8.3748158e-3f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 4.1668225e-2f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 1.6666420e-1f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 4.9999991e-1f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 1.0f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 1.0f;
  for (int j = 0; j < 4; ++j) {
    vi e = (ni[j] + 127) << 23;
    vf res = p[j] * (vf)e;
    x[j] = under[j] ? vsplat(0.0f) : res;
  }
}

// out[t * m + n][:] = exp(d[t][:] * A[n][:]) for t < nt, n < m (rows of 16 lanes).
RC_INLINE void exp_rows(const float* d, const float* A, int64_t m, int64_t nt, float* out) {
  if (m == 1) {
    const vf av = vload(A);
    int64_t t = 0;
    for (; t + 4 <= nt; t += 4) {
      vf x[4];
      for (int j = 0; j < 4; ++j) x[j] = vload(d + (t + j) * 16) * av;
      vexp4(x);
      for (int j = 0; j < 4; ++j) vstore(out + (t + j) * 16, x[j]);
    }
    for (; t < nt; ++t) vstore(out + t * 16, vexp(vload(d + t * 16) * av));
    return;
  }
  for (int64_t t = 0; t < nt; ++t) {
    const vf dv = vload(d + t * 16);
    float* o = out + t * m * 16;
    int64_t n = 0;
    for (; n + 4 <= m; n += 4) {
      vf x[4];
      for (int j = 0; j < 4; ++j) x[j] = dv * vload(A + (n + j) * 16);
      vexp4(x);
      for (int j = 0; j < 4; ++j) vstore(o + (n + j) * 16, x[j]);
    }
    for (; n < m; ++n) vstore(o + n * 16, vexp(dv * vload(A + n * 16)));
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(RECURRA_NO_CLONES)
#define RC_EXP512 1
// exp_rows for AVX-512 with its scaling instructions: exp(x) = 2^n 2^f, n = round(x log2 e),
// f in [-1/2, 1/2], 2^f by its degree-6 Taylor polynomial (relative error <= 1.3e-7),
// 2^n applied by vscalefps; 11 instructions per 16 values instead of vexp's ~19. Values
// below -87 give 0 as in vexp (never a denormal), NaN stays NaN.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp512(__m512 x) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.5403530393381606e-4f), f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);  // x >= -87 or NaN
  return _mm512_maskz_scalef_ps(keep, p, n);
}

__attribute__((target("avx512f"))) void exp_rows_avx512(const float* d, const float* A, int64_t m, int64_t nt,
                                                        float* out) {
  for (int64_t t = 0; t < nt; ++t) {
    const __m512 dv = _mm512_loadu_ps(d + t * 16);
    float* o = out + t * m * 16;
    for (int64_t n = 0; n < m; ++n) _mm512_storeu_ps(o + n * 16, exp512(_mm512_mul_ps(dv, _mm512_loadu_ps(A + n * 16))));
  }
}
#endif

RC_SIMD void exp_rows_clones(const float* d, const float* A, int64_t m, int64_t nt, float* out) {
  exp_rows(d, A, m, nt, out);
}


}  // namespace

void exp_rows_best(const float* d, const float* A, int64_t m, int64_t nt, float* out) {
#ifdef RC_EXP512
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) return exp_rows_avx512(d, A, m, nt, out);
#endif
  exp_rows_clones(d, A, m, nt, out);
}

RC_SIMD void dt_column(const float* dt, int64_t stride, int64_t T, float A, float* dtp, float* a,
                       float* sig) {
  for (int64_t t0 = 0; t0 < T; t0 += 16) {
    const int64_t m = std::min<int64_t>(16, T - t0);
    vf z = {};
    for (int64_t l = 0; l < m; ++l) z[l] = dt[(t0 + l) * stride];
    vf d = vsoftplus(z);
    vstore_part(dtp + t0, d, m);
    if (a) vstore_part(a + t0, vexp(d * A), m);
    if (sig) vstore_part(sig + t0, vsigmoid(z), m);
  }
}


RC_SIMD void exp_row(const float* A, float d, int64_t N, int64_t Np, float* out) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) vstore(out + n, vexp(vload(A + n) * d));
  if (n < N) vstore(out + n, vexp(vload_part(A + n, N - n) * d));
  for (int64_t k = ((N + 15) / 16) * 16; k < Np; ++k) out[k] = 0.0f;
}

Dims dims_of(const std::vector<TensorView>& src, int off) {
  Dims d;
  const Shape &s = src[off + 0].shape, &x = src[off + 1].shape, &A = src[off + 3].shape,
              &B = src[off + 4].shape;
  d.R = s[0];
  d.S = x[0];
  d.T = x[1];
  d.H = x[2];
  d.P = x[3];
  d.N = s[3];
  d.G = B[2];
  d.NA = A[1];
  d.hpg = d.G > 0 ? d.H / d.G : 0;
  d.per_n = d.NA != 1;
  return d;
}

void check_ids(const int32_t* ids, const Dims& d, const char* op) {
  for (int64_t i = 0; i < d.S; ++i)
    if (ids[i] < 0 || ids[i] >= d.R)
      throw ValueError(std::string(op) + ": ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                       " is out of range for " + std::to_string(d.R) + " state rows");
}

}  // namespace scan
}  // namespace ssm
}  // namespace recurra

// ssm_scan: Mamba's selective scan (Mamba-1 and Mamba-2), forward and backward, on the CPU.
//
// Shapes (numpy order; see docs/ops.md):
//   s    (R, H, P, N)  initial states, R >= S          x   (S, T, H, P)    dt (S, T, H)
//   A    (H, NA)       NA = N (one decay per state) or 1 (one decay per head, Mamba-2)
//   B, C (S, T, G, N)  head h reads group h / (H / G)  ids (S,) int32: sequence i starts
//                                                      from s[ids[i]]
//   ssm_scan      -> packed 1-D: y (S, T, H, P), then the final states (S, H, P, N)
//   ssm_scan_back (packed grad, s, x, dt, A, B, C, ids)
//                 -> packed 1-D: ds (R, H, P, N), dx (S, T, H, P), ddt (S, T, H),
//                    dA (H, NA), dB (S, T, G, N), dC (S, T, G, N)
//
// Two kernel layouts:
// * "rows" (P > 1): one task per (sequence, head, block of channels p). The forward keeps
//   the state block transposed, [n][p], and vectorizes along p, so y_t = sum_n C[n] S[n][:]
//   needs no horizontal sums. With one decay per head it keeps S~ = S / P_t, P_t the decay
//   accumulated since the last renormalisation, so a token costs two FMAs per element
//   (S~ += B~ u; y += C S~) instead of three; S~ is multiplied out whenever P_t leaves
//   [2^-60, 2^60] (and at the end), so nothing overflows.
// * "heads" (P == 1, Mamba-1): 16 heads of one group per vector, the state [n][16 heads];
//   every element needs its own exp(), done by a vectorized polynomial (vexp).
//
// Backward, rows layout. lam_t = dL/dS_t obeys lam_{t-1} = a_t lam_t + dy_{t-1} C_{t-1}^T,
// which needs no state, and dC_t = dy_t^T S_t needs only the forward state, so one forward
// sweep (S, dC) and one reverse sweep (lam, dB, dx) suffice. The decay gradient
// g_t = sum lam_t * a_t S_{t-1} would need S_{t-1} in the reverse sweep; instead
// Z_t = sum_p lam_t S_t follows Z_{t-1} = g_t + C_{t-1} dC_{t-1} and g_t = Z_t - B_t dB_t,
// re-anchored exactly (from a stored state) every K tokens so rounding cannot accumulate.
// Backward, heads layout: the state is checkpointed every K tokens; each segment of K
// tokens is recomputed into a small buffer and walked in reverse.
//
// Determinism: dB, dC, dA, d_s are sums over heads/sequences. Each task owns a fixed slice
// of the work (chosen from the shapes only) and its own partial sums, and partial sums are
// reduced in a fixed order, so results are bitwise the same for any number of threads.
//
// Peak extra memory of the backward (floats; Np = N rounded up to 16):
//   per thread, rows:  (1 + ceil(T / K)) * PB * Np + T * (1 or Np) + 16 * Np + 64 * PB
//   per thread, heads: (3 + ceil(T / K) + 2 K) * Np * 16 + 18 * K     (K = max(16, T / 256))
//   shared: (n_split - 1) * 2 * S*T*G*N (partial dB, dC), S*H*NA (partial dA), and
//   S*H*P*N when two sequences share a state row.
// Never the T * state history that storing every state would take.
#include <cmath>

#include "ssm.h"

namespace recurra {

namespace {

using namespace ssm;

// ---- vectorized maths ---------------------------------------------------------------

// exp(x) to about 1 ulp (max relative error 1e-7): exp(x) = 2^n e^r, |r| <= ln2 / 2, e^r by
// a degree-6 minimax polynomial. Below -87 it returns 0 (never a denormal, which would
// slow every later multiply). The clamps are written as `lo > x ? lo : x`, which is one
// vmaxps and lets NaN through.
RC_INLINE vf vexp(vf x) {
  const vf lo = vsplat(-87.0f), hi = vsplat(88.0f);
  const vi under = x < lo;
  x = lo > x ? lo : x;
  x = hi < x ? hi : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x * 1.44269504088896341f + magic;
  vf n = t - magic;
  vi ni = (vi)t - (vi)vsplat(magic);  // same-size vector casts reinterpret the bits
  vf r = x - n * 0.693359375f;        // ln 2 in two parts (Cody-Waite); n * hi is exact
  r = r - n * -2.12194440054690583e-4f;
  vf p = vsplat(1.3836826e-3f);
  p = p * r + 8.3748158e-3f;
  p = p * r + 4.1668225e-2f;
  p = p * r + 1.6666420e-1f;
  p = p * r + 4.9999991e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  vi e = (ni + 127) << 23;
  vf res = p * (vf)e;
  return under ? vsplat(0.0f) : res;
}

// softplus(z) = z for z > 20, else max(z, 0) + log1p(exp(-|z|)), with
// log1p(w) = 2 atanh(w / (2 + w)) (exact for tiny w, no 1 + w rounding).
RC_INLINE vf vsoftplus(vf z) {
  vf az = (vf)((vi)z & 0x7fffffff);
  vf w = vexp(-az);
  vf s = w / (w + 2.0f);
  vf s2 = s * s;
  vf q = vsplat(1.0f / 13);
  q = q * s2 + 1.0f / 11;
  q = q * s2 + 1.0f / 9;
  q = q * s2 + 1.0f / 7;
  q = q * s2 + 1.0f / 5;
  q = q * s2 + 1.0f / 3;
  q = q * s2 + 1.0f;
  const vf zero = {};
  vf r = (zero > z ? zero : z) + 2.0f * s * q;
  return z > 20.0f ? z : r;
}

// d softplus / dz: sigmoid(z), and 1 where z > 20 (softplus is the identity there).
RC_INLINE vf vsigmoid(vf z) {
  vf r = 1.0f / (vexp(-z) + 1.0f);
  r = z < -87.0f ? vsplat(0.0f) : r;
  return z > 20.0f ? vsplat(1.0f) : r;
}

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

// Renormalise the scaled state when the accumulated decay leaves this range.
constexpr float kPMin = 8.67361737988e-19f;  // 2^-60
constexpr float kPMax = 1.15292150461e18f;   // 2^60
RC_INLINE bool in_range(float p) { return p >= kPMin && p <= kPMax; }

// dtp[t] = softplus(dt[t * stride]); a[t] = exp(dtp[t] * A) when a != nullptr;
// sig[t] = sigmoid(dt[t * stride]) when sig != nullptr.
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

// out[n] = exp(d * A[n]) for n < N, 0 up to Np (multiple of 16).
RC_SIMD void exp_row(const float* A, float d, int64_t N, int64_t Np, float* out) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) vstore(out + n, vexp(vload(A + n) * d));
  if (n < N) vstore(out + n, vexp(vload_part(A + n, N - n) * d));
  for (int64_t k = ((N + 15) / 16) * 16; k < Np; ++k) out[k] = 0.0f;
}

struct Dims {
  int64_t R, S, T, H, P, N, G, NA, hpg;
  bool per_n;  // one decay per state (NA == N > 1)
};

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

// ======================================================================================
// Forward, rows layout: one (sequence, head, block of L channels).
// ======================================================================================

// Work is cut in time as well as across heads: a task owns a few (head, channel block)
// units and advances each by kChunk tokens in turn. The rows of x, y and dt that a task
// touches at one token are then adjacent in memory (the prefetchers and the TLB follow),
// while each unit's state stays in L1/L2 during its chunk.
constexpr int64_t kChunk = 16;

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
  int64_t T, N, pl, xs, bs;
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

// Two tokens per sweep over the state: each element is loaded and stored once for both,
// which halves the load/store traffic that otherwise limits the loop.
template <int V>
RC_INLINE void rows_fwd_token2(float* __restrict St, const float* __restrict b0, const float* __restrict c0,
                               const float* __restrict b1, const float* __restrict c1, const vf* u0,
                               const vf* u1, vf* out0, vf* out1, int64_t N) {
  constexpr int L = 16 * V;
  vf e0[V], e1[V], o0[V], o1[V];
  for (int v = 0; v < V; ++v) e0[v] = e1[v] = o0[v] = o1[v] = vf{};
  int64_t n = 0;
  for (; n + 2 <= N; n += 2) {
    float* sp = St + n * L;
    const float p0 = b0[n], q0 = c0[n], p1 = b1[n], q1 = c1[n];
    const float r0 = b0[n + 1], w0 = c0[n + 1], r1 = b1[n + 1], w1 = c1[n + 1];
    for (int v = 0; v < V; ++v) {
      vf s = vload(sp + 16 * v) + p0 * u0[v];
      e0[v] += q0 * s;
      s += p1 * u1[v];
      e1[v] += q1 * s;
      vstore(sp + 16 * v, s);
      vf t = vload(sp + L + 16 * v) + r0 * u0[v];
      o0[v] += w0 * t;
      t += r1 * u1[v];
      o1[v] += w1 * t;
      vstore(sp + L + 16 * v, t);
    }
  }
  if (n < N) {
    float* sp = St + n * L;
    for (int v = 0; v < V; ++v) {
      vf s = vload(sp + 16 * v) + b0[n] * u0[v];
      e0[v] += c0[n] * s;
      s += b1[n] * u1[v];
      e1[v] += c1[n] * s;
      vstore(sp + 16 * v, s);
    }
  }
  for (int v = 0; v < V; ++v) {
    out0[v] = e0[v] + o0[v];
    out1[v] = e1[v] + o1[v];
  }
}

constexpr int64_t kPrefetch = 4;  // tokens ahead: rows of x, y, dt are far apart in memory

// Prefetches the `len` floats at p (for writing when w).
RC_INLINE void prefetch_row(const float* p, int64_t len, bool w) {
  for (int64_t k = 0; k < len; k += 16) {
    if (w)
      __builtin_prefetch(p + k, 1);
    else
      __builtin_prefetch(p + k, 0);
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
  vf u0[V], u1[V], o0[V], o1[V];
  for (int64_t t = t0; t < t1;) {
    for (int64_t k = 0; k < 2; ++k)
      if (t + kPrefetch + k < T) {
        prefetch_row(f.x + (t + kPrefetch + k) * f.xs, pl, false);
        prefetch_row(f.y + (t + kPrefetch + k) * f.xs, pl, true);
      }
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    const float* xt = f.x + t * f.xs;
    float* yt = f.y + t * f.xs;
    if (f.a) {
      const float p0 = P * f.a[t];
      const float p1 = t + 1 < t1 ? p0 * f.a[t + 1] : 0.0f;
      if (t + 1 < t1 && in_range(p0) && in_range(p1)) {  // the common case: two tokens
        load_u<V>(xt, pl, f.dtp[t] / p0, u0);
        load_u<V>(xt + f.xs, pl, f.dtp[t + 1] / p1, u1);
        rows_fwd_token2<V>(St, Bt, Ct, Bt + f.bs, Ct + f.bs, u0, u1, o0, o1, N);
        store_y<V>(yt, pl, p0, o0);
        store_y<V>(yt + f.xs, pl, p1, o1);
        P = p1;
        t += 2;
        continue;
      }
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
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kChunk < f.T) {
      const int64_t o = (t + kChunk) * f.H;
      __builtin_prefetch(f.dt + o);
      __builtin_prefetch(f.x + o);
      __builtin_prefetch(f.y + o, 1);
    }
    const float* dtt = f.dt + t * f.H;
    const float* xt = f.x + t * f.H;
    vf z = nl == 16 ? vload(dtt) : vload_part(dtt, nl);
    vf xv = nl == 16 ? vload(xt) : vload_part(xt, nl);
    vf d = vsoftplus(z);
    vstore(dbuf + (t - t0) * 16, d);
    vstore(ubuf + (t - t0) * 16, xv * d);
  }
  exp_rows(dbuf, f.AT, na, t1 - t0, abuf);
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

// Rows layout: channels per unit (the state block stays within L1/L2).
int64_t rows_lanes(const Dims& d) { return d.P <= 16 ? 16 : 32; }

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
  float* sout = y + d.S * d.T * d.H * d.P;
  const int64_t Np = (d.N + 15) / 16 * 16;
  std::vector<Work> work(c.pool.size());
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
      for (int64_t t0 = 0; t0 < d.T; t0 += kChunk)
        for (int64_t k = 0; k < nb; ++k) heads_fwd_run(fs[k], t0, std::min(d.T, t0 + kChunk), abuf);
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
    for (int64_t t0 = 0; t0 < d.T; t0 += kChunk)
      for (RowsFwd& f : fs) {
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

// ======================================================================================
// Backward, rows layout: one (sequence, head, block of PB channels), state [p][n].
// ======================================================================================

struct RowsBwd {
  const float* s0;   // s[row, h, p0, 0]
  const float* x;    // x[i, 0, h, p0]: token stride xs (also dy, dx)
  const float* dy;
  const float* dsf;  // dL/d(final state) [i, h, p0, 0]
  const float* dtp;  // T
  const float* a;    // T (one decay per head) or nullptr
  const float* Ah;   // A[h, :]
  const float* B;    // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* dx;
  float* ddtp;  // T: dL/d softplus(dt), summed over the head's channel blocks
  float* ds;    // [i, h, p0, 0] (pl x N)
  float* dA;    // NA, summed over the head's channel blocks
  float* dB;    // partial-sum slot [i, 0, g, 0]: token stride bs
  float* dC;
  bool first_in_task;  // write dB, dC instead of adding
  bool first_in_head;  // write ddtp, dA instead of adding
  int64_t T, N, pl, xs, bs, K;
  float* work;
};

// Forward sweep of one token: S[p][:] += u[p] b; dc = sum_p dy[p] S[p][:].
template <int NV>
RC_INLINE void fwd_pn_chunk(float* __restrict S, const float* __restrict b, const float* u, const float* dy,
                            float* dc, int64_t pl, int64_t Np) {
  vf bv[NV], acc[NV];
  for (int j = 0; j < NV; ++j) {
    bv[j] = vload(b + 16 * j);
    acc[j] = vf{};
  }
  for (int64_t p = 0; p < pl; ++p) {
    float* sp = S + p * Np;
    const float up = u[p], dp = dy[p];
    for (int j = 0; j < NV; ++j) {
      vf sv = vload(sp + 16 * j) + up * bv[j];
      vstore(sp + 16 * j, sv);
      acc[j] += dp * sv;
    }
  }
  for (int j = 0; j < NV; ++j) vstore(dc + 16 * j, acc[j]);
}

RC_SIMD void fwd_pn(float* S, const float* b, const float* u, const float* dy, float* dc, int64_t pl, int64_t Np) {
  int64_t n = 0;
  for (; n + 64 <= Np; n += 64) fwd_pn_chunk<4>(S + n, b + n, u, dy, dc + n, pl, Np);
  switch ((Np - n) / 16) {
    case 3: fwd_pn_chunk<3>(S + n, b + n, u, dy, dc + n, pl, Np); break;
    case 2: fwd_pn_chunk<2>(S + n, b + n, u, dy, dc + n, pl, Np); break;
    case 1: fwd_pn_chunk<1>(S + n, b + n, u, dy, dc + n, pl, Np); break;
    default: break;
  }
}

// Reverse sweep of one token: lam[p][:] += dy[p] c; db = sum_p u[p] lam[p][:];
// dupart[p] (16 lanes) += lam[p][:] * bh (lane sums taken later).
template <int NV>
RC_INLINE void rev_pn_chunk(float* __restrict lam, const float* __restrict c, const float* __restrict bh,
                            const float* u, const float* dy, float* db, float* dupart, bool first,
                            int64_t pl, int64_t Np) {
  vf cv[NV], bv[NV], acc[NV];
  for (int j = 0; j < NV; ++j) {
    cv[j] = vload(c + 16 * j);
    bv[j] = vload(bh + 16 * j);
    acc[j] = vf{};
  }
  for (int64_t p = 0; p < pl; ++p) {
    float* lp = lam + p * Np;
    const float up = u[p], dp = dy[p];
    vf du = first ? vf{} : vload(dupart + 16 * p);
    for (int j = 0; j < NV; ++j) {
      vf lv = vload(lp + 16 * j) + dp * cv[j];
      vstore(lp + 16 * j, lv);
      acc[j] += up * lv;
      du += lv * bv[j];
    }
    vstore(dupart + 16 * p, du);
  }
  for (int j = 0; j < NV; ++j) vstore(db + 16 * j, acc[j]);
}

RC_SIMD void rev_pn(float* lam, const float* c, const float* bh, const float* u, const float* dy, float* db,
                    float* dupart, float* du, int64_t pl, int64_t Np) {
  int64_t n = 0;
  for (; n + 64 <= Np; n += 64)
    rev_pn_chunk<4>(lam + n, c + n, bh + n, u, dy, db + n, dupart, n == 0, pl, Np);
  switch ((Np - n) / 16) {
    case 3: rev_pn_chunk<3>(lam + n, c + n, bh + n, u, dy, db + n, dupart, n == 0, pl, Np); break;
    case 2: rev_pn_chunk<2>(lam + n, c + n, bh + n, u, dy, db + n, dupart, n == 0, pl, Np); break;
    case 1: rev_pn_chunk<1>(lam + n, c + n, bh + n, u, dy, db + n, dupart, n == 0, pl, Np); break;
    default: break;
  }
  for (int64_t p0 = 0; p0 < pl; p0 += 16) {
    vf r = hsum16x16(dupart + 16 * p0);
    vstore_part(du + p0, r, std::min<int64_t>(16, pl - p0));
  }
}

// z[n] = sum_p lam[p][n] * S[p][n]
RC_SIMD void dot_pn(const float* lam, const float* S, float* z, int64_t pl, int64_t Np) {
  for (int64_t n = 0; n < Np; n += 16) {
    vf acc = {};
    for (int64_t p = 0; p < pl; ++p) acc += vload(lam + p * Np + n) * vload(S + p * Np + n);
    vstore(z + n, acc);
  }
}

RC_SIMD void scale_pn(float* S, const float* f, int64_t pl, int64_t Np) {
  for (int64_t p = 0; p < pl; ++p)
    for (int64_t n = 0; n < Np; n += 16) vstore(S + p * Np + n, vload(S + p * Np + n) * vload(f + n));
}

void rows_bwd(const RowsBwd& f) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl, T = f.T, K = f.K;
  const int64_t plp = (pl + 15) / 16 * 16;
  const int64_t nanch = (T + K - 1) / K;
  const bool per_n = f.a == nullptr;
  float* S = f.work;             // [pl][Np]: the state, then lam
  float* anch = S + pl * Np;     // nanch x [pl][Np]: S_t at t = K-1, 2K-1, ..., T-1
  float* zc = anch + nanch * pl * Np;  // T x (Np or 1): C_t . dC_t
  float* v = zc + T * (per_n ? Np : 1);
  float *Pv = v, *pn = v + Np, *an = v + 2 * Np, *bt = v + 3 * Np, *dc = v + 4 * Np, *Z = v + 5 * Np;
  float *g = v + 6 * Np, *db = v + 7 * Np;
  float* uv = v + 8 * Np;         // plp
  float* dyv = uv + plp;          // plp
  float* du = dyv + plp;          // plp
  float* dupart = du + plp;       // plp x 16
  for (int64_t k = 0; k < 8 * Np + 3 * plp + 16 * plp; ++k) v[k] = 0.0f;
  auto is_anchor = [&](int64_t t) { return t % K == K - 1 || t == T - 1; };

  // ---- forward sweep: S~, dC, anchors --------------------------------------------------
  for (int64_t p = 0; p < pl; ++p)
    for (int64_t n = 0; n < Np; ++n) S[p * Np + n] = n < N ? f.s0[p * N + n] : 0.0f;
  for (int64_t n = 0; n < Np; ++n) Pv[n] = 1.0f;
  float P = 1.0f;
  for (int64_t t = 0; t < T; ++t) {
    if (t + kPrefetch < T) {
      prefetch_row(f.x + (t + kPrefetch) * f.xs, pl, false);
      prefetch_row(f.dy + (t + kPrefetch) * f.xs, pl, false);
    }
    const float d = f.dtp[t];
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    if (!per_n) {
      const float p = P * f.a[t];
      if (!in_range(p)) {
        for (int64_t k = 0; k < pl * Np; ++k) S[k] *= p;
        P = 1.0f;
      } else {
        P = p;
      }
      const float ip = 1.0f / P;
      for (int64_t n = 0; n < N; ++n) bt[n] = Bt[n] * ip;
    } else {
      exp_row(f.Ah, d, N, Np, an);
      bool renorm = false;
      for (int64_t n = 0; n < N; ++n) {
        pn[n] = Pv[n] * an[n];
        renorm |= !in_range(pn[n]);
      }
      if (renorm) {
        scale_pn(S, pn, pl, Np);
        for (int64_t n = 0; n < N; ++n) Pv[n] = 1.0f;
      } else {
        for (int64_t n = 0; n < N; ++n) Pv[n] = pn[n];
      }
      for (int64_t n = 0; n < N; ++n) bt[n] = Bt[n] / Pv[n];
    }
    const float* xt = f.x + t * f.xs;
    const float* dyt = f.dy + t * f.xs;
    for (int64_t p = 0; p < pl; ++p) {
      uv[p] = xt[p] * d;
      dyv[p] = dyt[p];
    }
    fwd_pn(S, bt, uv, dyv, dc, pl, Np);
    float* dCt = f.dC + t * f.bs;
    float zs = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      const float dcn = dc[n] * (per_n ? Pv[n] : P);
      dCt[n] = f.first_in_task ? dcn : dCt[n] + dcn;
      if (per_n)
        zc[t * Np + n] = Ct[n] * dcn;
      else
        zs += Ct[n] * dcn;
    }
    if (!per_n) zc[t] = zs;
    if (is_anchor(t)) {
      float* an_t = anch + (t / K) * pl * Np;
      for (int64_t p = 0; p < pl; ++p)
        for (int64_t n = 0; n < Np; ++n) an_t[p * Np + n] = S[p * Np + n] * (per_n ? Pv[n] : P);
    }
  }

  // ---- reverse sweep: lam~ = lam / R ----------------------------------------------------
  float* lam = S;
  for (int64_t p = 0; p < pl; ++p)
    for (int64_t n = 0; n < Np; ++n) lam[p * Np + n] = n < N ? f.dsf[p * N + n] : 0.0f;
  float* Rv = Pv;  // per-state R
  for (int64_t n = 0; n < Np; ++n) Rv[n] = 1.0f;
  float R = 1.0f, Zs = 0.0f, dAs = 0.0f;
  float* dAv = pn;  // per-state dA accumulator
  for (int64_t n = 0; n < Np; ++n) dAv[n] = 0.0f;
  float* cr = bt;  // C / R
  float* bh = an;  // B * R
  for (int64_t t = T - 1; t >= 0; --t) {
    if (t >= kPrefetch) {
      prefetch_row(f.x + (t - kPrefetch) * f.xs, pl, false);
      prefetch_row(f.dy + (t - kPrefetch) * f.xs, pl, false);
      prefetch_row(f.dx + (t - kPrefetch) * f.xs, pl, true);
    }
    const float d = f.dtp[t];
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    const float* xt = f.x + t * f.xs;
    const float* dyt = f.dy + t * f.xs;
    if (per_n) {
      for (int64_t n = 0; n < N; ++n) {
        cr[n] = Ct[n] / Rv[n];
        bh[n] = Bt[n] * Rv[n];
      }
    } else {
      const float ir = 1.0f / R;
      for (int64_t n = 0; n < N; ++n) {
        cr[n] = Ct[n] * ir;
        bh[n] = Bt[n] * R;
      }
    }
    for (int64_t p = 0; p < pl; ++p) {
      uv[p] = xt[p] * d;
      dyv[p] = dyt[p];
    }
    rev_pn(lam, cr, bh, uv, dyv, db, dupart, du, pl, Np);
    float* dBt = f.dB + t * f.bs;
    float* dxt = f.dx + t * f.xs;
    float dd = 0.0f;
    for (int64_t p = 0; p < pl; ++p) {
      dxt[p] = du[p] * d;
      dd += du[p] * xt[p];
    }
    if (is_anchor(t)) {  // Z_t exactly from the stored state
      dot_pn(lam, anch + (t / K) * pl * Np, Z, pl, Np);
      if (per_n) {
        for (int64_t n = 0; n < N; ++n) Z[n] *= Rv[n];
      } else {
        float z = 0.0f;
        for (int64_t n = 0; n < N; ++n) z += Z[n];
        Zs = z * R;
      }
    }
    if (per_n) {
      float gs = 0.0f;
      for (int64_t n = 0; n < N; ++n) {
        const float dbn = db[n] * Rv[n];
        dBt[n] = f.first_in_task ? dbn : dBt[n] + dbn;
        g[n] = Z[n] - Bt[n] * dbn;  // dL/d log a_t[n]
        dAv[n] += g[n] * d;
        gs += g[n] * f.Ah[n];
      }
      dd += gs;
      if (t > 0)
        for (int64_t n = 0; n < N; ++n) Z[n] = g[n] + zc[(t - 1) * Np + n];
    } else {
      float bdb = 0.0f;
      for (int64_t n = 0; n < N; ++n) {
        const float dbn = db[n] * R;
        dBt[n] = f.first_in_task ? dbn : dBt[n] + dbn;
        bdb += Bt[n] * dbn;
      }
      const float G = Zs - bdb;
      dAs += G * d;
      dd += G * f.Ah[0];
      if (t > 0) Zs = G + zc[t - 1];
    }
    f.ddtp[t] = f.first_in_head ? dd : f.ddtp[t] + dd;
    // lam_{t-1} = a_t lam_t (+ the next token's dy C, added at the top of the loop)
    if (per_n) {
      exp_row(f.Ah, d, N, Np, an);  // bh is dead here: an aliases it
      bool renorm = false;
      for (int64_t n = 0; n < N; ++n) {
        Rv[n] *= an[n];
        renorm |= !in_range(Rv[n]);
      }
      if (renorm) {
        scale_pn(lam, Rv, pl, Np);
        for (int64_t n = 0; n < N; ++n) Rv[n] = 1.0f;
      }
    } else {
      R *= f.a[t];
      if (!in_range(R)) {
        for (int64_t k = 0; k < pl * Np; ++k) lam[k] *= R;
        R = 1.0f;
      }
    }
  }
  for (int64_t p = 0; p < pl; ++p)
    for (int64_t n = 0; n < N; ++n) f.ds[p * N + n] = lam[p * Np + n] * (per_n ? Rv[n] : R);
  if (per_n) {
    for (int64_t n = 0; n < N; ++n) f.dA[n] = f.first_in_head ? dAv[n] : f.dA[n] + dAv[n];
  } else {
    f.dA[0] = f.first_in_head ? dAs : f.dA[0] + dAs;
  }
}

int64_t rows_bwd_block(const Dims& d) {
  const int64_t Np = (d.N + 15) / 16 * 16;
  return std::max<int64_t>(1, std::min<int64_t>(d.P, 4096 / Np));
}

size_t rows_bwd_work(const Dims& d, int64_t PB, int64_t K) {
  const int64_t Np = (d.N + 15) / 16 * 16, plp = (PB + 15) / 16 * 16;
  const int64_t nanch = (d.T + K - 1) / K;
  return static_cast<size_t>(PB * Np * (1 + nanch) + d.T * (d.per_n ? Np : 1) + 8 * Np + 19 * plp);
}

// ======================================================================================
// Backward, heads layout (P == 1): 16 heads of one group per vector, state [n][16].
// ======================================================================================

struct HeadsBwd {
  const float* s0;  // s[row, h0, 0, 0]
  const float* x;   // x[i, 0, h0, 0]: token stride H (also dt, dy, dx, ddt)
  const float* dt;
  const float* dy;
  const float* dsf;  // [i, h0, 0, 0]
  const float* A;    // A[h0, 0]: head stride NA
  const float* B;    // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* dx;
  float* ddt;
  float* ds;  // [i, h0, 0, 0]
  float* dA;  // partial [i, h0, :]: head stride NA
  float* dB;  // slot [i, 0, g, 0]
  float* dC;
  bool first_in_task;
  int64_t T, N, NA, nl, H, bs, K;
  float* work;
};

size_t heads_bwd_work(const Dims& d, int64_t K) {
  const int64_t Np = (d.N + 15) / 16 * 16, nseg = (d.T + K - 1) / K;
  return static_cast<size_t>(16 * Np * (6 + nseg + 2 * K) + 48 * K + 16);
}

RC_SIMD void heads_bwd(const HeadsBwd& f) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, nl = f.nl, T = f.T, K = f.K;
  const int64_t nseg = (T + K - 1) / K;
  float* AT = f.work;          // [N][16]
  float* St = AT + Np * 16;    // [N][16]
  float* lam = St + Np * 16;   // [N][16]
  float* dAacc = lam + Np * 16;
  float* dcv = dAacc + Np * 16;  // [Np][16]: per-lane dC terms of one token
  float* dbv = dcv + Np * 16;
  float* ck = dbv + Np * 16;        // nseg x [N][16]: state before token seg * K
  float* sbuf = ck + nseg * Np * 16;  // K x [N][16]: S_t within the segment
  float* abuf = sbuf + K * Np * 16;   // K x [N][16]: a_t
  float* dtpb = abuf + K * Np * 16;   // K x 16
  for (int64_t k = 0; k < 6 * Np * 16; ++k) f.work[k] = 0.0f;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t l = 0; l < nl; ++l) {
      AT[n * 16 + l] = f.A[l * f.NA + (f.NA == 1 ? 0 : n)];
      St[n * 16 + l] = f.s0[l * N + n];
    }
  auto lanes = [&](const float* p) { return nl == 16 ? vload(p) : vload_part(p, nl); };
  // One forward step; a_out/s_out (N x 16) receive a_t and S_t when not null.
  auto step = [&](int64_t t, float* S, float* a_out, float* s_out, float* dtp_out) {
    if (t + kPrefetch < T) {
      __builtin_prefetch(f.dt + (t + kPrefetch) * f.H);
      __builtin_prefetch(f.x + (t + kPrefetch) * f.H);
    }
    const float* Bt = f.B + t * f.bs;
    vf dv = vsoftplus(lanes(f.dt + t * f.H));
    vf u = lanes(f.x + t * f.H) * dv;
    if (dtp_out) vstore(dtp_out, dv);
    for (int64_t n = 0; n < N; ++n) {
      vf a = vexp(dv * vload(AT + n * 16));
      vf sv = vload(S + n * 16) * a + Bt[n] * u;
      vstore(S + n * 16, sv);
      if (a_out) vstore(a_out + n * 16, a);
      if (s_out) vstore(s_out + n * 16, sv);
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    if (t % K == 0) std::memcpy(ck + (t / K) * Np * 16, St, N * 16 * sizeof(float));
    step(t, St, nullptr, nullptr, nullptr);
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t l = 0; l < nl; ++l) lam[n * 16 + l] = f.dsf[l * N + n];
  for (int64_t seg = nseg - 1; seg >= 0; --seg) {
    const int64_t t0 = seg * K, t1 = std::min(T, t0 + K);
    std::memcpy(St, ck + seg * Np * 16, N * 16 * sizeof(float));
    for (int64_t t = t0; t < t1; ++t) {
      step(t, St, abuf + (t - t0) * Np * 16, sbuf + (t - t0) * Np * 16, dtpb + (t - t0) * 16);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      if (t >= kPrefetch) {
        const int64_t o = (t - kPrefetch) * f.H;
        __builtin_prefetch(f.dy + o);
        __builtin_prefetch(f.dx + o, 1);
        __builtin_prefetch(f.ddt + o, 1);
      }
      const float* Sc = sbuf + (t - t0) * Np * 16;
      const float* Sp = t > t0 ? sbuf + (t - t0 - 1) * Np * 16 : ck + seg * Np * 16;
      const float* at = abuf + (t - t0) * Np * 16;
      const float* Bt = f.B + t * f.bs;
      const float* Ct = f.C + t * f.bs;
      const vf dv = vload(dtpb + (t - t0) * 16);
      const vf dyv = lanes(f.dy + t * f.H);
      const vf xv = lanes(f.x + t * f.H);
      const vf u = xv * dv;
      vf du = {}, gA = {};
      for (int64_t n = 0; n < N; ++n) {
        const vf av = vload(at + n * 16);
        vf lv = vload(lam + n * 16) + dyv * Ct[n];
        vstore(dcv + n * 16, dyv * vload(Sc + n * 16));
        vstore(dbv + n * 16, lv * u);
        du += lv * Bt[n];
        vf gv = lv * av * vload(Sp + n * 16);  // dL/d log a_t
        vstore(dAacc + n * 16, vload(dAacc + n * 16) + gv * dv);
        gA += gv * vload(AT + n * 16);
        vstore(lam + n * 16, lv * av);
      }
      const vf dx = du * dv;
      const vf ddt = (du * xv + gA) * vsigmoid(lanes(f.dt + t * f.H));
      float* dxt = f.dx + t * f.H;
      float* ddtt = f.ddt + t * f.H;
      if (nl == 16) {
        vstore(dxt, dx);
        vstore(ddtt, ddt);
      } else {
        vstore_part(dxt, dx, nl);
        vstore_part(ddtt, ddt, nl);
      }
      float* dBt = f.dB + t * f.bs;
      float* dCt = f.dC + t * f.bs;
      for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t m = std::min<int64_t>(16, N - n0);
        vf rc = hsum16x16(dcv + n0 * 16), rb = hsum16x16(dbv + n0 * 16);
        if (!f.first_in_task) {
          rc += vload_part(dCt + n0, m);
          rb += vload_part(dBt + n0, m);
        }
        vstore_part(dCt + n0, rc, m);
        vstore_part(dBt + n0, rb, m);
      }
    }
  }
  for (int64_t l = 0; l < nl; ++l)
    for (int64_t n = 0; n < N; ++n) f.ds[l * N + n] = lam[n * 16 + l];
  for (int64_t l = 0; l < nl; ++l) {
    if (f.NA == 1) {
      float sacc = 0.0f;
      for (int64_t n = 0; n < N; ++n) sacc += dAacc[n * 16 + l];
      f.dA[l] = sacc;
    } else {
      for (int64_t n = 0; n < N; ++n) f.dA[l * f.NA + n] = dAacc[n * 16 + l];
    }
  }
}

// ---- backward driver ----------------------------------------------------------------

// Tasks are (sequence, group, split); each split covers a fixed range of heads (rows
// layout) or 16-head blocks (heads layout) and owns a slot of partial dB, dC. The split
// count depends on the shapes only, never on the thread count.
int64_t n_splits(const Dims& d, int64_t units_per_group) {
  const int64_t want = (8 + d.S * d.G - 1) / std::max<int64_t>(1, d.S * d.G);
  return std::max<int64_t>(1, std::min(want, units_per_group));
}

void scan_backward(KernelCtx& c) {
  const Dims d = dims_of(c.src, 1);
  const float* gy = c.src[0].f32();
  const float* s = c.src[1].f32();
  const float* x = c.src[2].f32();
  const float* dt = c.src[3].f32();
  const float* A = c.src[4].f32();
  const float* B = c.src[5].f32();
  const float* C = c.src[6].f32();
  const int32_t* ids = c.src[7].i32();
  check_ids(ids, d, "ssm_scan_back");
  const float* gs = gy + d.S * d.T * d.H * d.P;  // dL/d(final states)
  float* o_ds = c.dst.f32();
  float* o_dx = o_ds + d.R * d.H * d.P * d.N;
  float* o_ddt = o_dx + d.S * d.T * d.H * d.P;
  float* o_dA = o_ddt + d.S * d.T * d.H;
  float* o_dB = o_dA + d.H * d.NA;
  float* o_dC = o_dB + d.S * d.T * d.G * d.N;
  const int64_t nB = d.S * d.T * d.G * d.N, nstate = d.H * d.P * d.N;

  // d_s goes straight to row ids[i] when every row is used once; otherwise to a
  // per-sequence buffer summed into the rows in sequence order below.
  std::vector<char> used(d.R, 0);
  bool shared = false;
  for (int64_t i = 0; i < d.S; ++i) {
    shared |= used[ids[i]] != 0;
    used[ids[i]] = 1;
  }
  std::vector<float> ds_seq(shared ? d.S * nstate : 0);
  auto ds_of = [&](int64_t i) { return shared ? ds_seq.data() + i * nstate : o_ds + ids[i] * nstate; };

  const bool heads = d.P == 1;
  const int64_t nbg = (d.hpg + 15) / 16;
  const int64_t units = heads ? nbg : d.hpg;  // per group
  const int64_t nsplit = n_splits(d, units);
  std::vector<float> slots(static_cast<size_t>((nsplit - 1) * 2 * nB));
  auto slot_B = [&](int64_t j) { return j == 0 ? o_dB : slots.data() + (j - 1) * 2 * nB; };
  auto slot_C = [&](int64_t j) { return j == 0 ? o_dC : slots.data() + (j - 1) * 2 * nB + nB; };
  std::vector<float> dA_part(static_cast<size_t>(d.S * d.H * d.NA));
  std::vector<Work> work(c.pool.size());

  if (d.T == 0) {  // no tokens: dB, dC are empty, d_s = dL/d(final state)
    for (int64_t i = 0; i < d.S; ++i) std::memcpy(ds_of(i), gs + i * nstate, nstate * sizeof(float));
  } else if (heads) {
    const int64_t K = std::max<int64_t>(16, (d.T + 255) / 256);
    c.pool.run(d.S * d.G * nsplit, [&](int64_t task, int tid) {
      const int64_t i = task / (d.G * nsplit), g = task / nsplit % d.G, j = task % nsplit;
      const int64_t b0 = j * units / nsplit, b1 = (j + 1) * units / nsplit;
      float* wk = work[tid].get(heads_bwd_work(d, K));
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t h0 = g * d.hpg + blk * 16;
        HeadsBwd f;
        f.s0 = s + (ids[i] * d.H + h0) * d.N;
        f.x = x + i * d.T * d.H + h0;
        f.dt = dt + i * d.T * d.H + h0;
        f.dy = gy + i * d.T * d.H + h0;
        f.dsf = gs + (i * d.H + h0) * d.N;
        f.A = A + h0 * d.NA;
        f.B = B + (i * d.T * d.G + g) * d.N;
        f.C = C + (i * d.T * d.G + g) * d.N;
        f.dx = o_dx + i * d.T * d.H + h0;
        f.ddt = o_ddt + i * d.T * d.H + h0;
        f.ds = ds_of(i) + h0 * d.N;
        f.dA = dA_part.data() + (i * d.H + h0) * d.NA;
        f.dB = slot_B(j) + (i * d.T * d.G + g) * d.N;
        f.dC = slot_C(j) + (i * d.T * d.G + g) * d.N;
        f.first_in_task = blk == b0;
        f.T = d.T;
        f.N = d.N;
        f.NA = d.NA;
        f.nl = std::min<int64_t>(16, d.hpg - blk * 16);
        f.H = d.H;
        f.bs = d.G * d.N;
        f.K = K;
        f.work = wk;
        heads_bwd(f);
      }
    });
  } else {
    const int64_t PB = rows_bwd_block(d), npb = (d.P + PB - 1) / PB;
    const int64_t K = std::max<int64_t>(16, (d.T + 63) / 64);
    const size_t wsz = rows_bwd_work(d, PB, K);
    c.pool.run(d.S * d.G * nsplit, [&](int64_t task, int tid) {
      const int64_t i = task / (d.G * nsplit), g = task / nsplit % d.G, j = task % nsplit;
      const int64_t hb = g * d.hpg + j * units / nsplit, he = g * d.hpg + (j + 1) * units / nsplit;
      float* wk = work[tid].get(wsz + 4 * d.T);
      float* dtp = wk + wsz;
      float* a = dtp + d.T;
      float* sig = a + d.T;
      float* ddtp = sig + d.T;  // dL/d softplus(dt) of one head, summed over its blocks
      for (int64_t h = hb; h < he; ++h) {
        dt_column(dt + i * d.T * d.H + h, d.H, d.T, A[h * d.NA], dtp, d.per_n ? nullptr : a, sig);
        for (int64_t pb = 0; pb < npb; ++pb) {
          const int64_t p0 = pb * PB;
          RowsBwd f;
          f.s0 = s + ((ids[i] * d.H + h) * d.P + p0) * d.N;
          f.x = x + (i * d.T * d.H + h) * d.P + p0;
          f.dy = gy + (i * d.T * d.H + h) * d.P + p0;
          f.dsf = gs + ((i * d.H + h) * d.P + p0) * d.N;
          f.dtp = dtp;
          f.a = d.per_n ? nullptr : a;
          f.Ah = A + h * d.NA;
          f.B = B + (i * d.T * d.G + g) * d.N;
          f.C = C + (i * d.T * d.G + g) * d.N;
          f.dx = o_dx + (i * d.T * d.H + h) * d.P + p0;
          f.ddtp = ddtp;
          f.ds = ds_of(i) + (h * d.P + p0) * d.N;
          f.dA = dA_part.data() + (i * d.H + h) * d.NA;
          f.dB = slot_B(j) + (i * d.T * d.G + g) * d.N;
          f.dC = slot_C(j) + (i * d.T * d.G + g) * d.N;
          f.first_in_task = h == hb && pb == 0;
          f.first_in_head = pb == 0;
          f.T = d.T;
          f.N = d.N;
          f.pl = std::min(PB, d.P - p0);
          f.xs = d.H * d.P;
          f.bs = d.G * d.N;
          f.K = K;
          f.work = wk;
          rows_bwd(f);
        }
        float* o = o_ddt + i * d.T * d.H + h;
        for (int64_t t = 0; t < d.T; ++t) o[t * d.H] = ddtp[t] * sig[t];
      }
    });
  }

  // Fixed-order reductions of the partial sums.
  if (nsplit > 1 && nB > 0) {
    c.pool.parallel_for(nB, kGrainElems, [&](int64_t b, int64_t e, int) {
      for (int64_t j = 1; j < nsplit; ++j) {
        const float* pb = slot_B(j);
        const float* pc = slot_C(j);
        for (int64_t k = b; k < e; ++k) {
          o_dB[k] += pb[k];
          o_dC[k] += pc[k];
        }
      }
    });
  }
  for (int64_t k = 0; k < d.H * d.NA; ++k) {
    float acc = 0.0f;
    for (int64_t i = 0; i < d.S; ++i) acc += dA_part[i * d.H * d.NA + k];
    o_dA[k] = acc;
  }
  if (shared) {
    std::memset(o_ds, 0, static_cast<size_t>(d.R * nstate) * sizeof(float));
    c.pool.parallel_for(nstate, kGrainElems, [&](int64_t b, int64_t e, int) {
      for (int64_t i = 0; i < d.S; ++i) {
        float* dst = o_ds + ids[i] * nstate;
        const float* src = ds_seq.data() + i * nstate;
        for (int64_t k = b; k < e; ++k) dst[k] += src[k];
      }
    });
  } else {
    for (int64_t r = 0; r < d.R; ++r)
      if (!used[r]) std::memset(o_ds + r * nstate, 0, static_cast<size_t>(nstate) * sizeof(float));
  }
}

// ---- op definitions -----------------------------------------------------------------

// Validates (s, x, dt, A, B, C, ids) starting at source `off`; returns the dims.
Dims scan_check(Graph& g, Node& n, int off) {
  for (int i = off; i < off + 6; ++i) require_f32(g, n, i);
  const Node& idn = g.node(n.src[off + 6]);
  if (idn.dtype != DType::i32)
    throw TypeError(OpTable::get().at(n.op).name + ": ids must be int32, got " + dtype_name(idn.dtype));
  const Shape &s = g.node(n.src[off]).shape, &x = g.node(n.src[off + 1]).shape,
              &dt = g.node(n.src[off + 2]).shape, &A = g.node(n.src[off + 3]).shape,
              &B = g.node(n.src[off + 4]).shape, &C = g.node(n.src[off + 5]).shape, &ids = idn.shape;
  if (s.ndim != 4) fail_shape(g, n, "s must be (n_rows, n_head, head_dim, d_state)");
  if (x.ndim != 4) fail_shape(g, n, "x must be (n_seqs, n_tok, n_head, head_dim)");
  if (dt.ndim != 3) fail_shape(g, n, "dt must be (n_seqs, n_tok, n_head)");
  if (A.ndim != 2) fail_shape(g, n, "A must be (n_head, d_state) or (n_head, 1)");
  if (B.ndim != 4) fail_shape(g, n, "B must be (n_seqs, n_tok, n_group, d_state)");
  if (C != B) fail_shape(g, n, "B and C must have the same shape");
  if (ids.ndim != 1) fail_shape(g, n, "ids must be (n_seqs,)");
  const int64_t S = x[0], T = x[1], H = x[2], P = x[3], N = s[3], G = B[2];
  if (H < 1 || P < 1 || N < 1 || G < 1) fail_shape(g, n, "n_head, head_dim, d_state and n_group must be >= 1");
  if (s[1] != H || s[2] != P) fail_shape(g, n, "s must be (n_rows, n_head, head_dim, d_state) matching x");
  if (s[0] < S) fail_shape(g, n, "s needs at least n_seqs state rows");
  if (dt[0] != S || dt[1] != T || dt[2] != H) fail_shape(g, n, "dt must be (n_seqs, n_tok, n_head) matching x");
  if (A[0] != H || (A[1] != N && A[1] != 1)) fail_shape(g, n, "A must be (n_head, d_state) or (n_head, 1)");
  if (B[0] != S || B[1] != T || B[3] != N) fail_shape(g, n, "B and C must be (n_seqs, n_tok, n_group, d_state)");
  if (H % G != 0) fail_shape(g, n, "n_head must be a multiple of n_group");
  if (ids[0] != S) fail_shape(g, n, "ids must have n_seqs entries");
  Dims d;
  d.R = s[0];
  d.S = S;
  d.T = T;
  d.H = H;
  d.P = P;
  d.N = N;
  d.G = G;
  d.NA = A[1];
  d.hpg = H / G;
  d.per_n = d.NA != 1;
  return d;
}

}  // namespace

void register_ssm_ops(OpTable& t) {
  register_ssm_conv_ops(t);
  {
    OpDef d;
    d.name = "ssm_scan";
    d.contiguous_srcs = 0x7f;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 7) fail_shape(g, n, "takes (s, x, dt, A, B, C, ids)");
      const Dims dm = scan_check(g, n, 0);
      n.dtype = DType::f32;
      n.shape = Shape{dm.S * dm.T * dm.H * dm.P + dm.S * dm.H * dm.P * dm.N};
    };
    d.forward = scan_forward;
    d.backward = [](GradSink& k) {
      bool any = false;
      for (int i = 0; i < 6; ++i) any |= k.needs(i);
      if (!any) return;
      std::vector<int> src{k.grad_out};
      src.insert(src.end(), k.node.src.begin(), k.node.src.end());
      const int back = k.g.op("ssm_scan_back", src);
      int64_t off = 0;
      for (int i = 0; i < 6; ++i) {
        const Shape sh = k.g.node(k.node.src[i]).shape;
        if (k.needs(i)) k.add(i, k.g.unpack(back, off, sh));
        off += sh.numel();
      }
    };
    t.add(std::move(d));
  }
  {
    // The gradients of ssm_scan, packed: ds, dx, ddt, dA, dB, dC (shapes of s..C).
    OpDef d;
    d.name = "ssm_scan_back";
    d.contiguous_srcs = 0xff;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 8) fail_shape(g, n, "takes (grad, s, x, dt, A, B, C, ids)");
      require_f32(g, n, 0);
      const Dims dm = scan_check(g, n, 1);
      const Shape& gr = g.node(n.src[0]).shape;
      if (gr.ndim != 1 || gr[0] != dm.S * dm.T * dm.H * dm.P + dm.S * dm.H * dm.P * dm.N)
        fail_shape(g, n, "grad must be the packed (y, final states) gradient");
      int64_t total = 0;
      for (int i = 1; i < 7; ++i) total += g.node(n.src[i]).numel();
      n.dtype = DType::f32;
      n.shape = Shape{total};
    };
    d.forward = scan_backward;
    t.add(std::move(d));
  }
}

}  // namespace recurra

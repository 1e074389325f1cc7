// ssm_scan, the backward of the rows layout (P > 1): one forward sweep (S, dC) and one
// reverse sweep (lam, dB, dx), the decay gradient re-anchored from stored states (see scan.h).
#include "scan.h"

namespace recurra {
namespace ssm {
namespace scan {

namespace {

// ======================================================================================
// Backward, rows layout: one (sequence, head, block of PB channels), state [p][n].
// ======================================================================================

// One unit of the rows backward: (sequence, head, block of pl channels), state [p][n]. A
// task advances a few units chunk by chunk, forward then in reverse, so that the dB and dC
// rows of a chunk stay in L1 while every unit adds to them.
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
  bool first_in_head;  // write ddtp, dA instead of adding
  bool w16;            // the per-token steps on whole 16-float rows (see wide_rows)
  int64_t T, N, pl, xs, bs, K;
  // state kept between chunks
  float* S;     // [pl][Np]: S / P in the forward sweep, lam / R in the reverse sweep
  float* anch;  // ceil(T / K) x [pl][Np]: S_t at t = K-1, 2K-1, ..., T-1
  float* zc;    // T x (Np or 1): C_t . dC_t
  float* v;     // rows_bwd_scratch(): per-state vectors and staging
  float P, Zs, dAs;
};

// Scratch of a unit (f.v), in floats: per-state vectors, then per-token staging.
//   0 Pv / Rv | 1 (unused) | 2 an (bh) | 3 bt (cr) | 4 dc | 5 Z | 6 db | 7 dAv   (Np each)
//   8 Np: for each of two tokens: uv, du (plp each), dupart (16 plp); then bt2, dc2 /
//   cr2, bh2, db2 (Np each) for the second token of a pair.
size_t rows_bwd_scratch(int64_t Np, int64_t plp) {
  return static_cast<size_t>(8 * Np + 2 * 18 * plp + 3 * Np);
}

size_t rows_bwd_unit_floats(int64_t T, int64_t N, int64_t pl, int64_t K, bool per_n) {
  const int64_t Np = (N + 15) / 16 * 16, plp = (pl + 15) / 16 * 16, nanch = (T + K - 1) / K;
  return static_cast<size_t>(pl * Np * (1 + nanch) + T * (per_n ? Np : 1)) + rows_bwd_scratch(Np, plp);
}

// Rows of N floats from src into dst with rows of Np, zeros past N.
void copy_rows_padded(float* dst, const float* src, int64_t rows, int64_t N, int64_t Np) {
  for (int64_t p = 0; p < rows; ++p) {
    std::memcpy(dst + p * Np, src + p * N, static_cast<size_t>(N) * sizeof(float));
    std::memset(dst + p * Np + N, 0, static_cast<size_t>(Np - N) * sizeof(float));
  }
}

void rows_bwd_begin(RowsBwd& f) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, plp = (f.pl + 15) / 16 * 16;
  std::memset(f.v, 0, rows_bwd_scratch(Np, plp) * sizeof(float));
  copy_rows_padded(f.S, f.s0, f.pl, N, Np);
  for (int64_t n = 0; n < Np; ++n) f.v[n] = 1.0f;  // Pv
  f.P = 1.0f;
}

// A vector type's loads and stores: vf (16 floats) or v8 (8 floats, AVX2). The sweeps below
// broadcast a scalar by writing `s * v`: GCC 12 compiled vsplat(u[m][p]) there as 16
// masked one-lane broadcasts (kmovw + vbroadcastss{k} per lane), 3x the time of the sweep.
template <class V>
struct Lanes;
template <>
struct Lanes<vf> {
  static constexpr int n = 16;
  static RC_INLINE vf load(const float* p) { return vload(p); }
  static RC_INLINE void store(float* p, vf v) { vstore(p, v); }
};
template <>
struct Lanes<v8> {
  static constexpr int n = 8;
  static RC_INLINE v8 load(const float* p) { return v8load(p); }
  static RC_INLINE void store(float* p, v8 v) { v8store(p, v); }
};

// Forward sweep of M tokens: for each token m in turn, S[p][:] += u[m][p] b[m] and
// dc[m] = sum_p dy[m][p] S[p][:]. One load and one store of the state serve all M tokens.
// NV vectors of type V per row: with AVX2, v8 and NV = 2 keep 12 registers of 16 live (the
// 16-float version would need 2 x 14 and spill on every element); lane for lane the same
// operations in the same order either way.
template <class V, int NV, int M>
RC_INLINE void fwd_pn_chunk(float* __restrict S, const float* const* b, const float* const* u,
                            const float* const* dy, float* const* dc, int64_t n0, int64_t pl, int64_t Np) {
  using Ln = Lanes<V>;
  constexpr int W = Ln::n;
  V bv[M][NV], acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) {
      bv[m][j] = Ln::load(b[m] + n0 + W * j);
      acc[m][j] = V{};
    }
  for (int64_t p = 0; p < pl; ++p) {
    float* sp = S + p * Np + n0;
    V sv[NV];
    for (int j = 0; j < NV; ++j) sv[j] = Ln::load(sp + W * j);
    for (int m = 0; m < M; ++m) {
      const float up = u[m][p], dp = dy[m][p];
      for (int j = 0; j < NV; ++j) {
        sv[j] += up * bv[m][j];
        acc[m][j] += dp * sv[j];
      }
    }
    for (int j = 0; j < NV; ++j) Ln::store(sp + W * j, sv[j]);
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) Ln::store(dc[m] + n0 + W * j, acc[m][j]);
}

template <int M>
RC_INLINE void fwd_pn(float* S, const float* const* b, const float* const* u, const float* const* dy,
                      float* const* dc, int64_t pl, int64_t Np) {
  constexpr int NV = 4;
  if (!wide_registers()) {  // AVX2: 16 lanes as two 8-float registers (Np is a multiple of 16)
    for (int64_t n = 0; n < Np; n += 16) fwd_pn_chunk<v8, 2, M>(S, b, u, dy, dc, n, pl, Np);
    return;
  }
  int64_t n = 0;
  for (; n + 16 * NV <= Np; n += 16 * NV) fwd_pn_chunk<vf, NV, M>(S, b, u, dy, dc, n, pl, Np);
  for (; n < Np; n += 16) fwd_pn_chunk<vf, 1, M>(S, b, u, dy, dc, n, pl, Np);
}

// Reverse sweep of M tokens: for each token m in turn, lam[p][:] += dy[m][p] c[m];
// db[m] = sum_p u[m][p] lam[p][:]; du[m][p] = lam[p][:] . bh[m] (lane sums taken at the end
// from dupart[m], 16 lanes per p: lane l sums the n with n % 16 == l). NV vectors of type V
// per row; with AVX2 v8 and NV = 1 (M = 2: 12 live registers of 16), whose du partial sums go
// to lanes n0 % 16 .. + 7, so the sums and their order are those of the 16-float version.
template <class V, int NV, int M, bool FIRST>
RC_INLINE void rev_pn_chunk(float* __restrict lam, const float* const* c, const float* const* bh,
                            const float* const* u, const float* const* dy, float* const* db,
                            float* const* dupart, int64_t n0, int64_t pl, int64_t Np) {
  using Ln = Lanes<V>;
  constexpr int W = Ln::n;
  const int64_t lo = n0 & 15 & -W;  // 0 for vf
  V cv[M][NV], bv[M][NV], acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) {
      cv[m][j] = Ln::load(c[m] + n0 + W * j);
      bv[m][j] = Ln::load(bh[m] + n0 + W * j);
      acc[m][j] = V{};
    }
  for (int64_t p = 0; p < pl; ++p) {
    float* lp = lam + p * Np + n0;
    V lv[NV];
    for (int j = 0; j < NV; ++j) lv[j] = Ln::load(lp + W * j);
    for (int m = 0; m < M; ++m) {
      const float up = u[m][p], dp = dy[m][p];
      float* dq = dupart[m] + 16 * p + lo;
      V du = FIRST ? V{} : Ln::load(dq);
      for (int j = 0; j < NV; ++j) {
        lv[j] += dp * cv[m][j];
        acc[m][j] += up * lv[j];
        du += lv[j] * bv[m][j];
      }
      Ln::store(dq, du);
    }
    for (int j = 0; j < NV; ++j) Ln::store(lp + W * j, lv[j]);
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) Ln::store(db[m] + n0 + W * j, acc[m][j]);
}

template <int M>
RC_INLINE void rev_pn(float* lam, const float* const* c, const float* const* bh, const float* const* u,
                      const float* const* dy, float* const* db, float* const* dupart, float* const* du,
                      int64_t pl, int64_t Np) {
  constexpr int NV = 4;
  int64_t n = 0;
  if (!wide_registers()) {  // AVX2: 8 lanes at a time (Np is a multiple of 16)
    rev_pn_chunk<v8, 1, M, true>(lam, c, bh, u, dy, db, dupart, 0, pl, Np);
    rev_pn_chunk<v8, 1, M, true>(lam, c, bh, u, dy, db, dupart, 8, pl, Np);
    for (n = 16; n < Np; n += 8) rev_pn_chunk<v8, 1, M, false>(lam, c, bh, u, dy, db, dupart, n, pl, Np);
  } else {
    if (Np >= 16 * NV) {
      rev_pn_chunk<vf, NV, M, true>(lam, c, bh, u, dy, db, dupart, 0, pl, Np);
      n = 16 * NV;
    } else {
      rev_pn_chunk<vf, 1, M, true>(lam, c, bh, u, dy, db, dupart, 0, pl, Np);
      n = 16;
    }
    for (; n + 16 * NV <= Np; n += 16 * NV)
      rev_pn_chunk<vf, NV, M, false>(lam, c, bh, u, dy, db, dupart, n, pl, Np);
    for (; n < Np; n += 16) rev_pn_chunk<vf, 1, M, false>(lam, c, bh, u, dy, db, dupart, n, pl, Np);
  }
  if (!wide_registers()) {  // the sums of hsum16x16, in its order, without 16-float shuffles
    for (int m = 0; m < M; ++m)
      for (int64_t p = 0; p < pl; ++p)
        du[m][p] = hsum8(v8load(dupart[m] + 16 * p) + v8load(dupart[m] + 16 * p + 8));
    return;
  }
  for (int m = 0; m < M; ++m)
    for (int64_t p0 = 0; p0 < pl; p0 += 16) {
      vstore(du[m] + p0, hsum16x16(dupart[m] + 16 * p0));  // du is padded to a multiple of 16
    }
}

// z[n] = sum_p lam[p][n] * S[p][n]
RC_INLINE void dot_pn(const float* lam, const float* S, float* z, int64_t pl, int64_t Np) {
  for (int64_t n = 0; n < Np; n += 8) {
    v8 acc = {};
    for (int64_t p = 0; p < pl; ++p) acc += v8load(lam + p * Np + n) * v8load(S + p * Np + n);
    v8store(z + n, acc);
  }
}

RC_INLINE void scale_pn(float* S, const float* f, int64_t pl, int64_t Np) {
  for (int64_t p = 0; p < pl; ++p)
    for (int64_t n = 0; n < Np; n += 16) vstore(S + p * Np + n, vload(S + p * Np + n) * vload(f + n));
}

// Per-state decays: acc[n] *= exp(d A[n]); when any of them leaves [2^-60, 2^60] the
// scaled state is multiplied out (X[p][n] *= acc[n]) and acc is reset to 1. `an` is
// scratch (Np). The forward sweep keeps S~ = S / Pv and the reverse sweep lam~ = lam / Rv
// this way.
RC_INLINE void decay_pn(float* X, float* acc, const float* Ah, float d, float* an, int64_t N, int64_t Np,
                        int64_t pl) {
  exp_row(Ah, d, N, Np, an);
  vi bad = {};
  for (int64_t n0 = 0; n0 < Np; n0 += 16) {
    vf q = vload(acc + n0) * vload(an + n0);
    bad |= !(q >= kPMin && q <= kPMax);
    vstore(acc + n0, q);
  }
  bool renorm = false;
  for (int l = 0; l < 16; ++l) renorm |= bad[l] != 0;
  if (renorm) {
    scale_pn(X, acc, pl, Np);
    for (int64_t n = 0; n < Np; ++n) acc[n] = 1.0f;
  }
}

// One decay per head: the accumulated decay p of the scaled state X (n floats). When p
// leaves [2^-60, 2^60] (also when it is 0 or NaN) X is multiplied out and 1 is returned.
RC_INLINE float renorm_head(float* X, int64_t n, float p) {
  if (in_range(p)) return p;
  for (int64_t k = 0; k < n; k += 8) v8store(X + k, v8load(X + k) * p);
  return 1.0f;
}

// Lanes n0 .. n0 + 15 of a row of N floats (zero past N).
RC_INLINE vf row_at(const float* p, int64_t n0, int64_t N) {
  return n0 + 16 <= N ? vload(p + n0) : vload_part(p + n0, N - n0);
}
RC_INLINE void row_put(float* p, int64_t n0, int64_t N, vf v, bool add) {
  if (add) v += row_at(p, n0, N);
  if (n0 + 16 <= N)
    vstore(p + n0, v);
  else
    vstore_part(p + n0, v, N - n0);
}

// The per-token steps of one decay per head work on 8-float vectors (row8_at, scan.h), or
// with AVX-512 and N a multiple of 16 on whole 16-float vectors: half the instructions, no
// tails (at Mamba2-130M's shape, N 128, one call 15% faster on one thread).
inline bool wide_rows(int64_t N) { return wide_registers() && N % 16 == 0; }

// out[n] = B_t[n] * k (n < Np).
RC_INLINE void scaled_row(const float* Bt, float k, int64_t N, int64_t Np, float* out, bool w16) {
  if (w16) {
    for (int64_t n0 = 0; n0 < N; n0 += 16) vstore(out + n0, vload(Bt + n0) * k);
    return;
  }
  for (int64_t n0 = 0; n0 < Np; n0 += 8) v8store(out + n0, row8_at(Bt, n0, N) * k);
}

struct Stage {
  float *uv, *du, *dupart;
};
RC_INLINE Stage stage_of(float* v, int64_t Np, int64_t plp, int m) {
  float* b = v + 8 * Np + m * 18 * plp;
  return {b, b + plp, b + 2 * plp};
}

// K is a power of two.
RC_INLINE bool is_anchor(int64_t t, int64_t K, int64_t T) { return (t & (K - 1)) == K - 1 || t == T - 1; }

// uv = x_t * d_t (the row of this unit's channels); the sweeps read dy_t in place.
RC_INLINE void stage_rows(const RowsBwd& f, int64_t t, const Stage& st) {
  const float d = f.dtp[t];
  const float* xt = f.x + t * f.xs;
  int64_t p = 0;
  for (; p + 16 <= f.pl; p += 16) vstore(st.uv + p, vload(xt + p) * d);
  for (; p < f.pl; ++p) st.uv[p] = xt[p] * d;
}
RC_INLINE const float* dy_row(const RowsBwd& f, int64_t t) { return f.dy + t * f.xs; }

// After a token of the forward sweep: dC_t = P dc into the slot, C_t . dC_t, the anchor.
RC_INLINE void fwd_post(RowsBwd& f, int64_t t, const float* S, const float* dc, const float* Pv, float P,
                        bool first) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl;
  const bool per_n = f.a == nullptr;
  const float* Ct = f.C + t * f.bs;
  float* dCt = f.dC + t * f.bs;
  if (!per_n && f.w16) {
    vf zacc = {};
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      const vf dcn = vload(dc + n0) * P;
      vstore(dCt + n0, first ? dcn : dcn + vload(dCt + n0));
      zacc += vload(Ct + n0) * dcn;
    }
    f.zc[t] = hsum(zacc);
    if (is_anchor(t, f.K, f.T)) {
      float* at = f.anch + (t / f.K) * pl * Np;
      for (int64_t k = 0; k < pl * Np; k += 16) vstore(at + k, vload(S + k) * P);
    }
    return;
  }
  if (!per_n) {  // one decay per head (see row8_at)
    v8 zacc = {};
    for (int64_t n0 = 0; n0 < Np; n0 += 8) {
      const v8 dcn = v8load(dc + n0) * P;
      row8_put(dCt, n0, N, dcn, !first);
      zacc += row8_at(Ct, n0, N) * dcn;
    }
    f.zc[t] = hsum8(zacc);
    if (is_anchor(t, f.K, f.T)) {
      float* at = f.anch + (t / f.K) * pl * Np;
      for (int64_t k = 0; k < pl * Np; k += 8) v8store(at + k, v8load(S + k) * P);
    }
    return;
  }
  vf zacc = {};
  for (int64_t n0 = 0; n0 < Np; n0 += 16) {
    const vf dcn = vload(dc + n0) * (per_n ? vload(Pv + n0) : vsplat(P));
    row_put(dCt, n0, N, dcn, !first);
    const vf z = row_at(Ct, n0, N) * dcn;
    if (per_n)
      vstore(f.zc + t * Np + n0, z);
    else
      zacc += z;
  }
  if (!per_n) f.zc[t] = hsum(zacc);
  if (is_anchor(t, f.K, f.T)) {
    float* at = f.anch + (t / f.K) * pl * Np;
    for (int64_t p = 0; p < pl; ++p)
      for (int64_t n0 = 0; n0 < Np; n0 += 16)
        vstore(at + p * Np + n0, vload(S + p * Np + n0) * (per_n ? vload(Pv + n0) : vsplat(P)));
  }
}

// Forward sweep over tokens [t0, t1): S~, dC (added to the slot; `first` writes it), C.dC,
// anchors. Two tokens per sweep over the state where no renormalisation or anchor falls
// between them.
RC_SIMD void rows_bwd_fwd(RowsBwd& f, int64_t t0, int64_t t1, bool first) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl, T = f.T, K = f.K;
  const int64_t plp = (pl + 15) / 16 * 16;
  const bool per_n = f.a == nullptr;
  float* S = f.S;
  float* v = f.v;
  float *Pv = v, *an = v + 2 * Np, *bt = v + 3 * Np, *dc = v + 4 * Np;
  float* ext = v + 8 * Np + 2 * 18 * plp;
  float *bt2 = ext, *dc2 = ext + Np;
  const Stage s0 = stage_of(v, Np, plp, 0), s1 = stage_of(v, Np, plp, 1);
  float P = f.P;
  for (int64_t t = t0; t < t1;) {
    for (int64_t k = 0; k < 2; ++k)
      if (t + 2 * kPrefetch + k < T) {
        prefetch_row(f.x + (t + 2 * kPrefetch + k) * f.xs, pl, false);
        prefetch_row(f.dy + (t + 2 * kPrefetch + k) * f.xs, pl, false);
      }
    const float* Bt = f.B + t * f.bs;
    if (!per_n && t + 1 < t1 && !is_anchor(t, K, T)) {
      const float p0 = P * f.a[t], p1 = p0 * f.a[t + 1];
      if (in_range(p0) && in_range(p1)) {
        const float i0 = 1.0f / p0, i1 = 1.0f / p1;
        scaled_row(Bt, i0, N, Np, bt, f.w16);
        scaled_row(Bt + f.bs, i1, N, Np, bt2, f.w16);
        stage_rows(f, t, s0);
        stage_rows(f, t + 1, s1);
        const float* bb[2] = {bt, bt2};
        const float* uu[2] = {s0.uv, s1.uv};
        const float* dd[2] = {dy_row(f, t), dy_row(f, t + 1)};
        float* cc[2] = {dc, dc2};
        fwd_pn<2>(S, bb, uu, dd, cc, pl, Np);
        fwd_post(f, t, S, dc, Pv, p0, first);
        fwd_post(f, t + 1, S, dc2, Pv, p1, first);
        P = p1;
        t += 2;
        continue;
      }
    }
    if (!per_n) {
      P = renorm_head(S, pl * Np, P * f.a[t]);
      const float ip = 1.0f / P;
      scaled_row(Bt, ip, N, Np, bt, f.w16);
    } else {
      decay_pn(S, Pv, f.Ah, f.dtp[t], an, N, Np, pl);
      for (int64_t n0 = 0; n0 < Np; n0 += 16) vstore(bt + n0, row_at(Bt, n0, N) / vload(Pv + n0));
    }
    stage_rows(f, t, s0);
    const float* bb[1] = {bt};
    const float* uu[1] = {s0.uv};
    const float* dd[1] = {dy_row(f, t)};
    float* cc[1] = {dc};
    fwd_pn<1>(S, bb, uu, dd, cc, pl, Np);
    fwd_post(f, t, S, dc, Pv, P, first);
    t += 1;
  }
  f.P = P;
}

// Between the sweeps: lam = dL/d(final state), R = 1.
void rows_bwd_mid(RowsBwd& f) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16;
  copy_rows_padded(f.S, f.dsf, f.pl, N, Np);
  for (int64_t n = 0; n < Np; ++n) {
    f.v[n] = 1.0f;           // Rv
    f.v[7 * Np + n] = 0.0f;  // dAv
  }
  f.P = 1.0f;  // R
  f.Zs = f.dAs = 0.0f;
}

// cr = C_t / R, bh = B_t * R (one decay per head).
RC_INLINE void rev_pre(const RowsBwd& f, int64_t t, float R, float* cr, float* bh) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16;
  scaled_row(f.C + t * f.bs, 1.0f / R, N, Np, cr, f.w16);
  scaled_row(f.B + t * f.bs, R, N, Np, bh, f.w16);
}

// After a token of the reverse sweep (one decay per head): dx, dB into the slot, the
// decay gradient G_t = Z_t - B_t . dB_t, dA, ddtp, and Z_{t-1}.
RC_INLINE void rev_post(RowsBwd& f, int64_t t, float R, const float* lam, const float* db, const float* du,
                        float* Z, bool first) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl;
  const float d = f.dtp[t];
  const float* Bt = f.B + t * f.bs;
  const float* xt = f.x + t * f.xs;
  float* dBt = f.dB + t * f.bs;
  float* dxt = f.dx + t * f.xs;
  v8 ddv = {};
  for (int64_t p0 = 0; p0 < pl; p0 += 8) {  // du is padded to a multiple of 16
    const v8 dv = v8load(du + p0);
    row8_put(dxt, p0, pl, dv * d, false);
    ddv += dv * row8_at(xt, p0, pl);
  }
  float dd = hsum8(ddv);
  if (is_anchor(t, f.K, f.T)) {  // Z_t exactly from the stored state
    dot_pn(lam, f.anch + (t / f.K) * pl * Np, Z, pl, Np);
    v8 z = {};
    for (int64_t n0 = 0; n0 < Np; n0 += 8) z += v8load(Z + n0);
    f.Zs = hsum8(z) * R;
  }
  float bdbs;
  if (f.w16) {
    vf bdb = {};
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      const vf dbn = vload(db + n0) * R;
      vstore(dBt + n0, first ? dbn : dbn + vload(dBt + n0));
      bdb += vload(Bt + n0) * dbn;
    }
    bdbs = hsum(bdb);
  } else {
    v8 bdb = {};
    for (int64_t n0 = 0; n0 < Np; n0 += 8) {
      const v8 dbn = v8load(db + n0) * R;
      row8_put(dBt, n0, N, dbn, !first);
      bdb += row8_at(Bt, n0, N) * dbn;
    }
    bdbs = hsum8(bdb);
  }
  const float G = f.Zs - bdbs;
  f.dAs += G * d;
  dd += G * f.Ah[0];
  if (t > 0) f.Zs = G + f.zc[t - 1];
  f.ddtp[t] = f.first_in_head ? dd : f.ddtp[t] + dd;
}

// Reverse sweep over tokens t1 - 1 down to t0: lam~, dB (added to the slot; `first` writes
// it), dx, ddtp, dA. Two tokens per sweep where no renormalisation or anchor falls between.
RC_SIMD void rows_bwd_rev(RowsBwd& f, int64_t t0, int64_t t1, bool first) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl, T = f.T, K = f.K;
  const int64_t plp = (pl + 15) / 16 * 16;
  const bool per_n = f.a == nullptr;
  float* lam = f.S;
  float* v = f.v;
  float *Rv = v, *an = v + 2 * Np, *cr = v + 3 * Np, *Z = v + 5 * Np, *db = v + 6 * Np, *dAv = v + 7 * Np;
  float* bh = an;  // B * R (dead by the time `an` is needed)
  float* ext = v + 8 * Np + 2 * 18 * plp;
  float *cr2 = ext, *bh2 = ext + Np, *db2 = ext + 2 * Np;
  const Stage s0 = stage_of(v, Np, plp, 0), s1 = stage_of(v, Np, plp, 1);
  for (int64_t t = t1 - 1; t >= t0;) {
    for (int64_t k = 0; k < 2; ++k)
      if (t - 2 * kPrefetch - k >= 0) {
        const int64_t o = (t - 2 * kPrefetch - k) * f.xs;
        prefetch_row(f.x + o, pl, false);
        prefetch_row(f.dy + o, pl, false);
        prefetch_row(f.dx + o, pl, true);
      }
    if (!per_n && t - 1 >= t0 && !is_anchor(t, K, T)) {
      const float R0 = f.P, R1 = R0 * f.a[t];
      if (in_range(R1)) {
        rev_pre(f, t, R0, cr, bh);
        rev_pre(f, t - 1, R1, cr2, bh2);
        stage_rows(f, t, s0);
        stage_rows(f, t - 1, s1);
        const float* cc[2] = {cr, cr2};
        const float* bb[2] = {bh, bh2};
        const float* uu[2] = {s0.uv, s1.uv};
        const float* dd[2] = {dy_row(f, t), dy_row(f, t - 1)};
        float* dbs[2] = {db, db2};
        float* dup[2] = {s0.dupart, s1.dupart};
        float* dus[2] = {s0.du, s1.du};
        rev_pn<2>(lam, cc, bb, uu, dd, dbs, dup, dus, pl, Np);
        rev_post(f, t, R0, lam, db, s0.du, Z, first);
        rev_post(f, t - 1, R1, lam, db2, s1.du, Z, first);
        f.P = renorm_head(lam, pl * Np, R1 * f.a[t - 1]);
        t -= 2;
        continue;
      }
    }
    const float d = f.dtp[t];
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    if (per_n) {
      for (int64_t n0 = 0; n0 < Np; n0 += 16) {
        vstore(cr + n0, row_at(Ct, n0, N) / vload(Rv + n0));
        vstore(bh + n0, row_at(Bt, n0, N) * vload(Rv + n0));
      }
    } else {
      rev_pre(f, t, f.P, cr, bh);
    }
    stage_rows(f, t, s0);
    {
      const float* cc[1] = {cr};
      const float* bb[1] = {bh};
      const float* uu[1] = {s0.uv};
      const float* dd[1] = {dy_row(f, t)};
      float* dbs[1] = {db};
      float* dup[1] = {s0.dupart};
      float* dus[1] = {s0.du};
      rev_pn<1>(lam, cc, bb, uu, dd, dbs, dup, dus, pl, Np);
    }
    if (!per_n) {
      rev_post(f, t, f.P, lam, db, s0.du, Z, first);
      f.P = renorm_head(lam, pl * Np, f.P * f.a[t]);
      t -= 1;
      continue;
    }
    // One decay per state: the same steps with per-state R.
    const float* xt = f.x + t * f.xs;
    float* dBt = f.dB + t * f.bs;
    float* dxt = f.dx + t * f.xs;
    float dd = 0.0f;
    for (int64_t p = 0; p < pl; ++p) {
      dxt[p] = s0.du[p] * d;
      dd += s0.du[p] * xt[p];
    }
    const bool anchor = is_anchor(t, K, T);
    if (anchor) dot_pn(lam, f.anch + (t / K) * pl * Np, Z, pl, Np);  // Z_t exactly
    vf gs = {};
    for (int64_t n0 = 0; n0 < Np; n0 += 16) {
      const vf rv = vload(Rv + n0);
      const vf dbn = vload(db + n0) * rv;
      row_put(dBt, n0, N, dbn, !first);
      const vf z = anchor ? vload(Z + n0) * rv : vload(Z + n0);
      const vf g = z - row_at(Bt, n0, N) * dbn;  // dL/d log a_t[n]
      vstore(dAv + n0, vload(dAv + n0) + g * d);
      gs += g * row_at(f.Ah, n0, N);
      if (t > 0) vstore(Z + n0, g + vload(f.zc + (t - 1) * Np + n0));
    }
    dd += hsum(gs);
    f.ddtp[t] = f.first_in_head ? dd : f.ddtp[t] + dd;
    decay_pn(lam, Rv, f.Ah, d, an, N, Np, pl);
    t -= 1;
  }
}

// After the reverse sweep: d_s = lam (times R) and the unit's dA.
RC_SIMD void rows_bwd_end(const RowsBwd& f) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16;
  const bool per_n = f.a == nullptr;
  const float* Rv = f.v;
  const float* dAv = f.v + 7 * Np;
  for (int64_t p = 0; p < f.pl; ++p)
    for (int64_t n = 0; n < N; ++n) f.ds[p * N + n] = f.S[p * Np + n] * (per_n ? Rv[n] : f.P);
  if (per_n) {
    for (int64_t n = 0; n < N; ++n) f.dA[n] = f.first_in_head ? dAv[n] : f.dA[n] + dAv[n];
  } else {
    f.dA[0] = f.first_in_head ? f.dAs : f.dA[0] + f.dAs;
  }
}

// Channels per unit: a state block of about 16 KB (32 KB without AVX-512, where the 8-lane
// sweeps are cheaper per element than the per-token steps around them, which a larger
// block shares among more channels).
int64_t rows_bwd_block(const Dims& d) {
  const int64_t Np = (d.N + 15) / 16 * 16;
  return std::max<int64_t>(1, std::min<int64_t>(d.P, (wide_registers() ? 4096 : 8192) / Np));
}

}  // namespace

void backward_rows(const Back& b, ThreadPool& pool, std::vector<Work>& work) {
  const Dims& d = b.d;
  const float *gy = b.gy, *gs = b.gs, *s = b.s, *x = b.x, *dt = b.dt, *A = b.A, *B = b.B, *C = b.C;
  const int32_t* ids = b.ids;
  const int64_t units = b.units, nsplit = b.nsplit;
  const int64_t PB = rows_bwd_block(d), npb = (d.P + PB - 1) / PB;
  int64_t K = 64;  // anchor interval: a power of two, at most 16 (+1) anchors
  while (K * 16 < d.T) K *= 2;
  const int64_t hpu = std::max<int64_t>(1, 4 / npb);          // heads advanced together
  const size_t ufl = rows_bwd_unit_floats(d.T, d.N, PB, K, d.per_n);
  pool.run(d.S * d.G * nsplit, [&](int64_t task, int tid) {
    const int64_t i = task / (d.G * nsplit), g = task / nsplit % d.G, j = task % nsplit;
    const int64_t hb = g * d.hpg + j * units / nsplit, he = g * d.hpg + (j + 1) * units / nsplit;
    float* wk = work[tid].get(hpu * (npb * ufl + 4 * d.T));
    std::vector<RowsBwd> fs;
    for (int64_t h0 = hb; h0 < he; h0 += hpu) {
      const int64_t nh = std::min(hpu, he - h0);
      fs.clear();
      for (int64_t hh = 0; hh < nh; ++hh) {
        const int64_t h = h0 + hh;
        float* hw = wk + hh * (npb * ufl + 4 * d.T);
        float* dtp = hw + npb * ufl;
        float* a = dtp + d.T;
        float* sig = a + d.T;
        float* ddtp = sig + d.T;  // dL/d softplus(dt) of this head, summed over its blocks
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
          f.dx = b.o_dx + (i * d.T * d.H + h) * d.P + p0;
          f.ddtp = ddtp;
          f.ds = b.ds_of(i) + (h * d.P + p0) * d.N;
          f.dA = b.dA_part + (i * d.H + h) * d.NA;
          f.dB = b.slot_B(j) + (i * d.T * d.G + g) * d.N;
          f.dC = b.slot_C(j) + (i * d.T * d.G + g) * d.N;
          f.first_in_head = pb == 0;
          f.w16 = wide_rows(d.N);
          f.T = d.T;
          f.N = d.N;
          f.pl = std::min(PB, d.P - p0);
          f.xs = d.H * d.P;
          f.bs = d.G * d.N;
          f.K = K;
          const int64_t Np = (d.N + 15) / 16 * 16, nanch = (d.T + K - 1) / K;
          f.S = hw + pb * ufl;
          f.anch = f.S + f.pl * Np;
          f.zc = f.anch + nanch * f.pl * Np;
          f.v = f.zc + d.T * (d.per_n ? Np : 1);
          rows_bwd_begin(f);
          fs.push_back(f);
        }
      }
      const bool first_group = h0 == hb;
      for (int64_t t0 = 0; t0 < d.T; t0 += kChunk)
        for (size_t u = 0; u < fs.size(); ++u)
          rows_bwd_fwd(fs[u], t0, std::min(d.T, t0 + kChunk), first_group && u == 0);
      for (RowsBwd& f : fs) rows_bwd_mid(f);
      for (int64_t t1 = d.T; t1 > 0; t1 -= kChunk)
        for (size_t u = 0; u < fs.size(); ++u)
          rows_bwd_rev(fs[u], std::max<int64_t>(0, t1 - kChunk), t1, first_group && u == 0);
      for (const RowsBwd& f : fs) rows_bwd_end(f);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float* sig = wk + hh * (npb * ufl + 4 * d.T) + npb * ufl + 2 * d.T;
        const float* ddtp = sig + d.T;
        float* o = b.o_ddt + i * d.T * d.H + h0 + hh;
        for (int64_t t = 0; t < d.T; ++t) o[t * d.H] = ddtp[t] * sig[t];
      }
    }
  });
}

}  // namespace scan
}  // namespace ssm
}  // namespace recurra

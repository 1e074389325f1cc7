// ssm_scan, the forward: rows layout (P > 1), heads layout (P == 1), and one token at a time
// for generation (any P; its kernels in step.cpp), with the checkpoints a forward saves when
// asked (see scan.h).
#include "scan.h"

namespace recurra {
namespace ssm {
namespace scan {

namespace {

// ======================================================================================
// Forward, rows layout: one (sequence, head, block of L channels).
// ======================================================================================


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
    const StepFwd f{d, s, x, dt, A, B, C, ids, y, in_place ? nullptr : sout, ck, step_decay_row()};
    // Tasks of whole heads, about 1024 states each and 16 rows at least: Mamba-1's 1536
    // heads of one 16-state row make 24 tasks (one per head cost more in handing out than
    // in work). A small step runs on the calling thread alone.
    const int64_t heads = d.S * d.H;
    const int64_t hpt = std::max<int64_t>(1, 1024 / std::max<int64_t>(1, d.P * d.N));
    const int64_t ntask = (heads + hpt - 1) / hpt;
    const StepKernel kernel = step_kernel(d, ck);
    const bool p1n16 = kernel == StepKernel::p1n16;
    auto task = [&](int64_t k, int tid) {
      float* an = work[tid].get(Np + 16 * 16 + (hpt + 15) / 16 * 16);
      step_heads_run(kernel, f, k * hpt, std::min(heads, (k + 1) * hpt), an, an + Np, an + Np + 16 * 16);
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

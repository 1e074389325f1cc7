// rwkv_wkv7: RWKV-7 time mixing on the CPU, forward and backward.
//
// Shapes (numpy order): r, w, k, v, a, b (T, H, S); state (N, H, S, S) indexed
// [q, h, i value, j key] (transposed relative to wkv6); T = N runs of n tokens.
//
//   sa_i    = sum_j a_t[j] S[i, j]
//   S[i, j] = S[i, j] w_t[j] + v_t[i] k_t[j] + sa_i b_t[j]
//   y_t[i]  = sum_j S[i, j] r_t[j]
//
// Output, packed: y (T, H, S), then the final states (N, H, S, S).
//
// Backward, with Lam_t = dL/dS_t from the tokens after t (Lam_n = dL/d(final state)) and
// M = Lam_t + gy_t r_t^T the whole gradient of S_t:
//   dr_t  = S_t^T gy_t              dw_t[j] = sum_i M[i, j] S_{t-1}[i, j]
//   dv_t  = M k_t                   dk_t    = M^T v_t
//   dsa   = M b_t                   db_t    = M^T sa
//   da_t  = S_{t-1}^T dsa           Lam_{t-1} = M diag(w_t) + dsa a_t^T;   d(state) = Lam_0
#include "rwkv.h"

namespace recurra {
namespace rwkv {
namespace {

struct Wkv7In {
  const float *r, *w, *k, *v, *a, *b;
};

// ---- forward -----------------------------------------------------------------------------
//
// The rows i of the state are independent, so a task is (run, head, block of rows i). Its
// block is kept transposed in scratch, S rows j of W lanes i: then sa, the update and y are
// all vector operations (two passes over the block per token, no horizontal sums).

// One row j of the transposed block: S[:, j] = w_j S[:, j] + k_j v + b_j sa; acc += r_j S[:, j].
template <int NV>
RWKV_INLINE void wkv7_forward_row(float* s, const vf* vv, const vf* sa, float r, float w, float k,
                                  float b, vf* acc) {
  const vf wj = RWKV_SPLAT(w), kj = RWKV_SPLAT(k), bj = RWKV_SPLAT(b), rj = RWKV_SPLAT(r);
  for (int c = 0; c < NV; ++c) {
    const vf x = wj * vload(s + c * kL) + kj * vv[c] + bj * sa[c];
    vstore(s + c * kL, x);
    acc[c] += rj * x;
  }
}

// One token over a register block of NV lane groups (i). st: S rows j, row stride ld. Even
// and odd rows j go to separate sums (two dependency chains).
template <int NV>
RWKV_INLINE void wkv7_forward_rows(float* st, int64_t ld, int64_t S, const float* r,
                                   const float* w, const float* k, const float* v,
                                   const float* a, const float* b, float* y, bool stream) {
  vf sa[NV], sb[NV], vv[NV], acc0[NV], acc1[NV];
  for (int c = 0; c < NV; ++c) {
    sa[c] = sb[c] = acc0[c] = acc1[c] = vf{};
    vv[c] = vload(v + c * kL);
  }
  int64_t j = 0;
  for (; j + 1 < S; j += 2) {
    const vf a0 = RWKV_SPLAT(a[j]), a1 = RWKV_SPLAT(a[j + 1]);
    const float* s = st + j * ld;
    for (int c = 0; c < NV; ++c) {
      sa[c] += a0 * vload(s + c * kL);
      sb[c] += a1 * vload(s + ld + c * kL);
    }
  }
  if (j < S) {
    const vf a0 = RWKV_SPLAT(a[j]);
    for (int c = 0; c < NV; ++c) sa[c] += a0 * vload(st + j * ld + c * kL);
  }
  for (int c = 0; c < NV; ++c) sa[c] += sb[c];
  for (j = 0; j + 1 < S; j += 2) {
    wkv7_forward_row<NV>(st + j * ld, vv, sa, r[j], w[j], k[j], b[j], acc0);
    wkv7_forward_row<NV>(st + (j + 1) * ld, vv, sa, r[j + 1], w[j + 1], k[j + 1], b[j + 1], acc1);
  }
  if (j < S) wkv7_forward_row<NV>(st + j * ld, vv, sa, r[j], w[j], k[j], b[j], acc0);
  for (int c = 0; c < NV; ++c) {
    if (stream)
      vstream(y + c * kL, acc0[c] + acc1[c]);
    else
      vstore(y + c * kL, acc0[c] + acc1[c]);
  }
}

// One forward task: run q, head h, lanes i in [i0, i0 + W). `st` (S rows of W lanes) holds
// the transposed state block on entry and the final one on return; `buf` 2W floats.
RC_SIMD void wkv7_forward_task(const Wkv7In& in, const Dims& d, int64_t q, int64_t h, int64_t i0,
                               int64_t W, float* st, float* buf, float* y) {
  const int64_t S = d.S, in_ = std::min(W, S - i0);
  float* vb = buf;
  float* yb = buf + W;
  for (int64_t t = 0; t < d.n; ++t) {
    const int64_t base = d.token(q, t, h);
    if (t + kPrefetchTokens < d.n) {
      const int64_t ahead = d.token(q, t + kPrefetchTokens, h);
      for (const float* x : {in.r, in.w, in.k, in.a, in.b}) prefetch(x + ahead, S);
      prefetch(in.v + ahead + i0, in_);
    }
    // Without padding in this block, v is read and y written in place.
    const float* vt = in.v + base + i0;
    float* yt = in_ == W ? y + base + i0 : yb;
    const bool stream = in_ == W && stream_aligned(yt);
    if (in_ < W) {
      load_padded(vb, vt, in_, W);
      vt = vb;
    }
    for (int64_t c = 0; c < W; c += kMaxNV * kL) {
      const int64_t nv = std::min(kMaxNV, (W - c) / kL);
      RWKV_DISPATCH_NV(nv, wkv7_forward_rows, st + c, W, S, in.r + base, in.w + base,
                       in.k + base, vt + c, in.a + base, in.b + base, yt + c, stream)
    }
    if (in_ < W) copy_floats(y + base + i0, yb, in_);
  }
  stream_fence();
}

// One token per run (a generation step): the state rows i are contiguous in the stored
// layout [i value, j key], so each row is updated where it lies, with no transposed copy in
// scratch: sa_i = a . S_i, S_i <- w * S_i + v_i k + sa_i b, y_i = r . S_i (two passes over a
// row that stays in L1). Heads [h0, h1) of run q. sN may be s0 (a row is read whole before
// it is written).
RC_SIMD void wkv7_forward_one(const Wkv7In& in, const Dims& d, const float* s0, float* sN, float* y,
                              int64_t q, int64_t h0, int64_t h1) {
  const int64_t S = d.S;
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t base = d.token(q, 0, h);
    const float *r = in.r + base, *w = in.w + base, *k = in.k + base, *a = in.a + base, *b = in.b + base;
    const float* src = s0 + d.state(q, h);
    float* dst = sN + d.state(q, h);
    for (int64_t i = 0; i < S; ++i) {
      const float* si = src + i * S;
      float* di = dst + i * S;
      const float sa = dot(a, si, S), vi = in.v[base + i];
      const vf sav = RWKV_SPLAT(sa), vv = RWKV_SPLAT(vi);
      vf acc = vf{};
      int64_t j = 0;
      for (; j + kL <= S; j += kL) {
        const vf x = vload(w + j) * vload(si + j) + vv * vload(k + j) + sav * vload(b + j);
        vstore(di + j, x);
        acc += vload(r + j) * x;
      }
      float yi = hsum(acc);
      for (; j < S; ++j) {
        const float x = w[j] * si[j] + vi * k[j] + sa * b[j];
        di[j] = x;
        yi += r[j] * x;
      }
      y[base + i] = yi;
    }
  }
}

void wkv7_forward(KernelCtx& c, const Dims& d) {
  const Wkv7In in{c.src[0].f32(), c.src[1].f32(), c.src[2].f32(),
                  c.src[3].f32(), c.src[4].f32(), c.src[5].f32()};
  const float* s0 = c.src[6].f32();
  float* y = c.dst.f32();
  float* sN = y + d.ths();
  if (d.n == 1) {
    // The 0.1B preset's step (12 heads of 64 x 64) takes tens of microseconds on one
    // thread: there the pool's worker is better left to prefetch the next product's
    // weights (gemv.cpp). Larger states are cut into whole heads over the pool.
    constexpr int64_t kSerialStates = int64_t{64} << 10;
    if (d.nhss() <= kSerialStates || c.pool.size() == 1) {
      for (int64_t q = 0; q < d.N; ++q) wkv7_forward_one(in, d, s0, sN, y, q, 0, d.H);
    } else {
      c.pool.run(d.N * d.H, [&](int64_t t, int) {
        wkv7_forward_one(in, d, s0, sN, y, t / d.H, t % d.H, t % d.H + 1);
      });
    }
    return;
  }
  Scratch scratch(c.pool.size());
  for_each_head_block(c.pool, d, [&](int64_t q, int64_t h, int64_t i0, int64_t W, int64_t in_,
                                      int tid) {
    float* st = scratch.get(tid, static_cast<size_t>(d.S * W + 2 * W));
    const float* src = s0 + d.state(q, h);
    std::memset(st, 0, static_cast<size_t>(d.S * W) * sizeof(float));
    for (int64_t i = 0; i < in_; ++i)
      for (int64_t j = 0; j < d.S; ++j) st[j * W + i] = src[(i0 + i) * d.S + j];
    wkv7_forward_task(in, d, q, h, i0, W, st, st + d.S * W, y);
    float* dst = sN + d.state(q, h);
    for (int64_t i = 0; i < in_; ++i)
      for (int64_t j = 0; j < d.S; ++j) dst[(i0 + i) * d.S + j] = st[j * W + i];
  });
}

// ---- backward ----------------------------------------------------------------------------
//
// A task is (run q, head h, rows i in [i0, i1)), its block kept as stored: R rows i of Sp
// lanes j. The sums over i (dr, dw, dk, db, da) are then vector accumulations; dsa and dv
// need two horizontal sums per row, and the recomputed forward one (sa, saved per token).
// Checkpoints every K tokens as in wkv6. Peak scratch per thread:
// (2 + ceil(n/K) + K) * R * Sp + K R + R (2 kL + 2) + 10 Sp floats, e.g. 2.1 MB for n = 4096,
// S = 64.

// part[i] (kL lanes) gets, or with `add` adds, the lane-wise partial sums of src[i] * a over
// NV lane groups of a row block (R rows, row stride Sp).
template <int NV>
RWKV_INLINE void wkv7_dot_rows(const float* src, int64_t R, int64_t Sp, const float* a,
                               float* part, bool add) {
  vf aa[NV];
  for (int c = 0; c < NV; ++c) aa[c] = vload(a + c * kL);
  for (int64_t i = 0; i < R; ++i) {
    vf acc = add ? vload(part + i * kL) : vf{};
    for (int c = 0; c < NV; ++c) acc += vload(src + i * Sp + c * kL) * aa[c];
    vstore(part + i * kL, acc);
  }
}

// dst[i] = w * src[i] + v[i] k + sa[i] b over NV lane groups of a row block.
template <int NV>
RWKV_INLINE void wkv7_update_rows(float* dst, const float* src, int64_t R, int64_t Sp,
                                  const float* w, const float* k, const float* b,
                                  const float* v, const float* sa) {
  vf ww[NV], kk[NV], bb[NV];
  for (int c = 0; c < NV; ++c) {
    ww[c] = vload(w + c * kL);
    kk[c] = vload(k + c * kL);
    bb[c] = vload(b + c * kL);
  }
  for (int64_t i = 0; i < R; ++i) {
    const vf vi = RWKV_SPLAT(v[i]), si = RWKV_SPLAT(sa[i]);
    for (int c = 0; c < NV; ++c) {
      const int64_t o = i * Sp + c * kL;
      vstore(dst + o, ww[c] * vload(src + o) + vi * kk[c] + si * bb[c]);
    }
  }
}

// The forward update of one token on a row block, dst = step(src) (dst may be src). sa (R
// floats) gets sa = src a; part is scratch for R * kL floats.
RWKV_INLINE void wkv7_step(float* dst, const float* src, int64_t R, int64_t Sp, const float* w,
                           const float* k, const float* a, const float* b, const float* v,
                           float* sa, float* part) {
  for (int64_t c = 0; c < Sp; c += kMaxNV * kL) {
    const int64_t nv = std::min(kMaxNV, (Sp - c) / kL);
    RWKV_DISPATCH_NV(nv, wkv7_dot_rows, src + c, R, Sp, a + c, part, c > 0)
  }
  hsum_rows(part, R, sa);
  for (int64_t c = 0; c < Sp; c += kMaxNV * kL) {
    const int64_t nv = std::min(kMaxNV, (Sp - c) / kL);
    RWKV_DISPATCH_NV(nv, wkv7_update_rows, dst + c, src + c, R, Sp, w + c, k + c, b + c, v, sa)
  }
}

// Backward, before the update: with M[i] = lam[i] + gy[i] r, pb[i] and pk[i] (kL lanes) get,
// or with `add` add, the lane-wise partial sums of M[i] * b and M[i] * k over NV lane groups.
template <int NV>
RWKV_INLINE void wkv7_mbk_rows(const float* lam, int64_t R, int64_t Sp, const float* gy,
                               const float* r, const float* b, const float* k, float* pb,
                               float* pk, bool add) {
  vf rr[NV], bb[NV], kk[NV];
  for (int c = 0; c < NV; ++c) {
    rr[c] = vload(r + c * kL);
    bb[c] = vload(b + c * kL);
    kk[c] = vload(k + c * kL);
  }
  for (int64_t i = 0; i < R; ++i) {
    const vf g = RWKV_SPLAT(gy[i]);
    vf mb = add ? vload(pb + i * kL) : vf{};
    vf mk = add ? vload(pk + i * kL) : vf{};
    for (int c = 0; c < NV; ++c) {
      const vf m = vload(lam + i * Sp + c * kL) + g * rr[c];
      mb += m * bb[c];
      mk += m * kk[c];
    }
    vstore(pb + i * kL, mb);
    vstore(pk + i * kL, mk);
  }
}

// A token's w, k, a, b (and r when rb is set), padded to Sp lanes where needed.
struct Wkv7Token {
  const float *r, *w, *k, *a, *b;
};
RWKV_INLINE Wkv7Token token_vectors(const Wkv7In& in, int64_t base, int64_t S, int64_t Sp,
                                    float* buf, bool with_r) {
  Wkv7Token x{nullptr, nullptr, nullptr, nullptr, nullptr};
  if (with_r) x.r = padded(buf, in.r + base, S, Sp);
  x.w = padded(buf + Sp, in.w + base, S, Sp);
  x.k = padded(buf + 2 * Sp, in.k + base, S, Sp);
  x.a = padded(buf + 3 * Sp, in.a + base, S, Sp);
  x.b = padded(buf + 4 * Sp, in.b + base, S, Sp);
  return x;
}

// One backward token over a register block of NV lane groups (j), after dsa is known. sp:
// S_{t-1} rows; lam: Lam_t rows, updated to Lam_{t-1}; acc gets the block's sums over i of
// dr, dw, dk, da, db (at offsets 0, Sp, ..., 4 Sp).
template <int NV>
RWKV_INLINE void wkv7_backward_rows(const float* sp, float* lam, int64_t Sp, int64_t R,
                                    const float* gy, const float* v, const float* sa,
                                    const float* dsa, const float* r, const float* w,
                                    const float* k, const float* a, const float* b, float* acc) {
  vf dr[NV], dw[NV], dk[NV], da[NV], db[NV];
  for (int c = 0; c < NV; ++c) dr[c] = dw[c] = dk[c] = da[c] = db[c] = vf{};
  for (int64_t i = 0; i < R; ++i) {
    const vf g = RWKV_SPLAT(gy[i]), vi = RWKV_SPLAT(v[i]);
    const vf si = RWKV_SPLAT(sa[i]), di = RWKV_SPLAT(dsa[i]);
    const float* s = sp + i * Sp;
    float* l = lam + i * Sp;
    for (int c = 0; c < NV; ++c) {
      const int64_t o = c * kL;
      const vf x = vload(s + o), wj = vload(w + o);
      const vf m = vload(l + o) + g * vload(r + o);
      const vf xn = wj * x + vi * vload(k + o) + si * vload(b + o);
      dr[c] += g * xn;
      dw[c] += m * x;
      dk[c] += vi * m;
      db[c] += si * m;
      da[c] += di * x;
      vstore(l + o, wj * m + di * vload(a + o));
    }
  }
  for (int c = 0; c < NV; ++c) {
    const int64_t o = c * kL;
    vstore(acc + o, dr[c]);
    vstore(acc + Sp + o, dw[c]);
    vstore(acc + 2 * Sp + o, dk[c]);
    vstore(acc + 3 * Sp + o, da[c]);
    vstore(acc + 4 * Sp + o, db[c]);
  }
}

struct Wkv7Grad {
  float *dr, *dw, *dk, *da, *db;  // (T, H, S) layouts, possibly a block's partial buffers
  float* dv;                      // (T, H, S)
  float* ds;                      // d(initial state), (N, H, S, S)
};

RC_SIMD void wkv7_backward_task(const Wkv7In& in, const float* s0, const float* gy,
                                const float* gs, const Wkv7Grad& out, const Dims& d, int64_t q,
                                int64_t h, int64_t i0, int64_t i1, float* scratch) {
  const int64_t S = d.S, Sp = d.Sp, R = i1 - i0, n = d.n;
  const int64_t K = checkpoint_interval(n), nck = (n + K - 1) / K, RS = R * Sp;
  float* st = scratch;
  float* lam = st + RS;
  float* ck = lam + RS;
  float* chunk = ck + nck * RS;
  float* sab = chunk + K * RS;  // K * R: sa of the chunk's tokens
  float* tb = sab + K * R;      // 5 Sp: padded token vectors
  float* acc = tb + 5 * Sp;     // 5 Sp
  float* dsa = acc + 5 * Sp;    // R
  float* sa1 = dsa + R;         // R: pass 1's sa
  float* part = sa1 + R;        // 2 R kL: lane-wise partial sums

  const float* s0h = s0 + d.state(q, h) + i0 * S;
  const float* gsh = gs + d.state(q, h) + i0 * S;
  for (int64_t i = 0; i < R; ++i) {
    load_padded(ck + i * Sp, s0h + i * S, S, Sp);
    load_padded(lam + i * Sp, gsh + i * S, S, Sp);
  }
  auto prefetch_token = [&](int64_t t, bool backward) {
    const int64_t ahead = d.token(q, t, h);
    for (const float* x : {in.w, in.k, in.a, in.b}) prefetch(x + ahead, S);
    prefetch(in.v + ahead + i0, R);
    if (backward) {
      prefetch(in.r + ahead, S);
      prefetch(gy + ahead + i0, R);
      for (float* o : {out.dr, out.dw, out.dk, out.da, out.db}) prefetch(o + ahead, S, true);
      prefetch(out.dv + ahead + i0, R, true);
    }
  };

  // Pass 1: checkpoints ck[c] = the state before token c K (as in decay_checkpoints).
  for (int64_t t = 0; t < (nck - 1) * K; ++t) {
    const float* src = t % K == 0 ? ck + (t / K) * RS : st;
    float* dst = t % K == K - 1 ? ck + (t / K + 1) * RS : st;
    if (t + kPrefetchTokens < n) prefetch_token(t + kPrefetchTokens, false);
    const int64_t base = d.token(q, t, h);
    const Wkv7Token x = token_vectors(in, base, S, Sp, tb, false);
    wkv7_step(dst, src, R, Sp, x.w, x.k, x.a, x.b, in.v + base + i0, sa1, part);
  }
  // Pass 2: chunks from the last, recomputed (states and sa) and walked backwards.
  for (int64_t ci = nck - 1; ci >= 0; --ci) {
    const int64_t t0 = ci * K, t1 = std::min(n, t0 + K);
    std::memcpy(chunk, ck + ci * RS, static_cast<size_t>(RS) * sizeof(float));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t base = d.token(q, t, h);
      const Wkv7Token x = token_vectors(in, base, S, Sp, tb, false);
      // The last token's state is not needed, only its sa: it is written to st.
      float* dst = t + 1 < t1 ? chunk + (t - t0 + 1) * RS : st;
      wkv7_step(dst, chunk + (t - t0) * RS, R, Sp, x.w, x.k, x.a, x.b, in.v + base + i0,
                sab + (t - t0) * R, part);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      if (t - kPrefetchTokens >= t0) prefetch_token(t - kPrefetchTokens, true);
      const int64_t base = d.token(q, t, h);
      const Wkv7Token x = token_vectors(in, base, S, Sp, tb, true);
      const float* gyt = gy + base + i0;
      const float* vt = in.v + base + i0;
      // dsa_i = (M b)_i and dv_i = (M k)_i need whole rows before the update.
      for (int64_t c = 0; c < Sp; c += kMaxNV * kL) {
        const int64_t nv = std::min(kMaxNV, (Sp - c) / kL);
        RWKV_DISPATCH_NV(nv, wkv7_mbk_rows, lam + c, R, Sp, gyt, x.r + c, x.b + c, x.k + c, part,
                         part + R * kL, c > 0)
      }
      hsum_rows(part, R, dsa);
      hsum_rows(part + R * kL, R, out.dv + base + i0);
      const float* sp = chunk + (t - t0) * RS;
      const float* sat = sab + (t - t0) * R;
      for (int64_t c = 0; c < Sp; c += kMaxNV * kL) {
        const int64_t nv = std::min(kMaxNV, (Sp - c) / kL);
        RWKV_DISPATCH_NV(nv, wkv7_backward_rows, sp + c, lam + c, Sp, R, gyt, vt, sat, dsa,
                         x.r + c, x.w + c, x.k + c, x.a + c, x.b + c, acc + c)
      }
      copy_floats(out.dr + base, acc, S);
      copy_floats(out.dw + base, acc + Sp, S);
      copy_floats(out.dk + base, acc + 2 * Sp, S);
      copy_floats(out.da + base, acc + 3 * Sp, S);
      copy_floats(out.db + base, acc + 4 * Sp, S);
    }
  }
  float* dsh = out.ds + d.state(q, h) + i0 * S;
  for (int64_t i = 0; i < R; ++i) copy_floats(dsh + i * S, lam + i * Sp, S);
}

void wkv7_backward(KernelCtx& c, const Dims& d) {
  const Wkv7In in{c.src[0].f32(), c.src[1].f32(), c.src[2].f32(),
                  c.src[3].f32(), c.src[4].f32(), c.src[5].f32()};
  const float* s0 = c.src[6].f32();
  const float* gy = c.src[7].f32();
  const float* gs = gy + d.ths();
  const int64_t ths = d.ths();
  // Packed result, in source order: dr, dw, dk, dv, da, db, dstate.
  float* o = c.dst.f32();
  Wkv7Grad full{o, o + ths, o + 2 * ths, o + 4 * ths, o + 5 * ths, o + 3 * ths, o + 6 * ths};
  const int64_t units = d.N * d.H, nb = backward_blocks(units, d.S);
  // With several row blocks per head, the five sums over i go to partial buffers (block b of
  // quantity x at (x * nb + b) * ths) and are added up in block order afterwards.
  std::vector<float> part(nb > 1 ? static_cast<size_t>(5 * nb * ths) : 0);
  const int64_t K = checkpoint_interval(d.n), nck = (d.n + K - 1) / K;
  const int64_t rmax = (d.S + nb - 1) / nb;
  const size_t need =
      static_cast<size_t>((2 + nck + K) * rmax * d.Sp + K * rmax + 10 * d.Sp + rmax * (2 * kL + 2));
  Scratch scratch(c.pool.size());
  c.pool.run(units * nb, [&](int64_t task, int tid) {
    const int64_t b = task % nb, qh = task / nb, q = qh / d.H, h = qh % d.H;
    const int64_t i0 = block_begin(b, nb, d.S), i1 = block_begin(b + 1, nb, d.S);
    Wkv7Grad g = full;
    if (nb > 1) {
      float* p = part.data();
      g.dr = p + (0 * nb + b) * ths;
      g.dw = p + (1 * nb + b) * ths;
      g.dk = p + (2 * nb + b) * ths;
      g.da = p + (3 * nb + b) * ths;
      g.db = p + (4 * nb + b) * ths;
    }
    wkv7_backward_task(in, s0, gy, gs, g, d, q, h, i0, i1, scratch.get(tid, need));
  });
  if (nb > 1) {
    float* dst[5] = {full.dr, full.dw, full.dk, full.da, full.db};
    for (int x = 0; x < 5; ++x) reduce_blocks(c.pool, dst[x], part.data() + x * nb * ths, nb, ths);
  }
}

}  // namespace
}  // namespace rwkv

void register_wkv7_ops(OpTable& t) {
  rwkv::RecurrentOp op;
  op.name = "rwkv_wkv7";
  op.signature = "(r, w, k, v, a, b, state)";
  op.n_src = 7;
  op.tok = {0, 1, 2, 3, 4, 5};
  op.hs = -1;
  op.st = 6;
  op.n_fp = 0;
  op.forward = rwkv::wkv7_forward;
  op.backward = rwkv::wkv7_backward;
  rwkv::register_recurrent(t, op);
}

}  // namespace recurra

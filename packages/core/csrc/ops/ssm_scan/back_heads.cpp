// ssm_scan, the backward of the heads layout (P == 1, Mamba-1): states recomputed segment by
// segment from checkpoints (the forward's, or its own forward sweep), each segment walked in
// reverse (see scan.h).
#include "scan.h"

namespace recurra {
namespace ssm {
namespace scan {

namespace {

// ======================================================================================
// Backward, heads layout (P == 1): 16 heads of one group per vector, state [n][16].
// ======================================================================================

// One block of 16 heads (P == 1). A task walks the segments of K tokens in reverse and,
// within a segment, all its blocks; the per-lane dB and dC terms of the segment are summed
// over the blocks first and reduced across lanes once.
struct HeadsBwd {
  const float* s0;  // s[row, h0, 0, 0]
  const float* x;   // x[i, 0, h0, 0]: token stride H (also dt, dy, dx, ddt)
  const float* dt;
  const float* dy;
  const float* dsf;  // [i, h0, 0, 0]
  const float* B;    // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* dx;
  float* ddt;
  float* ds;  // [i, h0, 0, 0]
  float* dA;  // partial [i, h0, :]: head stride NA
  int64_t T, N, NA, nl, H, bs;
  float* AT;   // [N][16]: A of the 16 heads
  float* St;   // [N][16]: the state (pass 1), then lam
  float* dAa;  // [N][16]: dA terms
  float* ck;   // nseg x [N][16]: the state before each segment
};

// Softplus, exps and state of one block over tokens [t0, t1), t1 - t0 <= K: d and u = x d
// go to dbuf/ubuf (16 per token), a to abuf (na rows of 16 per token), S_t to sbuf when
// not null. S is advanced in place.
RC_SIMD void heads_seg_forward(const HeadsBwd& f, float* S, int64_t t0, int64_t t1, float* dbuf, float* ubuf,
                               float* abuf, float* sbuf) {
  const int64_t N = f.N, nl = f.nl, na = f.NA == 1 ? 1 : N;
  heads_stage(f.dt, f.x, nullptr, f.AT, f.T, f.H, nl, na, t0, t1, dbuf, ubuf, abuf);
  const int64_t as = na == 1 ? 0 : 16;
  for (int64_t t = t0; t < t1; ++t) {
    const float* Bt = f.B + t * f.bs;
    const float* at = abuf + (t - t0) * na * 16;
    const vf u = vload(ubuf + (t - t0) * 16);
    float* so = sbuf ? sbuf + (t - t0) * N * 16 : nullptr;
    for (int64_t n = 0; n < N; ++n) {
      vf sv = vload(S + n * 16) * vload(at + n * as) + Bt[n] * u;
      vstore(S + n * 16, sv);
      if (so) vstore(so + n * 16, sv);
    }
  }
}

// Reverse walk of one block over tokens t1 - 1 down to t0, given S_t (sbuf), the state
// before t0 (sprev), a_t, d_t, u_t from heads_seg_forward. Adds the per-lane dC and dB
// terms to dcv/dbv ([token][Np][16]); writes dx, ddt; updates lam (f.St) and dA terms.
RC_SIMD void heads_seg_reverse(const HeadsBwd& f, int64_t t0, int64_t t1, const float* sprev, const float* sbuf,
                               const float* abuf, const float* dbuf, const float* ubuf, float* dcv,
                               float* dbv, int64_t Np) {
  const int64_t N = f.N, nl = f.nl, na = f.NA == 1 ? 1 : N, as = na == 1 ? 0 : 16;
  float* lam = f.St;
  float* dAa = f.dAa;
  const float* AT = f.AT;
  auto lanes = [&](const float* p) { return nl == 16 ? vload(p) : vload_part(p, nl); };
  for (int64_t t = t1 - 1; t >= t0; --t) {
    if (t >= kChunk) {
      const int64_t o = (t - kChunk) * f.H;
      __builtin_prefetch(f.dy + o);
      __builtin_prefetch(f.dx + o, 1);
      __builtin_prefetch(f.ddt + o, 1);
    }
    const int64_t tt = t - t0;
    const float* Sc = sbuf + tt * N * 16;
    const float* Sp = tt > 0 ? sbuf + (tt - 1) * N * 16 : sprev;
    const float* at = abuf + tt * na * 16;
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    float* dct = dcv + tt * Np * 16;
    float* dbt = dbv + tt * Np * 16;
    const vf dv = vload(dbuf + tt * 16);
    const vf u = vload(ubuf + tt * 16);
    const vf dyv = lanes(f.dy + t * f.H);
    const vf xv = lanes(f.x + t * f.H);
    vf du = {}, gA = {};
    for (int64_t n = 0; n < N; ++n) {
      const vf av = vload(at + n * as);
      const vf lv = vload(lam + n * 16) + dyv * Ct[n];
      vstore(dct + n * 16, vload(dct + n * 16) + dyv * vload(Sc + n * 16));
      vstore(dbt + n * 16, vload(dbt + n * 16) + lv * u);
      du += lv * Bt[n];
      const vf gv = lv * av * vload(Sp + n * 16);  // dL/d log a_t
      vstore(dAa + n * 16, vload(dAa + n * 16) + gv * dv);
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
  }
}

// Sums the lanes of the segment's dC and dB terms into the slot rows of tokens [t0, t1).
RC_SIMD void heads_seg_reduce(const float* dcv, const float* dbv, int64_t t0, int64_t t1, int64_t N, int64_t Np,
                              float* dC, float* dB, int64_t bs) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t tt = t - t0;
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      const int64_t m = std::min<int64_t>(16, N - n0);
      vstore_part(dC + t * bs + n0, hsum16x16(dcv + (tt * Np + n0) * 16), m);
      vstore_part(dB + t * bs + n0, hsum16x16(dbv + (tt * Np + n0) * 16), m);
    }
  }
}

}  // namespace

void backward_heads(const Back& b, ThreadPool& pool, std::vector<Work>& work) {
  const Dims& d = b.d;
  const float *gy = b.gy, *gs = b.gs, *s = b.s, *x = b.x, *dt = b.dt, *A = b.A, *B = b.B, *C = b.C;
  const int32_t* ids = b.ids;
  const int64_t units = b.units, nsplit = b.nsplit;
  const int64_t K = heads_seg_len(d.T), nseg = heads_n_seg(d.T);
  const int64_t Np = (d.N + 15) / 16 * 16, na = d.NA == 1 ? 1 : d.N;
  const float* ckf = b.ckf;
  const int64_t blk_floats = d.N * 16 * (3 + nseg);
  const int64_t seg_floats = K * 16 * (2 + na + d.N + 2 * Np);
  pool.run(d.S * d.G * nsplit, [&](int64_t task, int tid) {
    const int64_t i = task / (d.G * nsplit), g = task / nsplit % d.G, j = task % nsplit;
    const int64_t b0 = j * units / nsplit, nb = (j + 1) * units / nsplit - b0;
    float* wk = work[tid].get(nb * blk_floats + seg_floats);
    float* dbuf = wk + nb * blk_floats;
    float* ubuf = dbuf + K * 16;
    float* abuf = ubuf + K * 16;
    float* sbuf = abuf + K * na * 16;
    float* dcv = sbuf + K * d.N * 16;
    float* dbv = dcv + K * Np * 16;
    std::vector<HeadsBwd> fs(nb);
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t h0 = g * d.hpg + (b0 + k) * 16;
      HeadsBwd& f = fs[k];
      f.s0 = s + (ids[i] * d.H + h0) * d.N;
      f.x = x + i * d.T * d.H + h0;
      f.dt = dt + i * d.T * d.H + h0;
      f.dy = gy + i * d.T * d.H + h0;
      f.dsf = gs + (i * d.H + h0) * d.N;
      f.B = B + (i * d.T * d.G + g) * d.N;
      f.C = C + (i * d.T * d.G + g) * d.N;
      f.dx = b.o_dx + i * d.T * d.H + h0;
      f.ddt = b.o_ddt + i * d.T * d.H + h0;
      f.ds = b.ds_of(i) + h0 * d.N;
      f.dA = b.dA_part + (i * d.H + h0) * d.NA;
      f.T = d.T;
      f.N = d.N;
      f.NA = d.NA;
      f.nl = std::min<int64_t>(16, d.hpg - (b0 + k) * 16);
      f.H = d.H;
      f.bs = d.G * d.N;
      f.AT = wk + k * blk_floats;
      f.St = f.AT + d.N * 16;
      f.dAa = f.St + d.N * 16;
      f.ck = f.dAa + d.N * 16;
      for (int64_t n = 0; n < d.N; ++n)
        for (int64_t l = 0; l < 16; ++l) {
          const bool on = l < f.nl;
          f.AT[n * 16 + l] = on ? A[(h0 + l) * d.NA + (d.NA == 1 ? 0 : n)] : 0.0f;
          f.St[n * 16 + l] = on ? f.s0[l * d.N + n] : 0.0f;
          f.dAa[n * 16 + l] = 0.0f;
        }
    }
    // Pass 1: the state before each segment (the last segment's own run is not needed),
    // read from the forward's checkpoints when it saved them.
    for (int64_t sg = 0; sg < nseg; ++sg) {
      const int64_t t0 = sg * K, t1 = std::min(d.T, t0 + K);
      for (int64_t k = 0; k < nb; ++k) {
        HeadsBwd& f = fs[k];
        float* cks = f.ck + sg * d.N * 16;
        if (ckf) {
          const float* src = ckf + ((i * nseg + sg) * d.H + g * d.hpg + (b0 + k) * 16) * d.N;
          for (int64_t n = 0; n < d.N; ++n)
            for (int64_t l = 0; l < 16; ++l) cks[n * 16 + l] = l < f.nl ? src[l * d.N + n] : 0.0f;
          continue;
        }
        std::memcpy(cks, f.St, d.N * 16 * sizeof(float));
        if (sg + 1 < nseg) heads_seg_forward(f, f.St, t0, t1, dbuf, ubuf, abuf, nullptr);
      }
    }
    // Pass 2: segments in reverse; lam starts as dL/d(final state).
    for (HeadsBwd& f : fs)
      for (int64_t n = 0; n < d.N; ++n)
        for (int64_t l = 0; l < 16; ++l) f.St[n * 16 + l] = l < f.nl ? f.dsf[l * d.N + n] : 0.0f;
    std::vector<float> stmp(d.N * 16);
    for (int64_t sg = nseg - 1; sg >= 0; --sg) {
      const int64_t t0 = sg * K, t1 = std::min(d.T, t0 + K);
      std::fill(dcv, dcv + 2 * K * Np * 16, 0.0f);
      for (HeadsBwd& f : fs) {
        const float* sprev = f.ck + sg * d.N * 16;
        std::memcpy(stmp.data(), sprev, d.N * 16 * sizeof(float));
        heads_seg_forward(f, stmp.data(), t0, t1, dbuf, ubuf, abuf, sbuf);
        heads_seg_reverse(f, t0, t1, sprev, sbuf, abuf, dbuf, ubuf, dcv, dbv, Np);
      }
      heads_seg_reduce(dcv, dbv, t0, t1, d.N, Np, b.slot_C(j) + (i * d.T * d.G + g) * d.N,
                       b.slot_B(j) + (i * d.T * d.G + g) * d.N, d.G * d.N);
    }
    for (const HeadsBwd& f : fs) {
      for (int64_t l = 0; l < f.nl; ++l)
        for (int64_t n = 0; n < d.N; ++n) f.ds[l * d.N + n] = f.St[n * 16 + l];
      for (int64_t l = 0; l < f.nl; ++l) {
        if (d.NA == 1) {
          float sacc = 0.0f;
          for (int64_t n = 0; n < d.N; ++n) sacc += f.dAa[n * 16 + l];
          f.dA[l] = sacc;
        } else {
          for (int64_t n = 0; n < d.N; ++n) f.dA[l * d.NA + n] = f.dAa[n * 16 + l];
        }
      }
    }
  });
}

}  // namespace scan
}  // namespace ssm
}  // namespace recurra

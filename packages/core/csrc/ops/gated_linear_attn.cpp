// gated_linear_attn (GLA) on the CPU, forward and backward.
//
// Shapes (numpy order): k, v, q, g (T, H, S); state (N, H, S, S) indexed [n, h, i key,
// j value]; fp = [scale]; T = N runs of n tokens. The state is updated before it is read:
//
//   S[i, j] = g_t[i] S[i, j] + k_t[i] v_t[j]
//   y_t[j]  = scale * sum_i q_t[i] S[i, j]
//
// Output, packed: y (T, H, S), then the final states (N, H, S, S). The forward is the decay
// recurrence of rwkv.h (decay_forward_task) with c = q g, alpha = q . k, s = scale.
//
// Backward, with lam_t = dL/dS_t from the tokens after t (lam_n = dL/d(final state)),
// mu_t = lam_t + scale q_t gy_t^T the whole gradient of S_t and gv_t = gy_t . v_t:
//   dq_t[i] = scale (g_t[i] sum_j S_{t-1}[i, j] gy_t[j] + k_t[i] gv_t)      (= scale S_t gy_t)
//   dk_t[i] = sum_j mu_t[i, j] v_t[j]      dv_t[j] = sum_i mu_t[i, j] k_t[i]
//   dg_t[i] = sum_j mu_t[i, j] S_{t-1}[i, j]
//   lam_{t-1}[i, j] = g_t[i] mu_t[i, j];   d(state) = lam_0
// Work split, transposed layout and checkpointing as in rwkv_wkv6.cpp.
#include "rwkv.h"

namespace recurra {
namespace rwkv {
namespace {

struct GlaIn {
  const float *k, *v, *q, *g;
};

// ---- forward: the decay recurrence of rwkv.h (decay_forward_task) -----------------------

RC_SIMD void gla_forward_task(const DecayIn& in, const Dims& d, int64_t q, int64_t h,
                              int64_t j0, int64_t W, float* st, float* buf, float* y) {
  decay_forward_task(in, d, q, h, j0, W, st, buf, y);
}

void gla_forward(KernelCtx& c, const Dims& d) {
  // Sources: k, v, q, g, state; fp = [scale].
  const DecayIn in{c.src[2].f32(), c.src[0].f32(), c.src[1].f32(), c.src[3].f32(), nullptr,
                   static_cast<float>(c.node.fp[RECURRA_P_SCALE])};
  decay_forward(c, d, in, c.src[4].f32(), gla_forward_task);
}

// ---- backward ----------------------------------------------------------------------------
//
// A task is (run, head, rows j in [j0, j1)) of the transposed state, R rows of Sp lanes (i),
// as in wkv6. Peak scratch per thread: (2 + ceil(n/K) + K) * R * Sp + R (kL + 1) + 6 Sp floats.

// One backward token over a register block of NV lane groups (i). sp: S_{t-1} rows; lam:
// lam_t rows, updated to lam_{t-1}; acc gets the block's sums over j of S_{t-1} gy, mu v and
// mu * S_{t-1} (offsets 0, Sp, 2 Sp); dvp[j] (kL lanes) gets, or with `add` adds, the block's
// lane-wise part of sum_i mu[j][i] k[i].
template <int NV>
RWKV_INLINE void gla_backward_rows(const float* sp, float* lam, int64_t Sp, int64_t R,
                                   const float* gy, const float* v, float scale, const float* q,
                                   const float* k, const float* g, float* dvp, bool add,
                                   float* acc) {
  vf sg[NV], dk[NV], dg[NV], qq[NV], kk[NV], gg[NV];
  for (int c = 0; c < NV; ++c) {
    sg[c] = dk[c] = dg[c] = vf{};
    qq[c] = vload(q + c * kL);
    kk[c] = vload(k + c * kL);
    gg[c] = vload(g + c * kL);
  }
  for (int64_t j = 0; j < R; ++j) {
    const vf gj = RWKV_SPLAT(gy[j]), gs = RWKV_SPLAT(scale * gy[j]), vj = RWKV_SPLAT(v[j]);
    const float* s = sp + j * Sp;
    float* l = lam + j * Sp;
    vf dv = vf{};
    for (int c = 0; c < NV; ++c) {
      const vf x = vload(s + c * kL);
      const vf m = vload(l + c * kL) + gs * qq[c];
      sg[c] += gj * x;
      dk[c] += vj * m;
      dg[c] += m * x;
      dv += m * kk[c];
      vstore(l + c * kL, gg[c] * m);
    }
    vstore(dvp + j * kL, add ? vload(dvp + j * kL) + dv : dv);
  }
  for (int c = 0; c < NV; ++c) {
    vstore(acc + c * kL, sg[c]);
    vstore(acc + Sp + c * kL, dk[c]);
    vstore(acc + 2 * Sp + c * kL, dg[c]);
  }
}

struct GlaGrad {
  float *dk, *dv, *dq, *dg;  // (T, H, S) layouts; dk, dq, dg may be a block's partial buffer
  float* ds;                 // d(initial state), (N, H, S, S)
};

RC_SIMD void gla_backward_task(const GlaIn& in, const float* s0, const float* gy,
                               const float* gs, const GlaGrad& out, const Dims& d, float scale,
                               int64_t qs, int64_t h, int64_t j0, int64_t j1, float* scratch) {
  const int64_t S = d.S, Sp = d.Sp, R = j1 - j0, n = d.n;
  const int64_t K = checkpoint_interval(n), nck = (n + K - 1) / K, RS = R * Sp;
  float* st = scratch;
  float* lam = st + RS;
  float* ck = lam + RS;
  float* chunk = ck + nck * RS;
  float* qb = chunk + K * RS;
  float* kb = qb + Sp;
  float* gb = kb + Sp;
  float* acc = gb + Sp;         // 3 Sp
  float* dvrow = acc + 3 * Sp;  // R
  float* dvp = dvrow + R;       // R * kL

  load_transposed(ck, s0 + d.state(qs, h), lam, gs + d.state(qs, h), S, Sp, j0, R);
  decay_checkpoints(ck, st, d, qs, h, j0, R, K, nck, in.k, in.g, in.v, kb, gb);
  // Chunks from the last: recomputed from the checkpoint, then walked backwards.
  for (int64_t ci = nck - 1; ci >= 0; --ci) {
    const int64_t t0 = ci * K, t1 = std::min(n, t0 + K);
    decay_recompute(chunk, ck + ci * RS, d, qs, h, j0, R, t0, t1, in.k, in.g, in.v, kb, gb);
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const int64_t base = d.token(qs, t, h);
      if (t - kPrefetchTokens >= t0) {  // walking backwards: no hardware prefetch
        const int64_t ahead = d.token(qs, t - kPrefetchTokens, h);
        prefetch(in.q + ahead, S);
        prefetch(gy + ahead + j0, R);
        for (float* o : {out.dq, out.dk, out.dg}) prefetch(o + ahead, S, true);
        prefetch(out.dv + ahead + j0, R, true);
      }
      const float* qp = padded(qb, in.q + base, S, Sp);
      const float* kp = padded(kb, in.k + base, S, Sp);
      const float* gp = padded(gb, in.g + base, S, Sp);
      const float* gyt = gy + base + j0;
      const float* vt = in.v + base + j0;
      const float gv = dot(gyt, vt, R);
      const float* sp = chunk + (t - t0) * RS;
      for (int64_t c = 0; c < Sp; c += kMaxNV * kL) {
        const int64_t nv = std::min(kMaxNV, (Sp - c) / kL);
        RWKV_DISPATCH_NV(nv, gla_backward_rows, sp + c, lam + c, Sp, R, gyt, vt, scale, qp + c,
                         kp + c, gp + c, dvp, c > 0, acc + c)
      }
      hsum_rows(dvp, R, dvrow);
      // dq = scale (g * sum_j S_{t-1} gy + k gv), finished in padded scratch.
      const vf sg = RWKV_SPLAT(scale), g = RWKV_SPLAT(gv);
      for (int64_t c = 0; c < Sp; c += kL)
        vstore(acc + c, sg * (vload(gp + c) * vload(acc + c) + vload(kp + c) * g));
      copy_floats(out.dq + base, acc, S);
      copy_floats(out.dk + base, acc + Sp, S);
      copy_floats(out.dg + base, acc + 2 * Sp, S);
      copy_floats(out.dv + base + j0, dvrow, R);
    }
  }
  float* dsh = out.ds + d.state(qs, h);
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < R; ++j) dsh[i * S + j0 + j] = lam[j * Sp + i];
}

void gla_backward(KernelCtx& c, const Dims& d) {
  const GlaIn in{c.src[0].f32(), c.src[1].f32(), c.src[2].f32(), c.src[3].f32()};
  const float* s0 = c.src[4].f32();
  const float* gy = c.src[5].f32();
  const float* gs = gy + d.ths();
  const float scale = static_cast<float>(c.node.fp[RECURRA_P_SCALE]);
  const int64_t ths = d.ths();
  // Packed result, in source order: dk, dv, dq, dg, dstate.
  float* o = c.dst.f32();
  GlaGrad full{o, o + ths, o + 2 * ths, o + 3 * ths, o + 4 * ths};
  const int64_t units = d.N * d.H, nb = backward_blocks(units, d.S);
  std::vector<float> part(nb > 1 ? static_cast<size_t>(3 * nb * ths) : 0);
  const int64_t K = checkpoint_interval(d.n), nck = (d.n + K - 1) / K;
  const int64_t rmax = (d.S + nb - 1) / nb;
  const size_t need =
      static_cast<size_t>((2 + nck + K) * rmax * d.Sp + 6 * d.Sp + rmax * (kL + 1));
  Scratch scratch(c.pool.size());
  c.pool.run(units * nb, [&](int64_t task, int tid) {
    const int64_t b = task % nb, qh = task / nb, q = qh / d.H, h = qh % d.H;
    const int64_t j0 = block_begin(b, nb, d.S), j1 = block_begin(b + 1, nb, d.S);
    GlaGrad g = full;
    if (nb > 1) {
      g.dk = part.data() + b * ths;
      g.dq = part.data() + (nb + b) * ths;
      g.dg = part.data() + (2 * nb + b) * ths;
    }
    gla_backward_task(in, s0, gy, gs, g, d, scale, q, h, j0, j1, scratch.get(tid, need));
  });
  if (nb > 1) {
    reduce_blocks(c.pool, full.dk, part.data(), nb, ths);
    reduce_blocks(c.pool, full.dq, part.data() + nb * ths, nb, ths);
    reduce_blocks(c.pool, full.dg, part.data() + 2 * nb * ths, nb, ths);
  }
}

}  // namespace
}  // namespace rwkv

void register_gla_ops(OpTable& t) {
  rwkv::RecurrentOp op;
  op.name = "gated_linear_attn";
  op.signature = "(k, v, q, g, state)";
  op.n_src = 5;
  op.tok = {0, 1, 2, 3};
  op.hs = -1;
  op.st = 4;
  op.n_fp = 1;
  op.forward = rwkv::gla_forward;
  op.backward = rwkv::gla_backward;
  rwkv::register_recurrent(t, op);
}

}  // namespace recurra

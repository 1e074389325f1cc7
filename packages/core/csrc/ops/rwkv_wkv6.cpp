// rwkv_wkv6: RWKV-6 time mixing on the CPU, forward and backward. Also the pieces the three
// RWKV-family ops share (validation, registration) and register_rwkv_ops. The forward runs
// through decay_forward (rwkv_decay_forward.cpp), shared with GLA.
//
// Shapes (numpy order): k, v, r, td (T, H, S); tf (H, S); state (N, H, S, S) indexed
// [q, h, i key, j value]; T = N runs of n tokens, run q starting from state[q].
//
//   y_t[j]  = sum_i r_t[i] * (tf[i] * k_t[i] * v_t[j] + S[i, j])
//   S[i, j] = td_t[i] * S[i, j] + k_t[i] * v_t[j]
//
// Output, packed: y (T, H, S), then the final states (N, H, S, S). The forward is the decay
// recurrence of rwkv.h (decay_forward_task) with c = r, alpha = sum_i r u k.
//
// Backward, with lam_t = dL/dS_t walked from the last token (lam_n = dL/d(final state)) and
// gv_t = gy_t . v_t:
//   dr_t[i]  = tf[i] k_t[i] gv_t + sum_j S_{t-1}[i, j] gy_t[j]
//   dk_t[i]  = r_t[i] tf[i] gv_t + sum_j lam_t[i, j] v_t[j]
//   dv_t[j]  = (sum_i r_t[i] tf[i] k_t[i]) gy_t[j] + sum_i lam_t[i, j] k_t[i]
//   dtd_t[i] = sum_j lam_t[i, j] S_{t-1}[i, j]
//   dtf[i]  += r_t[i] k_t[i] gv_t
//   lam_{t-1}[i, j] = td_t[i] lam_t[i, j] + r_t[i] gy_t[j];    d(state) = lam_0
#include "rwkv.h"

namespace recurra {
namespace rwkv {

// ---- shared by the three ops -------------------------------------------------------------

Dims make_dims(int64_t T, int64_t H, int64_t S, int64_t N) {
  Dims d;
  d.T = T;
  d.H = H;
  d.S = S;
  d.N = N;
  d.n = N > 0 ? T / N : 0;
  d.Sp = (S + kL - 1) / kL * kL;
  d.G = d.Sp / kL;
  return d;
}

Dims check_sources(const Graph& g, const Node& n, const std::vector<int>& tok, int hs, int st,
                   const char* signature, bool grad) {
  const size_t n_fwd = tok.size() + (hs >= 0 ? 1 : 0) + 1;
  const size_t want = n_fwd + (grad ? 1 : 0);
  if (n.src.size() != want)
    fail_shape(g, n, "takes " + std::to_string(want) + " inputs " + signature +
                         (grad ? " plus the packed output gradient" : ""));
  for (size_t i = 0; i < want; ++i) require_f32(g, n, static_cast<int>(i));
  const Shape x = g.node(n.src[tok[0]]).shape;
  if (x.ndim != 3) fail_shape(g, n, "per-token inputs must have shape (T, H, S)");
  for (int i : tok)
    if (g.node(n.src[i]).shape != x)
      fail_shape(g, n, std::string("the per-token inputs of ") + signature +
                           " must all have the same shape (T, H, S)");
  const int64_t T = x[0], H = x[1], S = x[2];
  if (T < 1 || H < 1 || S < 1) fail_shape(g, n, "T, H and S must be at least 1");
  const Shape s = g.node(n.src[st]).shape;
  if (s.ndim != 4 || s[1] != H || s[2] != S || s[3] != S || s[0] < 1)
    fail_shape(g, n, "the state must have shape (n_seqs, H, S, S) with the H and S of the inputs");
  if (T % s[0] != 0)
    fail_shape(g, n, "the token count T = " + std::to_string(T) +
                         " is not a multiple of n_seqs = " + std::to_string(s[0]));
  if (hs >= 0) {
    const Shape u = g.node(n.src[hs]).shape;
    if (u.ndim != 2 || u[0] != H || u[1] != S)
      fail_shape(g, n, "the per-head input must have shape (H, S)");
  }
  Dims d = make_dims(T, H, S, s[0]);
  if (grad) {
    const Shape gs = g.node(n.src.back()).shape;
    if (gs.ndim != 1 || gs[0] != d.ths() + d.nhss())
      fail_shape(g, n, "the output gradient must be 1-D with T*H*S + n_seqs*H*S*S elements");
  }
  return d;
}

void reduce_blocks(ThreadPool& pool, float* out, const float* part, int64_t nb, int64_t len) {
  pool.parallel_for(len, kGrainElems, [&](int64_t b0, int64_t e0, int) {
    for (int64_t i = b0; i < e0; ++i) out[i] = part[i];
    for (int64_t b = 1; b < nb; ++b) {
      const float* p = part + b * len;
      for (int64_t i = b0; i < e0; ++i) out[i] += p[i];
    }
  });
}

namespace {

Dims dims_from_ctx(const KernelCtx& c, const RecurrentOp& op) {
  const Shape& x = c.src[op.tok[0]].shape;
  return make_dims(x[0], x[1], x[2], c.src[op.st].shape[0]);
}

}  // namespace

void register_recurrent(OpTable& t, const RecurrentOp& op) {
  const uint32_t all_srcs = (1u << (op.n_src + 1)) - 1u;  // the backward op has one more
  {
    OpDef d;
    d.name = op.name;
    d.contiguous_srcs = all_srcs;
    d.infer = [op](Graph& g, Node& n) {
      if (static_cast<int>(n.fp.size()) != op.n_fp)
        fail_shape(g, n, "takes " + std::to_string(op.n_fp) + " float parameter(s)");
      Dims dm = check_sources(g, n, op.tok, op.hs, op.st, op.signature, false);
      n.dtype = DType::f32;
      n.shape = Shape{dm.ths() + dm.nhss()};
    };
    d.forward = [op](KernelCtx& c) { op.forward(c, dims_from_ctx(c, op)); };
    const std::string back = std::string(op.name) + "_back";
    const int n_src = op.n_src;
    d.backward = [back, n_src](GradSink& k) {
      std::vector<int> src = k.node.src;
      src.push_back(k.grad_out);
      std::vector<Shape> shapes;
      for (int i = 0; i < n_src; ++i) shapes.push_back(k.g.node(k.node.src[i]).shape);
      const int packed = k.g.op(back, src, {}, k.node.fp);
      int64_t off = 0;
      for (int i = 0; i < n_src; ++i) {
        if (k.needs(i)) k.add(i, k.g.unpack(packed, off, shapes[i]));
        off += shapes[i].numel();
      }
    };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = std::string(op.name) + "_back";
    d.contiguous_srcs = all_srcs;
    d.infer = [op](Graph& g, Node& n) {
      if (static_cast<int>(n.fp.size()) != op.n_fp)
        fail_shape(g, n, "takes " + std::to_string(op.n_fp) + " float parameter(s)");
      check_sources(g, n, op.tok, op.hs, op.st, op.signature, true);
      int64_t total = 0;
      for (int i = 0; i < op.n_src; ++i) total += g.node(n.src[i]).numel();
      n.dtype = DType::f32;
      n.shape = Shape{total};
    };
    d.forward = [op](KernelCtx& c) { op.backward(c, dims_from_ctx(c, op)); };
    t.add(std::move(d));  // no backward: not twice differentiable
  }
}

// ---- backward of the decay-plus-outer-product recurrences (wkv6 and GLA) ----------------
//
// A task is (run q, head h, rows j in [j0, j1)): the value columns of the state are
// independent, so a task needs only its own columns, kept transposed in scratch as R = j1 - j0
// rows of Sp lanes (i). Then the sums over j in dc, dk, dw are vector accumulations and only
// dv needs a horizontal sum. Per task: one pass saves the state every K tokens; then, chunk by
// chunk from the end, the chunk's states are recomputed from its checkpoint and walked
// backwards. Peak scratch per thread: (2 + ceil(n/K) + K) * R * Sp + R (kL + 1) + 8 Sp floats,
// e.g. 2.1 MB for n = 4096 (K = 64), S = 64.

namespace {

// One backward token over a register block of NV lane groups (i). sp: S_{t-1} rows, lam:
// lam_t rows (updated to lam_{t-1}); acc gets the block's sums over j of S_{t-1} gy, mu v and
// mu * S_{t-1} (offsets 0, Sp, 2 Sp), mu the whole gradient of S_t; dvp[j] (kL lanes) gets,
// or with `add` adds, the block's lane-wise part of sum_i mu[j][i] k[i] (summed across lanes
// later, 16 rows at a time). wkv6 (`after` false) reads before the update: mu = lam_t and
// lam_{t-1} = w mu + r gy^T; GLA reads after it: mu = lam_t + scale c gy^T, lam_{t-1} = w mu.
template <int NV>
RWKV_INLINE void decay_backward_rows(const float* sp, float* lam, int64_t Sp, int64_t R,
                                     const float* gy, const float* v, float scale, const float* c,
                                     const float* k, const float* w, float* dvp, bool add,
                                     float* acc, bool after) {
  vf dc[NV], dk[NV], dw[NV], cc[NV], kk[NV], ww[NV];
  for (int b = 0; b < NV; ++b) {
    dc[b] = dk[b] = dw[b] = vf{};
    cc[b] = vload(c + b * kL);
    kk[b] = vload(k + b * kL);
    ww[b] = vload(w + b * kL);
  }
  for (int64_t j = 0; j < R; ++j) {
    const vf g = RWKV_SPLAT(gy[j]), gs = RWKV_SPLAT(scale * gy[j]), vj = RWKV_SPLAT(v[j]);
    const float* s = sp + j * Sp;
    float* l = lam + j * Sp;
    vf dv = vf{};
    for (int b = 0; b < NV; ++b) {
      const vf x = vload(s + b * kL);
      const vf m = after ? vload(l + b * kL) + gs * cc[b] : vload(l + b * kL);
      dc[b] += g * x;
      dk[b] += vj * m;
      dw[b] += m * x;
      dv += m * kk[b];
      vstore(l + b * kL, after ? ww[b] * m : ww[b] * m + g * cc[b]);
    }
    vstore(dvp + j * kL, add ? vload(dvp + j * kL) + dv : dv);
  }
  for (int b = 0; b < NV; ++b) {
    vstore(acc + b * kL, dc[b]);
    vstore(acc + Sp + b * kL, dk[b]);
    vstore(acc + 2 * Sp + b * kL, dw[b]);
  }
}

template <int NV>
RWKV_INLINE void decay_backward_rows_before(const float* sp, float* lam, int64_t Sp, int64_t R,
                                            const float* gy, const float* v, float scale,
                                            const float* c, const float* k, const float* w,
                                            float* dvp, bool add, float* acc) {
  decay_backward_rows<NV>(sp, lam, Sp, R, gy, v, scale, c, k, w, dvp, add, acc, false);
}

template <int NV>
RWKV_INLINE void decay_backward_rows_after(const float* sp, float* lam, int64_t Sp, int64_t R,
                                           const float* gy, const float* v, float scale,
                                           const float* c, const float* k, const float* w,
                                           float* dvp, bool add, float* acc) {
  decay_backward_rows<NV>(sp, lam, Sp, R, gy, v, scale, c, k, w, dvp, add, acc, true);
}

// out.dc, dk, dw (T, H, S) may be a block's partial buffers; out.du is this task's Sp partial.
RC_SIMD void decay_backward_task(const DecayBackIn& in, const DecayGrad& out, const Dims& d,
                                 int64_t q, int64_t h, int64_t j0, int64_t j1, float* scratch) {
  const int64_t S = d.S, Sp = d.Sp, R = j1 - j0, n = d.n;
  const int64_t K = checkpoint_interval(n), nck = (n + K - 1) / K, RS = R * Sp;
  const bool bonus = in.u != nullptr;  // wkv6
  const float* gs = in.gy + d.ths();
  float* st = scratch;
  float* lam = st + RS;
  float* ck = lam + RS;
  float* chunk = ck + nck * RS;
  float* cb = chunk + K * RS;
  float* kb = cb + Sp;
  float* wb = kb + Sp;
  float* ub = wb + Sp;
  float* du = ub + Sp;
  float* acc = du + Sp;         // 3 Sp
  float* dvrow = acc + 3 * Sp;  // R
  float* dvp = dvrow + R;       // R * kL

  // Transposed, padded copies of the initial state (the first checkpoint) and of the final
  // state's gradient.
  load_transposed(ck, in.s0 + d.state(q, h), lam, gs + d.state(q, h), S, Sp, j0, R);
  if (bonus) {
    load_padded(ub, in.u + h * S, S, Sp);
    std::memset(du, 0, static_cast<size_t>(Sp) * sizeof(float));
  }

  decay_checkpoints(ck, st, d, q, h, j0, R, K, nck, in.k, in.w, in.v, kb, wb);
  // Chunks from the last: recomputed from the checkpoint, then walked backwards.
  for (int64_t ci = nck - 1; ci >= 0; --ci) {
    const int64_t t0 = ci * K, t1 = std::min(n, t0 + K);
    decay_recompute(chunk, ck + ci * RS, d, q, h, j0, R, t0, t1, in.k, in.w, in.v, kb, wb);
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const int64_t base = d.token(q, t, h);
      if (t - kPrefetchTokens >= t0) {  // walking backwards: no hardware prefetch
        const int64_t ahead = d.token(q, t - kPrefetchTokens, h);
        prefetch(in.c + ahead, S);
        prefetch(in.gy + ahead + j0, R);
        for (float* o : {out.dc, out.dk, out.dw}) prefetch(o + ahead, S, true);
        prefetch(out.dv + ahead + j0, R, true);
      }
      const float* cp = padded(cb, in.c + base, S, Sp);
      const float* kp = padded(kb, in.k + base, S, Sp);
      const float* wp = padded(wb, in.w + base, S, Sp);
      const float* gyt = in.gy + base + j0;
      const float* vt = in.v + base + j0;
      const float gv = dot(gyt, vt, R);
      const float* sp = chunk + (t - t0) * RS;
      for (int64_t c = 0; c < Sp; c += kMaxNV * kL) {
        const int64_t nv = std::min(kMaxNV, (Sp - c) / kL);
        if (bonus) {
          RWKV_DISPATCH_NV(nv, decay_backward_rows_before, sp + c, lam + c, Sp, R, gyt, vt,
                           in.scale, cp + c, kp + c, wp + c, dvp, c > 0, acc + c)
        } else {
          RWKV_DISPATCH_NV(nv, decay_backward_rows_after, sp + c, lam + c, Sp, R, gyt, vt,
                           in.scale, cp + c, kp + c, wp + c, dvp, c > 0, acc + c)
        }
      }
      hsum_rows(dvp, R, dvrow);
      // Finish in padded scratch (whole vectors), then copy S values out.
      const vf g = RWKV_SPLAT(gv);
      if (bonus) {  // dr += u k gv, dk += r u gv, du += r k gv, dv += (sum_i r u k) gy
        const float b = dot3(cp, ub, kp, Sp);
        for (int64_t c = 0; c < Sp; c += kL) {
          const vf r_ = vload(cp + c), k_ = vload(kp + c), u_ = vload(ub + c);
          vstore(acc + c, vload(acc + c) + u_ * k_ * g);
          vstore(acc + Sp + c, vload(acc + Sp + c) + r_ * u_ * g);
          vstore(du + c, vload(du + c) + r_ * k_ * g);
        }
        for (int64_t j = 0; j < R; ++j) dvrow[j] += b * gyt[j];
      } else {  // dq = scale (g * sum_j S_{t-1} gy + k gv)
        const vf sg = RWKV_SPLAT(in.scale);
        for (int64_t c = 0; c < Sp; c += kL)
          vstore(acc + c, sg * (vload(wp + c) * vload(acc + c) + vload(kp + c) * g));
      }
      copy_floats(out.dc + base, acc, S);
      copy_floats(out.dk + base, acc + Sp, S);
      copy_floats(out.dw + base, acc + 2 * Sp, S);
      copy_floats(out.dv + base + j0, dvrow, R);
    }
  }
  float* dsh = out.ds + d.state(q, h);
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < R; ++j) dsh[i * S + j0 + j] = lam[j * Sp + i];
  if (bonus) std::memcpy(out.du, du, static_cast<size_t>(Sp) * sizeof(float));
}

}  // namespace

void decay_backward(KernelCtx& c, const Dims& d, const DecayBackIn& in, const DecayGrad& full) {
  const int64_t ths = d.ths();
  // Rows j are split into blocks when there are few (run, head) pairs; the block sums of
  // dc, dk, dw then go to partial buffers, added up in block order afterwards.
  const int64_t units = d.N * d.H, nb = backward_blocks(units, d.S);
  std::vector<float> part(nb > 1 ? static_cast<size_t>(3 * nb * ths) : 0);
  std::vector<float> du_part(in.u ? static_cast<size_t>(units * nb * d.Sp) : 0);
  const int64_t K = checkpoint_interval(d.n), nck = (d.n + K - 1) / K;
  const int64_t rmax = (d.S + nb - 1) / nb;
  const size_t need =
      static_cast<size_t>((2 + nck + K) * rmax * d.Sp + 8 * d.Sp + rmax * (kL + 1));
  Scratch scratch(c.pool.size());
  c.pool.run(units * nb, [&](int64_t task, int tid) {
    const int64_t b = task % nb, qh = task / nb, q = qh / d.H, h = qh % d.H;
    const int64_t j0 = block_begin(b, nb, d.S), j1 = block_begin(b + 1, nb, d.S);
    DecayGrad g = full;
    g.du = in.u ? du_part.data() + task * d.Sp : nullptr;
    if (nb > 1) {
      g.dk = part.data() + b * ths;
      g.dc = part.data() + (nb + b) * ths;
      g.dw = part.data() + (2 * nb + b) * ths;
    }
    decay_backward_task(in, g, d, q, h, j0, j1, scratch.get(tid, need));
  });
  if (nb > 1) {
    reduce_blocks(c.pool, full.dk, part.data(), nb, ths);
    reduce_blocks(c.pool, full.dc, part.data() + nb * ths, nb, ths);
    reduce_blocks(c.pool, full.dw, part.data() + 2 * nb * ths, nb, ths);
  }
  if (!in.u) return;
  // du: the task partials in (run, head, block) order.
  for (int64_t h = 0; h < d.H; ++h)
    for (int64_t i = 0; i < d.S; ++i) {
      float s = 0.0f;
      for (int64_t q = 0; q < d.N; ++q)
        for (int64_t b = 0; b < nb; ++b) s += du_part[((q * d.H + h) * nb + b) * d.Sp + i];
      full.du[h * d.S + i] = s;
    }
}

namespace {

void wkv6_forward(KernelCtx& c, const Dims& d) {
  // Sources: k, v, r, tf, td, state.
  const DecayIn in{c.src[2].f32(), c.src[0].f32(), c.src[1].f32(), c.src[4].f32(),
                   c.src[3].f32(), 1.0f};
  decay_forward(c, d, in, c.src[5].f32());
}

void wkv6_backward(KernelCtx& c, const Dims& d) {
  // Sources: k, v, r, tf, td, state; packed result in source order: dk, dv, dr, dtf, dtd,
  // dstate.
  const int64_t ths = d.ths();
  const DecayBackIn in{c.src[0].f32(), c.src[1].f32(), c.src[2].f32(), c.src[4].f32(),
                       c.src[3].f32(), 1.0f, c.src[5].f32(), c.src[6].f32()};
  float* o = c.dst.f32();
  const DecayGrad out{o, o + ths, o + 2 * ths, o + 3 * ths + d.H * d.S, o + 3 * ths,
                      o + 4 * ths + d.H * d.S};
  decay_backward(c, d, in, out);
}

}  // namespace

}  // namespace rwkv

void register_wkv6_ops(OpTable& t) {
  rwkv::RecurrentOp op;
  op.name = "rwkv_wkv6";
  op.signature = "(k, v, r, tf, td, state)";
  op.n_src = 6;
  op.tok = {0, 1, 2, 4};
  op.hs = 3;
  op.st = 5;
  op.n_fp = 0;
  op.forward = rwkv::wkv6_forward;
  op.backward = rwkv::wkv6_backward;
  rwkv::register_recurrent(t, op);
}

void register_rwkv_ops(OpTable& t) {
  register_wkv6_ops(t);
  register_wkv7_ops(t);
  register_gla_ops(t);
}

}  // namespace recurra

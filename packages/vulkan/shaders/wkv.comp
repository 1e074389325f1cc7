// Forward of rwkv_wkv6 (OP 0), rwkv_wkv7 (OP 1) and gated_linear_attn (OP 2); see
// wkv_common.glsl for the notation and the thread tile, csrc/ops/rwkv.cpp for the grid.
//
// One workgroup per (run q, head h, block of CW columns nu): the block's state stays in
// registers for the whole run. Per chunk of C tokens the per-token vectors (all S rows) and
// v (the block's columns) are staged in shared memory (two barriers per chunk, none per
// token); per token and column:
//   wkv6: y = sum_k r (X + u k v);  X = w X + k v
//   GLA:  X = g X + k v;            y = scale sum_k q X
//   wkv7: sa = sum_k a X;  X = X w + k v + sa b;  y = sum_k r X
// with the sums over kappa done by cluster_sum. Output: y (T, H, S), then the final states.
#version 450
#include "common.glsl"
#include "wkv_common.glsl"

shared float shk[NK * C * SP];  // [vector][token][kappa]
shared float shv[C * CW];       // v: [token][column of the block]

// Stages tokens [t0, t0 + nc) of run q, head h (zeros past nc and past S).
// Each thread loads STG elements before storing any (the loads' latencies overlap).
void stage(uint q, uint h, uint nu0, uint t0, uint nc) {
  for (uint i0 = gl_LocalInvocationIndex; i0 < NK * C * SP; i0 += STG * WG) {
    float val[STG];
    [[unroll]] for (uint b = 0u; b < STG; ++b) val[b] = stage_vec(q, h, t0, nc, i0 + b * WG);
    [[unroll]] for (uint b = 0u; b < STG; ++b)
      if (i0 + b * WG < NK * C * SP) shk[i0 + b * WG] = val[b];
  }
  for (uint i0 = gl_LocalInvocationIndex; i0 < C * CW; i0 += STG * WG) {
    float val[STG];
    [[unroll]] for (uint b = 0u; b < STG; ++b) {
      const uint i = i0 + b * WG, tt = i / CW, nu = nu0 + (i - tt * CW);
      val[b] = (i < C * CW && tt < nc && nu < pc.S) ? FBuf(pc.src[SRC_V]).v[tok_base(q, t0 + tt, h) + nu] : 0.0;
    }
    [[unroll]] for (uint b = 0u; b < STG; ++b)
      if (i0 + b * WG < C * CW) shv[i0 + b * WG] = val[b];
  }
}

void main() {
  const uint wid = group_index();
  const uint N = pc.T / pc.n;
  if (wid >= N * pc.H * pc.NB) return;
  const uint blk = wid % pc.NB, qh = wid / pc.NB, q = qh / pc.H, h = qh % pc.H;
  const uint l = lane_id(), p = l % P, c = l / P;
  const uint nu0 = blk * CW;
  const uint S = pc.S;
  FBuf st0 = FBuf(pc.src[SRC_ST]);
  FBuf y = FBuf(pc.dst);
  const uint sb = (q * pc.H + h) * S * S;

  float x[RC];  // X[m * P + p, nu0 + c * CJ + jj] at [m * CJ + jj]
  [[unroll]] for (uint m = 0u; m < R; ++m) {
    const uint kappa = m * P + p;
    [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
      const uint nu = nu0 + c * CJ + jj;
      x[m * CJ + jj] = (kappa < S && nu < S) ? st0.v[sb + st_off(kappa, nu)] : 0.0;
    }
  }
#if OP == 0
  float u[R];
  [[unroll]] for (uint m = 0u; m < R; ++m) {
    const uint kappa = m * P + p;
    u[m] = kappa < S ? FBuf(pc.src[SRC_U]).v[h * S + kappa] : 0.0;
  }
#endif

  for (uint t0 = 0u; t0 < pc.n; t0 += C) {
    const uint nc = min(C, pc.n - t0);
    barrier();
    stage(q, h, nu0, t0, nc);
    barrier();
    for (uint tt = 0u; tt < nc; ++tt) {
      const uint kb = tt * SP + p;
      const uint ybase = tok_base(q, t0 + tt, h);
      [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
        const uint cl = c * CJ + jj;
        const float vj = shv[tt * CW + cl];
        float acc = 0.0;
#if OP == 0
        [[unroll]] for (uint m = 0u; m < R; ++m) {
          const uint o = kb + m * P;
          const float r = shk[VR * C * SP + o], k = shk[VK * C * SP + o], w = shk[VW * C * SP + o];
          const float s = x[m * CJ + jj];
          acc += r * (s + u[m] * k * vj);
          x[m * CJ + jj] = w * s + k * vj;
        }
        acc = cluster_sum(acc);
#elif OP == 1
        float sa = 0.0;
        [[unroll]] for (uint m = 0u; m < R; ++m) sa += shk[VA * C * SP + kb + m * P] * x[m * CJ + jj];
        sa = cluster_sum(sa);
        [[unroll]] for (uint m = 0u; m < R; ++m) {
          const uint o = kb + m * P;
          const float s = x[m * CJ + jj] * shk[VW * C * SP + o] + shk[VK * C * SP + o] * vj +
                          sa * shk[VB * C * SP + o];
          x[m * CJ + jj] = s;
          acc += shk[VR * C * SP + o] * s;
        }
        acc = cluster_sum(acc);
#else
        [[unroll]] for (uint m = 0u; m < R; ++m) {
          const uint o = kb + m * P;
          const float s = shk[VW * C * SP + o] * x[m * CJ + jj] + shk[VK * C * SP + o] * vj;
          x[m * CJ + jj] = s;
          acc += shk[VR * C * SP + o] * s;
        }
        acc = pc.scale * cluster_sum(acc);
#endif
        const uint nu = nu0 + cl;
        if (p == 0u && nu < S) y.v[ybase + nu] = acc;
      }
    }
  }

  const uint ob = pc.T * pc.H * S + sb;
  [[unroll]] for (uint m = 0u; m < R; ++m) {
    const uint kappa = m * P + p;
    [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
      const uint nu = nu0 + c * CJ + jj;
      if (kappa < S && nu < S) y.v[ob + st_off(kappa, nu)] = x[m * CJ + jj];
    }
  }
}

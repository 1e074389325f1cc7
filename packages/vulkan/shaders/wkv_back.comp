// Backward of rwkv_wkv6 (OP 0), rwkv_wkv7 (OP 1) and gated_linear_attn (OP 2); notation and
// thread tile in wkv_common.glsl, equations in the core's rwkv_wkv6.cpp / rwkv_wkv7.cpp /
// gated_linear_attn.cpp, grid and scratch in csrc/ops/rwkv.cpp.
//
// One workgroup per (run, head, block of CW columns nu), the tile of the forward:
// 1. forward sweep from the initial state, saving the block's state every K tokens
//    (checkpoints, [nck][RC][WG] per workgroup);
// 2. segments from the last: the segment's states X_{t-1} (and wkv7's sa) are recomputed
//    from its checkpoint into `seg` ([K][RC + CJ][WG] per workgroup, each lane reading back
//    only what it wrote), then walked backwards with lam = dL/dX_t in registers.
// Per token: the per-column results (dv) are sums over kappa (cluster_sum) and complete;
// the per-row results (dr, dk, dw, ...: NX of them) are sums over nu: each lane sums its CJ
// columns, the subgroup adds its column groups (shuffles), subgroups meet in shared memory
// (`shp`, per chunk), and the workgroup writes its block's partial to `part`; wkv_reduce.comp
// adds the NB blocks in a fixed order. lam_0 is d(state).
#version 450
#include "common.glsl"
#include "wkv_common.glsl"

// Floats of a saved token this op reads back: X_{t-1}, and wkv7's sa.
#if OP == 1
const uint NE = RC + CJ;
#else
const uint NE = RC;
#endif

shared float shk[NK * C * SP];       // [vector][token][kappa]
shared float shv[C * CW];            // v: [token][column of the block]
shared float shg[C * CW];            // dL/dy: [token][column]
shared float shp[C * NX * NSG * SP];  // row partials: [token][quantity][subgroup][kappa]

// Stages tokens [t0, t0 + nc) of run q, head h (zeros past nc and past S); dL/dy too when
// `grad`.
// Each thread loads STG elements before storing any (the loads' latencies overlap).
void stage(uint q, uint h, uint nu0, uint t0, uint nc, bool grad) {
  for (uint i0 = gl_LocalInvocationIndex; i0 < NK * C * SP; i0 += STG * WG) {
    float val[STG];
    [[unroll]] for (uint b = 0u; b < STG; ++b) val[b] = stage_vec(q, h, t0, nc, i0 + b * WG);
    [[unroll]] for (uint b = 0u; b < STG; ++b)
      if (i0 + b * WG < NK * C * SP) shk[i0 + b * WG] = val[b];
  }
  for (uint i0 = gl_LocalInvocationIndex; i0 < C * CW; i0 += STG * WG) {
    float val[STG], g[STG];
    [[unroll]] for (uint b = 0u; b < STG; ++b) {
      const uint i = i0 + b * WG, tt = i / CW, nu = nu0 + (i - tt * CW);
      val[b] = 0.0;
      g[b] = 0.0;
      if (i < C * CW && tt < nc && nu < pc.S) {
        const uint o = tok_base(q, t0 + tt, h) + nu;
        val[b] = FBuf(pc.src[SRC_V]).v[o];
        if (grad) g[b] = FBuf(pc.src[NSRC]).v[o];
      }
    }
    [[unroll]] for (uint b = 0u; b < STG; ++b)
      if (i0 + b * WG < C * CW) {
        shv[i0 + b * WG] = val[b];
        shg[i0 + b * WG] = g[b];
      }
  }
}

void main() {
  const uint wid = group_index();
  const uint N = pc.T / pc.n;
  if (wid >= N * pc.H * pc.NB) return;
  const uint blk = wid % pc.NB, qh = wid / pc.NB, q = qh / pc.H, h = qh % pc.H;
  const uint l = lane_id(), p = l % P, c = l / P;
  const uint sgi = gl_SubgroupInvocationID, sgid = gl_SubgroupID;
  const uint nu0 = blk * CW;
  const uint S = pc.S, K = pc.K;
  const uint ths = pc.T * pc.H * S;
  const uint sb = (q * pc.H + h) * S * S;
  const uint E = RC + CJ;  // floats per lane per saved token: X_{t-1}, then wkv7's sa
  // This workgroup's checkpoints and segment states.
  FBuf ck = FBuf(addr_at(pc.ckpt, wid, pc.nck * RC * WG));
  FBuf sg = FBuf(addr_at(pc.seg, wid, K * E * WG));
  FBuf res = FBuf(pc.dst);

  float x[RC];
  [[unroll]] for (uint m = 0u; m < R; ++m) {
    const uint kappa = m * P + p;
    [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
      const uint nu = nu0 + c * CJ + jj;
      x[m * CJ + jj] = (kappa < S && nu < S) ? FBuf(pc.src[SRC_ST]).v[sb + st_off(kappa, nu)] : 0.0;
    }
  }
#if OP == 0
  float u[R];
  [[unroll]] for (uint m = 0u; m < R; ++m) {
    const uint kappa = m * P + p;
    u[m] = kappa < S ? FBuf(pc.src[SRC_U]).v[h * S + kappa] : 0.0;
  }
#endif

  // ---- 1. forward sweep: checkpoints every K tokens --------------------------------------
  for (uint t0 = 0u; t0 < pc.n; t0 += C) {
    const uint nc = min(C, pc.n - t0);
    barrier();
    stage(q, h, nu0, t0, nc, false);
    barrier();
    for (uint tt = 0u; tt < nc; ++tt) {
      const uint t = t0 + tt;
      if (t % K == 0u) {
        const uint cb = (t / K) * RC * WG + l;
        [[unroll]] for (uint e = 0u; e < RC; ++e) ck.v[cb + e * WG] = x[e];
      }
      const uint kb = tt * SP + p;
      [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
        const float vj = shv[tt * CW + c * CJ + jj];
#if OP == 1
        float sa = 0.0;
        [[unroll]] for (uint m = 0u; m < R; ++m) sa += shk[VA * C * SP + kb + m * P] * x[m * CJ + jj];
        sa = cluster_sum(sa);
        [[unroll]] for (uint m = 0u; m < R; ++m) {
          const uint o = kb + m * P;
          x[m * CJ + jj] = x[m * CJ + jj] * shk[VW * C * SP + o] + shk[VK * C * SP + o] * vj +
                           sa * shk[VB * C * SP + o];
        }
#else
        [[unroll]] for (uint m = 0u; m < R; ++m) {
          const uint o = kb + m * P;
          x[m * CJ + jj] = shk[VW * C * SP + o] * x[m * CJ + jj] + shk[VK * C * SP + o] * vj;
        }
#endif
      }
    }
  }

  // ---- 2. segments from the last ---------------------------------------------------------
  float lam[RC];
  {
    FBuf gs = FBuf(pc.src[NSRC]);
    [[unroll]] for (uint m = 0u; m < R; ++m) {
      const uint kappa = m * P + p;
      [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
        const uint nu = nu0 + c * CJ + jj;
        lam[m * CJ + jj] = (kappa < S && nu < S) ? gs.v[ths + sb + st_off(kappa, nu)] : 0.0;
      }
    }
  }
  for (int si = int(pc.nck) - 1; si >= 0; --si) {
    const uint ts = uint(si) * K, te = min(pc.n, ts + K);
    {
      const uint cb = uint(si) * RC * WG + l;
      [[unroll]] for (uint e = 0u; e < RC; ++e) x[e] = ck.v[cb + e * WG];
    }
    // Recompute the segment's states X_{t-1} (and sa).
    for (uint t0 = ts; t0 < te; t0 += C) {
      const uint nc = min(C, te - t0);
      barrier();
      stage(q, h, nu0, t0, nc, false);
      barrier();
      for (uint tt = 0u; tt < nc; ++tt) {
        const uint sbase = (t0 + tt - ts) * E * WG + l;
        [[unroll]] for (uint e = 0u; e < RC; ++e) sg.v[sbase + e * WG] = x[e];
        const uint kb = tt * SP + p;
        [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
          const float vj = shv[tt * CW + c * CJ + jj];
#if OP == 1
          float sa = 0.0;
          [[unroll]] for (uint m = 0u; m < R; ++m) sa += shk[VA * C * SP + kb + m * P] * x[m * CJ + jj];
          sa = cluster_sum(sa);
          sg.v[sbase + (RC + jj) * WG] = sa;
          [[unroll]] for (uint m = 0u; m < R; ++m) {
            const uint o = kb + m * P;
            x[m * CJ + jj] = x[m * CJ + jj] * shk[VW * C * SP + o] + shk[VK * C * SP + o] * vj +
                             sa * shk[VB * C * SP + o];
          }
#else
          [[unroll]] for (uint m = 0u; m < R; ++m) {
            const uint o = kb + m * P;
            x[m * CJ + jj] = shk[VW * C * SP + o] * x[m * CJ + jj] + shk[VK * C * SP + o] * vj;
          }
#endif
        }
      }
    }
    // Walk the segment backwards, chunk by chunk.
    const uint last = ts + ((te - ts - 1u) / C) * C;
    for (int t0i = int(last); t0i >= int(ts); t0i -= int(C)) {
      const uint t0 = uint(t0i), nc = min(C, te - t0);
      barrier();
      stage(q, h, nu0, t0, nc, true);
      barrier();
      // the saved states of token tt - 1 are loaded while token tt is computed
      float xn[NE];
      {
        const uint sbase = (t0 + nc - 1u - ts) * E * WG + l;
        [[unroll]] for (uint e = 0u; e < NE; ++e) xn[e] = sg.v[sbase + e * WG];
      }
      for (int tti = int(nc) - 1; tti >= 0; --tti) {
        const uint tt = uint(tti);
        float xp[NE];
        [[unroll]] for (uint e = 0u; e < NE; ++e) xp[e] = xn[e];
        if (tti > 0) {
          const uint sbase = (t0 + tt - 1u - ts) * E * WG + l;
          [[unroll]] for (uint e = 0u; e < NE; ++e) xn[e] = sg.v[sbase + e * WG];
        }
        const uint kb = tt * SP + p;
        const uint ybase = tok_base(q, t0 + tt, h);
        float acc[NX * R];  // row partials, summed over this lane's columns
        [[unroll]] for (uint e = 0u; e < NX * R; ++e) acc[e] = 0.0;
        [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
          const uint cl = c * CJ + jj;
          const float vj = shv[tt * CW + cl], gj = shg[tt * CW + cl];
          float dv = 0.0;
#if OP == 0
          // acc: dr, dk, dtd (bonus terms added by wkv_reduce.comp)
          [[unroll]] for (uint m = 0u; m < R; ++m) {
            const uint o = kb + m * P;
            const float r = shk[VR * C * SP + o], k = shk[VK * C * SP + o], w = shk[VW * C * SP + o];
            const float L = lam[m * CJ + jj], X = xp[m * CJ + jj];
            acc[m] += X * gj;
            acc[R + m] += L * vj;
            acc[2u * R + m] += L * X;
            dv += L * k + gj * (r * u[m] * k);
            lam[m * CJ + jj] = w * L + r * gj;
          }
          dv = cluster_sum(dv);
#elif OP == 1
          // acc: dr, dw, dk, da, db
          const float sa = xp[RC + jj];
          float dsa = 0.0;
          [[unroll]] for (uint m = 0u; m < R; ++m) {
            const uint o = kb + m * P;
            const float r = shk[VR * C * SP + o], k = shk[VK * C * SP + o];
            const float w = shk[VW * C * SP + o], b = shk[VB * C * SP + o];
            const float X = xp[m * CJ + jj];
            const float Xt = X * w + k * vj + sa * b;
            const float M = lam[m * CJ + jj] + r * gj;
            acc[m] += Xt * gj;
            acc[R + m] += M * X;
            acc[2u * R + m] += M * vj;
            acc[4u * R + m] += M * sa;
            dv += M * k;
            dsa += M * b;
            lam[m * CJ + jj] = M;
          }
          dsa = cluster_sum(dsa);
          dv = cluster_sum(dv);
          [[unroll]] for (uint m = 0u; m < R; ++m) {
            const uint o = kb + m * P;
            acc[3u * R + m] += xp[m * CJ + jj] * dsa;
            lam[m * CJ + jj] = lam[m * CJ + jj] * shk[VW * C * SP + o] + shk[VA * C * SP + o] * dsa;
          }
#else
          // acc: dq, dk, dg
          [[unroll]] for (uint m = 0u; m < R; ++m) {
            const uint o = kb + m * P;
            const float qv = shk[VR * C * SP + o], k = shk[VK * C * SP + o], g = shk[VW * C * SP + o];
            const float X = xp[m * CJ + jj];
            const float Xt = g * X + k * vj;
            const float mu = lam[m * CJ + jj] + pc.scale * qv * gj;
            acc[m] += pc.scale * Xt * gj;
            acc[R + m] += mu * vj;
            acc[2u * R + m] += mu * X;
            dv += mu * k;
            lam[m * CJ + jj] = g * mu;
          }
          dv = cluster_sum(dv);
#endif
          const uint nu = nu0 + cl;
          if (p == 0u && nu < S) res.v[DV_OFF * ths + ybase + nu] = dv;
        }
        // Column groups of the subgroup, then one slot per subgroup.
        [[unroll]] for (uint e = 0u; e < NX * R; ++e) {
          float v = acc[e];
          for (uint o = P; o < SG; o <<= 1) v += subgroupShuffleXor(v, o);
          acc[e] = v;
        }
        if (sgi < P) {
          [[unroll]] for (uint xi = 0u; xi < NX; ++xi)
            [[unroll]] for (uint m = 0u; m < R; ++m)
              shp[((tt * NX + xi) * NSG + sgid) * SP + m * P + p] = acc[xi * R + m];
        }
      }
      barrier();
      // The block's partials of this chunk, subgroups added in order.
      for (uint i = gl_LocalInvocationIndex; i < nc * NX * S; i += WG) {
        const uint tt = i / (NX * S), rem = i - tt * (NX * S), xi = rem / S, kappa = rem - xi * S;
        float s = 0.0;
        for (uint g = 0u; g < NSG; ++g) s += shp[((tt * NX + xi) * NSG + g) * SP + kappa];
        FBuf(addr_at(pc.part, blk * NX + xi, ths)).v[tok_base(q, t0 + tt, h) + kappa] = s;
      }
    }
  }

  // d(state) = lam_0
  const uint ob = DS_OFF(ths, pc.H * S) + sb;
  [[unroll]] for (uint m = 0u; m < R; ++m) {
    const uint kappa = m * P + p;
    [[unroll]] for (uint jj = 0u; jj < CJ; ++jj) {
      const uint nu = nu0 + c * CJ + jj;
      if (kappa < S && nu < S) res.v[ob + st_off(kappa, nu)] = lam[m * CJ + jj];
    }
  }
}

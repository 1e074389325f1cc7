// ssm_scan forward and the two sweeps of ssm_scan_back (see csrc/ops/ssm.cpp for shapes,
// the packed layouts and the scratch layout).
//
// Work split: a "unit" is one state column block (sequence i, head h, channel p): the N
// states S[h, p, :]. Units of one group g are numbered u = (h - g * hpg) * P + p, so the
// units of a workgroup are consecutive in x, y and dt. A unit is held by NL lanes of one
// subgroup (a cluster), lane c holding states n = j * NL + c, j < NT, in registers. Sums
// over n (y_t, lam . B_t, ...) are xor-butterflies inside the cluster (fixed order: every
// lane gets the same bits). A workgroup holds UW units of one (sequence, group); B_t and
// C_t of the group and the per-unit x, dt (dy, y) are staged in shared memory TC tokens
// at a time.
//
// MODE 0 forward. MODE 1 backward with one decay per head (Mamba-2): forward sweep (states,
// anchors every K tokens, y_t, dC_t) then a reverse sweep (lam, dB_t, dx, d softplus(dt),
// dA) where the decay gradient g_t = a_t lam_t . S_{t-1} comes from Z_t = lam_t . S_t:
// Z_{t-1} = g_t + dy_{t-1} y_{t-1},  g_t = Z_t - u_t (lam_t . B_t), re-anchored exactly
// from a stored state every K tokens. MODE 2 backward with one decay per state (Mamba-1):
// checkpoints every K tokens; each segment is recomputed into scratch and walked in reverse.
// dB_t and dC_t are sums over the units of the group: reduced across the subgroup's units
// by xor-shuffles, across subgroups in shared memory (fixed order), one partial sum per
// workgroup written to scratch; ssm_scan_back_sum.comp adds the partials in order.
#version 450
#include "common.glsl"
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "ldf.glsl"  // the "_h" variant (-DHALF): dt, x, B, C in the dtypes DTDT .. CDT

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const int NL = 1;    // lanes per unit (power of two <= subgroup size)
layout(constant_id = 2) const int NT = 1;    // states per lane
layout(constant_id = 3) const int TC = 8;    // tokens per staged chunk
layout(constant_id = 4) const int MODE = 0;
layout(constant_id = 5) const int PERN = 0;  // A (H, N): one decay per state
layout(constant_id = 6) const int UW = 1;    // units per workgroup (local size = UW * NL)
layout(constant_id = 7) const int NRED = 1;  // most subgroups per workgroup (reduction buffer)
layout(constant_id = 8) const int DTDT = 0;  // dtypes of dt, x, B, C (float32, bfloat16,
layout(constant_id = 9) const int XDT = 0;   // float16; the "_h" variant reads them as
layout(constant_id = 10) const int BDT = 0;  // they are)
layout(constant_id = 11) const int CDT = 0;

const int NB = NL * NT;  // N rounded up

layout(push_constant) uniform PC {
  uvec2 gr;   // backward: packed (dy, d final state)
  uvec2 s, x, dt, A, B, C, ids;
  uvec2 out_;  // forward: packed (y, final state); backward: dx
  uvec2 scr, err;
  int R, S, T, H, P, N, G, nblk, K, nck;
} pc;

shared float sB[TC * NB];
shared float sC[TC * NB];
shared float sX[TC * UW];
shared float sD[TC * UW];   // softplus(dt)
shared float sDy[TC * UW];
shared float sY[TC * UW];
shared float red[NRED * TC * NB];

// softplus and its derivative as the CPU computes them (log1p by the atanh series).
float softplus(float z) {
  if (z > 20.0) return z;
  const float w = exp(-abs(z));
  const float s = w / (w + 2.0), s2 = s * s;
  float q = 1.0 / 13.0;
  q = q * s2 + 1.0 / 11.0;
  q = q * s2 + 1.0 / 9.0;
  q = q * s2 + 1.0 / 7.0;
  q = q * s2 + 1.0 / 5.0;
  q = q * s2 + 1.0 / 3.0;
  q = q * s2 + 1.0;
  return max(z, 0.0) + 2.0 * s * q;
}

// Sum over the NL lanes of this unit.
float cluster_sum(float v) {
  [[unroll]] for (int m = 1; m < NL; m *= 2) v += subgroupShuffleXor(v, uint(m));
  return v;
}

int lid, c, ul, i, g, blk, hpg, nst;
bool on;      // this lane's unit exists
int h, p;     // its head and channel
int unit0;    // first unit of the workgroup (in its group)

// Stages tokens [t0, t0 + TC) (rows past T are zero): B, C of the group, and per unit
// x, softplus(dt), and (backward) dy and the stored y.
void stage(int t0, bool want_c, bool want_dy, bool want_y) {
  FBuf gb = FBuf(pc.gr);
  const int WGS = UW * NL;
  for (int idx = lid; idx < TC * NB; idx += WGS) {
    const int tc = idx / NB, n = idx % NB, t = t0 + tc;
    const bool ok = t < pc.T && n < pc.N;
    const int off = ((i * pc.T + t) * pc.G + g) * pc.N + n;
    sB[idx] = ok ? ldf(pc.B, off, BDT) : 0.0;
    if (want_c) sC[idx] = ok ? ldf(pc.C, off, CDT) : 0.0;
  }
  const int U = hpg * pc.P;
  for (int idx = lid; idx < TC * UW; idx += WGS) {
    const int tc = idx / UW, uu = idx % UW, t = t0 + tc, u = unit0 + uu;
    const bool ok = t < pc.T && u < U;
    const int xo = (i * pc.T + t) * pc.H * pc.P + g * U + u;  // x[i, t, h(u), p(u)]
    sX[idx] = ok ? ldf(pc.x, xo, XDT) : 0.0;
    sD[idx] = ok ? softplus(ldf(pc.dt, (i * pc.T + t) * pc.H + g * hpg + u / pc.P, DTDT)) : 0.0;
    if (want_dy) sDy[idx] = ok ? gb.v[xo] : 0.0;
    if (want_y) sY[idx] = ok ? FBuf(pc.scr).v[nst * pc.nck + xo] : 0.0;
  }
}

// Adds this lane's values v (one per state) over the units of the workgroup for token
// slot tc: xor-shuffles across the units of the subgroup, then one row per subgroup in
// `red` (summed by flush()).
void reduce_units(inout float v[NT], int tc) {
  const int lim = min(int(gl_SubgroupSize), UW * NL);
  [[unroll]] for (int j = 0; j < NT; ++j)
    for (int m = NL; m < lim; m *= 2) v[j] += subgroupShuffleXor(v[j], uint(m));
  if (int(gl_SubgroupInvocationID) < NL)
    [[unroll]] for (int j = 0; j < NT; ++j) red[(int(gl_SubgroupID) * TC + tc) * NB + j * NL + c] = v[j];
}

// part[blk][i][t][g][n] = sum over subgroups of red, tokens [t0, t0 + TC) within [lo, hi).
void flush(int t0, int lo, int hi, uint part_off) {
  FBuf sc = FBuf(pc.scr);
  const int WGS = UW * NL, nsub = int(gl_NumSubgroups);
  for (int idx = lid; idx < TC * NB; idx += WGS) {
    const int tc = idx / NB, n = idx % NB, t = t0 + tc;
    if (t < lo || t >= hi || n >= pc.N) continue;
    float acc = 0.0;
    for (int sb = 0; sb < nsub; ++sb) acc += red[sb * TC * NB + idx];
    sc.v[part_off + uint(((blk * pc.S + i) * pc.T + t) * pc.G + g) * uint(pc.N) + uint(n)] = acc;
  }
}

void main() {
  lid = int(gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID);
  c = lid % NL;
  ul = lid / NL;
  const int wg = int(group_index());
  blk = wg % pc.nblk;
  const int ig = wg / pc.nblk;
  g = ig % pc.G;
  i = ig / pc.G;
  if (i >= pc.S) return;  // the whole workgroup: past the grid's end
  hpg = pc.H / pc.G;
  const int U = hpg * pc.P;
  unit0 = blk * UW;
  const int u = unit0 + ul;
  on = u < U;
  h = g * hpg + (on ? u / pc.P : 0);
  p = on ? u % pc.P : 0;
  nst = pc.S * pc.H * pc.P * pc.N;  // floats of one state per sequence set (S, H, P, N)
  const int NA = PERN != 0 ? pc.N : 1;

  int row = IBuf(pc.ids).v[i];
  const bool bad = row < 0 || row >= pc.R;
  if (bad) {
    if (lid == 0) set_error(pc.err, MODE == 0 ? ERR_SSM_SCAN : ERR_SSM_SCAN_BACK);
    row = 0;
  }

  // this lane's states: index into (.., H, P, N) arrays of unit (h, p)
  const int sbase = (h * pc.P + p) * pc.N;
  FBuf sb = FBuf(pc.s), Ab = FBuf(pc.A), ob = FBuf(pc.out_), sc = FBuf(pc.scr), gb = FBuf(pc.gr);
  float S[NT], Aj[NT];
  [[unroll]] for (int j = 0; j < NT; ++j) {
    const int n = j * NL + c;
    const bool ok = on && n < pc.N && !bad;
    S[j] = ok ? sb.v[row * pc.H * pc.P * pc.N + sbase + n] : 0.0;
    Aj[j] = (on && n < pc.N) ? Ab.v[h * NA + (PERN != 0 ? n : 0)] : 0.0;
  }
  const float Ah = Ab.v[h * NA];

  const int nx = pc.S * pc.T * pc.H * pc.P;  // elements of x (and y)
  const int xrow = pc.H * pc.P;               // x token stride

  // ---- forward ------------------------------------------------------------------------
  if (MODE == 0) {
    for (int t0 = 0; t0 < pc.T; t0 += TC) {
      barrier();
      stage(t0, true, false, false);
      barrier();
      const int tn = min(TC, pc.T - t0);
      for (int tc = 0; tc < tn; ++tc) {
        const float dtp = sD[tc * UW + ul], uu = sX[tc * UW + ul] * dtp;
        const float ah = exp(dtp * Ah);
        float yv = 0.0;
        [[unroll]] for (int j = 0; j < NT; ++j) {
          const int n = j * NL + c;
          const float a = PERN != 0 ? exp(dtp * Aj[j]) : ah;
          S[j] = S[j] * a + sB[tc * NB + n] * uu;
          yv += S[j] * sC[tc * NB + n];
        }
        yv = cluster_sum(yv);
        if (c == 0 && on) ob.v[(i * pc.T + t0 + tc) * xrow + h * pc.P + p] = bad ? 0.0 : yv;
      }
    }
    [[unroll]] for (int j = 0; j < NT; ++j) {
      const int n = j * NL + c;
      if (on && n < pc.N) ob.v[nx + i * pc.H * pc.P * pc.N + sbase + n] = bad ? 0.0 : S[j];
    }
    return;
  }

  // ---- backward: scratch layout (floats) ----------------------------------------------
  // ck [nck][S][H][P][N] | wk: MODE 1 y (S, T, H, P), MODE 2 segment states [K][S][H][P][N]
  // | dC parts [nblk][S][T][G][N] | dB parts (same) | d softplus(dt) (S, T, H, P)
  // | dA parts (S, H, P, NA) | d_s per sequence (S, H, P, N)
  const uint nbc = uint(pc.S * pc.T * pc.G * pc.N);
  const uint o_wk = uint(nst) * uint(pc.nck);
  const uint o_dc = o_wk + (MODE == 1 ? uint(nx) : uint(nst) * uint(pc.K));
  const uint o_db = o_dc + uint(pc.nblk) * nbc;
  const uint o_ddtp = o_db + uint(pc.nblk) * nbc;
  const uint o_da = o_ddtp + uint(nx);
  const uint o_dss = o_da + uint(pc.S * pc.H * pc.P * NA);
  const int st = i * pc.H * pc.P * pc.N + sbase;  // this unit's state in (S, H, P, N) arrays

  // Forward sweep: anchors / checkpoints (state before token kK), y (MODE 1), dC.
  for (int t0 = 0; t0 < pc.T; t0 += TC) {
    barrier();
    stage(t0, true, true, false);
    barrier();
    const int tn = min(TC, pc.T - t0);
    for (int tc = 0; tc < tn; ++tc) {
      const int t = t0 + tc;
      if (t % pc.K == 0)
        [[unroll]] for (int j = 0; j < NT; ++j) {
          const int n = j * NL + c;
          if (on && n < pc.N) sc.v[uint(t / pc.K) * uint(nst) + uint(st + n)] = S[j];
        }
      const float dtp = sD[tc * UW + ul], uu = sX[tc * UW + ul] * dtp, dyv = sDy[tc * UW + ul];
      const float ah = exp(dtp * Ah);
      float yv = 0.0, v[NT];
      [[unroll]] for (int j = 0; j < NT; ++j) {
        const int n = j * NL + c;
        const float a = PERN != 0 ? exp(dtp * Aj[j]) : ah;
        S[j] = S[j] * a + sB[tc * NB + n] * uu;
        yv += S[j] * sC[tc * NB + n];
        v[j] = dyv * S[j];
      }
      if (MODE == 1) {
        yv = cluster_sum(yv);
        if (c == 0 && on) sc.v[o_wk + uint((i * pc.T + t) * xrow + h * pc.P + p)] = yv;
      }
      reduce_units(v, tc);
    }
    barrier();
    flush(t0, 0, pc.T, o_dc);
  }

  // Reverse sweep.
  float lam[NT];
  [[unroll]] for (int j = 0; j < NT; ++j) {
    const int n = j * NL + c;
    lam[j] = (on && n < pc.N) ? gb.v[nx + st + n] : 0.0;
  }
  float dAacc[NT];
  [[unroll]] for (int j = 0; j < NT; ++j) dAacc[j] = 0.0;
  FBuf dxb = FBuf(pc.out_);

  if (MODE == 1) {
    float gprev = 0.0;
    for (int t1 = pc.T; t1 > 0;) {
      const int t0 = ((t1 - 1) / TC) * TC;
      barrier();
      stage(t0, true, true, true);
      barrier();
      for (int t = t1 - 1; t >= t0; --t) {
        const int tc = t - t0;
        const float dtp = sD[tc * UW + ul], xv = sX[tc * UW + ul], uu = xv * dtp;
        const float dyv = sDy[tc * UW + ul];
        const float ah = exp(dtp * Ah);
        [[unroll]] for (int j = 0; j < NT; ++j) lam[j] += dyv * sC[tc * NB + j * NL + c];
        float z;
        if (t == pc.T - 1 || (t + 1) % pc.K == 0) {
          // exact: lam_t . S_t from the final state or the anchor of token t + 1
          z = 0.0;
          const bool fin = t == pc.T - 1;
          [[unroll]] for (int j = 0; j < NT; ++j) {
            const int n = j * NL + c;
            const float sv = fin ? S[j] : ((on && n < pc.N) ? sc.v[uint((t + 1) / pc.K) * uint(nst) + uint(st + n)] : 0.0);
            z += lam[j] * sv;
          }
          z = cluster_sum(z);
        } else {
          z = gprev + dyv * sY[tc * UW + ul];
        }
        float du = 0.0, v[NT];
        [[unroll]] for (int j = 0; j < NT; ++j) {
          du += lam[j] * sB[tc * NB + j * NL + c];
          v[j] = lam[j] * uu;
        }
        du = cluster_sum(du);
        const float gt = z - uu * du;
        if (c == 0 && on) {
          const int xo = (i * pc.T + t) * xrow + h * pc.P + p;
          dxb.v[xo] = bad ? 0.0 : du * dtp;
          sc.v[o_ddtp + uint(xo)] = bad ? 0.0 : du * xv + gt * Ah;
        }
        dAacc[0] += gt * dtp;
        reduce_units(v, tc);
        [[unroll]] for (int j = 0; j < NT; ++j) lam[j] *= ah;
        gprev = gt;
      }
      barrier();
      flush(t0, t0, t1, o_db);
      t1 = t0;
    }
  } else {
    const int K = pc.K;
    for (int k = pc.nck - 1; k >= 0; --k) {
      const int ts = k * K, te = min(pc.T, ts + K);
      // recompute the segment's states into wk[t - ts]
      [[unroll]] for (int j = 0; j < NT; ++j) {
        const int n = j * NL + c;
        S[j] = (on && n < pc.N) ? sc.v[uint(k) * uint(nst) + uint(st + n)] : 0.0;
      }
      for (int t0 = ts; t0 < te; t0 += TC) {
        barrier();
        stage(t0, false, false, false);
        barrier();
        const int tn = min(TC, te - t0);
        for (int tc = 0; tc < tn; ++tc) {
          const float dtp = sD[tc * UW + ul], uu = sX[tc * UW + ul] * dtp;
          const float ah = exp(dtp * Ah);
          [[unroll]] for (int j = 0; j < NT; ++j) {
            const int n = j * NL + c;
            const float a = PERN != 0 ? exp(dtp * Aj[j]) : ah;
            S[j] = S[j] * a + sB[tc * NB + n] * uu;
            if (on && n < pc.N) sc.v[o_wk + uint(t0 + tc - ts) * uint(nst) + uint(st + n)] = S[j];
          }
        }
      }
      // walk it in reverse
      for (int t1 = te; t1 > ts;) {
        const int t0 = max(ts, ((t1 - 1) / TC) * TC);
        barrier();
        stage(t0, true, true, false);
        barrier();
        for (int t = t1 - 1; t >= t0; --t) {
          const int tc = t - t0;
          const float dtp = sD[tc * UW + ul], xv = sX[tc * UW + ul], uu = xv * dtp;
          const float dyv = sDy[tc * UW + ul];
          const float ah = exp(dtp * Ah);
          float du = 0.0, dd = 0.0, v[NT];
          [[unroll]] for (int j = 0; j < NT; ++j) {
            const int n = j * NL + c;
            const bool ok = on && n < pc.N;
            const uint po = t > ts ? o_wk + uint(t - 1 - ts) * uint(nst) : uint(k) * uint(nst);
            const float sp = ok ? sc.v[po + uint(st + n)] : 0.0;
            lam[j] += dyv * sC[tc * NB + n];
            du += lam[j] * sB[tc * NB + n];
            v[j] = lam[j] * uu;
            const float a = PERN != 0 ? exp(dtp * Aj[j]) : ah;
            const float da = lam[j] * sp * a;
            dAacc[j] += da * dtp;
            dd += da * (PERN != 0 ? Aj[j] : Ah);
            lam[j] *= a;
          }
          du = cluster_sum(du);
          dd = cluster_sum(dd);
          if (c == 0 && on) {
            const int xo = (i * pc.T + t) * xrow + h * pc.P + p;
            dxb.v[xo] = bad ? 0.0 : du * dtp;
            sc.v[o_ddtp + uint(xo)] = bad ? 0.0 : du * xv + dd;
          }
          reduce_units(v, t - t0);
        }
        barrier();
        flush(t0, t0, t1, o_db);
        t1 = t0;
      }
    }
  }

  // d_s of this sequence and the dA parts.
  [[unroll]] for (int j = 0; j < NT; ++j) {
    const int n = j * NL + c;
    if (on && n < pc.N) sc.v[o_dss + uint(st + n)] = bad ? 0.0 : lam[j];
  }
  const int dabase = ((i * pc.H + h) * pc.P + p) * NA;
  if (PERN != 0) {
    [[unroll]] for (int j = 0; j < NT; ++j) {
      const int n = j * NL + c;
      if (on && n < pc.N) sc.v[o_da + uint(dabase + n)] = bad ? 0.0 : dAacc[j];
    }
  } else {
    float tot = 0.0;
    if (MODE == 1) {
      tot = dAacc[0];  // already the unit's total (g_t is a cluster sum)
    } else {
      [[unroll]] for (int j = 0; j < NT; ++j) tot += dAacc[j];
      tot = cluster_sum(tot);
    }
    if (c == 0 && on) sc.v[o_da + uint(dabase)] = bad ? 0.0 : tot;
  }
}

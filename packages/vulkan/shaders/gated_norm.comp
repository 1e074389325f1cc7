// gated_rms_norm and gated_rms_norm_back (csrc/ops/fused.cpp): Mamba-2's output norm.
//   u = y + x D[c / P] (HAS_X), h = u silu(z) (HAS_Z), out = h r w with
//   r = 1 / sqrt(mean over the row's group of gs channels of h^2 + EPS)
// y, z, x (R rows of C; rows as (n0, n1) with a stride each, any channel stride), w (C,),
// D (H,) with P = C / H; g (the backward's grad) and out dense. A "unit" is one (row, group):
// R * C / gs of them.
//   OP 0 forward   per unit: r, then out
//      1 stats     per unit: st[2u] = r, st[2u + 1] = c1 = r <g w, h> / gs      (scratch)
//      2 rows      per (block of TB rows, channel): dy, dz, dx of each row, and partial
//                  sums pw[p, c] = sum g n, pd[p, c] = sum du x (n = h r)
//      3 reduce    dw[c] = sum_p pw[p, c]; pdc[c] = sum_p pd[p, c]  (fixed order)
//      4 dD        dD[h] = sum over the head's P channels of pdc
// OP 0/1: WIDE (gs >= 64) one workgroup per unit, its 256 threads stride over the group and
// sum in shared memory; else one thread per unit. TB = max(32, ceil(R / 16384)) rows per
// block (the host uses the same rule): every loop stays below lavapipe's 65535 iterations.
// The "_h" variant (-DHALF) reads y, z, w, x, D and g in the dtypes YDT .. GDT (float32,
// bfloat16 or float16: ldf.glsl), computing and writing float32 as the float32 one does.
#version 450
#include "common.glsl"
#include "ldf.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;
layout(constant_id = 1) const int HAS_Z = 0;
layout(constant_id = 2) const int HAS_X = 0;
layout(constant_id = 3) const float EPS = 1e-5;
layout(constant_id = 4) const int WIDE = 1;
layout(constant_id = 5) const int YDT = 0;
layout(constant_id = 6) const int ZDT = 0;
layout(constant_id = 7) const int WDT = 0;
layout(constant_id = 8) const int XDT = 0;
layout(constant_id = 9) const int DDT = 0;
layout(constant_id = 10) const int GDT = 0;
layout(constant_id = 11) const int ODT = 0;  // the forward's output dtype (_h: 2-byte allowed)

layout(push_constant) uniform PC {
  uvec2 y, z, w, x, d, g, out_, aux;  // aux: stats (2 per unit), then pw, pd, pdc
  int R, C, gs, n1, P, ws, ds;
  int ys0, ys1, ysc, zs0, zs1, zsc, xs0, xs1, xsc;
} pc;

shared float red_a[256], red_b[256];

int n_units() { return pc.R * (pc.C / pc.gs); }
int rows_per_block() { return max(32, (pc.R + 16383) / 16384); }
int n_blocks() { return (pc.R + rows_per_block() - 1) / rows_per_block(); }

// Offsets of row r's element c in y, z, x.
ivec3 offsets(int r, int c) {
  const int i0 = r / pc.n1, i1 = r % pc.n1;
  return ivec3(i0 * pc.ys0 + i1 * pc.ys1 + c * pc.ysc, i0 * pc.zs0 + i1 * pc.zs1 + c * pc.zsc,
               i0 * pc.xs0 + i1 * pc.xs1 + c * pc.xsc);
}

float u_at(ivec3 o, int c) {
  float u = ldf(pc.y, o.x, YDT);
  if (HAS_X != 0) u += ldf(pc.x, o.z, XDT) * ldf(pc.d, (c / pc.P) * pc.ds, DDT);
  return u;
}

float sigmoid(float v) { return 1.0 / (1.0 + exp(-v)); }

// h of row r, channel c
float h_at(int r, int c) {
  const ivec3 o = offsets(r, c);
  float h = u_at(o, c);
  if (HAS_Z != 0) {
    const float zv = ldf(pc.z, o.y, ZDT);
    h *= zv * sigmoid(zv);
  }
  return h;
}

// Partial sums of h^2 and g w h over the channels first, first + step, ... of unit's group;
// the forward keeps h in its output row (finish_unit scales it in place: each invocation
// rereads only what it wrote).
void unit_sums(int unit, int first, int step, out float ss, out float gwh) {
  const int ng = pc.C / pc.gs, r = unit / ng, c0 = (unit % ng) * pc.gs;
  FBuf out_ = FBuf(pc.out_);
  ss = 0.0;
  gwh = 0.0;
  for (int j = first; j < pc.gs; j += step) {
    const float h = h_at(r, c0 + j);
    ss += h * h;
    if (OP == 0 && ODT == DT_F32_) out_.v[r * pc.C + c0 + j] = h;  // scaled in finish_unit
    if (OP == 1) gwh += ldf(pc.g, r * pc.C + c0 + j, GDT) * ldf(pc.w, (c0 + j) * pc.ws, WDT) * h;
  }
}

float inv_rms(float ss) { return 1.0 / sqrt(ss / float(pc.gs) + EPS); }

// The unit's r (and c1), then (forward) its outputs over first, first + step, ...
void finish_unit(int unit, int first, int step, float ss, float gwh) {
  const float rr = inv_rms(ss);
  if (OP == 1) {
    if (first == 0) {
      FBuf st = FBuf(pc.aux);
      st.v[2 * unit] = rr;
      st.v[2 * unit + 1] = rr * gwh / float(pc.gs);
    }
    return;
  }
  const int ng = pc.C / pc.gs, r = unit / ng, c0 = (unit % ng) * pc.gs;
  FBuf out_ = FBuf(pc.out_);
  for (int j = first; j < pc.gs; j += step) {
    const int e = r * pc.C + c0 + j;
#ifdef HALF
    if (ODT != DT_F32_) {  // a 2-byte output cannot hold h: computed again, rounded once
      st(pc.out_, uint(e), ODT, h_at(r, c0 + j) * rr * ldf(pc.w, (c0 + j) * pc.ws, WDT));
      continue;
    }
#endif
    out_.v[e] = out_.v[e] * rr * ldf(pc.w, (c0 + j) * pc.ws, WDT);
  }
}

void main() {
  const int lid = int(gl_LocalInvocationID.x);
  if (OP <= 1) {
    float ss, gwh;
    if (WIDE != 0) {
      const int unit = int(group_index());
      if (unit >= n_units()) return;  // uniform over the workgroup
      unit_sums(unit, lid, 256, ss, gwh);
      red_a[lid] = ss;
      if (OP == 1) red_b[lid] = gwh;
      barrier();
      [[unroll]] for (int h = 128; h > 0; h /= 2) {
        if (lid < h) {
          red_a[lid] += red_a[lid + h];
          if (OP == 1) red_b[lid] += red_b[lid + h];
        }
        barrier();
      }
      finish_unit(unit, lid, 256, red_a[0], red_b[0]);
    } else {
      const int unit = int(group_index()) * 256 + lid;
      if (unit >= n_units()) return;
      unit_sums(unit, 0, 1, ss, gwh);
      finish_unit(unit, 0, 1, ss, gwh);
    }
    return;
  }
  const int ng = pc.C / pc.gs, nb = n_blocks(), TB = rows_per_block();
  const int RC = pc.R * pc.C;
  FBuf aux = FBuf(pc.aux);
  const int o_pw = 2 * n_units(), o_pd = o_pw + nb * pc.C, o_pdc = o_pd + nb * pc.C;
  // the packed output: dy, [dz], dw, [dx, dD]
  const int o_dz = RC, o_dw = (HAS_Z != 0 ? 2 : 1) * RC, o_dx = o_dw + pc.C, o_dd = o_dx + RC;
  FBuf out_ = FBuf(pc.out_);
  if (OP == 2) {
    const int c = int(gl_WorkGroupID.x) * 256 + lid, p = int(gl_WorkGroupID.y);
    if (c >= pc.C) return;
    const float wv = ldf(pc.w, c * pc.ws, WDT);
    const float dv = HAS_X != 0 ? ldf(pc.d, (c / pc.P) * pc.ds, DDT) : 0.0;
    float pw = 0.0, pd = 0.0;
    const int r1 = min(pc.R, (p + 1) * TB);
    for (int r = p * TB; r < r1; ++r) {
      const ivec3 o = offsets(r, c);
      const int unit = r * ng + c / pc.gs;
      const float rr = aux.v[2 * unit], c1 = aux.v[2 * unit + 1];
      const float u = u_at(o, c);
      float sg = 1.0, s = 1.0, zv = 0.0;
      if (HAS_Z != 0) {
        zv = ldf(pc.z, o.y, ZDT);
        sg = sigmoid(zv);
        s = zv * sg;
      }
      const float gv = ldf(pc.g, r * pc.C + c, GDT);
      const float nv = u * s * rr;
      const float dh = rr * (gv * wv - nv * c1);
      const float du = dh * s;
      out_.v[r * pc.C + c] = du;
      if (HAS_Z != 0) out_.v[o_dz + r * pc.C + c] = dh * u * sg * (1.0 + zv * (1.0 - sg));
      pw += gv * nv;
      if (HAS_X != 0) {
        out_.v[o_dx + r * pc.C + c] = du * dv;
        pd += du * ldf(pc.x, o.z, XDT);
      }
    }
    aux.v[o_pw + p * pc.C + c] = pw;
    if (HAS_X != 0) aux.v[o_pd + p * pc.C + c] = pd;
    return;
  }
  const int stride = int(gl_NumWorkGroups.x) * 256;
  if (OP == 3) {
    for (int c = int(gl_GlobalInvocationID.x); c < pc.C; c += stride) {
      float a = 0.0, b = 0.0;
      for (int p = 0; p < nb; ++p) {
        a += aux.v[o_pw + p * pc.C + c];
        if (HAS_X != 0) b += aux.v[o_pd + p * pc.C + c];
      }
      out_.v[o_dw + c] = a;
      if (HAS_X != 0) aux.v[o_pdc + c] = b;
    }
    return;
  }
  // OP 4: dD, one thread per head
  const int H = pc.P > 0 ? pc.C / pc.P : 0;
  for (int hh = int(gl_GlobalInvocationID.x); hh < H; hh += stride) {
    float a = 0.0;
    for (int c = hh * pc.P; c < (hh + 1) * pc.P; ++c) a += aux.v[o_pdc + c];
    out_.v[o_dd + hh] = a;
  }
}

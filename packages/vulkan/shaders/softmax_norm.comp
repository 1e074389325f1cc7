// Ops along the last axis of dense (rows, C) tensors, one workgroup per row: softmax,
// log_softmax, rms_norm, layer_norm, their *_back kernels, and the per-row parts of
// cross_entropy. The formulas are those of the core's nn.cpp.
//   OP 0 softmax(x)            y = exp(x - max) / sum
//      1 log_softmax(x)        y = x - max - log(sum exp(x - max))
//      2 softmax_back(g, y)    dx = y (g - sum(g y))             (x holds y)
//      3 log_softmax_back(g,y) dx = g - exp(y) sum(g)            (x holds y)
//      4 rms_norm(x)           y = x / sqrt(mean(x^2) + eps)
//      5 rms_norm_back(g, x)   dx = r g - x r^3 sum(g x) / C
//      6 layer_norm(x)         y = (x - mu) r, r = 1 / sqrt(var + eps)
//      7 layer_norm_back(g, x) dx = r (g - mean(g) - (x - mu) r mean(g (x - mu)) r)
//      8 cross_entropy rows    y[row] = logsumexp(x) - x[t[row]]  (y: per-row losses)
//      9 cross_entropy_back    dx = (softmax(x) - onehot(t)) g[0] / rows
// HALF (the softmax_norm_h variant, ops 0-9): x, g and y of the dtypes XDT, GDT, YDT
// (half.glsl), the maths float32, each output rounded once (8, 9: cross_entropy's 2-byte
// logits read as they are, RECURRA_OPS_HALF_IN; 9 writes their gradient in their dtype).
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#endif

layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;
#ifdef HALF
layout(constant_id = 1) const int XDT = 0;
layout(constant_id = 2) const int GDT = 0;
layout(constant_id = 3) const int YDT = 0;
#endif

layout(push_constant) uniform PC {
  uvec2 x, g, y, t, err;
  uint rows, C;
  float eps;
} pc;

#ifdef HALF
float ldx(uint i) { return ld(pc.x, i, XDT); }
float ldg(uint i) { return ld(pc.g, i, GDT); }
void sty(uint i, float v) { st(pc.y, i, YDT, v); }
#else  // the float32 module: the buffers of main(), as before the HALF variant
#define ldx(i) x.v[i]
#define ldg(i) g.v[i]
#define sty(i, val) y.v[i] = (val)
#endif

shared float red[256], red2[256];
const uint U = 16u;  // loads in flight per thread in cross-entropy's passes over a row

float wg_sum(float v) {
  const uint t = gl_LocalInvocationID.x;
  red[t] = v;
  barrier();
  [[unroll]] for (uint w = 128u; w > 0u; w >>= 1) {
    if (t < w) red[t] += red[t + w];
    barrier();
  }
  const float r = red[0];
  barrier();
  return r;
}

// The running maximum m and sum s of exp(v - m) of the values seen, one more value v taken
// in (online: s rescaled when the maximum grows). -inf adds nothing; NaN makes both NaN.
void online(inout float m, inout float s, float v) {
  if (isnan(v)) {
    m = v;
    s = v;
  } else if (v > m) {
    s = s * exp(m - v) + 1.0;  // the first value: m = -inf, s = 0
    m = v;
  } else if (!isinf(v) || v > 0.0) {
    s += exp(v - m);
  }
}

// (m, s) of the workgroup's threads combined: the row's maximum and sum of exp(x - max).
vec2 wg_online(float m, float s) {
  const uint t = gl_LocalInvocationID.x;
  red[t] = m;
  red2[t] = s;
  barrier();
  [[unroll]] for (uint w = 128u; w > 0u; w >>= 1) {
    if (t < w) {
      const float ma = red[t], mb = red[t + w], sa = red2[t], sb = red2[t + w];
      const float mm = max_nan(ma, mb);
      red[t] = mm;
      // a side without values (s 0, m -inf) adds nothing (exp(-inf - -inf) would be NaN)
      red2[t] = (sa == 0.0 ? 0.0 : sa * exp(ma - mm)) + (sb == 0.0 ? 0.0 : sb * exp(mb - mm));
    }
    barrier();
  }
  const vec2 r = vec2(red[0], red2[0]);
  barrier();
  return r;
}

void main() {
  const uint row = group_index();
  if (row >= pc.rows) return;
  const uint C = pc.C, t = gl_LocalInvocationID.x, base = row * C;
#ifndef HALF
  FBuf x = FBuf(pc.x), g = FBuf(pc.g), y = FBuf(pc.y);
#endif
  const float n = float(C);

  if (OP == 0 || OP == 1 || OP == 8 || OP == 9) {
    // One pass for the maximum and the sum (online), U loads in flight per thread (a row
    // of a 50k vocabulary is 12 rounds of loads, not 196 one after the other).
    const float ninf = uintBitsToFloat(0xff800000u);
    float m = ninf, s = 0.0;
    for (uint i = t; i < C; i += 256u * U) {
      float v[U];
      [[unroll]] for (uint j = 0u; j < U; ++j) v[j] = i + 256u * j < C ? ldx(base + i + 256u * j) : ninf;
      [[unroll]] for (uint j = 0u; j < U; ++j) online(m, s, v[j]);
    }
    const vec2 ms = wg_online(m, s);
    m = ms.x;
    s = ms.y;
    if (OP == 0) {
      const float inv = 1.0 / s;
      for (uint i = t; i < C; i += 256u) sty(base + i, exp(ldx(base + i) - m) * inv);
    } else if (OP == 1) {
      const float lse = m + log(s);
      for (uint i = t; i < C; i += 256u) sty(base + i, ldx(base + i) - lse);
    } else {
      const int tv = IBuf(pc.t).v[row];
      const bool ok = tv >= 0 && uint(tv) < C;
      if (!ok && t == 0u) set_error(pc.err, OP == 8 ? ERR_CROSS_ENTROPY : ERR_CROSS_ENTROPY_BACK);
      if (OP == 8) {
        if (t == 0u) sty(row, ok ? m + log(s) - ldx(base + uint(tv)) : 0.0);
      } else {
        // y may be x itself (the planner lets the gradient take the logits' memory): each
        // invocation reads its elements before it writes them, after the passes above.
        const float gs = ldg(0) / float(pc.rows);
        const float sc = gs / s;
        for (uint i = t; i < C; i += 256u * U) {
          float v[U];
          [[unroll]] for (uint j = 0u; j < U; ++j) v[j] = i + 256u * j < C ? ldx(base + i + 256u * j) : 0.0;
          [[unroll]] for (uint j = 0u; j < U; ++j) {
            const uint k = i + 256u * j;
            float d = exp(v[j] - m) * sc;
            if (ok && k == uint(tv)) d -= gs;
            if (k < C) sty(base + k, ok ? d : 0.0);
          }
        }
      }
    }
  } else if (OP == 2) {
    float d = 0.0;
    for (uint i = t; i < C; i += 256u) d += ldg(base + i) * ldx(base + i);
    d = wg_sum(d);
    for (uint i = t; i < C; i += 256u) sty(base + i, ldx(base + i) * (ldg(base + i) - d));
  } else if (OP == 3) {
    float s = 0.0;
    for (uint i = t; i < C; i += 256u) s += ldg(base + i);
    s = wg_sum(s);
    for (uint i = t; i < C; i += 256u) sty(base + i, ldg(base + i) - exp(ldx(base + i)) * s);
  } else if (OP == 4 || OP == 5) {
    float ss = 0.0;
    for (uint i = t; i < C; i += 256u) {
      const float v = ldx(base + i);
      ss += v * v;
    }
    const float r = 1.0 / sqrt(wg_sum(ss) / n + pc.eps);
    if (OP == 4) {
      for (uint i = t; i < C; i += 256u) sty(base + i, ldx(base + i) * r);
    } else {
      float dot = 0.0;
      for (uint i = t; i < C; i += 256u) dot += ldg(base + i) * ldx(base + i);
      const float cx = r * r * r * wg_sum(dot) / n;
      for (uint i = t; i < C; i += 256u) sty(base + i, r * ldg(base + i) - cx * ldx(base + i));
    }
  } else {  // 6, 7: layer_norm and its backward
    float s = 0.0;
    for (uint i = t; i < C; i += 256u) s += ldx(base + i);
    const float mu = wg_sum(s) / n;
    float vs = 0.0;
    for (uint i = t; i < C; i += 256u) {
      const float d = ldx(base + i) - mu;
      vs += d * d;
    }
    const float r = 1.0 / sqrt(wg_sum(vs) / n + pc.eps);
    if (OP == 6) {
      for (uint i = t; i < C; i += 256u) sty(base + i, (ldx(base + i) - mu) * r);
    } else {
      float sg = 0.0, sgx = 0.0;
      for (uint i = t; i < C; i += 256u) {
        const float gv = ldg(base + i);
        sg += gv;
        sgx += gv * (ldx(base + i) - mu);
      }
      const float a = wg_sum(sg) / n;
      const float b = wg_sum(sgx) * r / n;
      const float rb = r * b;
      for (uint i = t; i < C; i += 256u)
        sty(base + i, r * (ldg(base + i) - a - (ldx(base + i) - mu) * rb));
    }
  }
}

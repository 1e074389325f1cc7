// Inclusive prefix sums along one axis of a dense tensor seen as (O, L, I).
//   MODE 0 (I == 1, the last axis, or a long axis): one workgroup per (o, i) line, a
//          shared-memory scan per chunk of 256 elements carried across chunks
//   MODE 1 (I > 1, a short axis): one thread per (o, i) column walking L in order (the
//          CPU's order). Not for long axes: lavapipe ends the loops of one invocation after
//          65535 iterations in all, silently (the host picks MODE 0 past 16384).
//   REVERSE: sums from the end of the axis
//   HALF (the cumsum_h variant): x and y of the dtypes XDT / YDT (half.glsl), the running
//   sums float32, each output rounded once
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#endif

layout(local_size_x = 256) in;
layout(constant_id = 0) const int MODE = 0;
layout(constant_id = 1) const int REVERSE = 0;
#ifdef HALF
layout(constant_id = 2) const int XDT = 0;
layout(constant_id = 3) const int YDT = 0;
#endif

layout(push_constant) uniform PC {
  uvec2 x, y;
  uint O, L, I;
} pc;

#ifdef HALF
float ldx(uint i) { return ld(pc.x, i, XDT); }
void sty(uint i, float v) { st(pc.y, i, YDT, v); }
#else  // the float32 module: the buffers of main(), as before the HALF variant
#define ldx(i) x.v[i]
#define sty(i, val) y.v[i] = (val)
#endif

shared float sh[256];

void main() {
#ifndef HALF
  FBuf x = FBuf(pc.x), y = FBuf(pc.y);
#endif
  if (MODE == 1) {
    const uint stride = gl_NumWorkGroups.x * 256u;
    const uint cols = pc.O * pc.I;
    for (uint c = gl_GlobalInvocationID.x; c < cols; c += stride) {
      const uint o = c / pc.I, i = c % pc.I;
      const uint base = o * pc.L * pc.I + i;
      float acc = 0.0;
      for (uint k = 0u; k < pc.L; ++k) {
        const uint l = REVERSE != 0 ? pc.L - 1u - k : k;
        acc += ldx(base + l * pc.I);
        sty(base + l * pc.I, acc);
      }
    }
    return;
  }
  const uint line = group_index();
  if (line >= pc.O * pc.I) return;
  const uint t = gl_LocalInvocationID.x;
  const uint base = (line / pc.I) * pc.L * pc.I + line % pc.I;
  float carry = 0.0;
  for (uint c0 = 0u; c0 < pc.L; c0 += 256u) {
    const uint k = c0 + t;
    const uint l = REVERSE != 0 ? pc.L - 1u - k : k;
    sh[t] = k < pc.L ? ldx(base + l * pc.I) : 0.0;
    barrier();
    [[unroll]] for (uint off = 1u; off < 256u; off <<= 1) {
      const float add = t >= off ? sh[t - off] : 0.0;
      barrier();
      sh[t] += add;
      barrier();
    }
    if (k < pc.L) sty(base + l * pc.I, carry + sh[t]);
    carry += sh[255];
    barrier();
  }
}

// grad_norm on the device (csrc/ops/optim.cpp), in two passes whose summation order depends
// on the shapes only (deterministic):
//   PASS 0: workgroup w of one gradient writes partial[base + w] = sum over its grid-stride
//           share of clamp(g * grad_scale, +-clip)^2 (RAW: g^2 of g[0] alone: the combine
//           mode, whose sources are earlier [norm, coef] results).
//   PASS 1: one workgroup sums partial[0 .. count) and writes [norm, coef] to out.
#version 450
#include "common.glsl"
#define RECURRA_GLSL
#include "recurra/op_spec.h"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int PASS = 0;

layout(push_constant) uniform PC {
  uvec2 hyper, x, partial, out_;
  uint n;      // PASS 0: elements of x; PASS 1: number of partials
  uint base;   // PASS 0: index of this gradient's first partial
  uint raw;    // PASS 0: 1 = square x[0] as it is (combine mode)
} pc;

shared float red[256];

float hyp(int slot) {
  FBuf h = FBuf(pc.hyper);
  return h.v[2 * slot] + h.v[2 * slot + 1];
}

float tree(float v) {
  const uint t = gl_LocalInvocationID.x;
  red[t] = v;
  barrier();
  [[unroll]] for (uint w = 128u; w > 0u; w >>= 1) {
    if (t < w) red[t] += red[t + w];
    barrier();
  }
  return red[0];
}

void main() {
  FBuf part = FBuf(pc.partial);
  if (PASS == 0) {
    FBuf x = FBuf(pc.x);
    float acc = 0.0;
    if (pc.raw != 0u) {
      if (gl_GlobalInvocationID.x == 0u) acc = x.v[0] * x.v[0];
    } else {
      const float pre = hyp(RECURRA_HYPER_GRAD_SCALE);
      const float cv = hyp(RECURRA_HYPER_CLIP_VALUE);
      const float clip = cv > 0.0 ? cv : uintBitsToFloat(0x7f800000u);
      const uint stride = gl_NumWorkGroups.x * 256u;
      for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        const float v = min(max(x.v[i] * pre, -clip), clip);
        acc += v * v;
      }
    }
    const float s = tree(acc);
    if (gl_LocalInvocationID.x == 0u) part.v[pc.base + gl_WorkGroupID.x] = s;
    return;
  }
  float acc = 0.0;
  for (uint i = gl_LocalInvocationID.x; i < pc.n; i += 256u) acc += part.v[i];
  const float s = tree(acc);
  if (gl_LocalInvocationID.x == 0u) {
    const float norm = sqrt(s);
    const float max_norm = hyp(RECURRA_HYPER_MAX_NORM);
    float coef = 1.0;
    if (max_norm > 0.0) coef = min(1.0, max_norm / (norm + 1e-6));
    FBuf o = FBuf(pc.out_);
    o.v[0] = norm;
    o.v[1] = coef;
  }
}

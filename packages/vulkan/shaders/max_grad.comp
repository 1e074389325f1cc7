// max_grad(g, x, m; axis): dx = g at the first position along the axis where x equals the
// max m (or is NaN when m is NaN), 0 elsewhere. All dense; x seen as (O, L, I) around the
// axis; one thread per (o, i).
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform PC {
  uvec2 g, x, m, d;
  uint O, L, I;
} pc;

void main() {
  FBuf g = FBuf(pc.g), x = FBuf(pc.x), m = FBuf(pc.m), d = FBuf(pc.d);
  const uint stride = gl_NumWorkGroups.x * 256u;
  const uint K = pc.O * pc.I;
  for (uint k = gl_GlobalInvocationID.x; k < K; k += stride) {
    const uint base = (k / pc.I) * pc.L * pc.I + k % pc.I;
    const float mv = m.v[k];
    uint first = pc.L;
    for (uint l = 0u; l < pc.L; ++l) {
      const float xv = x.v[base + l * pc.I];
      if (xv == mv || (isnan(mv) && isnan(xv))) {
        first = l;
        break;
      }
    }
    const float gv = g.v[k];
    for (uint l = 0u; l < pc.L; ++l) d.v[base + l * pc.I] = l == first ? gv : 0.0;
  }
}

// max_grad(g, x, m; axis): dx = g at the first position along the axis where x equals the
// max m (or is NaN when m is NaN), 0 elsewhere. All dense; x seen as (O, L, I) around the
// axis, k = o * I + i. Three passes, each a grid-stride loop over elements (no thread walks
// the axis: lavapipe ends any invocation's loops after 65535 iterations in all, so a walk of
// an axis longer than that stopped early, silently):
//   PASS 0: first[k] = L                         (K threads' worth)
//   PASS 1: first[k] = min l where x matches m   (integer atomicMin, over O * L * I)
//   PASS 2: dx = l == first[k] ? g[k] : 0        (over O * L * I)
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int PASS = 0;

layout(push_constant) uniform PC {
  uvec2 g, x, m, d, first;
  uint O, L, I;
} pc;

void main() {
  UBuf first = UBuf(pc.first);
  const uint stride = gl_NumWorkGroups.x * 256u;
  const uint K = pc.O * pc.I;
  if (PASS == 0) {
    for (uint k = gl_GlobalInvocationID.x; k < K; k += stride) first.v[k] = pc.L;
    return;
  }
  FBuf g = FBuf(pc.g), x = FBuf(pc.x), m = FBuf(pc.m), d = FBuf(pc.d);
  const uint n = K * pc.L;
  for (uint e = gl_GlobalInvocationID.x; e < n; e += stride) {
    const uint i = e % pc.I, ol = e / pc.I;
    const uint l = ol % pc.L, k = (ol / pc.L) * pc.I + i;
    if (PASS == 1) {
      const float xv = x.v[e], mv = m.v[k];
      if (xv == mv || (isnan(mv) && isnan(xv))) atomicMin(first.v[k], l);
    } else {
      d.v[e] = l == first.v[k] ? g.v[k] : 0.0;
    }
  }
}

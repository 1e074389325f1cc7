// max_grad(g, x, m; axis): dx = g at the first position along the axis where x equals the
// max m (or is NaN when m is NaN), 0 elsewhere. All dense; x seen as (O, L, I) around the
// axis, k = o * I + i. Three passes, each a grid-stride loop over elements (no thread walks
// the axis: lavapipe ends any invocation's loops after 65535 iterations in all, so a walk of
// an axis longer than that stopped early, silently):
//   PASS 0: first[k] = L                         (K threads' worth)
//   PASS 1: first[k] = min l where x matches m   (integer atomicMin, over O * L * I)
//   PASS 2: dx = l == first[k] ? g[k] : 0        (over O * L * I)
// HALF (the max_grad_h variant): g, x, m, dx of the dtypes GDT, XDT, MDT, DDT (half.glsl),
// compared and stored through float32 (exact: a 2-byte value is a float32 one).
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#endif

layout(local_size_x = 256) in;
layout(constant_id = 0) const int PASS = 0;
#ifdef HALF
layout(constant_id = 1) const int GDT = 0;
layout(constant_id = 2) const int XDT = 0;
layout(constant_id = 3) const int MDT = 0;
layout(constant_id = 4) const int DDT = 0;
#endif

layout(push_constant) uniform PC {
  uvec2 g, x, m, d, first;
  uint O, L, I;
} pc;

#ifdef HALF
float ldg(uint i) { return ld(pc.g, i, GDT); }
float ldx(uint i) { return ld(pc.x, i, XDT); }
float ldm(uint i) { return ld(pc.m, i, MDT); }
void std_(uint i, float v) { st(pc.d, i, DDT, v); }
#else
float ldg(uint i) { return FBuf(pc.g).v[i]; }
float ldx(uint i) { return FBuf(pc.x).v[i]; }
float ldm(uint i) { return FBuf(pc.m).v[i]; }
void std_(uint i, float v) { FBuf(pc.d).v[i] = v; }
#endif

void main() {
  UBuf first = UBuf(pc.first);
  const uint stride = gl_NumWorkGroups.x * 256u;
  const uint K = pc.O * pc.I;
  if (PASS == 0) {
    for (uint k = gl_GlobalInvocationID.x; k < K; k += stride) first.v[k] = pc.L;
    return;
  }
  const uint n = K * pc.L;
  for (uint e = gl_GlobalInvocationID.x; e < n; e += stride) {
    const uint i = e % pc.I, ol = e / pc.I;
    const uint l = ol % pc.L, k = (ol / pc.L) * pc.I + i;
    if (PASS == 1) {
      const float xv = ldx(e), mv = ldm(k);
      if (xv == mv || (isnan(mv) && isnan(xv))) atomicMin(first.v[k], l);
    } else {
      std_(e, l == first.v[k] ? ldg(k) : 0.0);
    }
  }
}

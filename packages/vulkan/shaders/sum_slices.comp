// The split-K matmul's second pass (csrc/ops/matmul.cpp, record_split and record_half): c[i] =
// the sum over s = 0..slices-1 of p[s * n + i], in that order (deterministic), float32 partial
// sums. The "_h" variant (-DHALF) rounds the sum once to the output's 2-byte type (DT).
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
layout(constant_id = 0) const int DT = DT_BF16;
#endif

layout(local_size_x = 256) in;

layout(push_constant) uniform PC {
  uvec2 p, c;
  uint n, slices;
} pc;

void main() {
  FBuf p = FBuf(pc.p);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += gl_NumWorkGroups.x * 256u) {
    float s = 0.0;
    for (uint k = 0u; k < pc.slices; ++k) s += p.v[k * pc.n + i];
#ifdef HALF
    st(pc.c, i, DT, s);
#else
    FBuf(pc.c).v[i] = s;
#endif
  }
}

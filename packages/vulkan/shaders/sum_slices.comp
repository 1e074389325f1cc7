// The split-K matmul's second pass (csrc/ops/matmul.cpp, record_split): c[i] = the sum over
// s = 0..slices-1 of p[s * n + i], in that order (deterministic), float32.
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform PC {
  uvec2 p, c;
  uint n, slices;
} pc;

void main() {
  FBuf p = FBuf(pc.p), c = FBuf(pc.c);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += gl_NumWorkGroups.x * 256u) {
    float s = 0.0;
    for (uint k = 0u; k < pc.slices; ++k) s += p.v[k * pc.n + i];
    c.v[i] = s;
  }
}

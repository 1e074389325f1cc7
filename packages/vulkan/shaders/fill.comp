// d[i] = bits for i < n (a float32 or int32 constant given by its bit pattern).
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform PC {
  uvec2 d;
  uint n;
  uint bits;
} pc;

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  UBuf d = UBuf(pc.d);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) d.v[i] = pc.bits;
}

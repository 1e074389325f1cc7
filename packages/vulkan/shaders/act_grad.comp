// act_grad(g, x, y): g * f'(x) for activation CODE (y = f(x) where cheaper). All dense.
//   CODE: the activation's RECURRA_UNARY_* code (recurra/op_spec.h); clamp reads p0, p1
#version 450
#include "common.glsl"
#include "act.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int CODE = 0;

layout(push_constant) uniform PC {
  uvec2 g, x, y, d;
  uint n;
  float p0, p1;
} pc;

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  FBuf g = FBuf(pc.g), x = FBuf(pc.x), y = FBuf(pc.y), d = FBuf(pc.d);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) d.v[i] = g.v[i] * act(CODE, true, x.v[i], y.v[i], pc.p0, pc.p1);
}

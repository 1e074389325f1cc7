// act_grad(g, x, y): g * f'(x) for activation CODE (y = f(x) where cheaper). All dense.
//   CODE: the activation's RECURRA_UNARY_* code (recurra/op_spec.h); clamp reads p0, p1
//   HALF (the act_grad_h variant): the tensors are of dtype DT (bfloat16 or float16),
//   computed in float32 and rounded once on store; VEC: four elements an invocation (the
//   tensors 8-byte aligned)
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#include "half_ew.glsl"
#endif
#include "act.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int CODE = 0;
#ifdef HALF
layout(constant_id = 1) const int DT = DT_BF16;
layout(constant_id = 2) const bool VEC = false;
#endif

layout(push_constant) uniform PC {
  uvec2 g, x, y, d;
  uint n;
  float p0, p1;
} pc;

#ifdef HALF
float df(float g, float x, float y) { return g * act(CODE, true, x, y, pc.p0, pc.p1); }
#endif

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
#ifdef HALF
  uint i = gl_GlobalInvocationID.x;
  if (VEC) {
    const uint n4 = pc.n / 4u;
    for (uint j = i; j < n4; j += stride) {
      const vec4 g = ld4f(pc.g, j, DT), x = ld4f(pc.x, j, DT), y = ld4f(pc.y, j, DT);
      st4f(pc.d, j, DT, vec4(df(g.x, x.x, y.x), df(g.y, x.y, y.y), df(g.z, x.z, y.z), df(g.w, x.w, y.w)));
    }
    i += n4 * 4u;
    if (i < pc.n) st(pc.d, i, DT, df(ld(pc.g, i, DT), ld(pc.x, i, DT), ld(pc.y, i, DT)));
    return;
  }
  for (; i < pc.n; i += stride) st(pc.d, i, DT, df(ld(pc.g, i, DT), ld(pc.x, i, DT), ld(pc.y, i, DT)));
#else
  FBuf g = FBuf(pc.g), x = FBuf(pc.x), y = FBuf(pc.y), d = FBuf(pc.d);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) d.v[i] = g.v[i] * act(CODE, true, x.v[i], y.v[i], pc.p0, pc.p1);
#endif
}

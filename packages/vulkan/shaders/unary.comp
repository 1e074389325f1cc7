// Unary maths and activations on a strided source; the output is dense.
//
//   x: any strides (collapsed shape `shape`, strides `sx`), y: dense, n elements
//   OP: the op's RECURRA_UNARY_* code (recurra/op_spec.h); scale reads p0, clamp p0, p1
//   MODE 0: general, 1: dense source, 2: dense with vec4 access (four elements an invocation)
//   HALF (the unary_h variant): the tensors are of dtype DT (bfloat16 or float16), computed
//   in float32 and rounded once on store
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#include "half_ew.glsl"
#endif
#include "act.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;
layout(constant_id = 1) const int MODE = 0;
layout(constant_id = 2) const int ND = 4;  // axes of the collapsed shape (1..4)
#ifdef HALF
layout(constant_id = 3) const int DT = DT_BF16;
#endif

layout(push_constant) uniform PC {
  uvec2 x, y;
  uint n;
  float p0, p1;
  int shape[4];
  int sx[4];
} pc;

float f(float x) { return act(OP, false, x, 0.0, pc.p0, pc.p1); }

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  uint i = gl_GlobalInvocationID.x;
#ifdef HALF
  if (MODE == 2) {
    const uint n4 = pc.n / 4u;
    for (uint j = i; j < n4; j += stride) {
      const vec4 v = ld4f(pc.x, j, DT);
      st4f(pc.y, j, DT, vec4(f(v.x), f(v.y), f(v.z), f(v.w)));
    }
    const uint t = n4 * 4u + i;
    if (t < pc.n) st(pc.y, t, DT, f(ld(pc.x, t, DT)));
    return;
  }
  for (; i < pc.n; i += stride) st(pc.y, i, DT, f(ld(pc.x, MODE == 1 ? i : uint(offset_nd(i, pc.shape, pc.sx, ND)), DT)));
#else
  if (MODE == 2) {
    F4Buf x4 = F4Buf(pc.x), y4 = F4Buf(pc.y);
    const uint n4 = pc.n / 4u;
    for (uint j = i; j < n4; j += stride) {
      const vec4 v = x4.v[j];
      y4.v[j] = vec4(f(v.x), f(v.y), f(v.z), f(v.w));
    }
    const uint t = n4 * 4u + i;
    if (t < pc.n) FBuf(pc.y).v[t] = f(FBuf(pc.x).v[t]);
    return;
  }
  FBuf x = FBuf(pc.x), y = FBuf(pc.y);
  for (; i < pc.n; i += stride) y.v[i] = f(MODE == 1 ? x.v[i] : x.v[offset_nd(i, pc.shape, pc.sx, ND)]);
#endif
}

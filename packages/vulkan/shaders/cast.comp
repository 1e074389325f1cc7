// cast: float32 <-> bfloat16 <-> float16, any pair. The source has any strides, the output
// is dense; a value converts to float32 exactly and is rounded once to the target (to
// nearest even, on the bits: half.glsl), as the core's half.h does.
//
//   x: collapsed shape `shape`, strides `sx`; y: dense, n elements
//   FROM, TO: recurra_dtype codes (0 float32, 2 bfloat16, 3 float16)
//   MODE 0: general, 1: dense source, 2: dense, four elements an invocation (aligned)
#version 450
#include "common.glsl"
#include "half.glsl"
#include "half_ew.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int FROM = 0;
layout(constant_id = 1) const int TO = 0;
layout(constant_id = 2) const int MODE = 0;
layout(constant_id = 3) const int ND = 4;  // axes of the collapsed shape (1..4)

layout(push_constant) uniform PC {
  uvec2 x, y;
  uint n;
  int shape[4];
  int sx[4];
} pc;

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  uint i = gl_GlobalInvocationID.x;
  if (MODE == 2) {
    const uint n4 = pc.n / 4u;
    for (uint j = i; j < n4; j += stride) st4f(pc.y, j, TO, ld4f(pc.x, j, FROM));
    const uint t = n4 * 4u + i;
    if (t < pc.n) st(pc.y, t, TO, ld(pc.x, t, FROM));
    return;
  }
  for (; i < pc.n; i += stride) st(pc.y, i, TO, ld(pc.x, MODE == 1 ? i : uint(offset_nd(i, pc.shape, pc.sx, ND)), FROM));
}

// Constant padding: y (dense, shape `shape`) = x placed at `before` on every axis, `bits`
// elsewhere. 4-byte elements of either dtype.
//   x: shape `xshape`, strides `sx` (any); all right-aligned in 4 slots
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform PC {
  uvec2 x, y;
  uint n;
  uint bits;
  int shape[4];
  int xshape[4];
  int sx[4];
  int before[4];
} pc;

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  UBuf x = UBuf(pc.x), y = UBuf(pc.y);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
    uint r = i;
    int off = 0;
    bool inside = true;
    [[unroll]] for (int a = 3; a >= 0; --a) {
      const int c = int(r % uint(pc.shape[a])) - pc.before[a];
      r /= uint(pc.shape[a]);
      inside = inside && c >= 0 && c < pc.xshape[a];
      off += c * pc.sx[a];
    }
    y.v[i] = inside ? x.v[off] : pc.bits;
  }
}

// Constant padding: y (dense, shape `shape`) = x placed at `before` on every axis, `bits`
// elsewhere. 4-byte elements of either dtype; 2-byte ones of the dtype DT in the HALF variant
// pad_h (`bits` then a float32, rounded once to DT).
//   x: shape `xshape`, strides `sx` (any); all right-aligned in 4 slots
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#define WORDS U16Buf
#define WORD_T uint16_t
layout(constant_id = 0) const int DT = DT_BF16;
#define WORD(b) uint16_t(DT == DT_BF16 ? bf16_bits(uintBitsToFloat(b)) : f16_bits(uintBitsToFloat(b)))
#else
#define WORDS UBuf
#define WORD_T uint
#define WORD(b) (b)
#endif

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
  WORDS x = WORDS(pc.x), y = WORDS(pc.y);
  const WORD_T value = WORD(pc.bits);
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
    y.v[i] = inside ? x.v[off] : value;
  }
}

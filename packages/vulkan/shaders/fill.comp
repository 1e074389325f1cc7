// d[i] = bits for i < n (a float32 or int32 constant given by its bit pattern). The HALF
// variant fill_h: `bits` is a float32, rounded once to the dtype DT (bfloat16/float16) and
// stored as 16-bit elements.
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
layout(constant_id = 0) const int DT = DT_BF16;
#endif

layout(local_size_x = 256) in;

layout(push_constant) uniform PC {
  uvec2 d;
  uint n;
  uint bits;
} pc;

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
#ifdef HALF
  U16Buf d = U16Buf(pc.d);
  const float f = uintBitsToFloat(pc.bits);
  const uint16_t bits = uint16_t(DT == DT_BF16 ? bf16_bits(f) : f16_bits(f));
#else
  UBuf d = UBuf(pc.d);
  const uint bits = pc.bits;
#endif
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) d.v[i] = bits;
}

// d[i] = bits for i < n (a float32 or int32 constant given by its bit pattern). The HALF
// variant fill_h: `bits` is a float32, rounded once to the dtype DT (bfloat16/float16) and
// stored as 16-bit elements.
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#include "half_ew.glsl"  // U2Buf
layout(constant_id = 0) const int DT = DT_BF16;
#endif

layout(local_size_x = 256) in;
// 1: four elements an invocation (the host checks n % 4 == 0 and the address aligned to
// four elements)
layout(constant_id = 1) const int VEC = 0;

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
  if (VEC != 0) {
#ifdef HALF
    const uint w = uint(bits) | (uint(bits) << 16);
    for (uint i = gl_GlobalInvocationID.x; i < pc.n / 4u; i += stride) U2Buf(pc.d).v[i] = uvec2(w);
#else
    for (uint i = gl_GlobalInvocationID.x; i < pc.n / 4u; i += stride) U4Buf(pc.d).v[i] = uvec4(bits);
#endif
    return;
  }
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) d.v[i] = bits;
}

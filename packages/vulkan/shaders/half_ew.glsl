// The elementwise kernels' 2-byte variants (unary_h, binary_h, act_grad_h, cast): loads and
// stores of four float32/bfloat16/float16 elements at a time (one at a time: half.glsl's ld
// and st), with the conversions done on the bits so that every value (NaN payloads,
// subnormals included) converts exactly as the core's half.h does. Include after half.glsl.

// Four 2-byte elements (8 bytes, element 0 in the low half of .x); four float32 ones: common.glsl's
// U4Buf.
layout(buffer_reference, std430, buffer_reference_align = 8) buffer U2Buf { uvec2 v[]; };

// Elements 4j .. 4j+3 (the tensor 16-byte aligned for float32, 8-byte for 2-byte dtypes).
uvec4 ld4_bits(uvec2 a, uint j, int dt) {
  if (dt == DT_F32) return U4Buf(a).v[j];
  const uvec2 w = U2Buf(a).v[j];
  return uvec4(h_to_f32_bits(w.x & 0xffffu, dt), h_to_f32_bits(w.x >> 16, dt), h_to_f32_bits(w.y & 0xffffu, dt),
               h_to_f32_bits(w.y >> 16, dt));
}
vec4 ld4f(uvec2 a, uint j, int dt) { return uintBitsToFloat(ld4_bits(a, j, dt)); }

void st4f(uvec2 a, uint j, int dt, vec4 v) {
  if (dt == DT_F32) {
    U4Buf(a).v[j] = floatBitsToUint(v);
  } else {
    U2Buf(a).v[j] = uvec2(f32_to_h_bits(v.x, dt) | (f32_to_h_bits(v.y, dt) << 16),
                          f32_to_h_bits(v.z, dt) | (f32_to_h_bits(v.w, dt) << 16));
  }
}

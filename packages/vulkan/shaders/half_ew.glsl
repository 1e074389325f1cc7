// The elementwise kernels' 2-byte variants (unary_h, binary_h, act_grad_h, cast): loads and
// stores of float32/bfloat16/float16 elements, one at a time or four at a time, with the
// conversions done on the bits so that every value (NaN payloads, subnormals included)
// converts exactly as the core's half.h does. Include after half.glsl.

// Four 2-byte elements (8 bytes, element 0 in the low half of .x), and four float32 ones.
layout(buffer_reference, std430, buffer_reference_align = 8) buffer U2Buf { uvec2 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4Buf { uvec4 v[]; };

// 2-byte element bits of dtype dt -> float32 bits.
uint h_to_f32_bits(uint h, int dt) { return dt == DT_BF16 ? h << 16 : f16_to_f32_bits(h); }

// float32 -> the 2-byte bits of dt, rounded to nearest even (half.glsl).
uint f32_to_h_bits(float v, int dt) { return dt == DT_BF16 ? bf16_bits(v) : f16_bits(v); }

// Element i of the tensor at `a` (dtype dt) as float32 bits / as float32.
uint ld_bits(uvec2 a, uint i, int dt) {
  if (dt == DT_F32) return UBuf(a).v[i];
  return h_to_f32_bits(uint(U16Buf(a).v[i]), dt);
}
float ldf(uvec2 a, uint i, int dt) { return uintBitsToFloat(ld_bits(a, i, dt)); }

// Stores v at element i of the tensor at `a` (dtype dt), rounded once.
void stf(uvec2 a, uint i, int dt, float v) {
  if (dt == DT_F32)
    FBuf(a).v[i] = v;
  else
    U16Buf(a).v[i] = uint16_t(f32_to_h_bits(v, dt));
}

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

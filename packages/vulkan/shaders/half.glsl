// 2-byte elements: loads and stores of float32, bfloat16 and float16 tensors through one
// pair of functions, the element type a specialization constant (or a constant) of the
// caller, so the other branches compile away. Arithmetic stays in float32: a kernel loads,
// computes in float32 and rounds once when it stores, as the CPU does.
//
// Needs storageBuffer16BitAccess (Device::half_storage): include it only from the shader
// variants built for 2-byte tensors (meson: the "_h" variants, -DHALF), never from the
// float32 ones, so that devices without the feature still run those.
//
// Dtype codes: recurra_dtype (include/recurra/backend.h): 0 float32, 2 bfloat16, 3 float16.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require

const int DT_F32 = 0;
const int DT_BF16 = 2;
const int DT_F16 = 3;

layout(buffer_reference, std430, buffer_reference_align = 2) buffer U16Buf { uint16_t v[]; };

// float32 -> bfloat16 bits, round to nearest, ties to even; a NaN stays a (quiet) NaN.
uint bf16_bits(float x) {
  const uint u = floatBitsToUint(x);
  if (isnan(x)) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// float32 -> float16 bits, round to nearest, ties to even (subnormals, overflow to inf, NaN
// kept quiet), done on the bits so it does not depend on the device's conversion rounding.
uint f16_bits(float x) {
  const uint u = floatBitsToUint(x);
  const uint sign = (u >> 16) & 0x8000u;
  const uint a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);  // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // below 2^-14: a subnormal (or zero) half
    if (a < 0x33000000u) return sign;  // below 2^-25: rounds to zero (ties included)
    const uint e = a >> 23;  // 102..112
    const uint m = (a & 0x7fffffu) | 0x800000u;
    const uint shift = 126u - e;  // 14..24
    const uint r = m >> shift;
    const uint rem = m & ((1u << shift) - 1u);
    const uint half_ = 1u << (shift - 1u);
    return sign | (r + uint(rem > half_ || (rem == half_ && (r & 1u) == 1u)));
  }
  // normal: rebias the exponent (127 -> 15), round the 13 dropped mantissa bits
  const uint b = a - 0x38000000u;
  return sign | ((b + 0xfffu + ((b >> 13) & 1u)) >> 13);
}

// float16 bits -> float32 bits, exactly (subnormals normalized, NaN payloads kept; no
// quieting, as half.h's f16_to_f32).
uint f16_to_f32_bits(uint h) {
  const uint sign = (h & 0x8000u) << 16;
  const uint e = (h >> 10) & 0x1fu;
  const uint m = h & 0x3ffu;
  if (e == 0u) {
    if (m == 0u) return sign;
    const int p = findMSB(m);  // m * 2^-24 = 2^(p - 24) * (1 + fraction)
    return sign | (uint(p + 103) << 23) | ((m << uint(23 - p)) & 0x7fffffu);
  }
  if (e == 31u) return sign | 0x7f800000u | (m << 13);
  return sign | ((e + 112u) << 23) | (m << 13);
}

// 2-byte element bits of dtype dt -> float32 bits, on the bits, not unpackHalf2x16: a device
// may flush float16 subnormals or quiet NaNs there (the H200 does: float16 matmul and max
// results differed from the CPU's).
uint h_to_f32_bits(uint h, int dt) { return dt == DT_BF16 ? h << 16 : f16_to_f32_bits(h); }

// float32 -> the 2-byte bits of dt, rounded to nearest even.
uint f32_to_h_bits(float v, int dt) { return dt == DT_BF16 ? bf16_bits(v) : f16_bits(v); }

// Element i of the tensor at `a` (element type dt), as float32 (its bits moved, never
// converted by the device: NaN payloads and subnormals kept).
float ld(uvec2 a, uint i, int dt) {
  if (dt == DT_F32) return uintBitsToFloat(UBuf(a).v[i]);
  return uintBitsToFloat(h_to_f32_bits(uint(U16Buf(a).v[i]), dt));
}

// Stores v at element i of the tensor at `a`, rounded once to its type.
void st(uvec2 a, uint i, int dt, float v) {
  if (dt == DT_F32) {
    FBuf(a).v[i] = v;
  } else {
    U16Buf(a).v[i] = uint16_t(f32_to_h_bits(v, dt));
  }
}

// add / sub / mul / div with numpy broadcasting over strided sources.
//
//   a, b: any strides (0 on broadcast axes), d: dense, all of the collapsed shape `shape`
//   MODE 0: general (4-D index math), 1: all dense, same shape, 2: like 1 with vec4 access
//   HALF (the binary_h variant): the tensors are of dtype DT (bfloat16 or float16), computed
//   in float32 and rounded once on store; with DA (DB) = 0, source a (b) is float32 and each
//   of its values is rounded to DT where it is loaded (the cast the core folded into the add)
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#include "half_ew.glsl"
#endif

layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;  // 0 add, 1 sub, 2 mul, 3 div
layout(constant_id = 1) const int MODE = 0;
layout(constant_id = 2) const int ND = 4;  // axes of the collapsed shape (1..4)
#ifdef HALF
layout(constant_id = 3) const int DT = DT_BF16;
layout(constant_id = 4) const int DA = -1;  // -1: DT; 0: float32, rounded to DT on load
layout(constant_id = 5) const int DB = -1;

// Source values: loaded in their dtype `from` (DT, or float32 rounded to DT).
float rounded(float v) { return uintBitsToFloat(h_to_f32_bits(f32_to_h_bits(v, DT), DT)); }
float ldr(uvec2 a, uint i, int from) { return from != DT_F32 ? ld(a, i, DT) : rounded(ld(a, i, DT_F32)); }
vec4 ldr4(uvec2 a, uint j, int from) {
  if (from != DT_F32) return ld4f(a, j, DT);
  const vec4 v = ld4f(a, j, DT_F32);
  return vec4(rounded(v.x), rounded(v.y), rounded(v.z), rounded(v.w));
}
#endif

layout(push_constant) uniform PC {
  uvec2 a, b, d;
  uint n;
  int shape[4];
  int sa[4];
  int sb[4];
} pc;

float op(float x, float y) {
  if (OP == 0) return x + y;
  if (OP == 1) return x - y;
  if (OP == 2) return x * y;
  return x / y;
}

vec4 op4(vec4 x, vec4 y) {
  if (OP == 0) return x + y;
  if (OP == 1) return x - y;
  if (OP == 2) return x * y;
  return x / y;
}

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  uint i = gl_GlobalInvocationID.x;
#ifdef HALF
  if (MODE == 2) {
    const uint n4 = pc.n / 4u;
    for (uint j = i; j < n4; j += stride) st4f(pc.d, j, DT, op4(ldr4(pc.a, j, DA), ldr4(pc.b, j, DB)));
    const uint t = n4 * 4u + i;
    if (t < pc.n) st(pc.d, t, DT, op(ldr(pc.a, t, DA), ldr(pc.b, t, DB)));
    return;
  }
  for (; i < pc.n; i += stride) {
    const uint ia = MODE == 1 ? i : uint(offset_nd(i, pc.shape, pc.sa, ND));
    const uint ib = MODE == 1 ? i : uint(offset_nd(i, pc.shape, pc.sb, ND));
    st(pc.d, i, DT, op(ldr(pc.a, ia, DA), ldr(pc.b, ib, DB)));
  }
#else
  if (MODE == 2) {
    F4Buf a4 = F4Buf(pc.a), b4 = F4Buf(pc.b), d4 = F4Buf(pc.d);
    const uint n4 = pc.n / 4u;
    for (uint j = i; j < n4; j += stride) d4.v[j] = op4(a4.v[j], b4.v[j]);
    // The tail (n % 4 elements).
    const uint t = n4 * 4u + i;
    if (t < pc.n) FBuf(pc.d).v[t] = op(FBuf(pc.a).v[t], FBuf(pc.b).v[t]);
    return;
  }
  FBuf a = FBuf(pc.a), b = FBuf(pc.b), d = FBuf(pc.d);
  for (; i < pc.n; i += stride) {
    if (MODE == 1)
      d.v[i] = op(a.v[i], b.v[i]);
    else
      d.v[i] = op(a.v[offset_nd(i, pc.shape, pc.sa, ND)], b.v[offset_nd(i, pc.shape, pc.sb, ND)]);
  }
#endif
}

// Strided copy of 4-byte elements (float32 or int32 alike): d[view] = s[view], both views of
// the collapsed shape `shape`. Serves contiguous, concat (into windows of the output) and
// slice_grad (into a strided window of a zeroed output).
//   MODE 0: general, 1: both dense (flat copy), 2: flat, four elements an invocation (the
//   host checks n % 4 == 0 and both addresses aligned to four elements)
//   HALF (the copy_h variant): 2-byte elements (bfloat16/float16) moved as 16-bit words,
//   bits untouched (16-bit stores, or whole 8-byte groups in MODE 2: no invocation rewrites
//   another's half of a 32-bit word). With
//   FROM >= 0 the source has dtype FROM and the destination DT (float32, bfloat16, float16),
//   each element converted as a cast does (the core's folded casts: a merged slice gradient
//   reading a cast's float32 source, a slice_grad widening a 2-byte gradient).
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#include "half_ew.glsl"
#define WORDS U16Buf
#else
#define WORDS UBuf
#endif

layout(local_size_x = 256) in;
layout(constant_id = 0) const int MODE = 0;
layout(constant_id = 1) const int ND = 4;  // axes of the collapsed shape (1..4)
layout(constant_id = 4) const int RUN = 1;  // MODE 0: elements per invocation (see copy_runs)
#ifdef HALF
layout(constant_id = 2) const int FROM = -1;  // -1: the destination's dtype (bits moved); else a dtype code
layout(constant_id = 3) const int DT = DT_BF16;  // the destination's dtype when FROM >= 0
#endif

layout(push_constant) uniform PC {
  uvec2 s, d;
  uint n;
  int shape[4];
  int ss[4];
  int sd[4];
} pc;

// MODE 0 with RUN > 1 (the host: the innermost axis' length a multiple of RUN): each
// invocation moves RUN consecutive elements along that axis, one index computation and RUN
// loads in flight instead of one each (a strided copy waits on its index arithmetic and on
// single loads, not on bandwidth).
void copy_runs() {
  const uint stride = gl_NumWorkGroups.x * 256u, m = pc.n / uint(RUN);
  const int s3 = pc.ss[3], d3 = pc.sd[3];
  for (uint u = gl_GlobalInvocationID.x; u < m; u += stride) {
    const int so = offset_nd(u * uint(RUN), pc.shape, pc.ss, ND), dof = offset_nd(u * uint(RUN), pc.shape, pc.sd, ND);
#ifdef HALF
    if (FROM >= 0) {
      float v[RUN];
      [[unroll]] for (int q = 0; q < RUN; ++q) v[q] = ld(pc.s, uint(so + q * s3), FROM);
      [[unroll]] for (int q = 0; q < RUN; ++q) st(pc.d, uint(dof + q * d3), DT, v[q]);
      continue;
    }
    uint16_t v[RUN];
#else
    uint v[RUN];
#endif
    WORDS s = WORDS(pc.s), d = WORDS(pc.d);
    [[unroll]] for (int q = 0; q < RUN; ++q) v[q] = s.v[so + q * s3];
    [[unroll]] for (int q = 0; q < RUN; ++q) d.v[dof + q * d3] = v[q];
  }
}

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  if (MODE == 0 && RUN > 1) {
    copy_runs();
    return;
  }
  if (MODE == 2) {
    const uint n4 = pc.n / 4u;
    for (uint j = gl_GlobalInvocationID.x; j < n4; j += stride) {
#ifdef HALF
      if (FROM >= 0)
        st4f(pc.d, j, DT, ld4f(pc.s, j, FROM));
      else
        U2Buf(pc.d).v[j] = U2Buf(pc.s).v[j];
#else
      U4Buf(pc.d).v[j] = U4Buf(pc.s).v[j];
#endif
    }
    return;
  }
#ifdef HALF
  if (FROM >= 0) {
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
      const uint si = MODE == 1 ? i : uint(offset_nd(i, pc.shape, pc.ss, ND));
      const uint di = MODE == 1 ? i : uint(offset_nd(i, pc.shape, pc.sd, ND));
      st(pc.d, di, DT, ld(pc.s, si, FROM));
    }
    return;
  }
#endif
  WORDS s = WORDS(pc.s), d = WORDS(pc.d);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
    if (MODE == 1)
      d.v[i] = s.v[i];
    else
      d.v[offset_nd(i, pc.shape, pc.sd, ND)] = s.v[offset_nd(i, pc.shape, pc.ss, ND)];
  }
}

// The transposed copy of a 2-byte matrix (bfloat16/float16 bits, untouched) that the matmul op
// makes of a row-major A before a product on tensor cores (csrc/ops/matmul.cpp): A (M x K,
// k-contiguous: A(m, k) = a[m * rs + k]) into T (K x TS, m-contiguous: T(k, m) = t[k * TS + m]),
// TS = M rounded up to 8, the columns m >= M zero. On an H200 matmul_coopmat_op.comp stages
// an m-contiguous A (A_T) as K rows of BM elements (16-byte loads of 256-byte rows) and runs
// faster than on a row-major A (BM rows of BK elements: 32-byte rows, one L2 request each).
//
// A workgroup moves a 64 x 64 block through shared memory: 16-byte loads along A's rows (the
// host checks K, rs and the address: multiples of 8 elements, 16-byte aligned, so 8
// consecutive k are all inside A or all outside), 16-byte stores along T's rows.
// Workgroup (x, y) takes k in [64 x, 64 x + 64) and m in [64 y, 64 y + 64).
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;

layout(buffer_reference, std430, buffer_reference_align = 16) readonly buffer U4Src { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) writeonly buffer U4Dst { uvec4 v[]; };

layout(push_constant) uniform PC {
  uvec2 a, t;
  int M, K, rs, ts;
} pc;

// Element (m, k) of the block as the low 16 bits of a word; rows padded by one word, so that
// the 8 rows a store phase reads lie in different banks.
shared uint block[64][65];

void main() {
  const int m0 = int(gl_WorkGroupID.y) * 64, k0 = int(gl_WorkGroupID.x) * 64;
  const uint t = gl_LocalInvocationID.x;
  // 64 rows of A, 8 items of 8 elements each: 2 items an invocation.
  [[unroll]] for (uint i = t; i < 512u; i += 256u) {
    const int r = int(i / 8u), g = int(i % 8u);
    const int m = m0 + r, k = k0 + g * 8;
    uvec4 v = uvec4(0u);
    if (m < pc.M && k < pc.K) v = U4Src(pc.a).v[(m * pc.rs + k) >> 3];
    [[unroll]] for (int e = 0; e < 4; ++e) {
      block[r][g * 8 + 2 * e] = v[e] & 0xffffu;
      block[r][g * 8 + 2 * e + 1] = v[e] >> 16;
    }
  }
  barrier();
  // 64 rows of T, 8 items of 8 consecutive m each.
  [[unroll]] for (uint i = t; i < 512u; i += 256u) {
    const int kr = int(i / 8u), g = int(i % 8u);
    const int k = k0 + kr, m = m0 + g * 8;
    if (k < pc.K && m < pc.ts) {
      uvec4 v;
      [[unroll]] for (int e = 0; e < 4; ++e) v[e] = block[g * 8 + 2 * e][kr] | (block[g * 8 + 2 * e + 1][kr] << 16);
      U4Dst(pc.t).v[(k * pc.ts + m) >> 3] = v;
    }
  }
}

// Batched SGEMM: C (batch, M, N) dense = A (M, K) @ B (K, N) for every batch index, A and B
// any-strided (transposed operands, broadcast batch axes: batch stride 0).
//
// Register-blocked tiling: a workgroup of (BM/TM) x (BN/TN) = 256 threads owns a BM x BN tile
// of C, each thread TM x TN of it in registers. K advances BK at a time through shared
// memory, double-buffered: the next tiles are read from global memory into registers while
// the current ones are multiplied, so one barrier per step suffices. Shared tiles are stored
// k-major (As[k][m], Bs[k][n]) and read as vec4 (4 FMA-vec4 per shared load); the +4 padding
// keeps the transposed stores of k-contiguous operands free of bank conflicts.
//
// Variants: -D BM BN BK TM TN at build time (matmul_128: 128x128x8, 8x8 per thread;
// matmul_64: 64x64x16, 4x4); specialization constants for the operand layouts:
//   A_KC / B_KC: the operand's k axis is its contiguous one (else its m / n axis is, or the
//                layout is general: the scalar loads use both strides anyway)
//   VEC_A / VEC_B: vec4 global loads along the contiguous axis (host checks alignment)
//   VEC_C: vec4 stores of C
#version 450
#include "common.glsl"

#define WG ((BM / TM) * (BN / TN))
#define PAD 4

layout(local_size_x = WG) in;
layout(constant_id = 0) const int A_KC = 1;
layout(constant_id = 1) const int B_KC = 0;
layout(constant_id = 2) const int VEC_A = 0;
layout(constant_id = 3) const int VEC_B = 0;
layout(constant_id = 4) const int VEC_C = 0;

layout(push_constant) uniform PC {
  uvec2 a, b, c;
  int M, N, K;
  int a_rs, a_cs;  // A(m, k) = a[m * a_rs + k * a_cs]
  int b_rs, b_cs;  // B(k, n) = b[k * b_rs + n * b_cs]
  int nb1;         // the inner batch axis' length (batch index z = outer * nb1 + inner)
  int a_b0, a_b1, b_b0, b_b1;  // batch strides of A and B (outer, inner)
} pc;

shared vec4 As[2][BK][(BM + PAD) / 4];
shared vec4 Bs[2][BK][(BN + PAD) / 4];

// Each thread moves BM*BK/WG = 4 elements of each operand per step (both variants).
#define LOADS 4

// Reads this thread's 4 elements of an R x BK tile (rows r0.., k0..) of operand X(r, k) =
// x[base + r * rs + k * ks] into v; out-of-range elements read as 0.
vec4 load_tile(uvec2 xa, int base, int rs, int ks, int r0, int R, int k0, int RT, int KC, int VEC) {
  const int t = int(gl_LocalInvocationID.x);
  vec4 v = vec4(0.0);
  if (VEC != 0) {
    F4Buf x4 = F4Buf(xa);
    if (KC != 0) {
      const int r = t / (BK / 4), kk = (t % (BK / 4)) * 4;
      if (r0 + r < R && k0 + kk < pc.K) v = x4.v[(base + (r0 + r) * rs + (k0 + kk)) >> 2];
    } else {
      const int kk = t / (RT / 4), r = (t % (RT / 4)) * 4;
      if (r0 + r < R && k0 + kk < pc.K) v = x4.v[(base + (r0 + r) + (k0 + kk) * ks) >> 2];
    }
    return v;
  }
  FBuf x = FBuf(xa);
  [[unroll]] for (int i = 0; i < LOADS; ++i) {
    const int e = t + i * WG;
    const int r = KC != 0 ? e / BK : e % RT;
    const int kk = KC != 0 ? e % BK : e / RT;
    if (r0 + r < R && k0 + kk < pc.K) v[i] = x.v[base + (r0 + r) * rs + (k0 + kk) * ks];
  }
  return v;
}

void store_a(int buf, vec4 v) {
  const int t = int(gl_LocalInvocationID.x);
  if (VEC_A != 0 && A_KC == 0) {
    As[buf][t / (BM / 4)][t % (BM / 4)] = v;
  } else if (VEC_A != 0) {
    const int r = t / (BK / 4), kk = (t % (BK / 4)) * 4;
    [[unroll]] for (int j = 0; j < 4; ++j) As[buf][kk + j][r >> 2][r & 3] = v[j];
  } else {
    [[unroll]] for (int i = 0; i < LOADS; ++i) {
      const int e = t + i * WG;
      const int r = A_KC != 0 ? e / BK : e % BM;
      const int kk = A_KC != 0 ? e % BK : e / BM;
      As[buf][kk][r >> 2][r & 3] = v[i];
    }
  }
}

void store_b(int buf, vec4 v) {
  const int t = int(gl_LocalInvocationID.x);
  if (VEC_B != 0 && B_KC == 0) {
    Bs[buf][t / (BN / 4)][t % (BN / 4)] = v;
  } else if (VEC_B != 0) {
    const int r = t / (BK / 4), kk = (t % (BK / 4)) * 4;
    [[unroll]] for (int j = 0; j < 4; ++j) Bs[buf][kk + j][r >> 2][r & 3] = v[j];
  } else {
    [[unroll]] for (int i = 0; i < LOADS; ++i) {
      const int e = t + i * WG;
      const int r = B_KC != 0 ? e / BK : e % BN;
      const int kk = B_KC != 0 ? e % BK : e / BN;
      Bs[buf][kk][r >> 2][r & 3] = v[i];
    }
  }
}

void main() {
  const int t = int(gl_LocalInvocationID.x);
  const int tx = t % (BN / TN), ty = t / (BN / TN);
  const int m0 = int(gl_WorkGroupID.y) * BM, n0 = int(gl_WorkGroupID.x) * BN;
  const int z = int(gl_WorkGroupID.z);
  const int zo = z / pc.nb1, zi = z % pc.nb1;
  const int a_base = zo * pc.a_b0 + zi * pc.a_b1;
  const int b_base = zo * pc.b_b0 + zi * pc.b_b1;

  vec4 acc[TM][TN / 4];
  [[unroll]] for (int i = 0; i < TM; ++i)
    [[unroll]] for (int q = 0; q < TN / 4; ++q) acc[i][q] = vec4(0.0);

  const int ntiles = (pc.K + BK - 1) / BK;
  // A as an R x BK tile: rows m (stride a_rs), k stride a_cs. B likewise with rows n.
  vec4 ra = load_tile(pc.a, a_base, pc.a_rs, pc.a_cs, m0, pc.M, 0, BM, A_KC, VEC_A);
  vec4 rb = load_tile(pc.b, b_base, pc.b_cs, pc.b_rs, n0, pc.N, 0, BN, B_KC, VEC_B);
  store_a(0, ra);
  store_b(0, rb);
  barrier();

  int buf = 0;
  for (int kt = 0; kt < ntiles; ++kt) {
    const bool more = kt + 1 < ntiles;
    if (more) {
      ra = load_tile(pc.a, a_base, pc.a_rs, pc.a_cs, m0, pc.M, (kt + 1) * BK, BM, A_KC, VEC_A);
      rb = load_tile(pc.b, b_base, pc.b_cs, pc.b_rs, n0, pc.N, (kt + 1) * BK, BN, B_KC, VEC_B);
    }
    [[unroll]] for (int kk = 0; kk < BK; ++kk) {
      vec4 af[TM / 4], bf[TN / 4];
      [[unroll]] for (int q = 0; q < TM / 4; ++q) af[q] = As[buf][kk][ty + q * (BM / TM)];
      [[unroll]] for (int q = 0; q < TN / 4; ++q) bf[q] = Bs[buf][kk][tx + q * (BN / TN)];
      [[unroll]] for (int i = 0; i < TM; ++i) {
        const float av = af[i / 4][i % 4];
        [[unroll]] for (int q = 0; q < TN / 4; ++q) acc[i][q] = fma(vec4(av), bf[q], acc[i][q]);
      }
    }
    if (more) {
      store_a(buf ^ 1, ra);
      store_b(buf ^ 1, rb);
    }
    barrier();
    buf ^= 1;
  }

  // Row i of this thread: (ty + (i / 4) * (BM / TM)) * 4 + i % 4; columns of q: (tx + q * (BN / TN)) * 4 + 0..3.
  const int c_base = z * pc.M * pc.N;
  FBuf cbuf = FBuf(pc.c);
  F4Buf c4 = F4Buf(pc.c);
  [[unroll]] for (int i = 0; i < TM; ++i) {
    const int row = m0 + (ty + (i / 4) * (BM / TM)) * 4 + i % 4;
    if (row >= pc.M) continue;
    [[unroll]] for (int q = 0; q < TN / 4; ++q) {
      const int col = n0 + (tx + q * (BN / TN)) * 4;
      const int o = c_base + row * pc.N + col;
      if (VEC_C != 0) {
        if (col < pc.N) c4.v[o >> 2] = acc[i][q];
      } else {
        [[unroll]] for (int j = 0; j < 4; ++j)
          if (col + j < pc.N) cbuf.v[o + j] = acc[i][q][j];
      }
    }
  }
}

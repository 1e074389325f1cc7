// Skinny products: C (batch, M, N) dense = A (M, K) @ B (K, N) for M <= 4 (one-token steps:
// a token's activations times a weight), A and B any-strided, batch axes as in matmul_reg.comp
// (same push constants). The tiled kernels give such a product a handful of workgroups that
// walk K one slab and one barrier at a time; here every column's K is split over many
// threads and summed in shared memory, so the product runs at the speed of reading B.
//
// Specialization constant B_KC: B's k axis is its contiguous one (x @ W.T of a weight W
// (N, K)): a group of 32 threads owns a column and reads its K consecutive values together;
// 8 columns a workgroup. Otherwise 64 columns a workgroup, read together along n, each
// column's K split over 4 threads.
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int B_KC = 1;

layout(push_constant) uniform PC {
  uvec2 a, b, c;
  int M, N, K;
  int a_rs, a_cs;
  int b_rs, b_cs;
  int nb1;
  int a_b0, a_b1, b_b0, b_b1;
} pc;

const int MMAX = 4;
shared float part[MMAX][256];

void main() {
  const int t = int(gl_LocalInvocationID.x);
  const int z = int(gl_WorkGroupID.y);
  const int outer = z / pc.nb1, inner = z % pc.nb1;
  const int abase = outer * pc.a_b0 + inner * pc.a_b1;
  const int bbase = outer * pc.b_b0 + inner * pc.b_b1;
  const int LANES = B_KC != 0 ? 32 : 4;       // threads sharing one column
  const int COLS = 256 / LANES;               // columns of this workgroup
  const int lane = B_KC != 0 ? t % 32 : t / 64;
  const int col = B_KC != 0 ? t / 32 : t % 64;
  const int n = int(gl_WorkGroupID.x) * COLS + col;
  FBuf A = FBuf(pc.a);
  FBuf B = FBuf(pc.b);
  float acc[MMAX] = float[MMAX](0.0, 0.0, 0.0, 0.0);
  if (n < pc.N) {
    for (int k = lane; k < pc.K; k += LANES) {
      const float bv = B.v[bbase + k * pc.b_rs + n * pc.b_cs];
      [[unroll]] for (int m = 0; m < MMAX; ++m)
        if (m < pc.M) acc[m] += A.v[abase + m * pc.a_rs + k * pc.a_cs] * bv;
    }
  }
  [[unroll]] for (int m = 0; m < MMAX; ++m) part[m][t] = acc[m];
  barrier();
  // Sum each column's LANES partial sums: the LANES threads of a column are t = col*32 + lane
  // (B_KC) or t = lane*64 + col; halve the span until one is left.
  for (int span = LANES / 2; span >= 1; span /= 2) {
    if (lane < span) {
      const int other = B_KC != 0 ? t + span : t + span * 64;
      [[unroll]] for (int m = 0; m < MMAX; ++m) part[m][t] += part[m][other];
    }
    barrier();
  }
  if (lane == 0 && n < pc.N) {
    FBuf C = FBuf(pc.c);
    const int cbase = z * pc.M * pc.N;
    [[unroll]] for (int m = 0; m < MMAX; ++m)
      if (m < pc.M) C.v[cbase + m * pc.N + n] = part[m][t];
  }
}

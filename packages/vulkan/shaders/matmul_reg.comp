// Batched SGEMM for big GPUs: C (batch, M, N) dense = A (M, K) @ B (K, N) for every batch
// index, A and B any-strided (transposed operands, broadcast batch axes: batch stride 0).
// Same push constants, specialization constants and semantics as matmul.comp.
//
// Why a second shader: every register array here is indexed only by constants once the
// [[unroll]] loops are unrolled. spirv-opt's unroller gives up on a loop holding `continue`,
// `break`, or a loop nested inside a branch, and one dynamic index left anywhere keeps the
// whole array in the Function storage class: local memory on NVIDIA, in the innermost loop
// (matmul.comp's epilogue `continue` does exactly that to its accumulators). The SPIR-V of
// each variant here has no Function-storage variable at all (tests/vulkan/
// test_vulkan_matmul.py checks the built modules).
//
// Tiling: a workgroup of WG = (BM/TM) x (BN/TN) threads owns a BM x BN tile of C; each
// thread keeps TM x TN results in registers (rows (ty + a*BM/TM)*4 + 0..3, columns
// (tx + b*BN/TN)*4 + 0..3: strided 4x4 blocks, so the vec4 shared reads of a warp are
// contiguous and the C stores coalesce). K advances BK at a time; the next BM x BK and
// BK x BN slabs are read into registers (vec4 global loads along each operand's contiguous
// axis when the host finds them aligned) while the current ones are multiplied out of
// shared memory, then stored into the other shared buffer: one barrier per step. Shared
// tiles are k-major (As[k][m], Bs[k][n]) and read as vec4: TM/4 + TN/4 shared loads feed
// TM*TN FMAs per k.
//
// Build-time defines: BM BN BK TM TN (TM, TN multiples of 4; BM*BK and BN*BK multiples of
// 4*WG). Specialization constants (set by csrc/ops/matmul.cpp):
//   A_KC / B_KC: the operand's k axis is its contiguous one (else its m / n axis is, or the
//                layout is general: the scalar loads use both strides)
//   VEC_A / VEC_B: vec4 global loads along the contiguous axis (host checks alignment and
//                  that the axis' extent is a multiple of 4)
//   VEC_C: vec4 stores of C (N a multiple of 4, C 16-byte aligned)
//
// -DHALF (the "_h" modules, for bfloat16/float16 tensors; the device needs
// storageBuffer16BitAccess): A, B and C hold 2-byte elements of type DT (specialization
// constant 5: 2 bfloat16, 3 float16, half.glsl). Loads are scalar (VEC_A = VEC_B = VEC_C = 0:
// the host never sets them), accumulation stays float32, and each C element is rounded once
// when stored (half.glsl's st: round to nearest even on the bits). C_F32 (specialization
// constant 6, 1): C holds float32 instead (the partial sums of a split-K product).
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
layout(constant_id = 5) const int DT = DT_BF16;
layout(constant_id = 6) const int C_F32 = 0;
const int C_DT = C_F32 != 0 ? DT_F32 : DT;
#define LDX(xa, i) ld(xa, uint(i), DT)
#else
#define LDX(xa, i) FBuf(xa).v[i]
#endif

#define WG ((BM / TM) * (BN / TN))
#define NA (BM * BK / 4 / WG)  // vec4 slots of the A slab per thread and step
#define NB (BN * BK / 4 / WG)
#define PAD 4                  // keeps the transposed (k-contiguous) shared stores spread over banks

#if (BM * BK) % (4 * WG) != 0 || (BN * BK) % (4 * WG) != 0 || TM % 4 != 0 || TN % 4 != 0
#error "matmul_reg.comp: BM*BK and BN*BK must be multiples of 4*WG, TM and TN of 4"
#endif

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

// Where slot i (vec4 path) or scalar j of slot i (scalar path) of this thread lies in an
// RT x BK slab: row r (m or n), column kk. Vec4 slots cover 4 consecutive elements along the
// contiguous axis (k when KC, else r); scalar element s = (4i + j) * WG + t walks the
// contiguous axis with t, so a warp's loads coalesce in both paths.
void vec_pos(const int i, const int RT, const int KC, out int r, out int kk) {
  const int e = int(gl_LocalInvocationID.x) + i * WG;
  if (KC != 0) {
    r = e / (BK / 4);
    kk = (e % (BK / 4)) * 4;
  } else {
    kk = e / (RT / 4);
    r = (e % (RT / 4)) * 4;
  }
}

void scalar_pos(const int i, const int j, const int RT, const int KC, out int r, out int kk) {
  const int s = (4 * i + j) * WG + int(gl_LocalInvocationID.x);
  r = KC != 0 ? s / BK : s % RT;
  kk = KC != 0 ? s % BK : s / RT;
}

// Slot i of this thread's share of the RT x BK slab (rows r0.., columns k0..) of operand
// X(r, k) = x[base + r * rs + k * ks] (R rows in all); elements outside X read as 0.
vec4 load_slot(uvec2 xa, int base, int rs, int ks, int r0, int R, int k0, const int RT,
               const int KC, const int VEC, const int i) {
  vec4 v = vec4(0.0);
  if (VEC != 0) {
    int r, kk;
    vec_pos(i, RT, KC, r, kk);
    // vec4 path: ks == 1 (KC) or rs == 1 (!KC), the 4 elements all in range or all out.
    const int off = KC != 0 ? base + (r0 + r) * rs + (k0 + kk) : base + (r0 + r) + (k0 + kk) * ks;
    if (r0 + r < R && k0 + kk < pc.K) v = F4Buf(xa).v[off >> 2];
  } else {
    [[unroll]] for (int j = 0; j < 4; ++j) {
      int r, kk;
      scalar_pos(i, j, RT, KC, r, kk);
      if (r0 + r < R && k0 + kk < pc.K) v[j] = LDX(xa, base + (r0 + r) * rs + (k0 + kk) * ks);
    }
  }
  return v;
}

// Position of scalar j of slot i in the slab, for either load path.
void slot_pos(const int i, const int j, const int RT, const int KC, const int VEC, out int r,
              out int kk) {
  if (VEC != 0) {
    vec_pos(i, RT, KC, r, kk);
    if (KC != 0) kk += j; else r += j;
  } else {
    scalar_pos(i, j, RT, KC, r, kk);
  }
}

// Stores slot i (loaded by load_slot) into shared buffer `buf` of As / Bs, which are k-major:
// one vec4 store when the slot runs along r, else 4 scalar stores (a transpose). Written
// without nested loops so that the callers' [[unroll]] loops unroll (see the header).
#define STORE_SLOT(SH, RT, KC, VEC, buf, i, v)              \
  {                                                         \
    int r, kk;                                              \
    if (VEC != 0 && KC == 0) {                              \
      vec_pos(i, RT, KC, r, kk);                            \
      SH[buf][kk][r >> 2] = v;                              \
    } else {                                                \
      slot_pos(i, 0, RT, KC, VEC, r, kk);                   \
      SH[buf][kk][r >> 2][r & 3] = v.x;                     \
      slot_pos(i, 1, RT, KC, VEC, r, kk);                   \
      SH[buf][kk][r >> 2][r & 3] = v.y;                     \
      slot_pos(i, 2, RT, KC, VEC, r, kk);                   \
      SH[buf][kk][r >> 2][r & 3] = v.z;                     \
      slot_pos(i, 3, RT, KC, VEC, r, kk);                   \
      SH[buf][kk][r >> 2][r & 3] = v.w;                     \
    }                                                       \
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

  // A as a BM x BK slab of rows m (stride a_rs), k stride a_cs; B as BN x BK with rows n.
  vec4 ra[NA], rb[NB];
  [[unroll]] for (int i = 0; i < NA; ++i)
    ra[i] = load_slot(pc.a, a_base, pc.a_rs, pc.a_cs, m0, pc.M, 0, BM, A_KC, VEC_A, i);
  [[unroll]] for (int i = 0; i < NB; ++i)
    rb[i] = load_slot(pc.b, b_base, pc.b_cs, pc.b_rs, n0, pc.N, 0, BN, B_KC, VEC_B, i);
  [[unroll]] for (int i = 0; i < NA; ++i) STORE_SLOT(As, BM, A_KC, VEC_A, 0, i, ra[i])
  [[unroll]] for (int i = 0; i < NB; ++i) STORE_SLOT(Bs, BN, B_KC, VEC_B, 0, i, rb[i])
  barrier();

  const int ntiles = (pc.K + BK - 1) / BK;
  int buf = 0;
  for (int kt = 0; kt < ntiles; ++kt) {
    const bool more = kt + 1 < ntiles;
    const int k1 = (kt + 1) * BK;
    if (more) {
      [[unroll]] for (int i = 0; i < NA; ++i)
        ra[i] = load_slot(pc.a, a_base, pc.a_rs, pc.a_cs, m0, pc.M, k1, BM, A_KC, VEC_A, i);
      [[unroll]] for (int i = 0; i < NB; ++i)
        rb[i] = load_slot(pc.b, b_base, pc.b_cs, pc.b_rs, n0, pc.N, k1, BN, B_KC, VEC_B, i);
    }
    [[unroll]] for (int kk = 0; kk < BK; ++kk) {
      vec4 af[TM / 4], bf[TN / 4];
      [[unroll]] for (int a = 0; a < TM / 4; ++a) af[a] = As[buf][kk][ty + a * (BM / TM)];
      [[unroll]] for (int b = 0; b < TN / 4; ++b) bf[b] = Bs[buf][kk][tx + b * (BN / TN)];
      [[unroll]] for (int i = 0; i < TM; ++i) {
        const float av = af[i / 4][i % 4];
        [[unroll]] for (int b = 0; b < TN / 4; ++b) acc[i][b] = fma(vec4(av), bf[b], acc[i][b]);
      }
    }
    if (more) {
      [[unroll]] for (int i = 0; i < NA; ++i) STORE_SLOT(As, BM, A_KC, VEC_A, buf ^ 1, i, ra[i])
      [[unroll]] for (int i = 0; i < NB; ++i) STORE_SLOT(Bs, BN, B_KC, VEC_B, buf ^ 1, i, rb[i])
    }
    barrier();
    buf ^= 1;
  }

  // Guarded stores, one flat loop without `continue` (see the header: it must unroll).
  const int c_base = z * pc.M * pc.N;
  [[unroll]] for (int ib = 0; ib < TM * (TN / 4); ++ib) {
    const int i = ib / (TN / 4), b = ib % (TN / 4);
    const int row = m0 + (ty + (i / 4) * (BM / TM)) * 4 + i % 4;
    const int col = n0 + (tx + b * (BN / TN)) * 4;
    const int o = c_base + row * pc.N + col;
    const vec4 v = acc[i][b];
#ifdef HALF
    if (row < pc.M) {
      if (col < pc.N) st(pc.c, uint(o), C_DT, v.x);
      if (col + 1 < pc.N) st(pc.c, uint(o + 1), C_DT, v.y);
      if (col + 2 < pc.N) st(pc.c, uint(o + 2), C_DT, v.z);
      if (col + 3 < pc.N) st(pc.c, uint(o + 3), C_DT, v.w);
    }
#else
    if (VEC_C != 0) {
      if (row < pc.M && col < pc.N) F4Buf(pc.c).v[o >> 2] = v;
    } else if (row < pc.M) {
      if (col < pc.N) FBuf(pc.c).v[o] = v.x;
      if (col + 1 < pc.N) FBuf(pc.c).v[o + 1] = v.y;
      if (col + 2 < pc.N) FBuf(pc.c).v[o + 2] = v.z;
      if (col + 3 < pc.N) FBuf(pc.c).v[o + 3] = v.w;
    }
#endif
  }
}

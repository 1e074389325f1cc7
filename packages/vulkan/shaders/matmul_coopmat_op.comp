// The bfloat16/float16 matmul op on tensor cores (VK_KHR_cooperative_matrix): C = A @ B for
// every batch index, A (M x K), B (K x N) and C (M x N, dense) of one 2-byte float type,
// float32 accumulation, each C element rounded once to the type (half.glsl's st: round to
// nearest even on the bits). csrc/ops/matmul.cpp dispatches it for matmul and out_prod; the
// push constants and their meaning are matmul_reg.comp's (any strides, two batch axes with
// broadcasting as stride 0).
//
// Unlike matmul_coopmat.comp (the standalone benchmark entry: row-major operands, sizes padded
// to the tile) nothing is padded: M, N, K of any size, out-of-range elements are staged into
// shared memory as zeros and the stores of C are masked.
//
// As there, the 16-bit element type is float16_t here and the bf16 module is this one with
// that type rewritten (tools/spirv_bf16.py): the shader moves 16-bit values as raw bits (uvec4
// or uint16_t loads, uvec4 shared stores) and only cooperative matrices have the f16 type.
//
// Tiling: a workgroup of NW subgroups owns a BM x BN tile of C; subgroup w owns a WM x WN
// sub-tile as (WM/16) x (WN/16) 16x16 f32 accumulators. K advances BK at a time: the slabs of
// step s + 1 are read from global memory into registers while step s is multiplied out of
// shared memory, then stored into the other of two shared buffers (one barrier a step).
// DEFER = 1 stores the slabs of step s + 1 at the start of step s, behind the barrier that
// ended step s - 1, and only then loads those of step s + 2: with the stores at the end of the
// step NVIDIA's compiler hoists them above the math, where they wait for the loads just issued
// (matmul_coopmat.comp's DEFER).
//
// Staging: each operand's slab is stored with the operand's contiguous axis along the shared
// row (rows padded by 8 elements against bank conflicts), and its fragments are loaded row- or
// column-major to match:
//   A_T = 0: A's k axis contiguous (or general strides): As[m][k], fragments row-major
//   A_T = 1: A's m axis contiguous (x^T views, out_prod): As[k][m], fragments column-major
//   B_T = 0: B's n axis contiguous (or general strides): Bs[k][n], fragments row-major
//   B_T = 1: B's k axis contiguous (W^T views): Bs[n][k], fragments column-major
// A staged slab is ROWS x COLS (COLS along the contiguous axis) in items of 8 elements: item q
// is row q / (COLS/8), elements (q % (COLS/8)) * 8 + 0..7 of that row. VEC_A / VEC_B: one
// uvec4 global load per item (the host checks: unit stride along the row, the row's extent,
// the other strides and the batch strides multiples of 8, the address 16-byte aligned; then an
// item is all inside the operand or all outside); otherwise 8 masked uint16_t loads.
//
// Epilogue: each subgroup stores one 16x16 accumulator at a time into its own 1 KiB of the
// (then idle) A buffers, and its invocations round and store the elements inside C.
//
// Build-time defines: BM BN BK WM WN (WM, WN, BK multiples of 16, BM and BN multiples of 8),
// DEFER (0, the default, or 1), ROT (0, the default, or 1: the
// slab items in a bank-conflict-free order, see item), FS (0, the default, or 1: B fragments
// loaded one at a time, each before its products), NC (0, the default, or 1: DEFER's loop
// without conditions).
// Specialization constants (csrc/coopmat.cpp, csrc/ops/matmul.cpp): 0 the workgroup size
// WG = NW * the subgroup size (8 to 32), 1 A_T, 2 B_T, 3 VEC_A, 4 VEC_B, 5 DT (2 bfloat16,
// 3 float16: the rounding of C; 0: C holds float32, the partial sums of a split-K product). The schedule and indexing are transliterated in
// tests/vulkan/test_vulkan_half_matmul_schedule.py (checked against A @ B on the CPU there).
#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "half.glsl"

#define NW ((BM / WM) * (BN / WN))  // subgroups per workgroup
#define TM (WM / 16)
#define TN (WN / 16)
#define MAX2(x, y) ((x) > (y) ? (x) : (y))
// One shared buffer of each operand, in uvec4 (8 elements): room for either staging.
#define A_STAGE (MAX2(BM * (BK + 8), BK * (BM + 8)) / 8)
#define B_STAGE (MAX2(BK * (BN + 8), BN * (BK + 8)) / 8)
#define GROUP_M 8  // workgroups walk C in bands of 8 tile rows (L2 reuse of B)

#if (BM * BK) % (8 * NW * 32) != 0 || (BK * BN) % (8 * NW * 32) != 0 || WM % 16 != 0 || WN % 16 != 0 || BK % 16 != 0 || BM % WM != 0 || BN % WN != 0
#error "matmul_coopmat_op.comp: BM*BK and BK*BN must be multiples of 8*NW*32; WM, WN, BK multiples of 16"
#endif
#ifndef DEFER
#define DEFER 0  // 1: a staged slab is stored at the start of the next step (see the K loop)
#endif
#ifndef ROT
#define ROT 0  // 1: slab items in a bank-conflict-free order for the shared stores (see item)
#endif
#if ROT && BK % 64 != 0 && 64 % BK != 0
#error "matmul_coopmat_op.comp: ROT needs BK dividing 64 or a multiple of it"
#endif
#ifndef FS
#define FS 0  // 1: B fragments loaded one at a time (see MATH_STEP)
#endif
#ifndef NC
#define NC 0  // 1 (DEFER only): no conditions in the K loop (see the loop)
#endif
#if NC && !DEFER
#error "matmul_coopmat_op.comp: NC needs DEFER"
#endif
#ifndef MB
#define MB 0  // 1 (DEFER, NC, BK 16): the barrier in the middle of a step's products (see the loop)
#endif
#if MB && (!DEFER || !NC || BK != 16 || TN % 2 != 0)
#error "matmul_coopmat_op.comp: MB needs DEFER, NC, BK 16 and an even TN"
#endif
#if 2 * BM * (BK + 8) / 8 < NW * 64 && 2 * BK * (BM + 8) / 8 < NW * 64
#error "matmul_coopmat_op.comp: the epilogue needs 1 KiB of the A buffers per subgroup"
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const int A_T = 0;
layout(constant_id = 2) const int B_T = 0;
layout(constant_id = 3) const int VEC_A = 0;
layout(constant_id = 4) const int VEC_B = 0;
layout(constant_id = 5) const int DT = DT_F16;
const uint WG = gl_WorkGroupSize.x;
const uint NA = BM * BK / 8 / WG;  // items of the A slab per invocation and step
const uint NB = BK * BN / 8 / WG;
// Register arrays sized for the smallest subgroup (8), loops to that constant bound skipping
// s >= NA: every index is a constant once unrolled (see matmul_coopmat.comp).
#define NA_MAX (BM * BK / 8 / (NW * 8))
#define NB_MAX (BK * BN / 8 / (NW * 8))

layout(buffer_reference, std430, buffer_reference_align = 16) readonly buffer U4In { uvec4 v[]; };  // read-only U4Buf

layout(push_constant) uniform PC {
  uvec2 a, b, c;
  int M, N, K;
  int a_rs, a_cs;  // A(m, k) = a[m * a_rs + k * a_cs]
  int b_rs, b_cs;  // B(k, n) = b[k * b_rs + n * b_cs]
  int nb1;         // the inner batch axis' length (batch index z = outer * nb1 + inner)
  int a_b0, a_b1, b_b0, b_b1;  // batch strides of A and B (outer, inner)
} pc;

shared uvec4 As[2 * A_STAGE];
shared uvec4 Bs[2 * B_STAGE];

// A staged operand: X(row, col) = x[base + row * rs + col * cs], rows < R, cols < C (the
// tile's origin added by the caller).
struct Operand {
  uvec2 x;
  int base, rs, cs, R, C;
};

// Item (row, cg) of a slab whose origin is (r0, c0): 8 elements along the row, zero outside.
uvec4 load_item(const Operand o, const int r0, const int c0, const int row, const int cg, const int VEC) {
  const int r = r0 + row, c = c0 + cg * 8;
  uvec4 v = uvec4(0u);
  if (VEC != 0) {
    if (r < o.R && c < o.C) v = U4In(o.x).v[(o.base + r * o.rs + c) >> 3];
  } else if (r < o.R) {
    const int at = o.base + r * o.rs + c * o.cs;
    [[unroll]] for (int e = 0; e < 8; ++e) {
      const uint h = c + e < o.C ? uint(U16Buf(o.x).v[at + e * o.cs]) : 0u;
      v[e >> 1] |= h << ((e & 1) * 16);
    }
  }
  return v;
}

// Item q of a slab whose rows hold `cols` elements: (row, uvec4 column). Row-major order (row
// q / (cols/8)) unless ROT and a row has fewer than 8 uvec4 (C = cols/8 of 2 or 4): then the 8
// invocations of a 16-byte store phase take the C columns of 8/C rows C apart (rows j, j + C,
// .. of a group of 8), which a padded row of C + 1 uvec4 puts in 8 different bank groups
// (matmul_coopmat.comp's A_ROW); row-major order puts two of their stores in one.
ivec2 item(const uint q, const uint cols) {
  const uint c = cols / 8;
  if (ROT != 0 && c < 8) return ivec2((q / (8 * c)) * 8 + (q % (8 * c)) / 8 + (q % 8) / c * c, q % c);
  return ivec2(q / c, q % c);
}

void main() {
  // Grouped order of the output tiles: consecutive workgroups share B columns.
  const uint tiles_n = (uint(pc.N) + BN - 1) / BN, tiles_m = (uint(pc.M) + BM - 1) / BM;
  const uint pid = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
  const uint per_group = GROUP_M * tiles_n;
  const uint first_m = (pid / per_group) * GROUP_M;
  const uint group_m = min(tiles_m - first_m, uint(GROUP_M));
  const uint tm = first_m + (pid % per_group) % group_m;
  const uint tn = (pid % per_group) / group_m;
  const int m0 = int(tm * BM), n0 = int(tn * BN);
  const int z = int(gl_WorkGroupID.z);
  const int zo = z / pc.nb1, zi = z % pc.nb1;

  const uint t = gl_LocalInvocationID.x;
  const uint w = gl_SubgroupID;
  const uint wm = (w / (BN / WN)) * WM, wn = (w % (BN / WN)) * WN;

  // The staged view of each operand (rows x cols of the slab, cols along shared rows).
  Operand oa, ob;
  oa.x = pc.a;
  oa.base = zo * pc.a_b0 + zi * pc.a_b1;
  oa.rs = A_T != 0 ? pc.a_cs : pc.a_rs;
  oa.cs = A_T != 0 ? pc.a_rs : pc.a_cs;
  oa.R = A_T != 0 ? pc.K : pc.M;
  oa.C = A_T != 0 ? pc.M : pc.K;
  ob.x = pc.b;
  ob.base = zo * pc.b_b0 + zi * pc.b_b1;
  ob.rs = B_T != 0 ? pc.b_cs : pc.b_rs;
  ob.cs = B_T != 0 ? pc.b_rs : pc.b_cs;
  ob.R = B_T != 0 ? pc.N : pc.K;
  ob.C = B_T != 0 ? pc.K : pc.N;
  const uint a_cols = A_T != 0 ? BM : BK, b_cols = B_T != 0 ? BK : BN;  // slab row lengths
  const uint sa = a_cols / 8 + 1, sb = b_cols / 8 + 1;  // padded shared rows, in uvec4

  coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[TM][TN];
  [[unroll]] for (int i = 0; i < TM; ++i)
    [[unroll]] for (int j = 0; j < TN; ++j)
      acc[i][j] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);

  uvec4 ra[NA_MAX], rb[NB_MAX];
  const int steps = (pc.K + BK - 1) / BK;
  // LOAD_STEP(s): the slabs of K step s into the registers; STORE_STEP(buf): the registers into
  // shared buffer buf; MATH_STEP(buf): the fragments of buffer buf multiplied into acc.
#define LOAD_STEP(s)                                                                              \
  {                                                                                               \
    const int k0 = (s) * BK;                                                                      \
    [[unroll]] for (uint i = 0; i < NA_MAX; ++i) {                                                \
      const uint q = i * WG + t;                                                                  \
      const ivec2 rc = item(q, a_cols);                                                           \
      if (i < NA) ra[i] = load_item(oa, A_T != 0 ? k0 : m0, A_T != 0 ? m0 : k0, rc.x, rc.y, VEC_A); \
    }                                                                                             \
    [[unroll]] for (uint i = 0; i < NB_MAX; ++i) {                                                \
      const uint q = i * WG + t;                                                                  \
      const ivec2 rc = item(q, b_cols);                                                           \
      if (i < NB) rb[i] = load_item(ob, B_T != 0 ? n0 : k0, B_T != 0 ? k0 : n0, rc.x, rc.y, VEC_B); \
    }                                                                                             \
  }
#define STORE_STEP(buf)                                                                           \
  {                                                                                               \
    const uint abase = (buf) * A_STAGE, bbase = (buf) * B_STAGE;                                  \
    [[unroll]] for (uint i = 0; i < NA_MAX; ++i) {                                                \
      const uint q = i * WG + t;                                                                  \
      const ivec2 rc = item(q, a_cols);                                                           \
      if (i < NA) As[abase + rc.x * sa + rc.y] = ra[i];                                           \
    }                                                                                             \
    [[unroll]] for (uint i = 0; i < NB_MAX; ++i) {                                                \
      const uint q = i * WG + t;                                                                  \
      const ivec2 rc = item(q, b_cols);                                                           \
      if (i < NB) Bs[bbase + rc.x * sb + rc.y] = rb[i];                                           \
    }                                                                                             \
  }
#define LOAD_FB(j)                                                                                             \
  if (B_T != 0)                                                                                                \
    coopMatLoad(fb[j], Bs, bbase + (wn + (j) * 16) * sb + kk / 8, sb, gl_CooperativeMatrixLayoutColumnMajor);  \
  else                                                                                                         \
    coopMatLoad(fb[j], Bs, bbase + kk * sb + (wn + (j) * 16) / 8, sb, gl_CooperativeMatrixLayoutRowMajor);
#define MATH_STEP(buf)                                                                                         \
  {                                                                                                            \
    const uint abase = (buf) * A_STAGE, bbase = (buf) * B_STAGE;                                               \
    [[unroll]] for (uint kk = 0; kk < BK; kk += 16) {                                                          \
      coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> fa[TM];                                      \
      coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> fb[TN];                                      \
      [[unroll]] for (uint i = 0; i < TM; ++i) {                                                               \
        if (A_T != 0)                                                                                          \
          coopMatLoad(fa[i], As, abase + kk * sa + (wm + i * 16) / 8, sa, gl_CooperativeMatrixLayoutColumnMajor); \
        else                                                                                                   \
          coopMatLoad(fa[i], As, abase + (wm + i * 16) * sa + kk / 8, sa, gl_CooperativeMatrixLayoutRowMajor);    \
      }                                                                                                        \
      [[unroll]] for (uint j = 0; j < TN; ++j) {                                                               \
        if (FS == 0) LOAD_FB(j);                                                                               \
      }                                                                                                        \
      [[unroll]] for (int j = 0; j < TN; ++j) {                                                                \
        if (FS != 0) LOAD_FB(j); /* FS: each B fragment right before its products */                          \
        [[unroll]] for (int i = 0; i < TM; ++i)                                                                \
          acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);                                                  \
      }                                                                                                        \
    }                                                                                                          \
  }
#if MB
  // MB = 1: the loop of DEFER and NC below, with the barrier in the middle of a step's products,
  // so that the next step's first fragments load behind the barrier while the rest of this
  // step's products run (no wait for fragments after the barrier; H200, bf16 4096^3, standalone:
  // 128x128 251 -> 258 TFLOP/s, 128x256 239 -> 247). At the start of step s, fa (A) and fb[j]
  // for j < TN/2 hold step s's fragments. The step stores the slabs of step s + 1 into buffer
  // (s + 1) & 1 and loads those of step s + 2 (as DEFER), loads fb[j >= TN/2] of step s,
  // multiplies the first half (j < TN/2), meets the barrier (step s + 1's slabs are visible
  // after it, and every read of buffer s & 1 came before it), loads step s + 1's A fragments
  // into fa2 and its first B fragments into fb[j < TN/2], multiplies the second half with fa and
  // moves fa2 into fa. The shared accesses between two barriers are DEFER's.
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> fa[TM];
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> fa2[TM];
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> fb[TN];
#define LOAD_FA(f, i)                                                                                     \
  if (A_T != 0)                                                                                           \
    coopMatLoad(f[i], As, abase + kk * sa + (wm + (i) * 16) / 8, sa, gl_CooperativeMatrixLayoutColumnMajor); \
  else                                                                                                    \
    coopMatLoad(f[i], As, abase + (wm + (i) * 16) * sa + kk / 8, sa, gl_CooperativeMatrixLayoutRowMajor);
  LOAD_STEP(0)
  STORE_STEP(0)
  LOAD_STEP(1)
  barrier();
  {
    const uint abase = 0, bbase = 0, kk = 0;
    [[unroll]] for (uint i = 0; i < TM; ++i) LOAD_FA(fa, i)
    [[unroll]] for (uint j = 0; j < TN / 2; ++j) LOAD_FB(j)
  }
  for (int s = 0; s < steps; ++s) {
    STORE_STEP((s + 1) & 1)
    LOAD_STEP(s + 2)
    {
      const uint bbase = (s & 1) * B_STAGE, kk = 0;
      [[unroll]] for (uint j = TN / 2; j < TN; ++j) LOAD_FB(j)
    }
    [[unroll]] for (int j = 0; j < TN / 2; ++j)
      [[unroll]] for (int i = 0; i < TM; ++i) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);
    barrier();
    {
      const uint abase = ((s + 1) & 1) * A_STAGE, bbase = ((s + 1) & 1) * B_STAGE, kk = 0;
      [[unroll]] for (uint i = 0; i < TM; ++i) LOAD_FA(fa2, i)
      [[unroll]] for (uint j = 0; j < TN / 2; ++j) LOAD_FB(j)
    }
    [[unroll]] for (int j = TN / 2; j < TN; ++j)
      [[unroll]] for (int i = 0; i < TM; ++i) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);
    [[unroll]] for (uint i = 0; i < TM; ++i) fa[i] = fa2[i];
  }
  barrier();  // the last step's (unused) fragment loads before the epilogue's stores into As
#elif DEFER
  // Step s reads buffer s & 1. It first stores the slabs of step s + 1 (loaded during step
  // s - 1) into buffer (s + 1) & 1, free since the barrier that ended step s - 1, then loads
  // those of step s + 2: the store waits on loads issued a whole step earlier, and the barrier
  // keeps the compiler from moving it next to them (matmul_coopmat.comp's DEFER).
  // NC = 1: no conditions in the loop: past K the loads stage zeros (load_item masks them) and
  // the last step stores them into the buffer no step reads any more (free since the barrier
  // that ended the step before), so the loop body is one basic block.
  LOAD_STEP(0)
  STORE_STEP(0)
  if (NC != 0 || 1 < steps) LOAD_STEP(1)
  barrier();
  for (int s = 0; s < steps; ++s) {
    if (NC != 0 || s + 1 < steps) STORE_STEP((s + 1) & 1)
    if (NC != 0 || s + 2 < steps) LOAD_STEP(s + 2)
    MATH_STEP(s & 1)
    barrier();
  }
#else
  for (int s = 0; s < steps + 1; ++s) {
    // s < steps: load the slabs of step s; s > 0: multiply step s - 1 (buffer (s - 1) & 1)
    // while they arrive; then store them into buffer s & 1, read by the next iteration.
    if (s < steps) LOAD_STEP(s)
    if (s > 0) MATH_STEP((s - 1) & 1)
    if (s < steps) STORE_STEP(s & 1)
    barrier();
  }
#endif

  // Epilogue (the loop ended on a barrier: no subgroup reads the A buffers any more). EPI(i, j)
  // is written out per fragment, not as a loop: the element loop inside would stop spirv-opt
  // from unrolling a fragment loop, and acc indexed by a variable goes to Function storage
  // (local memory).
  const uint scratch = w * 64;  // 16 x 16 floats in uvec4
  const uint lane = gl_SubgroupInvocationID;
  const int c_base = z * pc.M * pc.N;
#define EPI(I, J)                                                                           \
  if ((I) < TM && (J) < TN) {                                                               \
    coopMatStore(acc[(I) < TM ? (I) : 0][(J) < TN ? (J) : 0], As, scratch, 4,               \
                 gl_CooperativeMatrixLayoutRowMajor);                                       \
    subgroupMemoryBarrierShared();                                                          \
    subgroupBarrier();                                                                      \
    const int row0 = m0 + int(wm) + (I) * 16, col0 = n0 + int(wn) + (J) * 16;               \
    for (uint e = lane; e < 256; e += gl_SubgroupSize) {                                    \
      const int row = row0 + int(e / 16), col = col0 + int(e % 16);                         \
      const float v = uintBitsToFloat(As[scratch + e / 4][e % 4]);                          \
      if (row < pc.M && col < pc.N) st(pc.c, uint(c_base + row * pc.N + col), DT, v);       \
    }                                                                                       \
    subgroupBarrier();                                                                      \
  }
#define EPI_ROW(I) EPI(I, 0) EPI(I, 1) EPI(I, 2) EPI(I, 3)
#if TM > 4 || TN > 4
#error "matmul_coopmat_op.comp: the epilogue is written out for up to 4 x 4 fragments"
#endif
  EPI_ROW(0)
  EPI_ROW(1)
  EPI_ROW(2)
  EPI_ROW(3)
}

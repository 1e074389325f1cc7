// Tensor-core matmul through VK_KHR_cooperative_matrix: C (M x N, f32, row-major) =
// A (M x K, 16-bit floats, row-major) @ B (K x N, 16-bit floats, row-major), fp32
// accumulation.
//
// The 16-bit element type is float16_t here. The bf16 variant is this module with the
// 16-bit float type rewritten to bfloat16 after compilation (tools/spirv_bf16.py): the
// shader never does arithmetic on 16-bit values, it only moves their bits (uvec4 global
// loads, uvec4 shared stores) and hands them to coopMatLoad, so the one f16 type left in the
// SPIR-V is the component type of the A and B matrices.
//
// Tiling: a workgroup of NW subgroups (of the device's subgroup size: 32 on NVIDIA) owns a
// BM x BN tile of C; subgroup w owns a WM x WN sub-tile, kept as
// (WM/16) x (WN/16) 16x16x16 f32 accumulator matrices. K advances BK at a time (a step):
// the BM x BK slab of A and the BK x BN slab of B of step s + PD are read from global memory
// into registers (uvec4: 8 elements; PD register sets) while step s is multiplied out of
// shared memory, and the slabs of step s + 1 (read PD steps earlier) are stored into the
// other of the two shared buffers, one barrier per step. DEFER = 1 moves each step's stores
// to the start of the next step, behind its barrier (see STEP): NVIDIA's compiler otherwise
// hoists them above the math, where they wait for the loads issued just before. Shared rows
// are padded by 8 elements (16 bytes), which spreads the 16-byte row segments of a 16x16 load
// over all banks.
//
// Shapes (the host checks): M % BM == 0, N % BN == 0, K % (BK * PD) == 0 (the standalone
// entry pads with zeros), A, B, C 16-byte aligned.
//
// Build-time defines: BM BN BK WM WN (WM, WN, BK multiples of 16; BM/WM * BN/WN = NW
// subgroups), PD (prefetch distance in steps, 1 to 4), DEFER (0, or 1: stores at the start of
// the next step), ROT (0, or 1: A's slab items in a bank-conflict-free order for the shared
// stores, A_ROW), NC (0, or 1: no conditions in the DEFER loop, STEP), FS (0, or 1: B
// fragments loaded one at a time, MATH), MB (0, or 1 or 2: the barrier in the middle of a
// step's products, STEP) with MBS (the B columns before it), GROUP_M (the band of tile rows,
// 8), PROBE (diagnosis only, wrong results: tools/coopmat_probe.cpp). Specialization
// constant 0 (csrc/coopmat.cpp): the workgroup size WG = NW * the subgroup size (8 to 32; BM * BK / 8 and BK * BN / 8 must be
// multiples of it). The schedule and indexing are transliterated in
// tests/vulkan/test_vulkan_coopmat.py (checked against A @ B there).
#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_buffer_reference_uvec2 : require
#extension GL_EXT_control_flow_attributes : require

#ifndef PD
#define PD 1  // prefetch distance in K steps (1 to 4): register sets of staged slabs in flight
#endif
#ifndef DEFER
#define DEFER 0  // 1: a staged slab is stored at the start of the next step (see STEP)
#endif
#define NW ((BM / WM) * (BN / WN))  // subgroups per workgroup
#define SA ((BK + 8) / 8)  // padded shared row of A, in uvec4
#ifndef ROT
#define ROT 0  // 1: the A slab's items in a bank-conflict-free order (see A_ROW)
#endif
#if ROT && BK > 64
#error "matmul_coopmat.comp: ROT needs BK <= 64"
#endif
#ifndef FS
#define FS 0  // 1: B fragments loaded one at a time (see MATH)
#endif
#ifndef MB
#define MB 0  // 1 or 2 (DEFER, NC, BK 16, PROBE 0 or 3 to 6): the barrier in the middle of a step (STEP)
#endif
#if MB && (!DEFER || !NC || BK != 16 || PROBE == 1 || PROBE == 2)
#error "matmul_coopmat.comp: MB needs DEFER, NC, BK 16 and PROBE 0 or 3 to 6"
#endif
#ifndef NC
#define NC 0  // 1 (DEFER only): no conditions in the K loop (see STEP)
#endif
#if NC && !DEFER
#error "matmul_coopmat.comp: NC needs DEFER"
#endif
#define SB ((BN + 8) / 8)  // padded shared row of B, in uvec4
#define B_STAGE (BK * SB)
#define TM (WM / 16)
#define TN (WN / 16)
#ifndef MBS
#define MBS (TN / 2)  // MB: the B fragment columns multiplied before the barrier (1 to TN - 1)
#endif
#if MB && (MB > 2 || MBS < 1 || MBS >= TN)
#error "matmul_coopmat.comp: MB is 1 or 2, MBS 1 to TN - 1"
#endif
#ifndef GROUP_M
#define GROUP_M 8  // workgroups walk C in bands of 8 tile rows (L2 reuse of B)
#endif

#if (BM * BK) % (8 * NW * 32) != 0 || (BK * BN) % (8 * NW * 32) != 0 || WM % 16 != 0 || WN % 16 != 0 || BK % 16 != 0 || PD < 1 || PD > 4
#error "matmul_coopmat.comp: BM*BK and BK*BN must be multiples of 8*NW*32; WM, WN, BK multiples of 16; PD 1 to 4"
#endif

layout(local_size_x_id = 0) in;  // NW * the subgroup size (csrc/coopmat.cpp)
const uint WG = gl_WorkGroupSize.x;
const uint NA = BM * BK / 8 / WG;  // uvec4 of the A slab per invocation and step
const uint NB = BK * BN / 8 / WG;
// The register arrays are sized for the smallest subgroup (8) and every loop over them runs to
// that constant bound, skipping s >= NA: unrolled at build time, every index is a constant and
// the arrays stay in registers (a loop bound of the specialization constant NA would keep them
// in Function storage: local memory on NVIDIA, unless the driver unrolls after specializing).
#define NA_MAX (BM * BK / 8 / (NW * 8))
#define NB_MAX (BK * BN / 8 / (NW * 8))

// Slab loads: invocation t takes items q = s * WG + t: row q / (cols/8), uvec4 column q % (cols/8).
// A with ROT = 1: row A_ROW(q), column q % (BK/8) (see A_ROW). LOAD_SLABS(r, k0): the A and B
// slabs of the step starting at k0 into register set r; STORE_SLABS(r, buf): register set r
// into shared buffer buf.
#if ROT
// ROT = 1: the 8 invocations of a 16-byte store phase (a quarter subgroup) take the C = BK/8
// columns of 8/C rows that lie C apart (rows j, j + C, .. of a group of 8 rows, j = the phase
// in the group): a padded row of C + 1 uvec4 moves row j + C by C (C + 1) uvec4, which puts
// their columns in different 16-byte bank groups (C 2: rows 0 2 4 6, then 1 3 5 7; C 4: rows
// 0 4, 1 5, ..). Row-major order (ROT = 0) puts rows 0..8/C-1 in a phase, two of whose stores
// share a bank group for C = 2 and 4. The same rows as before in every subgroup's loads.
#define A_ROW(q) (((q) / BK) * 8 + ((q) % BK) / 8 + ((q) % 8) / (BK / 8) * (BK / 8))
#else
#define A_ROW(q) ((q) / (BK / 8))
#endif
#define LOAD_SLABS(r, k0)                                                                 \
  {                                                                                       \
  [[unroll]] for (uint s = 0; s < NA_MAX; ++s) {                                          \
    const uint q = s * WG + t;                                                            \
    if (s < NA) ra[r][s] = a.v[(LM0 + A_ROW(q)) * k8 + LKA(k0) / 8 + q % (BK / 8)];           \
  }                                                                                       \
  LOAD_B(r, k0)                                                                           \
  }
#define LOAD_B(r, k0)                                                                     \
  [[unroll]] for (uint s = 0; s < NB_MAX; ++s) {                                          \
    const uint q = s * WG + t;                                                            \
    if (s < NB) rb[r][s] = b.v[(LKB(k0) + q / (BN / 8)) * n8 + LN0 / 8 + q % (BN / 8)];       \
  }
#define STORE_B(r, buf)                                                                   \
  [[unroll]] for (uint s = 0; s < NB_MAX; ++s) {                                          \
    const uint q = s * WG + t;                                                            \
    if (s < NB) Bs[(buf) * B_STAGE + (q / (BN / 8)) * SB + q % (BN / 8)] = rb[r][s];      \
  }
#define LOAD_FB(j, kk) \
  coopMatLoad(fb[j], Bs, bbase + (kk) * SB + (wn + (j) * 16) / 8, SB, gl_CooperativeMatrixLayoutRowMajor)
#define STORE_SLABS(r, buf)                                                               \
  {                                                                                       \
  [[unroll]] for (uint s = 0; s < NA_MAX; ++s) {                                          \
    const uint q = s * WG + t;                                                            \
    if (s < NA) As[(buf) * (BM * SA) + A_ROW(q) * SA + q % (BK / 8)] = ra[r][s];          \
  }                                                                                       \
  STORE_B(r, buf)                                                                         \
  }

// STEP(u): K step s0 + u, its slabs in shared buffer (s0 + u) % 2; the slabs of step
// s0 + u + PD are loaded into register set u (in flight during PD steps of math), those of
// step s0 + u + 1 (register set (u + 1) % PD) stored for the next step.
#ifndef PROBE
// Diagnosis only (tools/coopmat_probe.cpp; the results are wrong): 1 leaves out the global loads
// and shared stores of the K loop (its ceiling with every slab in shared memory), 2 also the
// fragment loads (fragments loaded once: the tensor-core ceiling through the driver), 3 keeps
// the loads but every workgroup reads the first tile's rows and columns (no DRAM traffic), 4
// also always K step 0 (every load an L1 hit), 5 keeps the workgroup's own tile but reads B's
// slab of K step 0 at every step (B's loads L1 hits, A's from L2), 6 the same for A. 3 to 6
// keep the schedule and the instructions (MB too) and change only the addresses.
#define PROBE 0
#endif
#if PROBE == 3 || PROBE == 4
#define LM0 0u
#define LN0 0u
#else
#define LM0 m0
#define LN0 n0
#endif
#if PROBE == 4 || PROBE == 6
#define LKA(k) 0u  // the K offset of A's slab loads
#else
#define LKA(k) (k)
#endif
#if PROBE == 4 || PROBE == 5
#define LKB(k) 0u  // the K offset of B's slab loads
#else
#define LKB(k) (k)
#endif
#define LOAD_FRAGS(kk, abase, bbase)                                                                  \
  [[unroll]] for (int i = 0; i < TM; ++i)                                                             \
    coopMatLoad(fa[i], As, abase + (wm + i * 16) * SA + kk / 8, SA, gl_CooperativeMatrixLayoutRowMajor); \
  [[unroll]] for (int j = 0; j < TN; ++j)                                                             \
    if (FS == 0) LOAD_FB(j, kk);

// FS = 1: each B fragment loaded right before its products (fewer registers live).
#define MATH(cur)                                                                                     \
  {                                                                                                   \
    const uint abase = (cur) * (BM * SA), bbase = (cur) * B_STAGE;                                    \
    [[unroll]] for (int kk = 0; kk < BK; kk += 16) {                                                  \
      if (PROBE != 2) { LOAD_FRAGS(kk, abase, bbase) }                                                \
      [[unroll]] for (int j = 0; j < TN; ++j) {                                                       \
        if (FS != 0 && PROBE != 2) LOAD_FB(j, kk);                                                    \
        [[unroll]] for (int i = 0; i < TM; ++i)                                                       \
          acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);                                         \
      }                                                                                               \
    }                                                                                                 \
  }

#if MB
// STEP(u), MB = 1 or 2 (with DEFER and NC; BK = 16, one fragment K step per K step): the
// barrier in the middle of the step's products, so that the next step's first fragments load
// behind it while the rest of this step's products run (no wait for the fragments after the
// barrier). At the start of step s, fa (A) and fb[j < MBS] (the first B fragments) of step s
// are in registers. The step loads fb[j >= MBS] of step s, multiplies columns j < MBS, meets
// the barrier (which makes step s + 1's slabs visible and ends every read of buffer s % 2),
// loads step s + 1's A fragments into fa2 and its first B fragments into fb[j < MBS],
// multiplies columns j >= MBS with fa, and moves fa2 into fa. Before the barrier it stores the
// slabs of step s + 1 into buffer (s + 1) % 2 (whose last reads, step s - 1's fragments, came
// before the barrier of step s - 1) and loads those of step s + 1 + PD: MB = 1 at the start of
// the step, MB = 2 after the first products, so that a warp waiting for the loaded slab to
// store has its first products issued (H200, bf16 4096^3, 128x128: MB 1 with MBS 2 255 to
// 258 TFLOP/s, MB 2 with MBS 2 262 to 265, with MBS 1 265 to 267).
#define STAGE_NEXT(u)                                                                                 \
  {                                                                                                   \
    STORE_SLABS(((u) + 1) % PD, nxt);                                                                 \
    LOAD_SLABS(((u) + 1) % PD, min(step + 1 + PD, steps - 1) * BK);                                   \
  }
#define STEP(u)                                                                                       \
  {                                                                                                   \
    const uint step = s0 + (u);                                                                       \
    const uint cur = step % 2, nxt = (step + 1) % 2;                                                  \
    const uint bbase = cur * B_STAGE;                                                                 \
    if (MB == 1) STAGE_NEXT(u)                                                                        \
    [[unroll]] for (int j = MBS; j < TN; ++j) LOAD_FB(j, 0);                                          \
    [[unroll]] for (int j = 0; j < MBS; ++j)                                                          \
      [[unroll]] for (int i = 0; i < TM; ++i) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);    \
    if (MB == 2) STAGE_NEXT(u)                                                                        \
    barrier();                                                                                        \
    {                                                                                                 \
      const uint abase = nxt * (BM * SA), bbase = nxt * B_STAGE;                                      \
      [[unroll]] for (int i = 0; i < TM; ++i)                                                         \
        coopMatLoad(fa2[i], As, abase + (wm + i * 16) * SA, SA, gl_CooperativeMatrixLayoutRowMajor);  \
      [[unroll]] for (int j = 0; j < MBS; ++j) LOAD_FB(j, 0);                                         \
    }                                                                                                 \
    [[unroll]] for (int j = MBS; j < TN; ++j)                                                         \
      [[unroll]] for (int i = 0; i < TM; ++i) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);    \
    [[unroll]] for (int i = 0; i < TM; ++i) fa[i] = fa2[i];                                          \
  }
#elif DEFER
// STEP(u), DEFER = 1: K step s = s0 + u reads shared buffer s % 2. It first stores the slabs of
// step s + 1 (register set (u + 1) % PD, loaded PD steps earlier) into buffer (s + 1) % 2, free
// since the barrier that ended step s - 1, then loads the slabs of step s + 1 + PD into that
// register set. The store waits on loads issued PD steps earlier, across a barrier, so the
// compiler cannot move it next to them: with the store at the end of the step (DEFER = 0)
// NVIDIA's compiler (driver 580, H200 SASS) hoists it above the math, right behind the loads
// of the same step (PD = 1), and every step waits out a global load.
// NC = 1: the same without conditions in the loop: the last steps store into the buffer no step
// reads any more (free since the last barrier) and load step steps - 1 again (a valid address),
// so that the loop body is one basic block the compiler can schedule as a whole.
#define STEP(u)                                                                                       \
  {                                                                                                   \
    const uint step = s0 + (u);                                                                       \
    if ((PROBE == 0 || PROBE >= 3) && (NC != 0 || step + 1 < steps)) STORE_SLABS(((u) + 1) % PD, (step + 1) % 2); \
    if ((PROBE == 0 || PROBE >= 3) && NC != 0) LOAD_SLABS(((u) + 1) % PD, min(step + 1 + PD, steps - 1) * BK); \
    if (PROBE == 0 && NC == 0 && step + 1 + PD < steps)                                               \
      LOAD_SLABS(((u) + 1) % PD, (step + 1 + PD) * BK);                                               \
    MATH(step % 2)                                                                                    \
    if (PROBE != 2) barrier(); \
  }
#else
// STEP(u): K step s0 + u, its slabs in shared buffer (s0 + u) % 2; the slabs of step
// s0 + u + PD are loaded into register set u (in flight during PD steps of math), those of
// step s0 + u + 1 (register set (u + 1) % PD) stored for the next step.
#define STEP(u)                                                                                       \
  {                                                                                                   \
    const uint step = s0 + (u);                                                                       \
    if (PROBE == 0 && step + PD < steps) LOAD_SLABS((u), (step + PD) * BK);                           \
    MATH(step % 2)                                                                                    \
    if (PROBE < 2) {                                                                                  \
      if (PROBE == 0 && step + 1 < steps) STORE_SLABS(((u) + 1) % PD, (step + 1) % 2);                \
      barrier();                                                                                      \
    }                                                                                                 \
  }
#endif

layout(buffer_reference, std430, buffer_reference_align = 16) readonly buffer U4Buf { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) writeonly buffer FBuf { float v[]; };

layout(push_constant) uniform PC {
  uvec2 a, b, c;
  uint M, N, K;
} pc;

shared uvec4 As[2 * BM * SA];
shared uvec4 Bs[2 * B_STAGE];

void main() {
  // Grouped order of the output tiles: consecutive workgroups share B columns.
  const uint tiles_n = pc.N / BN, tiles_m = pc.M / BM;
  const uint pid = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
  const uint per_group = GROUP_M * tiles_n;
  const uint first_m = (pid / per_group) * GROUP_M;
  const uint group_m = min(tiles_m - first_m, uint(GROUP_M));
  const uint tm = first_m + (pid % per_group) % group_m;
  const uint tn = (pid % per_group) / group_m;
  const uint m0 = tm * BM, n0 = tn * BN;

  const uint t = gl_LocalInvocationID.x;
  const uint w = gl_SubgroupID;
  const uint wm = (w / (BN / WN)) * WM, wn = (w % (BN / WN)) * WN;
  const uint k8 = pc.K / 8, n8 = pc.N / 8;

  U4Buf a = U4Buf(pc.a);
  U4Buf b = U4Buf(pc.b);

  coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[TM][TN];
  [[unroll]] for (int i = 0; i < TM; ++i)
    [[unroll]] for (int j = 0; j < TN; ++j)
      acc[i][j] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);

  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> fa[TM];
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> fb[TN];
#if MB
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> fa2[TM];
#endif

  uvec4 ra[PD][NA_MAX], rb[PD][NB_MAX];
  const uint steps = pc.K / BK;  // a multiple of PD (the host pads K to BK * PD)

  // Step 0 straight into shared buffer 0; steps 1 .. PD-1 (DEFER: 1 .. PD) into their register
  // sets (set r holds the slabs of the steps s with s % PD == r).
  LOAD_SLABS(0, 0);
  STORE_SLABS(0, 0);
#if DEFER
  if (PD < steps) LOAD_SLABS(0, PD * BK);  // step PD, in set 0 (PD = 1: the next step)
#endif
#if PD > 1
  LOAD_SLABS(1, BK);
#endif
#if PD > 2
  LOAD_SLABS(2, 2 * BK);
#endif
#if PD > 3
  LOAD_SLABS(3, 3 * BK);
#endif
  barrier();
  if (PROBE == 2 || MB != 0) {
    const uint abase = 0, bbase = 0;
    LOAD_FRAGS(0, abase, bbase)
  }

  // The loop body is PD steps written out (STEP(u): step s0 + u), so that the register set of
  // every step is a constant index (spirv-opt does not unroll a loop around a barrier).
  for (uint s0 = 0; s0 < steps; s0 += PD) {
    STEP(0);
#if PD > 1
    STEP(1);
#endif
#if PD > 2
    STEP(2);
#endif
#if PD > 3
    STEP(3);
#endif
  }

  FBuf c = FBuf(pc.c);
  [[unroll]] for (int i = 0; i < TM; ++i)
    [[unroll]] for (int j = 0; j < TN; ++j)
      coopMatStore(acc[i][j], c.v, (m0 + wm + i * 16) * pc.N + n0 + wn + j * 16, pc.N,
                   gl_CooperativeMatrixLayoutRowMajor);
}

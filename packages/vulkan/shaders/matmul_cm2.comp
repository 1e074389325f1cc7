// Tensor-core matmul through VK_NV_cooperative_matrix2 (issue 18): C (M x N, row-major) =
// A (M x K, bfloat16, row-major) @ B (K x N, bfloat16, row-major), fp32 accumulation; C is
// float32, or bfloat16 with -DOUT_BF16 (each element rounded once).
//
// Unlike shaders/matmul_coopmat.comp (subgroup-scope 16x16 matrices staged through shared
// memory by the shader), a workgroup owns its whole BM x BN tile of C as one workgroup-scope
// accumulator, and each K step loads the BM x BK slab of A and the BK x BN slab of B straight
// from global memory with coopMatLoadTensorNV: the driver picks the staging (shared memory,
// asynchronous copies) and the fragment layout. The tensor layouts clamp: elements outside
// the operands read as zero and the store leaves out those outside C, so M, N, K need not be
// multiples of the tile.
//
// Specialization constants: 0 the workgroup size (one the device lists for workgroup scope,
// vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV), 1 BM, 2 BN, 3 BK
// (multiples of the listed granularities). Push constants as the standalone entry's
// (tools/coopmat_probe.cpp): the buffers' device addresses and M, N, K. The workgroups walk C
// in bands of GROUP_M tile rows (L2 reuse of B); dispatch (ceil(N / BN), ceil(M / BM), 1).
#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_bfloat16 : require
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_EXT_control_flow_attributes : require

#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef UNROLL
#define UNROLL 1  // K steps per loop iteration
#endif
#ifndef PF
#define PF 0  // 1: the slabs of step s + 1 are loaded before step s is multiplied (K % BK == 0)
#endif
#ifndef B_T
#define B_T 0  // 1: B is stored transposed (N x K, row-major), read through a transposing view
#endif
#ifndef MATH_ONLY
#define MATH_ONLY 0  // 1 (diagnosis only, wrong results): the K loop's loads left out
#endif
#ifndef NOCLAMP
#define NOCLAMP 0  // 1 (diagnosis only): no clamping, M, N, K multiples of the tile
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint BM = 128;
layout(constant_id = 2) const uint BN = 128;
layout(constant_id = 3) const uint BK = 32;

layout(buffer_reference, std430, buffer_reference_align = 16) readonly buffer In { bfloat16_t v[]; };
#if OUT_BF16
layout(buffer_reference, std430, buffer_reference_align = 16) writeonly buffer Out { bfloat16_t v[]; };
#else
layout(buffer_reference, std430, buffer_reference_align = 16) writeonly buffer Out { float v[]; };
#endif

layout(push_constant) uniform PC {
  In a;
  In b;
  Out c;
  uint M, N, K;
} pc;

#if NOCLAMP
#define CLAMP gl_CooperativeMatrixClampModeUndefinedNV
#else
#define CLAMP gl_CooperativeMatrixClampModeConstantNV
#endif
#define MAT_A coopmat<bfloat16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA>
#define MAT_B coopmat<bfloat16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB>
#define LOAD(ma, mb, k0)                                                              \
  coopMatLoadTensorNV(ma, pc.a.v, 0, sliceTensorLayoutNV(ta, r0, BM, k0, BK));        \
  LOAD_B(mb, k0)
#if B_T
#define LOAD_B(mb, k0) coopMatLoadTensorNV(mb, pc.b.v, 0, sliceTensorLayoutNV(tb, c0, BN, k0, BK), vt)
#else
#define LOAD_B(mb, k0) coopMatLoadTensorNV(mb, pc.b.v, 0, sliceTensorLayoutNV(tb, k0, BK, c0, BN))
#endif

void main() {
  // The tile of this workgroup: bands of GROUP_M tile rows, walked column by column.
  const uint gx = gl_NumWorkGroups.x, gy = gl_NumWorkGroups.y;
  const uint id = gl_WorkGroupID.y * gx + gl_WorkGroupID.x;
  const uint band = id / (GROUP_M * gx), first = band * GROUP_M;
  const uint rows = min(gy - first, GROUP_M), in_band = id - band * GROUP_M * gx;
  const uint r0 = (first + in_band % rows) * BM, c0 = (in_band / rows) * BN;

  tensorLayoutNV<2, CLAMP> ta = createTensorLayoutNV(2, CLAMP);
  tensorLayoutNV<2, CLAMP> tb = createTensorLayoutNV(2, CLAMP);
  tensorLayoutNV<2, CLAMP> tc = createTensorLayoutNV(2, CLAMP);
  ta = setTensorLayoutDimensionNV(ta, pc.M, pc.K);
#if B_T
  tb = setTensorLayoutDimensionNV(tb, pc.N, pc.K);
  tensorViewNV<2, false, 1, 0> vt = createTensorViewNV(2, false, 1, 0);
#else
  tb = setTensorLayoutDimensionNV(tb, pc.K, pc.N);
#endif
  tc = setTensorLayoutDimensionNV(tc, pc.M, pc.N);

  coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> acc =
      coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(0.0);
  const uint steps = (pc.K + BK - 1) / BK;
#if MATH_ONLY  // diagnosis only, wrong results: one load, every step multiplies the same slabs
  MAT_A ma;
  MAT_B mb;
  LOAD(ma, mb, 0);
  for (uint s = 0; s < steps; ++s) acc = coopMatMulAdd(ma, mb, acc);
#elif PF
  MAT_A ma;
  MAT_B mb;
  LOAD(ma, mb, 0);
  for (uint s = 1; s < steps; ++s) {
    MAT_A na;
    MAT_B nb;
    LOAD(na, nb, s * BK);
    acc = coopMatMulAdd(ma, mb, acc);
    ma = na;
    mb = nb;
  }
  acc = coopMatMulAdd(ma, mb, acc);
#else
  uint s = 0;
  for (; s + UNROLL <= steps; s += UNROLL) {
    [[unroll]] for (uint u = 0; u < UNROLL; ++u) {
      MAT_A ma;
      MAT_B mb;
      LOAD(ma, mb, (s + u) * BK);
      acc = coopMatMulAdd(ma, mb, acc);
    }
  }
  for (; s < steps; ++s) {
    MAT_A ma;
    MAT_B mb;
    LOAD(ma, mb, s * BK);
    acc = coopMatMulAdd(ma, mb, acc);
  }
#endif
#if OUT_BF16
  coopmat<bfloat16_t, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> res =
      coopmat<bfloat16_t, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(acc);
  coopMatStoreTensorNV(res, pc.c.v, 0, sliceTensorLayoutNV(tc, r0, BM, c0, BN));
#else
  coopMatStoreTensorNV(acc, pc.c.v, 0, sliceTensorLayoutNV(tc, r0, BM, c0, BN));
#endif
}

// ssm_scan_back, last pass: fixed-order sums of the partial results that ssm_scan.comp
// left in scratch (layout in csrc/ops/ssm.cpp), written into the packed gradient.
//   OP 0 dB, dC   out[k] = sum_blk part[blk][k]          k < S*T*G*N, blocks in order
//      1 ddt      ddt[i, t, h] = sigmoid(dt) * sum_p ddtp[i, t, h, p]
//      2 dA       dA[h, a] = sum_i sum_p dAp[i, h, p, a]
//      3 ds       ds[r] = sum over sequences i with ids[i] == r (in order i) of dss[i]
// Grid-stride loops, 256 threads per workgroup.
// The "_h" variant (-DHALF): dt in the dtype DTDT (float32, bfloat16 or float16: ldf.glsl).
#version 450
#include "common.glsl"
#include "ldf.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;
layout(constant_id = 1) const int DTDT = 0;

layout(push_constant) uniform PC {
  uvec2 src, src2, dst, dst2, dt, ids;
  uint n, m, P, H, NA, nstate, S;
} pc;

float sigmoid_cpu(float z) {
  if (z > 20.0) return 1.0;
  if (z < -87.0) return 0.0;
  return 1.0 / (exp(-z) + 1.0);
}

// The sum of n terms term(0), term(1), .. in that order (the loads of RU terms issued
// together: these loops wait on memory, not on arithmetic).
#define ORDERED_SUM(acc, n, term)                                 \
  for (uint j0 = 0u; j0 < (n); j0 += RU) {                        \
    float v_[RU];                                                 \
    [[unroll]] for (uint q = 0u; q < RU; ++q) {                   \
      const uint j = min(j0 + q, (n) - 1u);                       \
      v_[q] = term;                                               \
    }                                                             \
    [[unroll]] for (uint q = 0u; q < RU; ++q)                     \
      if (j0 + q < (n)) acc += v_[q];                             \
  }
const uint RU = 8u;

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  FBuf src = FBuf(pc.src), src2 = FBuf(pc.src2), dst = FBuf(pc.dst), dst2 = FBuf(pc.dst2);
  for (uint k = gl_GlobalInvocationID.x; k < pc.n; k += stride) {
    if (OP == 0) {  // m = blocks
      float a = 0.0, b = 0.0;
      ORDERED_SUM(a, pc.m, src.v[j * pc.n + k])
      ORDERED_SUM(b, pc.m, src2.v[j * pc.n + k])
      dst.v[k] = a;
      dst2.v[k] = b;
    } else if (OP == 1) {  // k over (S, T, H)
      float a = 0.0;
      ORDERED_SUM(a, pc.P, src.v[k * pc.P + j])
      dst.v[k] = a * sigmoid_cpu(ldf(pc.dt, int(k), DTDT));
    } else if (OP == 2) {  // k over (H, NA)
      const uint h = k / pc.NA, na = k % pc.NA;
      float a = 0.0;
      for (uint i = 0u; i < pc.S; ++i) ORDERED_SUM(a, pc.P, src.v[((i * pc.H + h) * pc.P + j) * pc.NA + na])
      dst.v[k] = a;
    } else {  // k over (R, H, P, N)
      const uint r = k / pc.nstate, e = k % pc.nstate;
      float a = 0.0;
      for (uint i0 = 0u; i0 < pc.S; i0 += RU) {  // RU sequences' loads at a time, in order
        float v[RU];
        bool mine[RU];
        [[unroll]] for (uint q = 0u; q < RU; ++q) {
          const uint i = min(i0 + q, pc.S - 1u);
          mine[q] = i0 + q < pc.S && IBuf(pc.ids).v[i] == int(r);
          v[q] = src.v[i * pc.nstate + e];
        }
        [[unroll]] for (uint q = 0u; q < RU; ++q)
          if (mine[q]) a += v[q];
      }
      dst.v[k] = a;
    }
  }
}

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

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  FBuf src = FBuf(pc.src), src2 = FBuf(pc.src2), dst = FBuf(pc.dst), dst2 = FBuf(pc.dst2);
  for (uint k = gl_GlobalInvocationID.x; k < pc.n; k += stride) {
    if (OP == 0) {  // m = blocks
      float a = 0.0, b = 0.0;
      for (uint j = 0u; j < pc.m; ++j) {
        a += src.v[j * pc.n + k];
        b += src2.v[j * pc.n + k];
      }
      dst.v[k] = a;
      dst2.v[k] = b;
    } else if (OP == 1) {  // k over (S, T, H)
      float a = 0.0;
      for (uint p = 0u; p < pc.P; ++p) a += src.v[k * pc.P + p];
      dst.v[k] = a * sigmoid_cpu(ldf(pc.dt, int(k), DTDT));
    } else if (OP == 2) {  // k over (H, NA)
      const uint h = k / pc.NA, na = k % pc.NA;
      float a = 0.0;
      for (uint i = 0u; i < pc.S; ++i)
        for (uint p = 0u; p < pc.P; ++p) a += src.v[((i * pc.H + h) * pc.P + p) * pc.NA + na];
      dst.v[k] = a;
    } else {  // k over (R, H, P, N)
      const uint r = k / pc.nstate, e = k % pc.nstate;
      float a = 0.0;
      for (uint i = 0u; i < pc.S; ++i)
        if (IBuf(pc.ids).v[i] == int(r)) a += src.v[i * pc.nstate + e];
      dst.v[k] = a;
    }
  }
}

// causal_conv_silu and causal_conv_silu_back (csrc/ops/fused.cpp): Mamba's depthwise causal
// convolution over time from zeros, plus bias, then SiLU, in the tokens-major layout.
//   x (S, T, D) any strides, c (D, W), bias (D,); R = S * T rows r = s * T + t
//   pre[r, ch] = bias[ch] + sum_k c[ch, k] x[s, t - W + 1 + k, ch]   (x = 0 before t = 0)
//   OP 0 forward      out[r, ch] = silu(pre)
//      1 g            g[r, ch] = dy[r, ch] silu'(pre)                 (scratch, R * D)
//      2 dx           dx[r, ch] = sum_k c[ch, k] g[s, t + W - 1 - k, ch]   (t + W - 1 - k < T)
//      3 parts        part[p, k, ch] = sum over rows r of block p (TB rows, across sequences)
//                     of g[r, ch] * x[s, t - W + 1 + k, ch] (k < W), g[r, ch] (k = W: bias)
//      4 reduce       dc[ch, k] = sum_p part[p, k, ch], d_bias[ch] = sum_p part[p, W, ch]
//                     (fixed order: deterministic)
// OP 0-2: one invocation per (row, channel), a workgroup 64 channels x 4 rows (coalesced
// along the channels). OP 3: a workgroup 64 channels x 4 taps of one block. No invocation
// walks the time axis (the loops run over W taps, TB rows or the parts: the host keeps each
// below lavapipe's 65535 iterations).
// The "_h" variant (-DHALF) reads x, c, bias and dy in the dtypes XDT, CDT, BDT, DYDT
// (float32, bfloat16 or float16: ldf.glsl) and writes OP 0's output in ODT (the float32
// result rounded once); the scratch and the backward's outputs stay float32.
#version 450
#include "common.glsl"
#include "ldf.glsl"

layout(local_size_x = 64, local_size_y = 4) in;
layout(constant_id = 0) const int OP = 0;
layout(constant_id = 1) const int HAS_B = 0;
layout(constant_id = 2) const int XDT = 0;
layout(constant_id = 3) const int CDT = 0;
layout(constant_id = 4) const int BDT = 0;
layout(constant_id = 5) const int DYDT = 0;
layout(constant_id = 6) const int ODT = 0;  // the forward's output dtype (_h: 2-byte allowed)

layout(push_constant) uniform PC {
  uvec2 x, c, b, dy, out_, g, part;
  int S, T, D, W;
  int xs0, xs1, xs2;  // x's strides: sequence, token, channel
  int cs0, cs1, bs;   // c's strides, bias's stride
  int TB, np;         // rows per block of OP 3, blocks
} pc;

float silu_pre(int s, int t, int ch) {
  float a = HAS_B != 0 ? ldf(pc.b, ch * pc.bs, BDT) : 0.0;
  const int base = s * pc.xs0 + ch * pc.xs2;
  for (int k = max(0, pc.W - 1 - t); k < pc.W; ++k)
    a += ldf(pc.c, ch * pc.cs0 + k * pc.cs1, CDT) * ldf(pc.x, base + (t - pc.W + 1 + k) * pc.xs1, XDT);
  return a;
}

void main() {
  const int lx = int(gl_LocalInvocationID.x), ly = int(gl_LocalInvocationID.y);
  const int R = pc.S * pc.T;
  if (OP == 4) {
    const int nk = pc.W + HAS_B;
    const int n = nk * pc.D;
    FBuf part = FBuf(pc.part), out_ = FBuf(pc.out_);
    const int stride = int(gl_NumWorkGroups.x) * 256;
    for (int i = int(gl_WorkGroupID.x) * 256 + int(gl_LocalInvocationIndex); i < n; i += stride) {
      const int k = i / pc.D, ch = i % pc.D;
      float acc = 0.0;
      for (int p = 0; p < pc.np; ++p) acc += part.v[(p * nk + k) * pc.D + ch];
      if (k < pc.W)
        out_.v[R * pc.D + ch * pc.W + k] = acc;
      else
        out_.v[R * pc.D + pc.D * pc.W + ch] = acc;
    }
    return;
  }
  const int ch = int(gl_WorkGroupID.x) * 64 + lx;
  if (ch >= pc.D) return;
  if (OP == 3) {
    const int p = int(gl_WorkGroupID.y), k = int(gl_WorkGroupID.z) * 4 + ly;
    const int nk = pc.W + HAS_B;
    if (k >= nk) return;
    FBuf g = FBuf(pc.g);
    const int r1 = min(R, (p + 1) * pc.TB);
    float acc = 0.0;
    for (int r = p * pc.TB; r < r1; ++r) {
      const float gv = g.v[r * pc.D + ch];
      if (k == pc.W) {
        acc += gv;
        continue;
      }
      const int s = r / pc.T, t = r % pc.T, tt = t - pc.W + 1 + k;
      if (tt >= 0) acc += gv * ldf(pc.x, s * pc.xs0 + tt * pc.xs1 + ch * pc.xs2, XDT);
    }
    FBuf(pc.part).v[(p * nk + k) * pc.D + ch] = acc;
    return;
  }
  const int r = int(gl_WorkGroupID.z * gl_NumWorkGroups.y + gl_WorkGroupID.y) * 4 + ly;
  if (r >= R) return;
  const int s = r / pc.T, t = r % pc.T;
  const int e = r * pc.D + ch;
  if (OP == 0) {
    const float a = silu_pre(s, t, ch);
#ifdef HALF
    st(pc.out_, uint(e), ODT, a / (1.0 + exp(-a)));
#else
    FBuf(pc.out_).v[e] = a / (1.0 + exp(-a));
#endif
  } else if (OP == 1) {
    const float a = silu_pre(s, t, ch);
    const float sg = 1.0 / (1.0 + exp(-a));
    FBuf(pc.g).v[e] = ldf(pc.dy, e, DYDT) * sg * (1.0 + a * (1.0 - sg));
  } else {
    FBuf g = FBuf(pc.g);
    float acc = 0.0;
    for (int k = max(0, t + pc.W - pc.T); k < pc.W; ++k)
      acc += ldf(pc.c, ch * pc.cs0 + k * pc.cs1, CDT) * g.v[e + (pc.W - 1 - k) * pc.D];
    FBuf(pc.out_).v[e] = acc;
  }
}

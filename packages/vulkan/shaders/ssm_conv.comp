// ssm_conv and ssm_conv_back: Mamba's depthwise causal convolution (see csrc/ops/ssm.cpp).
//   sx (S, D, L = W - 1 + T), c (D, W), y / dy (S, T, D)
//   OP 0 forward     y[s, t, ch]  = sum_k sx[s, ch, t + k] c[ch, k]
//      1 d_sx        d_sx[s, ch, q] = sum_k dy[s, q - k, ch] c[ch, k]   (0 <= q - k < T)
//      2 d_c parts   part[s, tb, ch, k] = sum_{t in block tb} dy[s, t, ch] sx[s, ch, t + k]
//      3 d_c         d_c[ch, k] = sum_{s, tb} part[s, tb, ch, k]   (fixed order)
// OP 0-2: one workgroup per (s, block of 32 channels, block of 32 tokens / positions), 256
// threads. The input and output are transposed relative to each other, so a tile goes
// through shared memory: loads are coalesced along the input's fast axis, stores along the
// output's. The W taps are walked in chunks of KC so that any d_conv fits the tile.
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;

const int CB = 32;  // channels per workgroup
const int TB = 32;  // tokens (positions) per workgroup
const int KC = 8;   // taps per chunk
const int RL = TB + KC + 1;  // tile row length (odd: conflict-free column reads)

layout(push_constant) uniform PC {
  uvec2 sx, c, dy, out_, part;
  int S, D, T, W, ntb, nch;
} pc;

shared float tile[CB * RL];
shared float dyt[TB * (CB + 1)];

void main() {
  const int lid = int(gl_LocalInvocationID.x);
  const int L = pc.W - 1 + pc.T;
  FBuf sx = FBuf(pc.sx), cw = FBuf(pc.c), dy = FBuf(pc.dy), out_ = FBuf(pc.out_), part = FBuf(pc.part);
  if (OP == 3) {  // grid-stride over D * W outputs, sum over S * ntb parts in order
    const int n = pc.D * pc.W, m = pc.S * pc.ntb;
    for (int idx = int(gl_GlobalInvocationID.x); idx < n; idx += int(gl_NumWorkGroups.x) * 256) {
      float acc = 0.0;
      for (int j = 0; j < m; ++j) acc += part.v[j * n + idx];
      out_.v[idx] = acc;
    }
    return;
  }
  const int wg = int(group_index());
  const int nb = OP == 1 ? (L + TB - 1) / TB : pc.ntb;
  const int cb = wg % pc.nch, rest = wg / pc.nch, tb = rest % nb, s = rest / nb;
  if (s >= pc.S) return;
  const int ch0 = cb * CB;
  const int t0 = tb * TB;
  if (OP == 0) {
    // thread: channel cx, tokens ty + 8 r
    const int cx = lid % CB, ty = lid / CB;
    const int ch = ch0 + cx;
    float acc[4] = float[4](0.0, 0.0, 0.0, 0.0);
    for (int k0 = 0; k0 < pc.W; k0 += KC) {
      barrier();
      for (int idx = lid; idx < CB * (TB + KC); idx += 256) {
        const int cc = idx / (TB + KC), j = idx % (TB + KC);
        const int q = t0 + k0 + j;
        tile[cc * RL + j] = (ch0 + cc < pc.D && q < L) ? sx.v[(s * pc.D + ch0 + cc) * L + q] : 0.0;
      }
      barrier();
      const int kn = min(KC, pc.W - k0);
      for (int k = 0; k < kn; ++k) {
        const float cv = ch < pc.D ? cw.v[ch * pc.W + k0 + k] : 0.0;
        [[unroll]] for (int r = 0; r < 4; ++r) acc[r] += tile[cx * RL + ty + 8 * r + k] * cv;
      }
    }
    if (ch < pc.D)
      [[unroll]] for (int r = 0; r < 4; ++r) {
        const int t = t0 + ty + 8 * r;
        if (t < pc.T) out_.v[(s * pc.T + t) * pc.D + ch] = acc[r];
      }
  } else if (OP == 1) {
    // thread: position q0 + qx, channels cy + 8 r; tile[cc][jj] = dy[s, tb0 + jj, ch0 + cc]
    const int qx = lid % TB, cy = lid / TB;
    float acc[4] = float[4](0.0, 0.0, 0.0, 0.0);
    for (int k0 = 0; k0 < pc.W; k0 += KC) {
      const int tb0 = t0 - k0 - (KC - 1);
      barrier();
      for (int idx = lid; idx < CB * (TB + KC); idx += 256) {
        const int cc = idx % CB, jj = idx / CB;
        const int t = tb0 + jj;
        tile[cc * RL + jj] = (ch0 + cc < pc.D && t >= 0 && t < pc.T) ? dy.v[(s * pc.T + t) * pc.D + ch0 + cc] : 0.0;
      }
      barrier();
      const int kn = min(KC, pc.W - k0);
      [[unroll]] for (int r = 0; r < 4; ++r) {
        const int ch = ch0 + cy + 8 * r;
        if (ch >= pc.D) continue;
        for (int k = 0; k < kn; ++k)
          acc[r] += tile[(cy + 8 * r) * RL + qx + KC - 1 - k] * cw.v[ch * pc.W + k0 + k];
      }
    }
    const int q = t0 + qx;
    [[unroll]] for (int r = 0; r < 4; ++r) {
      const int ch = ch0 + cy + 8 * r;
      if (ch < pc.D && q < L) out_.v[(s * pc.D + ch) * L + q] = acc[r];
    }
  } else {
    // dyt[t][cc] = dy[s, t0 + t, ch0 + cc]; thread: channel cx, tap k0 + kk
    for (int idx = lid; idx < TB * CB; idx += 256) {
      const int cc = idx % CB, t = idx / CB;
      dyt[t * (CB + 1) + cc] = (ch0 + cc < pc.D && t0 + t < pc.T) ? dy.v[(s * pc.T + t0 + t) * pc.D + ch0 + cc] : 0.0;
    }
    const int cx = lid % CB, kk = lid / CB;
    const int ch = ch0 + cx;
    for (int k0 = 0; k0 < pc.W; k0 += KC) {
      barrier();
      for (int idx = lid; idx < CB * (TB + KC); idx += 256) {
        const int cc = idx / (TB + KC), j = idx % (TB + KC);
        const int q = t0 + k0 + j;
        tile[cc * RL + j] = (ch0 + cc < pc.D && q < L) ? sx.v[(s * pc.D + ch0 + cc) * L + q] : 0.0;
      }
      barrier();
      float acc = 0.0;
      for (int t = 0; t < TB; ++t) acc += dyt[t * (CB + 1) + cx] * tile[cx * RL + t + kk];
      const int k = k0 + kk;
      if (ch < pc.D && k < pc.W) part.v[((s * pc.ntb + tb) * pc.D + ch) * pc.W + k] = acc;
    }
  }
}

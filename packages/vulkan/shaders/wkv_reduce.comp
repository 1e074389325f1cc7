// The second pass of the RWKV-family backward (wkv_back.comp): the NX per-row gradients of
// each token are the sums over the NB column blocks of the partials in `part`, added in
// block order (deterministic). One workgroup per (token, head) row of S elements.
// wkv6 also adds the bonus terms, with gv = dL/dy . v over the whole head:
//   dr += tf k gv,  dk += r tf gv,  and writes r k gv (d tf per token) to `ckpt`, summed over
//   the tokens afterwards by reduce.comp.
#version 450
#include "common.glsl"
#include "wkv_common.glsl"

shared float red[WG];

void main() {
  const uint row = group_index();
  if (row >= pc.T * pc.H) return;
  const uint S = pc.S, ths = pc.T * pc.H * S, hs = pc.H * S, base = row * S;
  const uint lid = gl_LocalInvocationIndex;
  FBuf res = FBuf(pc.dst);
#if OP == 0
  FBuf gy = FBuf(pc.src[NSRC]), v = FBuf(pc.src[SRC_V]);
  float s = 0.0;
  for (uint i = lid; i < S; i += WG) s += gy.v[base + i] * v.v[base + i];
  red[lid] = s;
  barrier();
  for (uint w = WG / 2u; w > 0u; w >>= 1) {
    if (lid < w) red[lid] += red[lid + w];
    barrier();
  }
  const float gv = red[0];
  const uint h = row % pc.H;
#endif
  for (uint kappa = lid; kappa < S; kappa += WG) {
    float val[NX];
    [[unroll]] for (uint xi = 0u; xi < NX; ++xi) {
      float a = 0.0;
      for (uint b = 0u; b < pc.NB; ++b) a += FBuf(addr_at(pc.part, b * NX + xi, ths)).v[base + kappa];
      val[xi] = a;
    }
#if OP == 0
    const float r = FBuf(pc.src[2]).v[base + kappa], k = FBuf(pc.src[0]).v[base + kappa];
    const float u = FBuf(pc.src[SRC_U]).v[h * S + kappa];
    val[0] += u * k * gv;
    val[1] += r * u * gv;
    FBuf(pc.ckpt).v[base + kappa] = r * k * gv;
#endif
    [[unroll]] for (uint xi = 0u; xi < NX; ++xi) res.v[x_off(xi, ths, hs) + base + kappa] = val[xi];
  }
}

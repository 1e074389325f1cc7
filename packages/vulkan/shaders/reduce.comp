// Sum or max of x over "summed" axes for every index of the "kept" axes (both collapsed by
// the host, up to 4 each): out[k] = reduce_s x[koff(k) + soff(s)], k < K, s < S.
//
//   MODE 0 (rows): one workgroup per (k, chunk of s); threads stride over s, then a shared
//          tree. For reductions whose summed axis is the dense one.
//   MODE 1 (cols): one thread per k (consecutive k are neighbours in memory), y = chunk.
//   Partial results: with nchunks > 1, out is a scratch of K * nchunks partials (rows:
//   [K][nchunks], cols: [nchunks][K]) reduced again by a second dispatch.
//   `scale` multiplies the final value (cross_entropy's mean).
// The order of every sum depends on the shapes only: results are deterministic.
//   HALF (the reduce_h variant): x and out of the dtypes XDT / ODT (float32, bfloat16,
//   float16: half.glsl), loaded as float32, accumulated in float32, rounded once on store
//   (the partials of a two-pass reduction stay float32).
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#endif

layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;        // 0 sum, 1 max
layout(constant_id = 1) const int MODE = 0;
layout(constant_id = 2) const int SIMPLE_K = 0;  // kept axes collapsed to one
layout(constant_id = 3) const int SIMPLE_S = 0;  // summed axes collapsed to one

layout(push_constant) uniform PC {
  uvec2 x, out_;
  uint K, S, chunk, nchunks;
  float scale;
  int kshape[4];
  int kst[4];
  int sshape[4];
  int sst[4];
} pc;

#ifdef HALF
layout(constant_id = 4) const int XDT = 0;
layout(constant_id = 5) const int ODT = 0;
float ldx(int i) { return ld(pc.x, uint(i), XDT); }
void sto(uint i, float v) { st(pc.out_, i, ODT, v); }
#else  // the float32 module: the buffers of main(), as before the HALF variant
#define ldx(i) x.v[i]
#define sto(i, val) out_.v[i] = (val)
#endif

shared float red[256];

float ident() { return OP == 0 ? 0.0 : uintBitsToFloat(0xff800000u); }
float comb(float a, float b) { return OP == 0 ? a + b : max_nan(a, b); }
int koff(uint k) { return SIMPLE_K != 0 ? int(k) * pc.kst[3] : offset4(k, pc.kshape, pc.kst); }
int soff(uint s) { return SIMPLE_S != 0 ? int(s) * pc.sst[3] : offset4(s, pc.sshape, pc.sst); }
float finish(float v) { return (OP == 0 && pc.nchunks == 1u) ? v * pc.scale : v; }

void main() {
#ifndef HALF
  FBuf x = FBuf(pc.x), out_ = FBuf(pc.out_);
#endif
  if (MODE == 0) {
    const uint g = group_index();
    if (g >= pc.K * pc.nchunks) return;
    const uint k = g / pc.nchunks, c = g % pc.nchunks;
    const uint s0 = c * pc.chunk, s1 = min(pc.S, s0 + pc.chunk);
    const int base = koff(k);
    const uint t = gl_LocalInvocationID.x;
    float acc = ident();
    for (uint s = s0 + t; s < s1; s += 256u) acc = comb(acc, ldx(base + soff(s)));
    red[t] = acc;
    barrier();
    [[unroll]] for (uint w = 128u; w > 0u; w >>= 1) {
      if (t < w) red[t] = comb(red[t], red[t + w]);
      barrier();
    }
    if (t == 0u) sto(g, finish(red[0]));
    return;
  }
  const uint c = gl_WorkGroupID.y;
  const uint s0 = c * pc.chunk, s1 = min(pc.S, s0 + pc.chunk);
  const uint stride = gl_NumWorkGroups.x * 256u;
  for (uint k = gl_GlobalInvocationID.x; k < pc.K; k += stride) {
    const int base = koff(k);
    float acc = ident();
    for (uint s = s0; s < s1; ++s) acc = comb(acc, ldx(base + soff(s)));
    sto(c * pc.K + k, finish(acc));
  }
}

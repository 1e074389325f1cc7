// get_rows_back: out (V, D) = scatter-add of grad rows (N, D) to rows idx (N), summed per
// table row in increasing n (the CPU's order): deterministic, no float atomics.
//   PASS 0 rank:    rank[n] = #{j < n : idx[j] == idx[n]}, counts[v] += 1 (integer atomics);
//                   the j < n walk split in blocks of RANK_BLOCK (the z of the grid), each
//                   adding its count: lavapipe ends one invocation's loops after 65535
//                   iterations in all, silently
//   PASS 1 scan:    start = exclusive prefix sum of counts (one workgroup)
//   PASS 2 scatter: pos[start[v] + rank[n]] = n
//   PASS 3 sum:     out[v, d] = sum over p in [start[v], start[v] + counts[v]) of grad[pos[p], d]
// counts and rank must be zeroed before PASS 0. Indices outside [0, V) set the error flag and are
// skipped.
// HALF (the get_rows_back_h variant): grad and out of the dtypes GDT / ODT (half.glsl), the
// sums float32, each output rounded once.
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#endif

layout(local_size_x = 256) in;
layout(constant_id = 0) const int PASS = 0;
#ifdef HALF
layout(constant_id = 1) const int GDT = 0;
layout(constant_id = 2) const int ODT = 0;
#endif
const uint RANK_BLOCK = 16384u;  // must match kRankBlock in ops/nn.cpp

layout(push_constant) uniform PC {
  uvec2 g, idx, out_, err, counts, start, rank, pos;
  uint N, V, D;
} pc;

#ifdef HALF
float ldg(uint i) { return ld(pc.g, i, GDT); }
void sto(uint i, float v) { st(pc.out_, i, ODT, v); }
#else
float ldg(uint i) { return FBuf(pc.g).v[i]; }
void sto(uint i, float v) { FBuf(pc.out_).v[i] = v; }
#endif

shared int tile[256];
shared uint scan[256];

void main() {
  IBuf idx = IBuf(pc.idx);
  UBuf counts = UBuf(pc.counts), start = UBuf(pc.start), rank = UBuf(pc.rank), pos = UBuf(pc.pos);
  const uint t = gl_LocalInvocationID.x;
  if (PASS == 0) {
    const uint g0 = group_index() * 256u;
    const uint i = g0 + t;
    const int v = i < pc.N ? idx.v[i] : -1;
    const bool valid = v >= 0 && uint(v) < pc.V;
    if (i < pc.N && !valid) set_error(pc.err, ERR_GET_ROWS_BACK);
    const uint last = min(pc.N, g0 + 256u);  // every thread of the group walks j < last
    const uint jb = gl_WorkGroupID.z * RANK_BLOCK, je = min(last, jb + RANK_BLOCK);
    if (jb >= last) return;  // the whole workgroup: no barrier is left waiting
    uint r = 0u;
    for (uint j0 = jb; j0 < je; j0 += 256u) {
      tile[t] = j0 + t < pc.N ? idx.v[j0 + t] : -1;
      barrier();
      const uint jn = min(256u, je - j0);
      for (uint j = 0u; j < jn; ++j) r += (j0 + j < i && tile[j] == v) ? 1u : 0u;
      barrier();
    }
    if (valid) {
      if (r != 0u) atomicAdd(rank.v[i], r);
      if (gl_WorkGroupID.z == 0u) atomicAdd(counts.v[uint(v)], 1u);
    }
  } else if (PASS == 1) {
    if (gl_WorkGroupID.x != 0u) return;
    // Chunks of 1024 counts: 4 per thread scanned in registers, the thread totals in
    // shared memory, a running carry across chunks.
    uint carry = 0u;
    for (uint c0 = 0u; c0 < pc.V; c0 += 1024u) {
      uint v[4];
      uint sum = 0u;
      [[unroll]] for (uint j = 0u; j < 4u; ++j) {
        const uint e = c0 + 4u * t + j;
        v[j] = e < pc.V ? counts.v[e] : 0u;
        sum += v[j];
      }
      scan[t] = sum;
      barrier();
      [[unroll]] for (uint off = 1u; off < 256u; off <<= 1) {
        const uint add = t >= off ? scan[t - off] : 0u;
        barrier();
        scan[t] += add;
        barrier();
      }
      uint excl = carry + scan[t] - sum;
      [[unroll]] for (uint j = 0u; j < 4u; ++j) {
        const uint e = c0 + 4u * t + j;
        if (e < pc.V) start.v[e] = excl;
        excl += v[j];
      }
      carry += scan[255];
      barrier();
    }
  } else if (PASS == 2) {
    const uint stride = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x; i < pc.N; i += stride) {
      const int v = idx.v[i];
      if (v >= 0 && uint(v) < pc.V) pos.v[start.v[uint(v)] + rank.v[i]] = i;
    }
  } else {
    const uint stride = gl_NumWorkGroups.x * 256u;
    const uint total = pc.V * pc.D;
    for (uint e = gl_GlobalInvocationID.x; e < total; e += stride) {
      const uint v = e / pc.D, d = e % pc.D;
      const uint p0 = start.v[v], p1 = p0 + counts.v[v];
      float s = 0.0;
      for (uint p = p0; p < p1; ++p) s += ldg(pos.v[p] * pc.D + d);
      sto(e, s);
    }
  }
}

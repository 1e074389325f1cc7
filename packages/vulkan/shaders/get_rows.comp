// get_rows: out[n, d] = table[idx[n], d]; table (V, D) and idx (N) dense. An index outside
// [0, V) sets the error flag and yields a zero row.
// HALF (the get_rows_h variant): table and out of the dtypes TDT / ODT (half.glsl); one
// 2-byte dtype on both sides moves the bits as they are.
#version 450
#include "common.glsl"
#ifdef HALF
#include "half.glsl"
#endif

layout(local_size_x = 256) in;
#ifdef HALF
layout(constant_id = 0) const int TDT = 0;
layout(constant_id = 1) const int ODT = 0;
#endif

layout(push_constant) uniform PC {
  uvec2 table, idx, out_, err;
  uint N, D, V;
} pc;

#ifdef HALF
void put(uint i, uint j) {  // out[i] = table[j]
  if (TDT == ODT && TDT != DT_F32)
    U16Buf(pc.out_).v[i] = U16Buf(pc.table).v[j];
  else
    st(pc.out_, i, ODT, ld(pc.table, j, TDT));
}
void zero(uint i) { st(pc.out_, i, ODT, 0.0); }
#else  // the float32 module: the buffers of main(), as before the HALF variant
#define put(i, j) out_.v[i] = table.v[j]
#define zero(i) out_.v[i] = 0.0
#endif

void main() {
#ifndef HALF
  FBuf table = FBuf(pc.table), out_ = FBuf(pc.out_);
#endif
  IBuf idx = IBuf(pc.idx);
  const uint stride = gl_NumWorkGroups.x * 256u;
  const uint total = pc.N * pc.D;
  for (uint i = gl_GlobalInvocationID.x; i < total; i += stride) {
    const uint n = i / pc.D, d = i % pc.D;
    const int v = idx.v[n];
    if (v < 0 || uint(v) >= pc.V) {
      if (d == 0u) set_error(pc.err, ERR_GET_ROWS);
      zero(i);
    } else {
      put(i, uint(v) * pc.D + d);
    }
  }
}

// get_rows: out[n, d] = table[idx[n], d]; table (V, D) and idx (N) dense. An index outside
// [0, V) sets the error flag and yields a zero row.
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform PC {
  uvec2 table, idx, out_, err;
  uint N, D, V;
} pc;

void main() {
  FBuf table = FBuf(pc.table), out_ = FBuf(pc.out_);
  IBuf idx = IBuf(pc.idx);
  const uint stride = gl_NumWorkGroups.x * 256u;
  const uint total = pc.N * pc.D;
  for (uint i = gl_GlobalInvocationID.x; i < total; i += stride) {
    const uint n = i / pc.D, d = i % pc.D;
    const int v = idx.v[n];
    if (v < 0 || uint(v) >= pc.V) {
      if (d == 0u) set_error(pc.err, ERR_GET_ROWS);
      out_.v[i] = 0.0;
    } else {
      out_.v[i] = table.v[uint(v) * pc.D + d];
    }
  }
}

// Shared by every shader: buffer references (tensors are device addresses passed in push
// constants), index helpers, the error flags word.
//
// Conventions: shapes and strides are in elements, right-aligned in 4 slots (slot 3 is the
// fastest axis; unused leading slots have size 1). Indices are 32-bit: the host refuses
// tensors past 2^31 elements.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_buffer_reference_uvec2 : require
#extension GL_EXT_control_flow_attributes : require

layout(buffer_reference, std430, buffer_reference_align = 4) buffer FBuf { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer IBuf { int v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer UBuf { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer F4Buf { vec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4Buf { uvec4 v[]; };  // 16 bytes as bits

// Error flags (Device::wait_all reports them): one word per op, set with a plain store (no
// atomics: the words live in host memory, where GPU atomics need PCIe atomic support).
// Must match ShaderError in ops/ops.h.
const uint ERR_GET_ROWS = 0u;
const uint ERR_GET_ROWS_BACK = 1u;
const uint ERR_CROSS_ENTROPY = 2u;
const uint ERR_CROSS_ENTROPY_BACK = 3u;
const uint ERR_SSM_SCAN = 4u;
const uint ERR_SSM_SCAN_BACK = 5u;

void set_error(uvec2 err, uint which) { UBuf(err).v[which] = 1u; }

// The linear index of this workgroup in a 2-D grid (one workgroup per item, see grid_2d).
uint group_index() { return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x; }

// Element offset of linear (row-major) index i of `shape` under `st`.
int offset4(uint i, int shape[4], int st[4]) {
  int off = 0;
  [[unroll]] for (int a = 3; a >= 1; --a) {
    const uint d = uint(shape[a]);
    off += int(i % d) * st[a];
    i /= d;
  }
  return off + int(i) * st[0];
}

// offset4 for a shape whose leading 4 - nd slots are 1 (nd in 1..4, a specialization
// constant in the callers, so the unused levels of index math compile away).
int offset_nd(uint i, int shape[4], int st[4], const int nd) {
  int off = 0;
  [[unroll]] for (int a = 3; a >= 1; --a) {
    if (a > 4 - nd) {
      const uint d = uint(shape[a]);
      off += int(i % d) * st[a];
      i /= d;
    }
  }
  return off + int(i) * st[4 - nd];
}

// The maximum numpy computes: a NaN wins.
float max_nan(float m, float v) { return (v > m || isnan(v)) ? v : m; }

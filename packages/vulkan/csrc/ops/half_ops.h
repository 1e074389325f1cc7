// bfloat16/float16 in the shape, reduction and lookup ops: which nodes take the "_h" shader
// variants (those built with -DHALF, which include shaders/half.glsl), and the dtype codes
// their specialization constants take. check_node (run.cpp) has already refused 2-byte
// tensors on a device without 16-bit storage.
#pragma once

#include <string>

#include "ops.h"

namespace recurra_vk {

inline bool is_half(recurra_dtype dt) { return dt == RECURRA_BF16 || dt == RECURRA_F16; }
inline bool is_float(recurra_dtype dt) { return dt == RECURRA_F32 || is_half(dt); }

// Whether the output or one of the first n_src sources is 2 bytes an element.
inline bool has_half(const recurra_node_desc& n, int n_src) {
  bool h = is_half(n.dst.dtype);
  for (int i = 0; i < n_src && i < n.n_src; ++i) h = h || is_half(n.src[i].dtype);
  return h;
}

// The dtype code of half.glsl (DT_F32 0, DT_BF16 2, DT_F16 3: recurra_dtype's values).
inline int32_t dt_code(recurra_dtype dt) { return static_cast<int32_t>(dt); }

// require_f32 with bfloat16/float16 allowed too: output and the first n_src sources float.
inline std::string require_float(const recurra_node_desc& n, int n_src) {
  if (!is_float(n.dst.dtype)) return std::string(n.op) + ": the output must be float32, bfloat16 or float16";
  for (int i = 0; i < n_src && i < n.n_src; ++i)
    if (!is_float(n.src[i].dtype))
      return std::string(n.op) + ": source " + std::to_string(i) + " must be float32, bfloat16 or float16";
  return "";
}

// The check of the fused float32 kernels reading 2-byte sources as they are
// (RECURRA_OPS_HALF_IN): a float32 output, float32/bfloat16/float16 sources.
inline std::string require_f32_out(const recurra_node_desc& n) {
  if (n.dst.dtype != RECURRA_F32) return std::string(n.op) + ": the output must be float32";
  return require_float(n, n.n_src);
}

// `module`, or its 2-byte variant `module_h` when `half`.
inline std::string variant(const char* module, bool half) { return half ? std::string(module) + "_h" : module; }

}  // namespace recurra_vk

#include "ops.h"

#include <algorithm>
#include <map>
#include <mutex>

namespace recurra_vk {

namespace {

std::map<std::string, OpImpl>& registry() {
  static std::map<std::string, OpImpl> r;
  return r;
}

void register_all() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_elementwise_ops();
    register_reduce_ops();
    register_matmul_ops();
    register_nn_ops();
    register_shape_ops();
    register_optim_ops();
    register_ssm_ops();
    register_rwkv_ops();
    register_fused_ops();
  });
}

}  // namespace

void add_op(const char* name, OpImpl impl) { registry()[name] = impl; }

const OpImpl* find_op(const char* name) {
  register_all();
  if (!name) return nullptr;
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : &it->second;
}

std::vector<std::string> op_names() {
  register_all();
  std::vector<std::string> out;
  for (const auto& kv : registry()) out.push_back(kv.first);
  return out;
}

int64_t numel(const recurra_tensor_desc& d) {
  int64_t n = 1;
  for (int i = 0; i < d.ndim; ++i) n *= d.shape[i];
  return n;
}

bool same_shape(const recurra_tensor_desc& a, const recurra_tensor_desc& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  return true;
}

bool is_dense(const recurra_tensor_desc& d) {
  int64_t expect = 1;
  for (int i = d.ndim - 1; i >= 0; --i) {
    if (d.shape[i] != 1 && d.strides[i] != expect) return false;
    expect *= d.shape[i];
  }
  return true;
}

int64_t max_offset(const recurra_tensor_desc& d) {
  int64_t o = 0;
  for (int i = 0; i < d.ndim; ++i) {
    if (d.shape[i] == 0) return 0;
    o += (d.shape[i] - 1) * d.strides[i];
  }
  return o;
}

std::string shape_str(const recurra_tensor_desc& d) {
  std::string s = "(";
  for (int i = 0; i < d.ndim; ++i) s += std::to_string(d.shape[i]) + (d.ndim == 1 ? "," : (i + 1 < d.ndim ? ", " : ""));
  return s + ")";
}

void dense_strides(const recurra_tensor_desc& d, int64_t* out) {
  int64_t acc = 1;
  for (int i = d.ndim - 1; i >= 0; --i) {
    out[i] = acc;
    acc *= d.shape[i];
  }
}

Dims4 dims4(const recurra_tensor_desc& d) {
  Dims4 r;
  for (int i = 0; i < d.ndim; ++i) {
    r.shape[4 - d.ndim + i] = static_cast<int32_t>(d.shape[i]);
    r.stride[4 - d.ndim + i] = static_cast<int32_t>(d.strides[i]);
  }
  return r;
}

Collapsed collapse(int n_operands, int nd, const int64_t* shape, const int64_t (*strides)[4]) {
  // Work innermost first: out axes in reverse order.
  int64_t sh[4];
  int64_t st[4][4];
  int m = 0;
  for (int i = nd - 1; i >= 0; --i) {
    if (shape[i] == 1) continue;
    if (m > 0) {
      bool merge = true;
      for (int k = 0; k < n_operands; ++k) merge = merge && strides[k][i] == st[k][m - 1] * sh[m - 1];
      if (merge) {
        sh[m - 1] *= shape[i];
        continue;
      }
    }
    sh[m] = shape[i];
    for (int k = 0; k < n_operands; ++k) st[k][m] = strides[k][i];
    ++m;
  }
  Collapsed c;
  c.nd = m;
  for (int j = 0; j < m; ++j) {
    c.shape[3 - j] = static_cast<int32_t>(sh[j]);
    for (int k = 0; k < n_operands; ++k) c.strides[k][3 - j] = static_cast<int32_t>(st[k][j]);
  }
  return c;
}

bool broadcast_strides(const recurra_tensor_desc& src, const recurra_tensor_desc& out, int64_t* st) {
  if (src.ndim > out.ndim) return false;
  for (int i = 0; i < out.ndim; ++i) {
    const int j = src.ndim - out.ndim + i;
    if (j < 0) {
      st[i] = 0;
    } else if (src.shape[j] == out.shape[i]) {
      st[i] = src.shape[j] == 1 ? 0 : src.strides[j];
    } else if (src.shape[j] == 1) {
      st[i] = 0;
    } else {
      return false;
    }
  }
  return true;
}

uint32_t grid_groups(int64_t n, int64_t per_group) {
  const int64_t g = (n + per_group - 1) / per_group;
  return static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(g, 0), 65535));
}

void grid_2d(int64_t n, uint32_t& gx, uint32_t& gy) {
  if (n <= 0) {
    gx = gy = 0;
    return;
  }
  gx = static_cast<uint32_t>(std::min<int64_t>(n, 65535));
  gy = static_cast<uint32_t>((n + gx - 1) / gx);
}

std::string require_srcs(const recurra_node_desc& n, int count) {
  if (n.n_src != count)
    return std::string(n.op) + " takes " + std::to_string(count) + " sources, got " + std::to_string(n.n_src);
  return "";
}

std::string require_f32(const recurra_node_desc& n, int n_src) {
  if (n.dst.dtype != RECURRA_F32) return std::string(n.op) + ": the output must be float32";
  for (int i = 0; i < n_src && i < n.n_src; ++i)
    if (n.src[i].dtype != RECURRA_F32) return std::string(n.op) + ": source " + std::to_string(i) + " must be float32";
  return "";
}

}  // namespace recurra_vk

// The op registry of the Vulkan backend and helpers shared by the op files.
//
// Each op file (elementwise, reduce, matmul, nn, shape) registers, per op name of the core's
// op table, a `check` (can this node run here? shapes, dtypes, layouts, parameters, exactly
// as the core's OpDef defines them) and a `record` (the dispatches of the node). Tensors
// reach the shaders as buffer device addresses with shapes and strides in elements.
#pragma once

#include <string>
#include <vector>

#include "../common.h"
#include "../device.h"
#include "recurra/op_spec.h"
#include "../recorder.h"

namespace recurra_vk {

// A tensor of a node, resolved to memory when the split is recorded.
struct Tensor {
  const recurra_tensor_desc* d = nullptr;
  VkDeviceAddress addr = 0;  // element 0 (the desc's byte offset included)
  Range range;               // the bytes the view can touch

  int ndim() const { return d->ndim; }
  int64_t dim(int i) const { return d->shape[i]; }
  int64_t stride(int i) const { return d->strides[i]; }
};

struct NodeCall {
  const recurra_node_desc& node;
  Tensor dst;
  Tensor src[RECURRA_MAX_SRC];
  Recorder& rec;
};

struct OpImpl {
  std::string (*check)(const recurra_node_desc& n);  // "" when supported, else why not
  void (*record)(NodeCall& c);
};

// "" when the node can run on the device (its tensors, then its op's own check), else why not.
// half_storage: whether the device stores 2-byte elements (Device::half_storage); without
// it every node with a bfloat16/float16 tensor is refused.
std::string check_node(const recurra_node_desc& n, bool half_storage);
// Validates the n nodes (all before recording any), resolves their tensors to memory and
// records and submits them on `dev` (run.cpp).
void compute_nodes(Device& dev, const recurra_node_desc* nodes, int32_t n);

// The op named `name`, or nullptr when the backend has no kernel for it.
const OpImpl* find_op(const char* name);
// Every op name with a kernel here.
std::vector<std::string> op_names();

void add_op(const char* name, OpImpl impl);
void register_elementwise_ops();
void register_reduce_ops();
void register_matmul_ops();
void register_nn_ops();
void register_shape_ops();
void register_optim_ops();
void register_ssm_ops();
void register_rwkv_ops();
void register_fused_ops();

// ---- helpers ------------------------------------------------------------------------

int64_t numel(const recurra_tensor_desc& d);
// The same shape (strides aside).
bool same_shape(const recurra_tensor_desc& a, const recurra_tensor_desc& b);
// Row-major dense (strides of size-1 axes do not matter).
bool is_dense(const recurra_tensor_desc& d);
// Largest element offset the view reaches (0 for an empty tensor).
int64_t max_offset(const recurra_tensor_desc& d);
// Bytes an element of `dt` takes: 2 for bfloat16/float16, 4 otherwise.
inline int elem_bytes(recurra_dtype dt) { return dt == RECURRA_BF16 || dt == RECURRA_F16 ? 2 : 4; }
std::string shape_str(const recurra_tensor_desc& d);
// The dense row-major strides of d's shape.
void dense_strides(const recurra_tensor_desc& d, int64_t* out);

// Shapes/strides right-aligned into 4 slots (leading slots: size 1, stride 0), as shaders
// take them.
struct Dims4 {
  int32_t shape[4] = {1, 1, 1, 1};
  int32_t stride[4] = {0, 0, 0, 0};
};
Dims4 dims4(const recurra_tensor_desc& d);

// An index space shared by several operands (dst first), collapsed: adjacent axes merge
// where every operand walks them with one uniform stride, size-1 axes drop. `strides[k]`
// holds operand k's strides (0 on broadcast axes) aligned with `shape`. Returns the
// collapsed shape/strides right-aligned in 4 slots.
struct Collapsed {
  int nd = 0;
  int32_t shape[4] = {1, 1, 1, 1};
  int32_t strides[4][4] = {};  // [operand][axis]
};
Collapsed collapse(int n_operands, int nd, const int64_t* shape, const int64_t (*strides)[4]);

// numpy broadcasting: strides of `src` as seen from shape `out` (0 on broadcast axes),
// right-aligned; false when the shapes do not broadcast.
bool broadcast_strides(const recurra_tensor_desc& src, const recurra_tensor_desc& out, int64_t* st);

// Workgroups for a grid-stride loop over n items with `per_group` items per workgroup pass
// (capped at 65535: the shaders loop over the rest).
uint32_t grid_groups(int64_t n, int64_t per_group);
// 2-D workgroup grid for one workgroup per item (rows > 65535 spill into y).
void grid_2d(int64_t n, uint32_t& gx, uint32_t& gy);

inline uint64_t addr(const Tensor& t) { return static_cast<uint64_t>(t.addr); }

// The i-th int parameter (0 when absent).
inline int64_t ip(const recurra_node_desc& n, int i) { return i < n.n_ip ? n.ip[i] : 0; }
inline double fp(const recurra_node_desc& n, int i) { return i < n.n_fp ? n.fp[i] : 0.0; }

// Common checks: dtypes of dst and sources, dense dst.
std::string require_f32(const recurra_node_desc& n, int n_src);
std::string require_srcs(const recurra_node_desc& n, int count);

// A reduction for reduce.comp: out[k] (dense, k over the kept axes in row-major order) =
// sum or max over the summed axes of x, times `scale` (sums only).
struct ReduceSpec {
  int op = 0;  // 0 sum, 1 max
  int kn = 0, sn = 0;
  int64_t kshape[4] = {}, kst[4] = {};
  int64_t sshape[4] = {}, sst[4] = {};
  float scale = 1.0f;
  recurra_dtype xdt = RECURRA_F32, odt = RECURRA_F32;  // bfloat16/float16: reduce_h (float32 sums)
};
void record_reduce(Recorder& rec, const ReduceSpec& r, uint64_t x, const Range& x_range, uint64_t out,
                   const Range& out_range);

}  // namespace recurra_vk

// Running nodes on a device: the checks every node passes before its op's own, and the
// resolution of its tensors to device memory; the device records and submits what the ops
// record (Device::compute), knowing no op itself.
#include <string>
#include <vector>

#include "ops.h"

namespace recurra_vk {

namespace {

std::string check_tensor(const recurra_tensor_desc& d) {
  if (d.ndim < 0 || d.ndim > RECURRA_MAX_DIMS) return "bad ndim";
  if (d.dtype != RECURRA_F32 && d.dtype != RECURRA_I32 && d.dtype != RECURRA_BF16 && d.dtype != RECURRA_F16)
    return "unknown dtype";
  for (int i = 0; i < d.ndim; ++i) {
    if (d.shape[i] < 0) return "negative dimension";
    if (d.shape[i] > 1 && d.strides[i] < 0) return "negative strides are not supported";
  }
  if (numel(d) > kMaxIndex || max_offset(d) > kMaxIndex) return "tensors past 2^31 elements are not supported";
  if (d.offset % elem_bytes(d.dtype))
    return "offsets must be multiples of the element size (" + std::to_string(elem_bytes(d.dtype)) + " bytes)";
  return "";
}

}  // namespace

std::string check_node(const recurra_node_desc& n, bool half_storage) {
  const OpImpl* op = find_op(n.op);
  if (!op) return std::string("op '") + (n.op ? n.op : "?") + "' has no Vulkan kernel";
  if (n.n_src < 0 || n.n_src > RECURRA_MAX_SRC) return "bad source count";
  if ((n.n_ip > 0 && !n.ip) || (n.n_fp > 0 && !n.fp)) return "null parameter array";
  std::string why = check_tensor(n.dst);
  if (!why.empty()) return "output: " + why;
  if (!is_dense(n.dst)) return "the output must be dense";
  for (int i = 0; i < n.n_src; ++i) {
    why = check_tensor(n.src[i]);
    if (!why.empty()) return "source " + std::to_string(i) + ": " + why;
  }
  if (!half_storage) {
    bool half = elem_bytes(n.dst.dtype) == 2;
    for (int i = 0; i < n.n_src; ++i) half = half || elem_bytes(n.src[i].dtype) == 2;
    if (half) return "bfloat16/float16 tensors need storageBuffer16BitAccess, which this device lacks";
  }
  return op->check(n);
}

void compute_nodes(Device& dev, const recurra_node_desc* nodes, int32_t n) {
  std::vector<const OpImpl*> impls;
  std::vector<std::vector<Tensor>> tensors;
  auto resolve = [&](const recurra_tensor_desc& d, int node, const char* what) {
    Tensor t;
    t.d = &d;
    const Allocation a = dev.memory().lookup(d.buffer, "compute");
    const int64_t count = numel(d);
    const uint64_t bytes = count == 0 ? 0 : static_cast<uint64_t>(max_offset(d) + 1) * elem_bytes(d.dtype);
    if (d.offset > a.nbytes || bytes > a.nbytes - d.offset)
      fail_invalid("compute: node " + std::to_string(node) + " (" + nodes[node].op + "): the " + what + " view " +
                   shape_str(d) + " at byte " + std::to_string(d.offset) + " reaches past the end of its buffer (" +
                   std::to_string(a.nbytes) + " bytes)");
    t.addr = dev.memory().address(a) + d.offset;
    t.range = {a.block, a.offset + d.offset, a.offset + d.offset + bytes};
    return t;
  };
  auto validate = [&] {
    impls.resize(n);
    for (int32_t i = 0; i < n; ++i) {
      const std::string why = check_node(nodes[i], dev.half_storage());
      if (!why.empty())
        fail(RECURRA_ERR_UNSUPPORTED, std::string("node ") + std::to_string(i) + " (" +
                                          (nodes[i].op ? nodes[i].op : "?") + "): " + why);
      impls[i] = find_op(nodes[i].op);
    }
    tensors.resize(n);
    for (int32_t i = 0; i < n; ++i) {
      tensors[i].push_back(resolve(nodes[i].dst, i, "output"));
      for (int k = 0; k < nodes[i].n_src; ++k) tensors[i].push_back(resolve(nodes[i].src[k], i, "source"));
    }
  };
  auto record = [&](Recorder& rec) {
    for (int32_t i = 0; i < n; ++i) {
      NodeCall call{nodes[i], tensors[i][0], {}, rec};
      for (int k = 0; k < nodes[i].n_src; ++k) call.src[k] = tensors[i][k + 1];
      rec.begin_node(nodes[i].op);
      impls[i]->record(call);
      rec.end_node();
    }
  };
  dev.compute(nodes, n, validate, record);
}

}  // namespace recurra_vk

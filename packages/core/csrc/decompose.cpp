// Which backend takes a node, and decompositions: a node of an op with a decomposition
// (recurra/op_spec.h) that the backend it would be placed on does not take is built from
// other ops instead, when it is created (Graph::op), recursively. The placement rule is
// the scheduler's (schedule.cpp): the first open backend of set_backends() whose
// supports_op takes the node, else the CPU. A node no listed device takes would run on the
// CPU, away from the device graph around it: it is decomposed so its pieces can run on the
// device. On the CPU alone a node is decomposed only when the CPU kernel refuses it
// (OpDef::cpu_supports, or the test knob set_cpu_refused_ops).
//
// The backward follows: a fused node kept on a backend gets its backward op (which should
// run there too); a decomposed one gets the gradients of its pieces.
#include <mutex>
#include <set>
#include <unordered_map>

#include "graph.h"
#include "ops/ssm.h"

namespace recurra {

namespace {

// Builds the decomposition of node n (inferred, not yet in the graph) and returns the id of
// the node holding its result (of n's shape), or -1 when n has nothing to decompose.
using Decomposition = int (*)(Graph& g, const Node& n);

int reshape_to(Graph& g, int a, const Shape& s) { return g.node(a).shape == s ? a : g.reshape(a, s); }

// gated_rms_norm(y, [z], w, [x, D]; group_size; eps): h = (y + x D) * silu(z), then
// rms_norm over groups of group_size channels, times w.
int gated_rms_norm_ops(Graph& g, const Node& n) {
  const size_t k = n.src.size();
  const int y = n.src[0], z = k == 3 || k == 5 ? n.src[1] : -1, w = n.src[z >= 0 ? 2 : 1];
  const Shape ys = g.node(y).shape;
  const int64_t c = ys[ys.ndim - 1], gs = n.ip[RECURRA_P_GROUP_SIZE];
  int h = y;
  if (k >= 4) {  // the D skip: x (ys) times D (H,), one value per block of C / H channels
    const int x = n.src[k - 2], d = n.src[k - 1];
    const int64_t heads = g.node(d).shape[0];
    Shape hs = ys;
    hs.d[hs.ndim - 1] = heads;
    hs.d[hs.ndim++] = c / heads;
    const int xh = reshape_to(g, x, hs);  // (one statement each: the nodes come in this order)
    const int dh = g.reshape(d, Shape{heads, 1});
    const int skip = reshape_to(g, g.mul(xh, dh), ys);
    h = g.add(y, skip);
  }
  if (z >= 0) {
    const int gate = g.op("silu", {z});
    h = g.mul(h, gate);
  }
  const std::vector<double> eps{n.fp[RECURRA_P_EPS]};
  if (gs != c) {
    Shape grouped = ys;
    grouped.d[grouped.ndim - 1] = c / gs;
    grouped.d[grouped.ndim++] = gs;
    const int hg = reshape_to(g, h, grouped);
    h = reshape_to(g, g.op("rms_norm", {hg}, {}, eps), ys);
  } else {
    h = g.op("rms_norm", {h}, {}, eps);
  }
  const int out = g.mul(h, w);
  if (n.ip.size() <= RECURRA_P_OUT_DTYPE || n.ip[RECURRA_P_OUT_DTYPE] == static_cast<int64_t>(DType::f32)) return out;
  return g.op("cast", {out}, {n.ip[RECURRA_P_OUT_DTYPE]});
}

// causal_conv_silu(x (S, T, D), c (D, K), [bias]): silu(ssm_conv(x^T padded with K - 1
// zeros in front) + bias).
int causal_conv_silu_ops(Graph& g, const Node& n) {
  const int64_t k = g.node(n.src[1]).shape[1];
  const int xt = g.permute(n.src[0], {0, 2, 1});
  const int sx = g.op("pad", {xt}, {0, 0, 0, 0, k - 1, 0}, {0.0});
  int y = g.op("ssm_conv", {sx, n.src[1]});
  if (n.src.size() == 3) y = g.add(y, n.src[2]);
  y = g.op("silu", {y});
  if (n.ip.empty() || n.ip[RECURRA_P_CONV_OUT_DTYPE] == static_cast<int64_t>(DType::f32)) return y;
  return g.op("cast", {y}, {n.ip[RECURRA_P_CONV_OUT_DTYPE]});
}

// ssm_scan with CHECKPOINTS_AUTO: the scan saving its checkpoints where the backend it would
// be placed on takes (and reads) them, else the scan without them.
int ssm_scan_ops(Graph& g, const Node& n) {
  if (n.ip.empty() || !(n.ip[RECURRA_P_SCAN_FLAGS] & RECURRA_SSM_SCAN_CHECKPOINTS_AUTO)) return -1;
  Node save = n;
  save.ip = {RECURRA_SSM_SCAN_SAVE_CHECKPOINTS};
  bool taken = false;
  try {
    OpTable::get().at(n.op).infer(g, save);  // the layout may have no checkpoints
    contiguous_strides(save.shape, save.strides);
    taken = g.runs_as_is(save);
  } catch (const ValueError&) {
  }
  return g.op("ssm_scan", n.src, {taken ? RECURRA_SSM_SCAN_SAVE_CHECKPOINTS : 0});
}

const std::unordered_map<std::string, Decomposition>& decompositions() {
  static const std::unordered_map<std::string, Decomposition> d{
      {"gated_rms_norm", gated_rms_norm_ops},
      {"causal_conv_silu", causal_conv_silu_ops},
      {"ssm_scan", ssm_scan_ops},
  };
  return d;
}

std::mutex refused_mu;
std::set<std::string>& refused() {
  static std::set<std::string> r;
  return r;
}

bool cpu_refuses(const std::string& name) {
  std::lock_guard<std::mutex> lock(refused_mu);
  return refused().count(name) > 0;
}

}  // namespace

static_assert(RECURRA_F32 == static_cast<int>(DType::f32) && RECURRA_I32 == static_cast<int>(DType::i32) &&
                  RECURRA_BF16 == static_cast<int>(DType::bf16) && RECURRA_F16 == static_cast<int>(DType::f16),
              "DType and recurra_dtype share their codes");

recurra_tensor_desc shape_desc(const Node& n) {
  recurra_tensor_desc d{};
  d.dtype = static_cast<recurra_dtype>(static_cast<int>(n.dtype));  // the same codes
  d.ndim = n.shape.ndim;
  for (int i = 0; i < kMaxDims; ++i) {
    d.shape[i] = i < n.shape.ndim ? n.shape.d[i] : 1;
    d.strides[i] = i < n.shape.ndim ? n.strides[i] : 1;
  }
  return d;
}

// Whether backend b (not the CPU, not closed) has a kernel for node nd as it is shaped.
// Nodes with more sources than the C table carries never reach a plugin.
bool Graph::backend_supports(int b, const Node& nd) const {
  if (nd.src.size() > RECURRA_MAX_SRC) return false;
  const BackendEntry& e = backend_entry(b);
  recurra_node_desc desc{};
  desc.op = OpTable::get().at(nd.op).name.c_str();
  desc.dst = shape_desc(nd);
  desc.n_src = static_cast<int32_t>(nd.src.size());
  for (size_t i = 0; i < nd.src.size(); ++i) {
    desc.src[i] = shape_desc(nodes_[nd.src[i]]);
    desc.src[i].offset = static_cast<size_t>(nodes_[nd.src[i]].view_offset) * dtype_size(nodes_[nd.src[i]].dtype);
  }
  desc.n_ip = static_cast<int32_t>(nd.ip.size());
  desc.ip = nd.ip.data();
  desc.n_fp = static_cast<int32_t>(nd.fp.size());
  desc.fp = nd.fp.data();
  return e.table->supports_op(e.table->ctx, e.device, &desc) == 1;
}

bool Graph::backend_supports(int b, int j) const { return backend_supports(b, nodes_[j]); }

bool Graph::cpu_supports(const Node& n) const {
  const OpDef& def = OpTable::get().at(n.op);
  if (cpu_refuses(def.name)) return false;
  return !def.cpu_supports || def.cpu_supports(*this, n);
}

bool Graph::runs_as_is(const Node& n) const {
  bool device = false;
  for (int b : backends_) {
    if (backend_entry(b).closed) continue;
    device = true;
    if (backend_supports(b, n)) return true;
  }
  return !device && cpu_supports(n);
}

int Graph::decompose_unless_taken(const Node& n) {
  const std::string& name = OpTable::get().at(n.op).name;
  const auto it = decompositions().find(name);
  if (it == decompositions().end() || runs_as_is(n)) return -1;
  // ssm_scan's "decomposition" is ssm_scan again (its checkpoints chosen), taking the mix.
  if (!recurra_op_takes_half_in(name.c_str()) || name == "ssm_scan") return it->second(*this, n);
  // The pieces take one float dtype: 2-byte sources widened to float32 first (exactly).
  Node w = n;
  for (int& s : w.src)
    if (is_half(nodes_[s].dtype)) s = op("cast", {s}, {static_cast<int64_t>(DType::f32)});
  return it->second(*this, w);
}

void check_decompositions_against_spec(const OpTable& t) {
  int32_t n = 0;
  const recurra_op_spec* spec = recurra_op_specs(&n);
  for (int32_t i = 0; i < n; ++i)
    if ((spec[i].decomposition[0] != 0) != (decompositions().count(spec[i].name) > 0))
      throw StateError(std::string("internal: recurra/op_spec.h and decompose.cpp disagree on whether ") +
                       spec[i].name + " has a decomposition");
  for (const auto& kv : decompositions())
    if (t.find(kv.first) < 0) throw StateError("internal: decomposition of unknown op " + kv.first);
}

void set_cpu_refused_ops(const std::vector<std::string>& names) {
  for (const auto& nm : names)
    if (OpTable::get().find(nm) < 0) throw ValueError("unknown op '" + nm + "'");
  std::lock_guard<std::mutex> lock(refused_mu);
  refused() = std::set<std::string>(names.begin(), names.end());
}

}  // namespace recurra

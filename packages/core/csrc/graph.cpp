#include "graph.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <new>

#include "memory.h"

namespace recurra {

// ---- small helpers ------------------------------------------------------------------

// A shape whose element count, or byte count, an int64 cannot hold is refused where it is
// made: kernels and allocators compute with numel() * 4, which would wrap around.
static void check_size(const std::string& what, const Shape& s, DType dtype) {
  int64_t n = 1;
  bool over = false;
  for (int i = 0; i < s.ndim; ++i) over = over || __builtin_mul_overflow(n, s.d[i], &n);
  int64_t bytes = 0;
  over = over || __builtin_mul_overflow(n, static_cast<int64_t>(dtype_size(dtype)), &bytes);
  if (!over) return;
  long double count = 1;
  for (int i = 0; i < s.ndim; ++i) count *= static_cast<long double>(s.d[i]);
  char counts[96];
  std::snprintf(counts, sizeof counts, "%.0Lf elements (%.0Lf bytes)", count, count * dtype_size(dtype));
  throw ValueError(std::string(what) + ": shape " + s.str() + " has " + counts + ", more than a 64-bit size can hold");
}

// A node its op's infer accepted must also fit the op's spec (recurra/op_spec.h): the
// counts a backend plugin relies on. A mismatch is a bug of the core, not of the caller.
static void check_counts(const recurra_op_spec& sp, const Node& n) {
  auto in = [](size_t v, int32_t lo, int32_t hi) {
    return static_cast<int64_t>(v) >= lo && (hi < 0 || static_cast<int64_t>(v) <= hi);
  };
  if (!in(n.src.size(), sp.src_min, sp.src_max) || !in(n.ip.size(), sp.ip_min, sp.ip_max) ||
      !in(n.fp.size(), sp.fp_min, sp.fp_max))
    throw StateError(std::string("internal: a ") + sp.name + " node with " + std::to_string(n.src.size()) +
                     " sources, " + std::to_string(n.ip.size()) + " ip and " + std::to_string(n.fp.size()) +
                     " fp disagrees with recurra/op_spec.h");
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int i = shape.ndim - 1; i >= 0; --i) {
    if (shape.d[i] != 1 && strides[i] != expect) return false;
    expect *= shape.d[i];
  }
  return true;
}

bool Node::is_leaf() const { return op < 0; }

Shape broadcast_shapes(const char* op, const Shape& a, const Shape& b) {
  Shape out;
  out.ndim = std::max(a.ndim, b.ndim);
  for (int i = 0; i < out.ndim; ++i) {
    int ia = a.ndim - out.ndim + i, ib = b.ndim - out.ndim + i;
    int64_t da = ia >= 0 ? a.d[ia] : 1, db = ib >= 0 ? b.d[ib] : 1;
    if (da != db && da != 1 && db != 1)
      throw ValueError(std::string(op) + ": shapes " + a.str() + " and " + b.str() +
                       " cannot be broadcast together");
    out.d[i] = da == 1 ? db : da;
  }
  return out;
}

void broadcast_strides(const TensorView& src, const Shape& shape, int64_t* out) {
  for (int i = 0; i < shape.ndim; ++i) {
    int is = src.shape.ndim - shape.ndim + i;
    out[i] = (is < 0 || src.shape.d[is] == 1) ? 0 : src.strides[is];
  }
}

std::string shapes_str(const Graph& g, const Node& n) {
  std::string s;
  for (size_t i = 0; i < n.src.size(); ++i) {
    if (i) s += ", ";
    s += g.node(n.src[i]).shape.str();
  }
  return s;
}

void fail_shape(const Graph& g, const Node& n, const std::string& msg) {
  const auto& name = OpTable::get().at(n.op).name;
  throw ValueError(name + ": " + msg + " (got shapes " + shapes_str(g, n) + ")");
}

void require_f32(const Graph& g, const Node& n, int i) {
  if (i >= static_cast<int>(n.src.size()))
    throw ValueError(OpTable::get().at(n.op).name + ": expected at least " + std::to_string(i + 1) +
                     " inputs, got " + std::to_string(n.src.size()));
  const Node& s = g.node(n.src[i]);
  // bfloat16/float16 reach an op's infer only when the op takes them (Graph::op checks).
  if (!is_float(s.dtype))
    throw TypeError(OpTable::get().at(n.op).name + ": input " + std::to_string(i) +
                    " must be float32, got " + dtype_name(s.dtype));
}

// ---- op table -----------------------------------------------------------------------

OpTable& OpTable::get() {
  static OpTable* t = [] {
    auto* tab = new OpTable();
    register_all_ops(*tab);
    check_against_spec(*tab);
    check_decompositions_against_spec(*tab);  // decompose.cpp
    return tab;
  }();
  return *t;
}

// The op table and recurra/op_spec.h list the same ops in the same order (so an op's id is
// its index in the spec), each unary kernel registered under its spec's code.
void OpTable::check_against_spec(const OpTable& t) {
  int32_t n = 0;
  const recurra_op_spec* spec = recurra_op_specs(&n);
  for (int i = 0; i < std::max<int>(n, t.size()); ++i) {
    const std::string have = i < t.size() ? t.at(i).name : "(none)";
    const std::string want = i < n ? spec[i].name : "(none)";
    if (have != want)
      throw StateError("internal: op table entry " + std::to_string(i) + " is " + have +
                       " but recurra/op_spec.h lists " + want);
  }
}

const recurra_op_spec& OpTable::spec(int id) const {
  int32_t n = 0;
  return recurra_op_specs(&n)[id];
}

int OpTable::add(OpDef def) {
  if (by_name_.count(def.name)) throw StateError("op registered twice: " + def.name);
  int id = static_cast<int>(ops_.size());
  by_name_[def.name] = id;
  ops_.push_back(std::move(def));
  return id;
}

int OpTable::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

// ---- gradient sink ------------------------------------------------------------------

void GradSink::add(int i, int grad_node) {
  const Node& s = g.node(node.src[i]);
  const Node& gn = g.node(grad_node);
  if (gn.shape != s.shape)
    throw StateError("internal: gradient of " + OpTable::get().at(node.op).name + " input " +
                     std::to_string(i) + " has shape " + gn.shape.str() + ", expected " +
                     s.shape.str());
  if (contributions[i] < 0)
    contributions[i] = grad_node;
  else
    contributions[i] = g.add(contributions[i], grad_node);
}

// ---- graph building -----------------------------------------------------------------

Node& Graph::node(int id) {
  if (id < 0 || id >= size()) throw ValueError("node id " + std::to_string(id) + " is not in this graph");
  return nodes_[id];
}
const Node& Graph::node(int id) const {
  if (id < 0 || id >= size()) throw ValueError("node id " + std::to_string(id) + " is not in this graph");
  return nodes_[id];
}

int Graph::push(Node n) {
  n.id = size();
  n.segment = n.is_leaf() ? 0 : cur_segment_;
  nodes_.push_back(std::move(n));
  planned_ = false;
  return nodes_.back().id;
}

int Graph::leaf(DType dtype, Shape shape, uint32_t flags, const std::string& name) {
  if (shape.ndim > kMaxDims) throw ValueError("at most 4 axes are supported");
  check_size(name.empty() ? std::string("leaf") : "leaf '" + name + "'", shape, dtype);
  if ((flags & kParam) && !is_float(dtype))
    throw TypeError("parameters must be float32, bfloat16 or float16");
  Node n;
  n.dtype = dtype;
  n.shape = shape;
  contiguous_strides(shape, n.strides);
  n.flags = flags;
  n.name = name;
  return push(std::move(n));
}

// The bfloat16/float16 dtype of op `name`'s float sources (f32 when none has one). Raises
// TypeError when the op does not take them (RECURRA_OPS_HALF in recurra/op_spec.h) or the
// sources mix float dtypes: there is no implicit promotion.
DType Graph::half_dtype_of(const std::string& name, const std::vector<int>& src) const {
  // RECURRA_OPS_HALF_IN: any mix of float dtypes, a float32 result (the op's infer sets it)
  if (recurra_op_takes_half_in(name.c_str())) return DType::f32;
  DType half = DType::f32;
  int first = -1, f32_src = -1;
  for (size_t i = 0; i < src.size(); ++i) {
    const DType t = nodes_[src[i]].dtype;
    if (t == DType::f32 && f32_src < 0) f32_src = static_cast<int>(i);
    if (!is_half(t)) continue;
    if (first >= 0 && t != half)
      throw TypeError(name + ": inputs " + std::to_string(first) + " and " + std::to_string(i) +
                      " are " + dtype_name(half) + " and " + dtype_name(t) +
                      "; recurra does not promote dtypes: cast one with .to()");
    if (first < 0) first = static_cast<int>(i);
    half = t;
  }
  if (!is_half(half)) return half;
  if (!recurra_op_takes_half(name.c_str()))
    throw TypeError(name + ": input " + std::to_string(first) + " is " + dtype_name(half) + ", but " +
                    name + " takes float32 only; cast it with .to(recurra.float32) first");
  if (f32_src >= 0 && name != "cast")
    throw TypeError(name + ": inputs " + std::to_string(std::min(first, f32_src)) + " and " +
                    std::to_string(std::max(first, f32_src)) + " are " +
                    (first < f32_src ? std::string(dtype_name(half)) + " and float32" :
                                       std::string("float32 and ") + dtype_name(half)) +
                    "; recurra does not promote dtypes: cast one with .to()");
  return half;
}

static bool node_contiguous(const Node& n) {
  TensorView v;
  v.shape = n.shape;
  std::copy(n.strides, n.strides + kMaxDims, v.strides);
  return v.is_contiguous();
}

int Graph::op(const std::string& name, std::vector<int> src, std::vector<int64_t> ip,
              std::vector<double> fp) {
  const OpTable& tab = OpTable::get();
  int id = tab.find(name);
  if (id < 0) throw ValueError("unknown op '" + name + "'");
  const OpDef& def = tab.at(id);
  for (int s : src) node(s);  // range check
  for (size_t i = 0; i < src.size() && i < 32; ++i)
    if ((def.contiguous_srcs >> i) & 1u)
      if (!node_contiguous(nodes_[src[i]])) src[i] = contiguous(src[i]);
  const DType half = half_dtype_of(name, src);
  Node n;
  n.op = id;
  n.src = std::move(src);
  n.ip = std::move(ip);
  n.fp = std::move(fp);
  def.infer(*this, n);
  // An op taking bfloat16/float16 computes in float32 on the CPU; its output has the
  // sources' dtype (cast and fill set their own).
  if (is_half(half) && n.dtype == DType::f32 && name != "cast") n.dtype = half;
  check_counts(tab.spec(id), n);
  if (n.shape.ndim > kMaxDims) throw ValueError(name + ": result would have more than 4 axes");
  check_size(name, n.shape, n.dtype);
  if (!def.is_view) {
    contiguous_strides(n.shape, n.strides);
    n.view_base = -1;
  }
  const int pieces = decompose_unless_taken(n);  // decompose.cpp
  return pieces >= 0 ? pieces : push(std::move(n));
}

int Graph::reduce_to(int a, Shape target) {
  if (node(a).shape == target) return a;
  return op("sum_to", {a}, target.vec());
}

// ---- autodiff -----------------------------------------------------------------------

void Graph::set_segment(int seg) {
  if (seg < 0) throw ValueError("set_segment: the segment must be >= 0, got " + std::to_string(seg));
  cur_segment_ = seg;
}

namespace {
std::atomic<bool> g_recompute_casts{true};
}  // namespace

void set_recompute_casts(bool on) { g_recompute_casts = on; }
bool recompute_casts() { return g_recompute_casts; }

// What a backward rule reads in place of forward node s (one of nodes [0, end]): a copy of
// s appended now when s is a cast that build_backward recomputes (see there), a dense copy
// (contiguous) of a leaf's view, a cast of one, or a view of any of these; else s itself. made[original] = its copy, so one rule reading s twice makes one.
int Graph::recast(int s, int end, std::map<int, int>& made) {
  if (s > end || !recompute_casts()) return s;
  const auto hit = made.find(s);
  if (hit != made.end()) return hit->second;
  if (nodes_[s].is_leaf()) return s;
  Node c = nodes_[s];  // a copy: appending may move nodes_
  if (c.is_view()) {
    const int r = recast(c.src[0], end, made);
    if (r == c.src[0]) return s;
    c.src[0] = r;
    const auto base = made.find(c.view_base);
    if (base != made.end()) c.view_base = base->second;
  } else {
    static const int cast_op = OpTable::get().find("cast");
    static const int contiguous_op = OpTable::get().find("contiguous");
    if (c.op != cast_op && c.op != contiguous_op) return s;
    const Node& from = nodes_[c.src[0]];
    const bool of_leaf = nodes_[from.is_view() ? from.view_base : from.id].is_leaf();
    if (c.op == contiguous_op) {
      if (!of_leaf) return s;  // a dense copy of a leaf's view (W^T): the leaf is kept
    } else {
      const bool widens = dtype_size(c.dtype) > dtype_size(from.dtype);
      const int r = recast(c.src[0], end, made);  // the cast of such a copy
      if (!widens && !of_leaf && r == c.src[0]) return s;
      c.src[0] = r;
    }
  }
  c.flags = 0;
  c.grad = -1;
  c.data = nullptr;
  c.dbuf.reset();
  c.given.reset();
  const int id = push(std::move(c));
  made[s] = id;
  return id;
}

// Points the sources of n (a copy of a node whose rule runs now, or a segment's copy being
// made) at recomputed casts; needs[] of every copy made is its original's.
void Graph::recast_sources(Node& n, int end, std::map<int, int>& made, std::vector<char>& needs) {
  for (int& s : n.src) s = recast(s, end, made);
  if (n.view_base >= 0) {
    const auto base = made.find(n.view_base);
    if (base != made.end()) n.view_base = base->second;
  }
  needs.resize(nodes_.size(), 0);
  for (const auto& [orig, copy] : made) needs[copy] = needs[orig];
}

// Whether node s is a leaf, or a view, cast or dense copy of one (through any chain).
bool Graph::of_leaf(int s) const {
  static const int cast_op = OpTable::get().find("cast");
  static const int contiguous_op = OpTable::get().find("contiguous");
  const Node& n = nodes_[s];
  if (n.is_leaf()) return true;
  if (!n.is_view() && n.op != cast_op && n.op != contiguous_op) return false;
  return of_leaf(n.src[0]);
}

// Appends a copy of every op node of segment `seg` among nodes [0, end], in order: the
// same op, shape and parameters, sources (and view bases) inside the segment replaced by
// their copies, casts outside it recomputed (recast); no flags, no data.
// clone_of[original] = its copy. leaf_casts: the recomputed casts of leaves (and their
// views' copies) that the segments copied so far made, shared by every segment of one
// backward: a weight read in several segments (the LM head in each chunk of a chunked
// loss) is cast once in the backward, not once per segment; that copy then lives from the
// first of those segments' copies to the last (the chunks of a loss run one after another).
void Graph::clone_segment(int seg, int end, std::vector<int>& clone_of, std::vector<char>& needs,
                          std::map<int, int>& leaf_casts) {
  std::map<int, int> made = leaf_casts;  // casts outside the segment, recomputed for it
  for (int i = 0; i <= end; ++i) {
    if (nodes_[i].segment != seg || nodes_[i].is_leaf()) continue;
    const auto shared = leaf_casts.find(i);  // a leaf's cast that another segment made again
    if (shared != leaf_casts.end()) {
      clone_of[i] = shared->second;
      continue;
    }
    Node c = nodes_[i];
    c.flags = 0;
    c.grad = -1;
    c.data = nullptr;
    c.dbuf.reset();
    c.given.reset();
    c.hbuf.reset();
    for (int& s : c.src)
      if (clone_of[s] >= 0) s = clone_of[s];
    if (c.view_base >= 0 && clone_of[c.view_base] >= 0) c.view_base = clone_of[c.view_base];
    recast_sources(c, end, made, needs);
    clone_of[i] = push(std::move(c));
  }
  for (const auto& [orig, copy] : made)
    if (of_leaf(orig)) leaf_casts.emplace(orig, copy);
  needs.resize(nodes_.size(), 0);
  for (int k = 0; k <= end; ++k)
    if (clone_of[k] >= 0) needs[clone_of[k]] = needs[k];
}

void Graph::build_backward(int loss, int seed) {
  const Node& L = node(loss);
  if (!is_float(L.dtype)) throw TypeError("backward: the loss must be a float tensor");
  if (seed < 0 && L.numel() != 1)
    throw ValueError("backward: the loss must be a scalar (got shape " + L.shape.str() +
                     "); pass a gradient of that shape to differentiate a non-scalar");
  if (seed >= 0 && node(seed).shape != L.shape)
    throw ValueError("backward: the gradient has shape " + node(seed).shape.str() +
                     " but the tensor has shape " + L.shape.str());
  nodes_[loss].flags |= kLoss | kOutput;
  // The gradient nodes (and the copies of segments) belong to no segment.
  struct SegmentReset {
    Graph& g;
    int saved;
    ~SegmentReset() { g.cur_segment_ = saved; }
  } reset{*this, cur_segment_};
  cur_segment_ = 0;

  // needs[i]: some parameter flows into node i.
  std::vector<char> needs(loss + 1, 0);
  for (int i = 0; i <= loss; ++i) {
    const Node& n = nodes_[i];
    if (n.flags & kParam) needs[i] = 1;
    for (int s : n.src)
      if (needs[s]) needs[i] = 1;
  }
  std::vector<int> grads(loss + 1, -1);
  if (!needs[loss]) return;  // nothing to differentiate: no parameter reaches the loss
  // A segment runs again in the backward: an op updating memory in place cannot be in one
  // that a parameter flows into. Checked before anything is appended.
  const OpTable& tab = OpTable::get();
  std::map<int, int> in_place;  // segment -> a node of it that updates memory in place
  for (int i = 0; i <= loss; ++i)
    if (nodes_[i].segment != 0 && !nodes_[i].is_leaf() && tab.at(nodes_[i].op).writes_any_src(nodes_[i]))
      in_place.emplace(nodes_[i].segment, i);
  for (int i = 0; i <= loss && !in_place.empty(); ++i) {
    const auto it = in_place.find(nodes_[i].segment);
    if (needs[i] && it != in_place.end())
      throw ValueError("backward: op '" + tab.at(nodes_[it->second].op).name +
                       "' updates memory in place and cannot run twice; build it outside the "
                       "recompute block");
  }
  grads[loss] = seed >= 0 ? seed : fill(L.shape, 1.0, L.dtype);

  std::vector<int> clone_of(loss + 1, -1);  // node of a segment -> its recomputed copy
  std::map<int, int> leaf_casts;  // the segments' recomputed casts of leaves (clone_segment)
  for (int i = loss; i >= 0; --i) {
    if (grads[i] < 0 || !needs[i]) continue;
    if (nodes_[i].is_leaf()) continue;
    int at = i;  // the node whose rule runs: i, or its copy when i is in a segment
    if (nodes_[i].segment != 0) {
      if (clone_of[i] < 0) clone_segment(nodes_[i].segment, loss, clone_of, needs, leaf_casts);
      at = clone_of[i];
    }
    Node n = nodes_[at];  // copy: the rule appends nodes
    std::map<int, int> recast_made;  // this rule's recomputed casts
    recast_sources(n, loss, recast_made, needs);
    const std::vector<int> orig_src = nodes_[i].src;
    const OpDef& def = tab.at(n.op);
    if (!def.backward) throw ValueError("backward: op '" + def.name + "' is not differentiable");
    GradSink sink{*this, n, grads[i], std::vector<int>(n.src.size(), -1), &needs};
    def.backward(sink);
    for (size_t j = 0; j < n.src.size(); ++j) {
      int c = sink.contributions[j];
      int s = orig_src[j];
      if (c < 0 || !needs[s]) continue;
      // A parameter's gradient stays readable after compute (an output): as a view (a piece
      // of a packed multi-input gradient) it would pin all of that larger result for the
      // rest of the step. A copy lets the planner reuse it once the other pieces are read.
      if (grads[s] < 0 && (nodes_[s].flags & kParam) && nodes_[c].is_view() &&
          nodes_[nodes_[c].view_base].nbytes() > nodes_[c].nbytes())
        c = contiguous(c);
      // An op reading a 2-byte source as it is (RECURRA_OPS_HALF_IN) gives it a float32
      // gradient: rounded to the source's dtype, as the gradient of the up-cast it replaces.
      if (nodes_[c].dtype != nodes_[s].dtype && is_float(nodes_[s].dtype))
        c = op("cast", {c}, {static_cast<int64_t>(nodes_[s].dtype)});
      grads[s] = grads[s] < 0 ? c : add(grads[s], c);
    }
  }
  for (int i = 0; i <= loss; ++i) {
    if (!needs[i] || grads[i] < 0) continue;
    nodes_[i].grad = grads[i];
    if (nodes_[i].flags & kParam) nodes_[grads[i]].flags |= kOutput | kOwnMemory;
  }
}

bool GradSink::needs(int i) const {
  int s = node.src[i];
  return needs_ && s < static_cast<int>(needs_->size()) && (*needs_)[s];
}

}  // namespace recurra

// Folded gradient casts (see Scatter::from and MergedAdds::folded in schedule.h): on a
// device, a cast after the loss whose only reader is a merged slice gradient's piece, a
// 2-byte add or a slice_grad is not run; the reader loads the cast's source and converts
// each value itself, as the cast would have.
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>

#include "backend_registry.h"
#include "schedule.h"

namespace recurra {
namespace sched {

namespace {

// Whether device backend b runs `op` (add or slice_grad; an assign: assigns_into_windows) of
// dtype dt on a source of dtype src_dt, converting each value to dt where it loads it, as a
// cast to dt would.
bool converts_sources(int b, const std::string& op, DType dt, DType src_dt) {
  recurra_tensor_desc t{};
  t.dtype = static_cast<recurra_dtype>(static_cast<int>(dt));
  t.ndim = 1;
  for (int i = 0; i < RECURRA_MAX_DIMS; ++i) t.shape[i] = 1;
  t.shape[0] = 4;
  t.strides[0] = 1;
  recurra_node_desc d{};
  d.op = op.c_str();
  d.dst = t;
  d.n_src = op == "add" ? 2 : 1;
  d.src[0] = d.src[1] = t;
  d.src[0].dtype = static_cast<recurra_dtype>(static_cast<int>(src_dt));
  const int64_t ip[4] = {4, 1, 3, 1};  // slice_grad: the full shape, (start, stop, step)
  if (op == "slice_grad") {
    d.src[0].shape[0] = 2;
    d.n_ip = 4;
    d.ip = ip;
  }
  return backend_runs(b, d);
}

// Whether device backend b runs product `op` (matmul or out_prod) of two sources of the
// 2-byte dtype dt into a float32 output (the sums not rounded to dt).
bool widens_products(int b, const std::string& op, DType dt) {
  recurra_tensor_desc t{};
  t.dtype = static_cast<recurra_dtype>(static_cast<int>(dt));
  t.ndim = 2;
  for (int i = 0; i < RECURRA_MAX_DIMS; ++i) t.shape[i] = 1;
  t.shape[0] = t.shape[1] = 8;
  t.strides[0] = 8;
  t.strides[1] = 1;
  recurra_node_desc d{};
  d.op = op.c_str();
  d.n_src = 2;
  d.src[0] = d.src[1] = t;
  d.dst = t;
  d.dst.dtype = RECURRA_F32;
  return backend_runs(b, d);
}

}  // namespace

void fold_casts(const Graph& g, const std::vector<int>& where, const std::vector<int>& readers,
                std::unordered_map<int, Scatter>& merged, std::unordered_map<int, std::vector<int>>& folded,
                std::unordered_map<int, int>& widened) {
  const OpTable& tab = OpTable::get();
  const int n = g.size();
  const int add_op = tab.find("add");
  auto base = [&](int id) { return g.node(id).view_base >= 0 ? g.node(id).view_base : id; };
  const char* fold_env = std::getenv("RECURRA_FOLD_CASTS");
  const bool fold = !(fold_env && std::string(fold_env) == "0");
  const int cast_op = tab.find("cast");
  int loss_at = n;  // casts up to the loss run anyway (the forward): only later ones fold
  for (int j = 0; j < n && loss_at == n; ++j)
    if (g.node(j).flags & kLoss) loss_at = j;
  // The node whose cast to dt (on backend b, after the loss, read by nothing else) q is,
  // or a dense reshape of: what its reader may read and convert instead; else -1.
  auto cast_source = [&](int q, DType dt, int b) {
    int c = q;
    if (readers[q] != 1 || (g.node(q).flags & (kOutput | kLoss))) return -1;
    if (g.node(q).is_view()) {  // a reshape of the cast: the same elements in order
      c = g.node(q).view_base;
      if (!is_dense(g.node(q)) || g.node(q).view_offset != 0 || g.node(q).src[0] != c ||
          g.node(q).numel() != g.node(c).numel() || readers[c] != 1)
        return -1;
    }
    const Node& cn = g.node(c);
    if (c <= loss_at || cn.is_leaf() || cn.is_view() || cn.op != cast_op || cn.dtype != dt || where[c] != b ||
        (cn.flags & (kOutput | kLoss)))
      return -1;
    const int s = cn.src[0];
    if (!is_float(g.node(s).dtype) || !is_dense(g.node(s)) || where[base(s)] != b) return -1;
    return s;
  };
  std::map<std::tuple<int, std::string, int, int>, bool> converts;  // converts_sources, cached
  auto converts_from = [&](int b, const std::string& op, DType dt, int s) {
    if (s < 0) return true;
    const auto key = std::make_tuple(b, op, static_cast<int>(dt), static_cast<int>(g.node(s).dtype));
    auto it = converts.find(key);
    if (it == converts.end()) {
      const DType sd = g.node(s).dtype;
      const bool yes = op == "assign" ? sd == DType::f32 && is_half(dt) && assigns_into_windows(b, dt, sd)
                                      : converts_sources(b, op, dt, sd);
      it = converts.emplace(key, yes).first;
    }
    return it->second;
  };
  // Merged scatters' pieces that are casts of float32 nodes to the scatter's 2-byte dtype:
  // their assigns read those nodes and round.
  for (auto& [j, sc] : merged) {
    sc.from.assign(sc.parts.size(), -1);
    const int b = where[j];
    const DType dt = g.node(j).dtype;
    if (!fold || b == kCpuBackend) continue;
    for (size_t i = 0; i < sc.parts.size(); ++i) {
      const int s = cast_source(sc.parts[i], dt, b);
      if (converts_from(b, "assign", dt, s)) sc.from[i] = s;
    }
  }
  // The same for the adds of a 2-byte dtype (a gradient summed from two uses, each rounded
  // from a float32 result) and for slice_grads (a 2-byte gradient widened to a float32
  // packed result's) on a device: they read the cast's source and convert it.
  const int slice_grad_op = tab.find("slice_grad");
  for (int j = 0; j < n && fold; ++j) {
    const Node& nd = g.node(j);
    const int b = where[j];
    if (nd.is_leaf() || nd.is_view() || merged.count(j) || b == kCpuBackend) continue;
    const bool add2 = nd.op == add_op && is_half(nd.dtype) && nd.src.size() == 2 && nd.src[0] != nd.src[1];
    if (!add2 && nd.op != slice_grad_op) continue;
    std::vector<int> from;
    bool any = false, ok = true;
    for (int q : nd.src) {
      from.push_back(cast_source(q, nd.dtype, b));
      any = any || from.back() >= 0;
      ok = ok && converts_from(b, tab.at(nd.op).name, nd.dtype, from.back());
    }
    if (any && ok) folded[j] = std::move(from);
  }
  // Widened products: a cast to float32 whose source is a 2-byte product read by nothing
  // else (the gradient of a float32 weight that autocast cast to bf16) runs as that product
  // writing float32: one dispatch, and the sums not rounded to the 2-byte type on the way.
  // Not bitwise the values of before (the sums are not rounded): a switch of its own,
  // RECURRA_WIDEN_PRODUCTS=0 (comparisons), beside RECURRA_FOLD_CASTS=0.
  const char* widen_env = std::getenv("RECURRA_WIDEN_PRODUCTS");
  const bool widen = !(widen_env && std::string(widen_env) == "0");
  const int matmul_op = tab.find("matmul"), out_prod_op = tab.find("out_prod");
  std::map<std::tuple<int, int, int>, bool> widens;  // widens_products, cached
  for (int j = loss_at + 1; j < n && widen; ++j) {
    const Node& nd = g.node(j);
    const int b = where[j];
    if (nd.is_leaf() || nd.is_view() || nd.op != cast_op || nd.dtype != DType::f32 || b == kCpuBackend) continue;
    const int m = nd.src[0];
    const Node& mn = g.node(m);
    if (m <= loss_at || mn.is_leaf() || mn.is_view() || (mn.op != matmul_op && mn.op != out_prod_op) ||
        !is_half(mn.dtype) || readers[m] != 1 || (mn.flags & (kOutput | kLoss)) || where[m] != b)
      continue;
    const auto key = std::make_tuple(b, mn.op, static_cast<int>(mn.dtype));
    auto it = widens.find(key);
    if (it == widens.end()) it = widens.emplace(key, widens_products(b, tab.at(mn.op).name, mn.dtype)).first;
    if (it->second) widened[j] = m;
  }
}

}  // namespace sched
}  // namespace recurra

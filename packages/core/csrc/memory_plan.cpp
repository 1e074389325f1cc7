// Memory planning: each backend's transient arena (best fit in growing segments), the
// lifetimes of the nodes, and the merged slice gradients (see schedule.h).
#include <algorithm>
#include <climits>
#include <map>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "backend_registry.h"
#include "graph.h"
#include "memory.h"
#include "schedule.h"

namespace recurra {

using namespace sched;

namespace sched {

std::mutex g_scatter_mu;
std::unordered_map<const Graph*, MergedAdds> g_scatters;

bool backend_runs(int b, const recurra_node_desc& d) {
  const BackendEntry& e = backend_entry(b);
  return !e.closed && e.table->supports_op(e.table->ctx, e.device, &d) == 1;
}

bool assigns_into_windows(int b, DType dt, DType src_dt) {
  recurra_tensor_desc w{}, src{}, one{};
  w.dtype = one.dtype = static_cast<recurra_dtype>(static_cast<int>(dt));
  src.dtype = static_cast<recurra_dtype>(static_cast<int>(src_dt));
  w.ndim = src.ndim = 2;
  for (int i = 0; i < RECURRA_MAX_DIMS; ++i) w.shape[i] = src.shape[i] = one.shape[i] = 1;
  w.shape[0] = w.shape[1] = src.shape[0] = src.shape[1] = 2;
  w.strides[0] = 4, w.strides[1] = 1;
  src.strides[0] = 2, src.strides[1] = 1;
  one.ndim = 1;
  one.strides[0] = 1;
  recurra_node_desc d{};
  d.op = "assign";
  d.dst = one;
  d.n_src = 2;
  d.src[0] = w;
  d.src[1] = src;
  return backend_runs(b, d);
}

}  // namespace sched

namespace {

// Best-fit allocation of [offset, size) blocks within one growing arena.
class ArenaAllocator {
 public:
  size_t alloc(size_t bytes) {
    bytes = align_up(std::max<size_t>(bytes, 1));
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second >= bytes && (best == free_.end() || it->second < best->second)) best = it;
    if (best != free_.end()) {
      size_t off = best->first, sz = best->second;
      free_.erase(best);
      if (sz > bytes) free_[off + bytes] = sz - bytes;
      return off;
    }
    if (!free_.empty()) {  // grow from a free block that ends at the top
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) {
        size_t off = last->first;
        free_.erase(last);
        top_ = off + bytes;
        return off;
      }
    }
    size_t off = top_;
    top_ += bytes;
    return off;
  }
  void release(size_t off, size_t bytes) {
    bytes = align_up(std::max<size_t>(bytes, 1));
    auto it = free_.emplace(off, bytes).first;
    auto nx = std::next(it);
    if (nx != free_.end() && it->first + it->second == nx->first) {
      it->second += nx->second;
      free_.erase(nx);
    }
    if (it != free_.begin()) {
      auto pv = std::prev(it);
      if (pv->first + pv->second == it->first) {
        pv->second += it->second;
        free_.erase(it);
      }
    }
  }
  size_t top() const { return top_; }
  // The smallest free block that holds `bytes` (aligned), SIZE_MAX when none does.
  size_t best_free(size_t bytes) const {
    size_t best = SIZE_MAX;
    for (const auto& [off, sz] : free_)
      if (sz >= bytes && sz < best) best = sz;
    return best;
  }
  // The top after alloc(bytes) had to grow the arena.
  size_t grown_top(size_t bytes) const {
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) return last->first + bytes;
    }
    return top_ + bytes;
  }

 private:
  std::map<size_t, size_t> free_;
  size_t top_ = 0;
};

// The arena of one backend as segments of at most `limit` bytes each (a device's largest
// buffer; the host has one unbounded segment). A block goes to the best-fitting free block
// of any segment, else to the first segment that can grow enough, else to a new segment;
// with one segment this is ArenaAllocator's best fit. Callers never ask for more than
// `limit` (Graph::check_fits refuses such tensors first).
class SegmentedArena {
 public:
  struct Slot {
    int segment;
    size_t offset;
  };
  explicit SegmentedArena(size_t limit = SIZE_MAX) : limit_(limit) {}
  Slot alloc(size_t bytes) {
    bytes = align_up(std::max<size_t>(bytes, 1));
    int best = -1;
    size_t best_size = SIZE_MAX;
    for (size_t i = 0; i < segs_.size(); ++i) {
      const size_t f = segs_[i].best_free(bytes);
      if (f < best_size) best = static_cast<int>(i), best_size = f;
    }
    for (size_t i = 0; best < 0 && i < segs_.size(); ++i)
      if (segs_[i].grown_top(bytes) <= limit_) best = static_cast<int>(i);
    if (best < 0) {
      segs_.emplace_back();
      best = static_cast<int>(segs_.size()) - 1;
    }
    return {best, segs_[best].alloc(bytes)};
  }
  void release(int segment, size_t offset, size_t bytes) { segs_[segment].release(offset, bytes); }
  std::vector<size_t> segment_bytes() const {
    std::vector<size_t> out;
    for (const auto& a : segs_) out.push_back(a.top());
    return out;
  }

 private:
  size_t limit_;
  std::vector<ArenaAllocator> segs_;
};

// The pieces a node contributes as a scatter: a slice_grad over the last axis only (whole
// ranges elsewhere, step 1), or an add already merged. False otherwise.
bool scatter_parts(const Graph& g, const std::unordered_map<int, Scatter>& merged, int id, Scatter* out) {
  const auto it = merged.find(id);
  if (it != merged.end()) {
    *out = it->second;
    return true;
  }
  const Node& nd = g.node(id);
  if (nd.is_leaf() || nd.is_view() || OpTable::get().at(nd.op).name != "slice_grad") return false;
  const int d = nd.shape.ndim;
  if (d == 0 || static_cast<int>(nd.ip.size()) != 4 * d) return false;
  for (int i = 0; i < d - 1; ++i)
    if (nd.ip[d + 3 * i] != 0 || nd.ip[d + 3 * i + 1] != nd.shape.d[i] || nd.ip[d + 3 * i + 2] != 1) return false;
  if (nd.ip[d + 3 * (d - 1) + 2] != 1) return false;
  *out = Scatter{{nd.src[0]}, {nd.ip[d + 3 * (d - 1)]}, {nd.ip[d + 3 * (d - 1) + 1]}, {}, {}, {}, {}};
  return true;
}

// Merges a and b (sorted by begin); false when their columns overlap.
bool merge_scatters(const Scatter& a, const Scatter& b, Scatter* out) {
  std::vector<size_t> order;
  Scatter all = a;
  all.parts.insert(all.parts.end(), b.parts.begin(), b.parts.end());
  all.begin.insert(all.begin.end(), b.begin.begin(), b.begin.end());
  all.end.insert(all.end.end(), b.end.begin(), b.end.end());
  for (size_t i = 0; i < all.parts.size(); ++i) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return all.begin[x] < all.begin[y]; });
  *out = Scatter{};
  for (size_t i : order) {
    if (!out->end.empty() && all.begin[i] < out->end.back()) return false;
    out->parts.push_back(all.parts[i]);
    out->begin.push_back(all.begin[i]);
    out->end.push_back(all.end[i]);
  }
  return true;
}

// Whether the pieces cover columns [0, width) of the last axis (merge_scatters keeps them
// sorted and apart).
bool covers(const Scatter& sc, int64_t width) {
  int64_t at = 0;
  for (size_t i = 0; i < sc.parts.size(); ++i) {
    if (sc.begin[i] != at) return false;
    at = sc.end[i];
  }
  return at == width;
}

// The first element of the piece of P's packed result that dense view q is, when P's kernel
// can write that piece elsewhere (KernelCtx::pieces; see Redirect), else -1; *row: the
// length of the piece's rows.
int64_t redirectable_piece(const Graph& g, const Node& P, const Node& q, int64_t* row) {
  static const int norm_back = OpTable::get().find("gated_rms_norm_back");
  static const int conv_back = OpTable::get().find("causal_conv_silu_back");
  if ((P.op != norm_back && P.op != conv_back) || !is_dense(q)) return -1;
  const Node& first = g.node(P.src[1]);  // y (dy first, then dz), or x (dx first)
  if (first.shape.ndim == 0 || q.numel() != first.numel()) return -1;
  *row = first.shape.d[first.shape.ndim - 1];
  const bool dz = P.op == norm_back && P.src.size() >= 4;  // (g, y, w): no gate, no dz
  if (q.view_offset == 0 || (dz && q.view_offset == first.numel())) return q.view_offset;
  return -1;
}

}  // namespace

const MemoryPlan& Graph::plan() {
  if (planned_) return plan_;
  const int n = size();
  place_ = Placement{};
  assign_backends();

  auto base_of = [&](int id) { return nodes_[id].view_base >= 0 ? nodes_[id].view_base : id; };

  // Adds of slice gradients that run as one scatter (see Scatter): on the CPU (float32), or
  // on a device whose backend copies into a strided window in place (an assign into it),
  // when the pieces cover the whole last axis there (no zeros are written on a device).
  // Every node of the chain is placed where the add is.
  const OpTable& tab = OpTable::get();
  std::vector<int> readers(n, 0);
  for (int j = 0; j < n; ++j)
    for (int s : nodes_[j].src) ++readers[s];
  std::unordered_map<int, Scatter> merged;
  std::unordered_map<int, RowsAdd> rows_adds;
  std::unordered_map<int, std::vector<Redirect>> redirects;
  std::unordered_map<int, std::vector<int>> folded;  // see MergedAdds::folded
  std::unordered_map<int, int> widened;              // see MergedAdds::widened
  const int add_op = tab.find("add");
  {
    std::map<std::pair<int, int>, bool> window_ok;  // (backend, dtype): takes window assigns
    auto takes = [&](int b, DType dt) {
      if (b == kCpuBackend) return dt == DType::f32;
      const auto key = std::make_pair(b, static_cast<int>(dt));
      auto it = window_ok.find(key);
      if (it == window_ok.end()) it = window_ok.emplace(key, assigns_into_windows(b, dt, dt)).first;
      return it->second;
    };
    for (int j = 0; j < n; ++j) {
      const Node& nd = nodes_[j];
      if (nd.op != add_op || nd.src.size() != 2 || !takes(place_.where[j], nd.dtype)) continue;
      Scatter a, b, m;
      bool ok = true;
      for (int k = 0; k < 2 && ok; ++k) {
        const Node& s = nodes_[nd.src[k]];
        ok = s.shape == nd.shape && readers[nd.src[k]] == 1 && !(s.flags & (kOutput | kLoss)) &&
             nd.src[0] != nd.src[1] && place_.where[nd.src[k]] == place_.where[j] &&
             scatter_parts(*this, merged, nd.src[k], k == 0 ? &a : &b);
      }
      if (ok && merge_scatters(a, b, &m)) merged[j] = std::move(m);
    }
    for (auto it = merged.begin(); it != merged.end();) {
      const Node& nd = nodes_[it->first];
      if (place_.where[it->first] != kCpuBackend && !covers(it->second, nd.shape.d[nd.shape.ndim - 1]))
        it = merged.erase(it);  // (an add that does merge keeps its own copy of the pieces)
      else
        ++it;
    }
    // On the CPU, a piece that is a dense view of an add read by nothing else: the add's
    // two dense sources are summed into the output instead (Scatter::lhs, rhs).
    auto on_cpu = [&](int id) { return location(base_of(id)) == kCpuBackend; };
    for (auto& [j, sc] : merged) {
      sc.lhs.assign(sc.parts.size(), -1);
      sc.rhs.assign(sc.parts.size(), -1);
      if (place_.where[j] != kCpuBackend) continue;
      for (size_t i = 0; i < sc.parts.size(); ++i) {
        const int q = sc.parts[i], b = base_of(q);
        const Node& a = nodes_[b];
        if (a.is_leaf() || a.op != add_op || merged.count(b) || readers[b] != 1 || (q != b && readers[q] != 1) ||
            (a.flags & (kOutput | kLoss)) || a.dtype != DType::f32 || !on_cpu(b) ||
            nodes_[q].view_offset != 0 || nodes_[q].numel() != a.numel() || !is_dense(nodes_[q]))
          continue;
        bool ok = a.src.size() == 2;
        for (int s : a.src)
          ok = ok && nodes_[s].shape == a.shape && nodes_[s].dtype == DType::f32 && is_dense(nodes_[s]) && on_cpu(s);
        if (!ok) continue;
        sc.lhs[i] = a.src[0];
        sc.rhs[i] = a.src[1];
      }
    }
    fold_casts(*this, place_.where, readers, merged, folded, widened);  // (see Scatter::from)
    // Tied embeddings: add(A, get_rows_back(g, idx)) on the CPU (see RowsAdd).
    const int rows_op = tab.find("get_rows_back");
    for (int j = 0; j < n; ++j) {
      const Node& nd = nodes_[j];
      if (nd.op != add_op || nd.src.size() != 2 || nd.dtype != DType::f32 || merged.count(j) ||
          place_.where[j] != kCpuBackend || nd.src[0] == nd.src[1])
        continue;
      for (int k = 0; k < 2; ++k) {
        const int r = nd.src[k], a = nd.src[1 - k];
        const Node& rn = nodes_[r];
        if (rn.is_leaf() || rn.op != rows_op || readers[r] != 1 || (rn.flags & (kOutput | kLoss)) ||
            !on_cpu(r) || !on_cpu(rn.src[0]) || !on_cpu(rn.src[1]) || rn.dtype != DType::f32 ||
            nodes_[rn.src[0]].dtype != DType::f32 || !is_dense(nodes_[rn.src[0]]) || !is_dense(nodes_[rn.src[1]]))
          continue;
        const Node& an = nodes_[a];
        if (an.shape != nd.shape || an.dtype != DType::f32 || !is_dense(an) || !on_cpu(a)) continue;
        rows_adds[j] = RowsAdd{a, rn.src[0], rn.src[1]};
        break;
      }
    }
  }
  // The nodes a merged add reads in place of its own sources.
  std::unordered_map<int, std::vector<int>> merged_reads;
  for (const auto& [j, sc] : merged) {
    auto& r = merged_reads[j];
    for (size_t i = 0; i < sc.parts.size(); ++i)
      if (!sc.from.empty() && sc.from[i] >= 0)
        r.push_back(sc.from[i]);
      else if (sc.lhs.empty() || sc.lhs[i] < 0)
        r.push_back(sc.parts[i]);
      else
        r.insert(r.end(), {sc.lhs[i], sc.rhs[i]});
  }
  for (const auto& [j, ra] : rows_adds) merged_reads[j] = {ra.base, ra.grad, ra.idx};
  for (const auto& [j, from] : folded) {
    auto& r = merged_reads[j];
    for (size_t k = 0; k < from.size(); ++k) r.push_back(from[k] >= 0 ? from[k] : nodes_[j].src[k]);
  }
  for (const auto& [j, m] : widened) merged_reads[j] = nodes_[m].src;  // the product's sources
  auto srcs_of = [&](int j) -> const std::vector<int>& {
    const auto it = merged_reads.find(j);
    return it == merged_reads.end() ? nodes_[j].src : it->second;
  };
  // Nodes the backward appended (after the loss) that nothing reads are not run: gradients
  // a rule left unused, or forms a rule or a scatter superseded. Outputs, in-place updates
  // and whatever they read are kept; everything up to the loss is kept.
  std::vector<char> keep(n, 1);
  int first_loss = n;
  for (int j = 0; j < n && first_loss == n; ++j)
    if (nodes_[j].flags & kLoss) first_loss = j;
  std::vector<char> read(n, 0);
  for (int j = n - 1; j > first_loss; --j) {
    const Node& nd = nodes_[j];
    const bool effect = !nd.is_leaf() && !nd.is_view() && tab.at(nd.op).writes_any_src(nd);
    keep[j] = nd.is_leaf() || (nd.flags & (kOutput | kLoss)) || effect || read[j];
    if (keep[j])
      for (int s : srcs_of(j)) read[s] = 1;
  }

  // Pieces their producers write into the node that would copy them (see Redirect): a kept
  // merged scatter's window, or a kept slice_grad's slice (a packed 1-D gradient zero-padded
  // around it: Mamba-2's scan reading the norm's dy). The piece's view is read there only,
  // and no other view of the producer reaches it.
  std::unordered_set<int> written_slices;
  {
    std::vector<std::vector<int>> views_of(n);
    for (int v = 0; v < n; ++v)
      if (nodes_[v].is_view()) views_of[nodes_[v].view_base].push_back(v);
    auto try_redirect = [&](int target, int q, int64_t col, int64_t last_dim) {
      const int b = base_of(q);
      const Node& P = nodes_[b];
      if (q == b || P.is_leaf() || !keep[target] || place_.where[target] != kCpuBackend ||
          nodes_[target].dtype != DType::f32 || place_.where[b] != kCpuBackend || P.dtype != DType::f32 ||
          (P.flags & (kOutput | kLoss)))
        return false;
      int64_t row = 0;
      const int64_t off = redirectable_piece(*this, P, nodes_[q], &row), len = nodes_[q].numel();
      bool ok = off >= 0 && (last_dim < 0 || last_dim == row);
      for (const Redirect& r : redirects[b]) ok = ok && r.offset != off;
      for (int s : P.src) ok = ok && !is_half(nodes_[s].dtype);
      std::vector<int> chain;  // q and the views it is made from (unpack: a slice, reshaped)
      for (int v = q; v != b && ok; v = nodes_[v].src[0]) {
        ok = readers[v] == 1 && !(nodes_[v].flags & (kOutput | kLoss));  // nobody else reads the piece
        chain.push_back(v);
      }
      for (int v : views_of[b]) {
        const Node& o = nodes_[v];
        const bool apart = is_dense(o) && (o.view_offset + o.numel() <= off || o.view_offset >= off + len);
        ok = ok && (apart || std::find(chain.begin(), chain.end(), v) != chain.end());
      }
      if (!ok) return false;
      const Shape& ts = nodes_[target].shape;  // a scatter's rows, or the slice's own
      const int64_t stride = last_dim < 0 ? row : ts.d[ts.ndim - 1];
      redirects[b].push_back({target, off, col, stride});
      return true;
    };
    for (auto& [j, sc] : merged) {
      sc.written.assign(sc.parts.size(), 0);
      for (size_t i = 0; i < sc.parts.size(); ++i) {
        const Node& q = nodes_[sc.parts[i]];
        if (sc.lhs[i] < 0 && q.shape.ndim > 0 && try_redirect(j, sc.parts[i], sc.begin[i], q.shape.d[q.shape.ndim - 1]))
          sc.written[i] = 1;
      }
    }
    const int slice_grad_op = tab.find("slice_grad");
    for (int j = 0; j < n; ++j) {
      const Node& nd = nodes_[j];
      if (nd.op != slice_grad_op || nd.shape.ndim != 1 || nd.ip.size() != 4 || nd.ip[3] != 1 || merged.count(j))
        continue;
      if (try_redirect(j, nd.src[0], nd.ip[1], -1)) written_slices.insert(j);
    }
  }

  // Splits, and the mirrors each one needs.
  for (int j = 0; j < n; ++j) {
    const Node& nd = nodes_[j];
    if (nd.is_leaf() || nd.is_view() || !keep[j]) continue;
    int b = place_.where[j];
    if (place_.splits.empty() || place_.splits.back().backend != b) place_.splits.push_back({b, {}, {}});
    auto& sp = place_.splits.back();
    sp.nodes.push_back(j);
    for (int s : srcs_of(j)) {
      int base = base_of(s);
      if (location(base) == b) continue;
      auto key = std::make_pair(base, b);
      if (!place_.mirror_of.count(key)) {
        place_.mirror_of[key] = static_cast<int>(place_.mirrors.size());
        place_.mirrors.push_back({base, b, SIZE_MAX, 0, false});
        sp.mirrors.push_back(place_.mirror_of[key]);
      }
    }
  }

  // Liveness: the last node that reads each base, and each mirror.
  const int kForever = INT_MAX;
  std::vector<int> last(n, -1);
  std::vector<int> mirror_last(place_.mirrors.size(), -1);
  for (int j = 0; j < n; ++j) {
    if (!keep[j]) continue;
    for (int s : srcs_of(j)) {
      int base = base_of(s);
      last[base] = std::max(last[base], j);
      if (!nodes_[j].is_view() && !nodes_[j].is_leaf()) {
        auto it = place_.mirror_of.find({base, place_.where[j]});
        if (it != place_.mirror_of.end()) mirror_last[it->second] = std::max(mirror_last[it->second], j);
      }
    }
  }
  for (int j = 0; j < n; ++j)
    if (nodes_[j].flags & (kOutput | kLoss)) last[base_of(j)] = kForever;

  // A mirror on a device must fit one of its buffers too.
  for (const auto& mr : place_.mirrors)
    if (mr.backend != kCpuBackend) check_fits(mr.backend, mr.base, true);

  MemoryPlan p;
  for (const auto& [producer, rs] : redirects) p.n_redirected += rs.size();
  for (const auto& [j, sc] : merged)
    for (int f : sc.from) p.n_folded_casts += keep[j] && f >= 0;
  for (const auto& [j, from] : folded)
    for (int f : from) p.n_folded_casts += keep[j] && f >= 0;
  for (const auto& [j, m] : widened) p.n_widened_products += keep[j];
  p.offsets.assign(n, SIZE_MAX);
  p.segments.assign(n, 0);
  // Outputs with memory of their own (kOwnMemory): no place in the arena (compute() makes
  // their buffers, take_buffers()/take_host() hand them over).
  p.own.assign(n, 0);
  for (int j = 0; j < n; ++j) {
    const Node& nd = nodes_[j];
    if (keep[j] && !nd.is_leaf() && !nd.is_view() && (nd.flags & kOwnMemory) && (nd.flags & kOutput)) {
      p.own[j] = 1;
      p.own_bytes += align_up(std::max<size_t>(nd.nbytes(), 1));
    }
  }
  // In place: an elementwise node (each output element read from the same element of its
  // sources and nothing else) takes over the memory of a source that dies at it, when that
  // source has its size and dtype, lives in the same arena and is read through an identity
  // view (itself, or a dense reshape at offset 0). The kernels read each element before
  // writing it, on the CPU (binary/unary/act_grad rows load a[i] then store d[i]; the strided
  // unary path already transforms its output in place) and on Vulkan (binary.comp, unary.comp,
  // act_grad.comp: each invocation loads its elements, then stores the same ones; the
  // recorder puts a barrier between the source's earlier readers and this write).
  std::vector<char> elementwise(tab.size(), 0);
  for (const char* name : {"add", "sub", "mul", "div", "act_grad"}) {
    const int id = tab.find(name);
    if (id >= 0) elementwise[id] = 1;
  }
  for (int id = 0; id < tab.size(); ++id)
    if (tab.spec(id).unary >= 0) elementwise[id] = 1;
  // Row by row: a kernel that reads the whole row of one source before it writes that row of
  // its output may write over that source too: on the CPU in float32, on a device in the
  // source's dtype (Vulkan's softmax_norm.comp: each invocation reads its elements of the
  // row before it writes them, after the row's reductions). cross_entropy_back's logits,
  // (N, V): the gradient takes their memory (at 1024 x 50288, 206 MB less at the peak, and
  // its rows are written where they were just read, not into memory fetched for it; a bf16
  // Mamba2-130m step on the H200 holds one loss chunk's logits, 64 MB, less at its peak).
  std::vector<int> row_source(tab.size(), -1);
  row_source[tab.find("cross_entropy_back")] = 1;
  std::vector<int> taken_by(n, -1);  // a source whose memory node taken_by[s] took over
  auto identity_view = [&](int s, int base) {
    if (s == base) return true;
    const Node& v = nodes_[s];
    TensorView tv;
    tv.shape = v.shape;
    std::copy(v.strides, v.strides + kMaxDims, tv.strides);
    return v.view_offset == 0 && v.numel() == nodes_[base].numel() && tv.is_contiguous();
  };
  // Own chains: a node with memory of its own (or computed into such memory) that could
  // write over a source dying at it has that source computed straight into its buffer: a
  // gradient summed over chunks or uses (the LM head's, a tied weight's) grows in the
  // parameter's gradient buffer instead of the arena. chain_root[s]: the node whose buffer
  // s is computed into (MemoryPlan::segments holds -2 - it; see schedule.h).
  std::vector<int> chain_root(n, -1);
  // The source node j may write over: `chain` for the chains above (decided before the
  // arena is planned), else among the sources planned in the arena so far.
  auto writable_source = [&](int j, bool chain) -> int {
    const Node& nd = nodes_[j];
    if (merged.count(j)) return -1;
    std::vector<int> over;  // the sources it may write over
    if (const auto ra = rows_adds.find(j); ra != rows_adds.end())
      over = {ra->second.base};  // a merged rows add: its dense base only (see RowsAdd)
    else if (const auto rd = folded.find(j); rd != folded.end()) {  // the sources it reads as they are
      for (size_t k = 0; k < nd.src.size(); ++k)
        if (rd->second[k] < 0) over.push_back(nd.src[k]);
    } else if (elementwise[nd.op])
      over = nd.src;
    else if (row_source[nd.op] >= 0 && (place_.where[j] != kCpuBackend || nd.dtype == DType::f32))
      over = {nd.src[row_source[nd.op]]};
    else
      return -1;
    for (int s : over) {
      const int base = base_of(s);
      const Node& bn = nodes_[base];
      const bool free = chain ? !p.own[base] && chain_root[base] < 0
                              : p.offsets[base] != SIZE_MAX && taken_by[base] < 0;
      if (bn.is_leaf() || !free || last[base] != j || place_.where[base] != place_.where[j] ||
          bn.dtype != nd.dtype || bn.numel() != nd.numel() || bn.nbytes() != nd.nbytes() ||
          !identity_view(s, base))
        continue;
      bool ok = true;  // every source reading this memory reads it element for element
      for (int o : srcs_of(j)) ok = ok && (base_of(o) != base || identity_view(o, base));
      if (ok) return base;
    }
    return -1;
  };
  for (int j = n - 1; j >= 0; --j) {
    const int root = p.own[j] ? j : chain_root[j];
    const int s = root >= 0 ? writable_source(j, true) : -1;
    if (s >= 0) chain_root[s] = root;
  }
  std::map<int, SegmentedArena> alloc;  // per backend
  auto arena = [&](int b) -> SegmentedArena& {
    auto it = alloc.find(b);
    if (it != alloc.end()) return it->second;
    const uint64_t lim = b == kCpuBackend ? 0 : limits_of(b).max_buffer_bytes;
    return alloc.emplace(b, SegmentedArena(lim ? lim / kAlign * kAlign : SIZE_MAX)).first->second;
  };
  std::vector<std::vector<int>> dies_at(n), mirrors_die_at(n);
  for (int j = 0; j < n; ++j)
    if (last[j] >= 0 && last[j] != kForever && !nodes_[j].is_view()) dies_at[last[j]].push_back(j);
  for (size_t m = 0; m < place_.mirrors.size(); ++m)  // a constant's mirror lives on
    if (mirror_last[m] >= 0 && !(nodes_[place_.mirrors[m].base].flags & kConst))
      mirrors_die_at[mirror_last[m]].push_back(static_cast<int>(m));

  size_t split_i = 0;
  size_t live = 0;  // bytes of planned intermediates (and mirrors) alive now
  // A scatter that producers write into (Redirect) takes its memory at the first of them.
  auto place = [&](int j) {
    const auto slot = arena(place_.where[j]).alloc(nodes_[j].nbytes());
    live += align_up(std::max<size_t>(nodes_[j].nbytes(), 1));
    p.segments[j] = slot.segment;
    p.offsets[j] = slot.offset;
  };
  for (int j = 0; j < n; ++j) {
    const Node& nd = nodes_[j];
    if (nd.is_leaf() || nd.is_view() || !keep[j]) continue;
    if (const auto rd = redirects.find(j); rd != redirects.end())
      for (const Redirect& r : rd->second)
        if (!p.own[r.scatter] && chain_root[r.scatter] < 0 && p.offsets[r.scatter] == SIZE_MAX) place(r.scatter);
    // Mirrors are written when their split starts: allocate them there, before the
    // split's own nodes, so nothing still live in the split can share their memory.
    while (split_i < place_.splits.size() && place_.splits[split_i].nodes.front() <= j) {
      for (int m : place_.splits[split_i].mirrors) {
        auto& mr = place_.mirrors[m];
        const auto slot = arena(mr.backend).alloc(nodes_[mr.base].nbytes());
        mr.segment = slot.segment;
        mr.offset = slot.offset;
        live += align_up(std::max<size_t>(nodes_[mr.base].nbytes(), 1));
      }
      ++split_i;
    }
    const size_t bytes = align_up(std::max<size_t>(nd.nbytes(), 1));
    if (chain_root[j] >= 0) {  // computed into a later node's own buffer
      p.segments[j] = -2 - chain_root[j];
      p.n_in_place++;
      p.in_place_bytes += bytes;
    } else if (!p.own[j]) {
      const int reuse = writable_source(j, false);
      if (reuse >= 0) {
        taken_by[reuse] = j;
        p.segments[j] = p.segments[reuse];
        p.offsets[j] = p.offsets[reuse];
        p.n_in_place++;
        p.in_place_bytes += bytes;
      } else if (p.offsets[j] == SIZE_MAX) {
        place(j);
      }
      if (live > p.peak_live_bytes) p.peak_live_bytes = live, p.peak_node = j;
      p.unplanned_bytes += bytes;
      p.n_planned++;
    }
    if (last[j] < 0) dies_at[j].push_back(j);  // dead on arrival
    for (int d : dies_at[j])
      if (p.offsets[d] != SIZE_MAX && taken_by[d] < 0) {
        arena(place_.where[d]).release(p.segments[d], p.offsets[d], nodes_[d].nbytes());
        live -= align_up(std::max<size_t>(nodes_[d].nbytes(), 1));
      }
    for (int m : mirrors_die_at[j]) {
      const auto& mr = place_.mirrors[m];
      arena(mr.backend).release(mr.segment, mr.offset, nodes_[mr.base].nbytes());
      live -= align_up(std::max<size_t>(nodes_[mr.base].nbytes(), 1));
    }
  }
  if (p.peak_node >= 0) {  // what is live at the peak, by op
    std::map<std::string, size_t> by_op;
    for (int i = 0; i <= p.peak_node; ++i)
      if (p.offsets[i] != SIZE_MAX && (last[i] >= p.peak_node || i == p.peak_node) &&
          (taken_by[i] < 0 || taken_by[i] > p.peak_node)) {
        by_op[tab.at(nodes_[i].op).name] += align_up(std::max<size_t>(nodes_[i].nbytes(), 1));
        p.live_nodes_at_peak.push_back(i);
      }
    p.live_at_peak.assign(by_op.begin(), by_op.end());
    std::sort(p.live_at_peak.begin(), p.live_at_peak.end(),
              [](const auto& a, const auto& b) { return a.second > b.second; });
  }
  for (auto& [b, a] : alloc) {
    auto& segs = place_.segment_bytes[b] = a.segment_bytes();
    for (size_t bytes : segs) place_.arena_bytes[b] += bytes;
    p.arena_bytes += place_.arena_bytes[b];
  }

  // Memory: the host arena (one segment), and one buffer per segment of each device backend.
  size_t host_bytes = place_.arena_bytes.count(kCpuBackend) ? place_.arena_bytes[kCpuBackend] : 0;
  if (host_bytes > arena_capacity_) {
    arena_.reset();
    try {
      arena_.reset(host_alloc(host_bytes, "transient arena"));
    } catch (const OutOfMemory& e) {
      memory_stats_adjust(Pool::transient, -static_cast<int64_t>(arena_capacity_));  // freed above
      arena_capacity_ = 0;
      int big = -1;  // the largest planned node: usually the culprit
      for (int j = 0; j < n; ++j)
        if (p.offsets[j] != SIZE_MAX && place_.where[j] == kCpuBackend &&
            (big < 0 || nodes_[j].nbytes() > nodes_[big].nbytes()))
          big = j;
      std::string msg = e.what();
      if (big >= 0)
        msg += " (the largest intermediate: " + OpTable::get().at(nodes_[big].op).name + " of shape " +
               nodes_[big].shape.str() + ", " + std::to_string(nodes_[big].nbytes()) + " bytes)";
      throw OutOfMemory(msg);
    }
    memory_stats_adjust(Pool::transient, static_cast<int64_t>(host_bytes) - static_cast<int64_t>(arena_capacity_));
    arena_capacity_ = host_bytes;
  }
  for (const auto& [b, segs] : place_.segment_bytes) {
    if (b == kCpuBackend) continue;
    auto& bufs = dev_arena_[b];
    bufs.resize(std::max(bufs.size(), segs.size()));
    // Buffers of another size go first, so that their memory is free for the new ones. One
    // larger than its segment is given back too: a graph planned before its leaves were bound
    // (the tensor API plans when it builds) had every device leaf mirrored into its arena,
    // and kept that arena (a model's parameters' worth) after the plan with the leaves bound.
    for (size_t i = 0; i < bufs.size(); ++i)
      if (bufs[i] && (i >= segs.size() || bufs[i]->nbytes() != std::max<size_t>(segs[i], 64) || !bufs[i]->valid()))
        bufs[i].reset();
    bufs.resize(segs.size());
    for (size_t i = 0; i < segs.size(); ++i)
      if (!bufs[i]) bufs[i] = std::make_shared<DeviceBuffer>(b, std::max<size_t>(segs[i], 64), Pool::transient);
  }
  for (int j = 0; j < n; ++j)
    if (p.offsets[j] != SIZE_MAX && place_.where[j] == kCpuBackend)
      nodes_[j].data = static_cast<uint8_t*>(arena_.get()) + p.offsets[j];
  {
    std::lock_guard<std::mutex> lk(g_scatter_mu);
    if (merged.empty() && rows_adds.empty() && redirects.empty() && folded.empty() && widened.empty())
      g_scatters.erase(this);
    else
      g_scatters[this] = MergedAdds{std::move(merged),         std::move(rows_adds), std::move(redirects),
                                    std::move(written_slices), std::move(folded),    std::move(widened)};
  }
  plan_ = std::move(p);
  planned_ = true;
  ++generation_;
  return plan_;
}

Graph::~Graph() {
  {
    std::lock_guard<std::mutex> lk(g_scatter_mu);
    g_scatters.erase(this);
  }
  if (arena_capacity_) memory_stats_adjust(Pool::transient, -static_cast<int64_t>(arena_capacity_));
}

}  // namespace recurra

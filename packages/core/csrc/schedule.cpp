// The scheduler and the executor: placing nodes on backends, planning memory per backend,
// copying tensors across split boundaries, and running the splits.
//
// Placement: each op node goes to the first backend of set_backends() whose supports_op
// accepts it, the CPU otherwise (or an error in strict mode). Leaves live where their data
// is bound; views live with their base. Input flags play no part, so an input never drags
// the graph onto the CPU.
//
// A split is a maximal run of consecutive op nodes on one backend. A node that reads data
// held by another backend reads a *mirror*: a copy of the whole base tensor in its own
// backend's arena, filled once per compute at the start of the first split that needs it.
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include "graph.h"
#include "memory.h"
#include "profile.h"

namespace recurra {

void scatter_last_axis(const TensorView& dst, const std::vector<TensorView>& parts,
                       const std::vector<int64_t>& begin, ThreadPool& tp);  // ops/views.cpp

void Graph::AlignedFree::operator()(void* p) const { host_free(p); }

namespace {

constexpr size_t kAlign = 64;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

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

// ---- merged slice gradients ----------------------------------------------------------
//
// A tensor cut into pieces along its last axis (a projection split into its parts) gets the
// gradient add(slice_grad(g_1), slice_grad(g_2)), add(that, slice_grad(g_3)), ...: every
// slice_grad writes a whole zero-padded tensor and every add reads two. When all of it runs
// on the CPU, plan() has each such add run instead as one scatter of the pieces' gradients
// g_i (each output element written once), and the slice_grads and inner adds, now unread,
// are not run. The graph's nodes stay as they are; the substitution lives here, per graph.

struct Scatter {
  std::vector<int> parts;      // the nodes written into the output, by begin
  std::vector<int64_t> begin;  // their first column on the last axis
  std::vector<int64_t> end;
};

std::mutex g_scatter_mu;
std::unordered_map<const Graph*, std::unordered_map<int, Scatter>> g_scatters;

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
  *out = Scatter{{nd.src[0]}, {nd.ip[d + 3 * (d - 1)]}, {nd.ip[d + 3 * (d - 1) + 1]}};
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

recurra_tensor_desc shape_desc(const Node& n) {
  recurra_tensor_desc d{};
  d.dtype = n.dtype == DType::f32 ? RECURRA_F32 : RECURRA_I32;
  d.ndim = n.shape.ndim;
  for (int i = 0; i < kMaxDims; ++i) {
    d.shape[i] = i < n.shape.ndim ? n.shape.d[i] : 1;
    d.strides[i] = i < n.shape.ndim ? n.strides[i] : 1;
  }
  return d;
}

}  // namespace

const DeviceLimits& Graph::limits_of(int b) {
  auto it = place_.limits.find(b);
  if (it == place_.limits.end()) it = place_.limits.emplace(b, device_limits(b)).first;
  return it->second;
}

void Graph::check_fits(int b, int j, bool mirror) {
  const DeviceLimits& lim = limits_of(b);
  const Node& nd = nodes_[j];
  const uint64_t bytes = align_up(std::max<size_t>(nd.nbytes(), 1));
  const bool too_many = lim.max_tensor_elements && static_cast<uint64_t>(nd.numel()) > lim.max_tensor_elements;
  if (!too_many && (!lim.max_buffer_bytes || bytes <= lim.max_buffer_bytes)) return;
  const std::string what = nd.is_leaf() ? "leaf" : "the result of op '" + OpTable::get().at(nd.op).name + "'";
  const std::string limit =
      too_many ? "a tensor there has at most " + std::to_string(lim.max_tensor_elements) + " elements"
               : "one buffer there holds at most " + bytes_str(lim.max_buffer_bytes) +
                     (std::getenv("RECURRA_VK_MAX_BUFFER_MB") ? ", as RECURRA_VK_MAX_BUFFER_MB sets" : "");
  throw OutOfMemory("recurra: " + backend_name(b) + " cannot hold " + (mirror ? "a copy of " : "") + what +
                    " (node " + std::to_string(j) + (nd.name.empty() ? "" : ", '" + nd.name + "'") + "): shape " +
                    nd.shape.str() + " " + dtype_name(nd.dtype) + ", " + std::to_string(nd.numel()) + " elements, " +
                    bytes_str(nd.nbytes()) + " of the transient arena; " + limit + "; " +
                    (lim.free_bytes ? bytes_str(lim.free_bytes) : std::string("an unknown amount")) + " free of " +
                    bytes_str(lim.memory_bytes) + "; refused when planning, before anything ran; " +
                    RECURRA_OOM_HINT);
}

DeviceBuffer& Graph::arena_segment(int backend, int segment) const {
  return *dev_arena_.at(backend).at(static_cast<size_t>(segment));
}

int Graph::location(int id) const {
  const Node& n = nodes_[id];
  if (n.is_view()) return location(n.view_base);
  if (n.is_leaf()) return n.dbuf ? n.dbuf->backend() : kCpuBackend;
  return place_.where[id];
}

void Graph::set_backends(std::vector<int> ids, bool strict) {
  for (int b : ids)
    if (b != kCpuBackend) backend_entry(b);  // validates
  ids.erase(std::remove(ids.begin(), ids.end(), kCpuBackend), ids.end());
  if (ids != backends_ || strict != strict_) planned_ = false;
  backends_ = std::move(ids);
  strict_ = strict;
}

// Whether backend b (not the CPU, not closed) has a kernel for node j as it is shaped. Nodes
// with more sources than the C table carries never reach a plugin.
bool Graph::backend_supports(int b, int j) const {
  const Node& nd = nodes_[j];
  if (nd.src.size() > RECURRA_MAX_SRC) return false;
  const BackendEntry& e = backend_entry(b);
  recurra_node_desc desc{};
  desc.op = OpTable::get().at(nd.op).name.c_str();
  desc.dst = shape_desc(nd);
  desc.n_src = static_cast<int32_t>(nd.src.size());
  for (size_t i = 0; i < nd.src.size(); ++i) {
    desc.src[i] = shape_desc(nodes_[nd.src[i]]);
    desc.src[i].offset = static_cast<size_t>(nodes_[nd.src[i]].view_offset) * 4;
  }
  desc.n_ip = static_cast<int32_t>(nd.ip.size());
  desc.ip = nd.ip.data();
  desc.n_fp = static_cast<int32_t>(nd.fp.size());
  desc.fp = nd.fp.data();
  return e.table->supports_op(e.table->ctx, e.device, &desc) == 1;
}

// An op that updates its sources in place runs where the memory it writes lives: on a copy
// (a mirror) the update would be lost. Every written source must live on one backend, and
// that backend must have a kernel for the op; otherwise this raises rather than fall back.
int Graph::place_in_place_op(int j) const {
  const Node& nd = nodes_[j];
  const OpDef& def = OpTable::get().at(nd.op);
  int target = -2;
  for (size_t i = 0; i < nd.src.size(); ++i) {
    if (!def.writes_src(nd, i)) continue;
    const int loc = location(nd.src[i]);
    if (target == -2) target = loc;
    if (loc != target)
      throw ValueError(def.name + ": the tensors it updates in place live on different devices (" +
                       backend_name(target) + " and " + backend_name(loc) +
                       "); move them to one device first");
  }
  if (target == -2 || target == kCpuBackend) return kCpuBackend;
  const BackendEntry& e = backend_entry(target);
  if (e.closed)
    throw StateError(def.name + ": the memory it updates lives on " + backend_name(target) +
                     ", which was released");
  if (backend_supports(target, j)) return target;
  throw StateError(def.name + " with " + std::to_string(nd.src.size()) +
                   " sources updates memory on " + backend_name(target) +
                   ", which has no kernel for it (at most " + std::to_string(RECURRA_MAX_SRC) +
                   " sources per node reach a device backend)");
}

void Graph::assign_backends() {
  const int n = size();
  place_.where.assign(n, kCpuBackend);
  const OpTable& tab = OpTable::get();
  for (int j = 0; j < n; ++j) {
    const Node& nd = nodes_[j];
    if (nd.is_leaf()) {
      place_.where[j] = nd.dbuf ? nd.dbuf->backend() : kCpuBackend;
      continue;
    }
    if (nd.is_view()) {
      place_.where[j] = place_.where[nd.view_base];
      continue;
    }
    const OpDef& def = tab.at(nd.op);
    if (def.writes_src) {
      place_.where[j] = place_in_place_op(j);
      continue;
    }
    int chosen = -1;
    for (int b : backends_) {
      if (backend_entry(b).closed) continue;
      check_fits(b, j, false);  // a node too large for the device is refused, not moved
      if (backend_supports(b, j)) {
        chosen = b;
        break;
      }
    }
    if (chosen < 0) {
      if (strict_ && !backends_.empty()) {
        std::string names;
        for (int b : backends_) names += (names.empty() ? "" : ", ") + backend_name(b);
        throw StateError("strict placement: op '" + tab.at(nd.op).name + "' with shapes " +
                         shapes_str(*this, nd) + " -> " + nd.shape.str() + " is not supported by " +
                         names + "; allow CPU fallback (strict=False) or change the graph");
      }
      chosen = kCpuBackend;
    }
    place_.where[j] = chosen;
  }
}

const MemoryPlan& Graph::plan() {
  if (planned_) return plan_;
  const int n = size();
  place_ = Placement{};
  assign_backends();

  auto base_of = [&](int id) { return nodes_[id].view_base >= 0 ? nodes_[id].view_base : id; };

  // Adds of slice gradients that run as one scatter (see Scatter); only when nothing is
  // placed on a device backend (which has no scatter kernel).
  const OpTable& tab = OpTable::get();
  std::vector<int> readers(n, 0);
  for (int j = 0; j < n; ++j)
    for (int s : nodes_[j].src) ++readers[s];
  std::unordered_map<int, Scatter> merged;
  if (backends_.empty()) {
    const int add_op = tab.find("add");
    for (int j = 0; j < n; ++j) {
      const Node& nd = nodes_[j];
      if (nd.op != add_op || nd.src.size() != 2) continue;
      Scatter a, b, m;
      bool ok = true;
      for (int k = 0; k < 2 && ok; ++k) {
        const Node& s = nodes_[nd.src[k]];
        ok = s.shape == nd.shape && readers[nd.src[k]] == 1 && !(s.flags & (kOutput | kLoss)) &&
             nd.src[0] != nd.src[1] && scatter_parts(*this, merged, nd.src[k], k == 0 ? &a : &b);
      }
      if (ok && merge_scatters(a, b, &m)) merged[j] = std::move(m);
    }
  }
  auto srcs_of = [&](int j) -> const std::vector<int>& {
    const auto it = merged.find(j);
    return it == merged.end() ? nodes_[j].src : it->second.parts;
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
    const bool effect = !nd.is_leaf() && !nd.is_view() && tab.at(nd.op).writes_src;
    keep[j] = nd.is_leaf() || (nd.flags & (kOutput | kLoss)) || effect || read[j];
    if (keep[j])
      for (int s : srcs_of(j)) read[s] = 1;
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
  p.offsets.assign(n, SIZE_MAX);
  p.segments.assign(n, 0);
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
  for (int j = 0; j < n; ++j) {
    const Node& nd = nodes_[j];
    if (nd.is_leaf() || nd.is_view() || !keep[j]) continue;
    // Mirrors are written when their split starts: allocate them there, before the
    // split's own nodes, so nothing still live in the split can share their memory.
    while (split_i < place_.splits.size() && place_.splits[split_i].nodes.front() <= j) {
      for (int m : place_.splits[split_i].mirrors) {
        auto& mr = place_.mirrors[m];
        const auto slot = arena(mr.backend).alloc(nodes_[mr.base].nbytes());
        mr.segment = slot.segment;
        mr.offset = slot.offset;
      }
      ++split_i;
    }
    const auto slot = arena(place_.where[j]).alloc(nd.nbytes());
    p.segments[j] = slot.segment;
    p.offsets[j] = slot.offset;
    p.unplanned_bytes += align_up(std::max<size_t>(nd.nbytes(), 1));
    p.n_planned++;
    if (last[j] < 0) dies_at[j].push_back(j);  // dead on arrival
    for (int d : dies_at[j])
      if (p.offsets[d] != SIZE_MAX) arena(place_.where[d]).release(p.segments[d], p.offsets[d], nodes_[d].nbytes());
    for (int m : mirrors_die_at[j]) {
      const auto& mr = place_.mirrors[m];
      arena(mr.backend).release(mr.segment, mr.offset, nodes_[mr.base].nbytes());
    }
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
    // Buffers too small go first, so that their memory is free for the new ones.
    for (size_t i = 0; i < bufs.size(); ++i)
      if (bufs[i] && (i >= segs.size() || bufs[i]->nbytes() < segs[i] || !bufs[i]->valid())) bufs[i].reset();
    bufs.resize(segs.size());
    for (size_t i = 0; i < segs.size(); ++i)
      if (!bufs[i]) bufs[i] = std::make_shared<DeviceBuffer>(b, std::max<size_t>(segs[i], 64), Pool::transient);
  }
  for (int j = 0; j < n; ++j)
    if (p.offsets[j] != SIZE_MAX && place_.where[j] == kCpuBackend)
      nodes_[j].data = static_cast<uint8_t*>(arena_.get()) + p.offsets[j];
  {
    std::lock_guard<std::mutex> lk(g_scatter_mu);
    if (merged.empty())
      g_scatters.erase(this);
    else
      g_scatters[this] = std::move(merged);
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

void Graph::bind(int id, void* data) {
  Node& n = node(id);
  if (!n.is_leaf()) throw ValueError("bind: node " + std::to_string(id) + " is not a leaf");
  for (auto& mr : place_.mirrors)
    if (mr.base == id) mr.filled = false;
  if (n.dbuf) {
    n.dbuf.reset();
    planned_ = false;  // the leaf moved to the host
  }
  n.data = data;
}

void Graph::bind_device(int id, std::shared_ptr<DeviceBuffer> buf) {
  Node& n = node(id);
  if (!n.is_leaf()) throw ValueError("bind: node " + std::to_string(id) + " is not a leaf");
  for (auto& mr : place_.mirrors)
    if (mr.base == id) mr.filled = false;
  if (!buf || buf->nbytes() < n.nbytes())
    throw ValueError("bind: the device buffer is smaller than leaf " + std::to_string(id) + " (" +
                     std::to_string(n.nbytes()) + " bytes)");
  if (!n.dbuf || n.dbuf->backend() != buf->backend()) planned_ = false;
  n.dbuf = std::move(buf);
  n.data = nullptr;
}

int Graph::backend_of(int id) {
  node(id);
  plan();
  return location(id);
}

int Graph::n_splits() {
  plan();
  return static_cast<int>(place_.splits.size());
}

TensorView Graph::host_view(int id, int consumer) const {
  const Node& n = node(id);
  TensorView v;
  v.dtype = n.dtype;
  v.shape = n.shape;
  std::copy(n.strides, n.strides + kMaxDims, v.strides);
  int base = n.is_view() ? n.view_base : id;
  const Node& b = nodes_[base];
  uint8_t* mem = nullptr;
  if (location(base) == consumer) {
    mem = static_cast<uint8_t*>(b.data);
  } else {
    auto it = place_.mirror_of.find({base, consumer});
    if (it != place_.mirror_of.end())
      mem = static_cast<uint8_t*>(arena_.get()) + place_.mirrors[it->second].offset;
  }
  v.data = mem ? mem + n.view_offset * dtype_size(n.dtype) : nullptr;
  return v;
}

TensorView Graph::view_of(int id) const { return host_view(id, kCpuBackend); }

recurra_tensor_desc Graph::desc_on(int id, int backend) const {
  const Node& n = nodes_[id];
  recurra_tensor_desc d = shape_desc(n);
  int base = n.is_view() ? n.view_base : id;
  const Node& b = nodes_[base];
  size_t off = 0;
  if (location(base) == backend) {
    if (b.is_leaf()) {
      d.buffer = b.dbuf->handle();
    } else {
      d.buffer = arena_segment(backend, plan_.segments[base]).handle();
      off = plan_.offsets[base];
    }
  } else {
    const auto& m = place_.mirrors[place_.mirror_of.at({base, backend})];
    d.buffer = arena_segment(backend, m.segment).handle();
    off = m.offset;
  }
  d.offset = off + static_cast<size_t>(n.view_offset) * dtype_size(n.dtype);
  return d;
}

void Graph::fill_mirror(const Placement::Mirror& m) {
  const Node& b = nodes_[m.base];
  const size_t bytes = b.nbytes();
  if (bytes == 0) return;
  const int src = location(m.base);
  // Where the source bytes are.
  auto download_src = [&](void* dst) {
    if (b.is_leaf())
      b.dbuf->download(0, dst, bytes);
    else
      arena_segment(src, plan_.segments[m.base]).download(plan_.offsets[m.base], dst, bytes);
  };
  if (m.backend == kCpuBackend) {
    download_src(static_cast<uint8_t*>(arena_.get()) + m.offset);
    return;
  }
  DeviceBuffer& dst = arena_segment(m.backend, m.segment);
  if (src == kCpuBackend) {
    dst.upload(m.offset, b.data, bytes);
    return;
  }
  std::vector<uint8_t> tmp(bytes);  // device to device through the host
  download_src(tmp.data());
  dst.upload(m.offset, tmp.data(), bytes);
}

void Graph::run_device_split(const Placement::Split& sp) {
  const BackendEntry& e = backend_entry(sp.backend);
  if (e.closed) throw StateError(e.name + " was released; rebuild the graph on another device");
  const OpTable& tab = OpTable::get();
  std::vector<recurra_node_desc> descs(sp.nodes.size());
  for (size_t k = 0; k < sp.nodes.size(); ++k) {
    const Node& nd = nodes_[sp.nodes[k]];
    recurra_node_desc& d = descs[k];
    d.op = tab.at(nd.op).name.c_str();
    d.dst = desc_on(nd.id, sp.backend);
    d.n_src = static_cast<int32_t>(nd.src.size());
    for (size_t i = 0; i < nd.src.size(); ++i) d.src[i] = desc_on(nd.src[i], sp.backend);
    d.n_ip = static_cast<int32_t>(nd.ip.size());
    d.ip = nd.ip.data();
    d.n_fp = static_cast<int32_t>(nd.fp.size());
    d.fp = nd.fp.data();
  }
  check_status(sp.backend, e.table->compute(e.table->ctx, e.device, descs.data(), static_cast<int32_t>(descs.size())),
               "compute");
  check_status(sp.backend, e.table->synchronize(e.table->ctx, e.device), "synchronize");
}

void Graph::check_ready() const {
  for (const Node& n : nodes_)
    if (n.is_leaf() && !n.data && !n.dbuf && n.numel() > 0)
      throw StateError("compute: leaf " + std::to_string(n.id) +
                       (n.name.empty() ? "" : " ('" + n.name + "')") +
                       " has no data; set it before computing");
}

namespace {

int64_t elapsed_ns(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

// The profiler's key of a CPU node: its op, and with by_shape the shapes of its sources
// (marked T when its last two axes are stored transposed, * when otherwise strided) and
// of its result.
std::string profile_key(const Node& n, const std::string& op, const std::vector<TensorView>& src) {
  if (!profile_by_shape()) return op;
  std::string k = op + " ";
  for (size_t i = 0; i < src.size(); ++i) {
    const TensorView& v = src[i];
    k += (i ? ", " : "") + v.shape.str();
    if (!v.is_contiguous()) {
      const int nd = v.shape.ndim;
      k += nd >= 2 && v.strides[nd - 2] == 1 && v.shape.d[nd - 2] > 1 ? "T" : "*";
    }
  }
  return k + " -> " + n.shape.str();
}

}  // namespace

void Graph::compute() {
  plan();
  check_ready();
  const OpTable& tab = OpTable::get();
  const PoolLease lease;  // set_num_threads waits for this computation to end
  ThreadPool& tp = lease.pool();
  for (const auto& sp : place_.splits) {
    for (int m : sp.mirrors) {
      Placement::Mirror& mr = place_.mirrors[m];
      if (mr.filled) continue;
      fill_mirror(mr);
      mr.filled = (nodes_[mr.base].flags & kConst) != 0;
    }
    if (sp.backend != kCpuBackend) {
      const auto t0 = std::chrono::steady_clock::now();
      run_device_split(sp);
      if (profile_enabled())
        profile_record(backend_name(sp.backend) + " split", elapsed_ns(t0));
      continue;
    }
    const std::unordered_map<int, Scatter>* merged = nullptr;
    {
      std::lock_guard<std::mutex> lk(g_scatter_mu);
      const auto it = g_scatters.find(this);
      if (it != g_scatters.end()) merged = &it->second;  // stable until the next plan()
    }
    for (int j : sp.nodes) {
      const Node& n = nodes_[j];
      const bool prof = profile_enabled();
      const auto t0 = std::chrono::steady_clock::now();
      if (merged && merged->count(j)) {
        const Scatter& sc = merged->at(j);
        std::vector<TensorView> parts;
        for (int q : sc.parts) parts.push_back(host_view(q, kCpuBackend));
        scatter_last_axis(host_view(j, kCpuBackend), parts, sc.begin, tp);
        if (prof) profile_record(profile_key(n, "scatter", parts), elapsed_ns(t0));
        continue;
      }
      KernelCtx ctx{n, host_view(j, kCpuBackend), {}, tp};
      ctx.src.reserve(n.src.size());
      for (int s : n.src) ctx.src.push_back(host_view(s, kCpuBackend));
      tab.at(n.op).forward(ctx);
      if (prof) profile_record(profile_key(n, tab.at(n.op).name, ctx.src), elapsed_ns(t0));
    }
  }
}

void Graph::read(int id, void* out) {
  const Node& n = node(id);
  plan();
  const int base = n.is_view() ? n.view_base : id;
  const int loc = location(base);
  const size_t esz = dtype_size(n.dtype);
  std::vector<uint8_t> staging;
  const uint8_t* mem;
  if (loc == kCpuBackend) {
    mem = static_cast<const uint8_t*>(nodes_[base].data);
    if (!mem && n.numel() > 0)
      throw StateError("read: node " + std::to_string(id) + " has no data yet; compute the graph first");
  } else {
    const Node& b = nodes_[base];
    staging.resize(b.nbytes());
    if (b.is_leaf())
      b.dbuf->download(0, staging.data(), b.nbytes());
    else
      arena_segment(loc, plan_.segments[base]).download(plan_.offsets[base], staging.data(), b.nbytes());
    mem = staging.data();
  }
  if (n.numel() == 0) return;
  TensorView v;
  v.shape = n.shape;
  std::copy(n.strides, n.strides + kMaxDims, v.strides);
  const uint8_t* src = mem + n.view_offset * esz;
  auto* dst = static_cast<uint8_t*>(out);
  if (v.is_contiguous()) {
    std::memcpy(dst, src, n.numel() * esz);
    return;
  }
  int64_t idx[kMaxDims] = {0, 0, 0, 0};
  const int nd = n.shape.ndim;
  for (int64_t k = 0; k < n.numel(); ++k) {
    int64_t off = 0;
    for (int i = 0; i < nd; ++i) off += idx[i] * v.strides[i];
    std::memcpy(dst + k * esz, src + off * esz, esz);
    for (int i = nd - 1; i >= 0; --i) {
      if (++idx[i] < n.shape.d[i]) break;
      idx[i] = 0;
    }
  }
}

std::shared_ptr<DeviceBuffer> Graph::copy_to_device_buffer(int id) { return copy_to_device_buffers({id}).at(0); }

std::vector<std::shared_ptr<DeviceBuffer>> Graph::copy_to_device_buffers(const std::vector<int>& ids) {
  plan();
  std::vector<std::shared_ptr<DeviceBuffer>> out(ids.size());
  // Per backend: one dense "contiguous" node per result, all in one compute call and one
  // wait (a training step's gradients cost one round trip, not one per parameter).
  std::map<int, std::vector<size_t>> by_backend;
  for (size_t k = 0; k < ids.size(); ++k) {
    const Node& n = node(ids[k]);
    const int loc = location(ids[k]);
    if (loc == kCpuBackend)
      throw ValueError("copy_to_device_buffer: node " + std::to_string(ids[k]) + " is on the CPU");
    out[k] = std::make_shared<DeviceBuffer>(loc, std::max<size_t>(n.nbytes(), 4), Pool::persistent);
    if (n.numel() > 0) by_backend[loc].push_back(k);
  }
  for (const auto& [loc, ks] : by_backend) {
    const BackendEntry& e = backend_entry(loc);
    std::vector<recurra_node_desc> descs(ks.size());
    for (size_t q = 0; q < ks.size(); ++q) {
      const Node& n = nodes_[ids[ks[q]]];
      recurra_node_desc& d = descs[q];
      d = recurra_node_desc{};
      d.op = "contiguous";
      d.dst = shape_desc(n);
      int64_t st[kMaxDims];
      contiguous_strides(n.shape, st);
      for (int i = 0; i < n.shape.ndim; ++i) d.dst.strides[i] = st[i];
      d.dst.buffer = out[ks[q]]->handle();
      d.dst.offset = 0;
      d.n_src = 1;
      d.src[0] = desc_on(n.id, loc);
    }
    check_status(loc, e.table->compute(e.table->ctx, e.device, descs.data(), static_cast<int32_t>(descs.size())),
                 "copy");
    check_status(loc, e.table->synchronize(e.table->ctx, e.device), "synchronize");
  }
  return out;
}

}  // namespace recurra

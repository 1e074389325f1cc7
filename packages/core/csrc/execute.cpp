// The executor: binding leaves, host views of node results, mirrors across backends, and
// running the splits of a planned graph (see schedule.cpp for the placement).
#include <algorithm>
#include <chrono>
#include <climits>
#include <deque>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include "graph.h"
#include "half.h"
#include "ops/kernel_util.h"
#include "profile.h"
#include "memory.h"
#include "schedule.h"

namespace recurra {

using namespace sched;

void scatter_last_axis(const TensorView& dst, const std::vector<TensorView>& parts,
                       const std::vector<TensorView>& plus, const std::vector<int64_t>& begin,
                       ThreadPool& tp);  // ops/views.cpp
void zeros_around(const TensorView& dst, int64_t b, int64_t e, ThreadPool& tp);  // ops/views.cpp
void add_rows_back(const TensorView& dst, const TensorView& base, const TensorView& grad, const TensorView& idx,
                   ThreadPool& tp);  // ops/nn.cpp

void Graph::AlignedFree::operator()(void* p) const { host_free(p); }

namespace {

bool touches_half(const KernelCtx& c) {
  if (is_half(c.dst.dtype)) return true;
  for (const auto& v : c.src)
    if (is_half(v.dtype)) return true;
  return false;
}

// Host scratch of float32, given back when it goes out of scope.
struct F32Scratch {
  float* p = nullptr;
  explicit F32Scratch(int64_t n) : p(static_cast<float*>(host_alloc(std::max<int64_t>(n, 1) * sizeof(float)))) {}
  ~F32Scratch() { host_free(p); }
  F32Scratch(const F32Scratch&) = delete;
  F32Scratch& operator=(const F32Scratch&) = delete;
};

// Runs a float32 kernel on a node with bfloat16/float16 tensors: each such source is
// converted to float32 over the span of memory its view reaches (so its strides, broadcast
// axes included, stay as they are), the kernel writes a float32 output, which is rounded to
// the output's dtype (to nearest even). Accumulation inside the kernel is float32.
void run_in_f32(KernelCtx& ctx, const std::function<void(KernelCtx&)>& kernel) {
  std::vector<std::unique_ptr<F32Scratch>> scratch;
  auto widen = [&](TensorView& v) {
    if (!is_half(v.dtype)) return;
    int64_t lo = 0, hi = 0;  // element offsets the view reaches, relative to v.data
    for (int i = 0; i < v.shape.ndim; ++i) {
      if (v.shape.d[i] == 0) return;  // empty: nothing to read
      const int64_t reach = (v.shape.d[i] - 1) * v.strides[i];
      (reach < 0 ? lo : hi) += reach;
    }
    const int64_t n = hi - lo + 1;
    scratch.push_back(std::make_unique<F32Scratch>(n));
    float* f = scratch.back()->p;
    const uint16_t* h = static_cast<const uint16_t*>(v.data) + lo;
    const DType t = v.dtype;
    ctx.pool.parallel_for(n, kGrainElems, [&](int64_t b, int64_t e, int) { half_to_f32(t, h + b, f + b, e - b); });
    v.data = f - lo;
    v.dtype = DType::f32;
  };
  for (auto& v : ctx.src) widen(v);
  TensorView out = ctx.dst;  // dense: a node's own memory
  if (is_half(out.dtype)) {
    scratch.push_back(std::make_unique<F32Scratch>(out.numel()));
    ctx.dst.data = scratch.back()->p;
    ctx.dst.dtype = DType::f32;
  }
  kernel(ctx);
  if (is_half(out.dtype)) {
    const float* f = ctx.dst.f32();
    auto* h = static_cast<uint16_t*>(out.data);
    ctx.pool.parallel_for(out.numel(), kGrainElems,
                          [&](int64_t b, int64_t e, int) { f32_to_half(out.dtype, f + b, h + b, e - b); });
  }
}

// Whether a compute reporting groups reads them asynchronously on `backend` (see
// Graph::compute; RECURRA_ASYNC_READS=0 turns it off).
bool async_reads_on(int backend) {
  const char* v = std::getenv("RECURRA_ASYNC_READS");
  if (v && std::strcmp(v, "0") == 0) return false;
  return has_async_reads(backend);
}
}  // namespace

void Graph::bind(int id, void* data) {
  Node& n = node(id);
  if (!n.is_leaf()) throw ValueError("bind: node " + std::to_string(id) + " is not a leaf");
  for (auto& mr : place_.mirrors)
    if (mr.base == id) mr.filled = false;
  n.dbuf.reset();
  if (n.leaf_backend != kCpuBackend) planned_ = false;  // the leaf moved to the host
  n.leaf_backend = kCpuBackend;
  n.data = data;
}

void Graph::unbind(int id) {
  Node& n = node(id);
  if (!n.is_leaf()) throw ValueError("unbind: node " + std::to_string(id) + " is not a leaf");
  for (auto& mr : place_.mirrors)
    if (mr.base == id) mr.filled = false;
  n.dbuf.reset();
  n.data = nullptr;
}

void Graph::bind_device(int id, std::shared_ptr<DeviceBuffer> buf) {
  Node& n = node(id);
  if (!n.is_leaf()) throw ValueError("bind: node " + std::to_string(id) + " is not a leaf");
  for (auto& mr : place_.mirrors)
    if (mr.base == id) mr.filled = false;
  if (!buf || buf->nbytes() < n.nbytes())
    throw ValueError("bind: the device buffer is smaller than leaf " + std::to_string(id) + " (" +
                     std::to_string(n.nbytes()) + " bytes)");
  if (n.leaf_backend != buf->backend()) planned_ = false;
  n.leaf_backend = buf->backend();
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
    const int owner = memory_owner(plan_, base);
    if (b.is_leaf() || owns_memory(owner)) {
      check_own_held(owner, "compute");
      d.buffer = nodes_[owner].dbuf->handle();
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
  const int owner = memory_owner(plan_, m.base);
  auto download_src = [&](void* dst) {
    if (b.is_leaf() || owns_memory(owner))
      nodes_[owner].dbuf->download(0, dst, bytes);
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

namespace {

// The adds plan() merged for graph g (see Scatter, RowsAdd), or null; stable until g's
// next plan().
const MergedAdds* merged_adds(const Graph* g) {
  std::lock_guard<std::mutex> lk(g_scatter_mu);
  const auto it = g_scatters.find(g);
  return it == g_scatters.end() ? nullptr : &it->second;
}

}  // namespace

void Graph::run_device_split(const Placement::Split& sp, size_t begin, size_t end,
                             const std::vector<recurra_node_desc>& extra, bool wait) {
  const BackendEntry& e = backend_entry(sp.backend);
  if (e.closed) throw StateError(e.name + " was released; rebuild the graph on another device");
  if (begin >= end && extra.empty()) return;
  const OpTable& tab = OpTable::get();
  const MergedAdds* merged = merged_adds(this);
  // Source s of a node, or with from >= 0 the node whose cast s is (a cast not run: see
  // Scatter::from, MergedAdds::folded), dense in s's shape, for the node to convert.
  auto folded_desc = [&](int s, int from) {
    if (from < 0) return desc_on(s, sp.backend);
    const recurra_tensor_desc f = desc_on(from, sp.backend);
    recurra_tensor_desc d = shape_desc(nodes_[s]);
    d.dtype = f.dtype;
    d.buffer = f.buffer;
    d.offset = f.offset;
    return d;
  };
  std::vector<recurra_node_desc> descs;
  descs.reserve(end - begin);
  for (size_t q = begin; q < end; ++q) {
    const int j = sp.nodes[q];
    const Node& nd = nodes_[j];
    const Scatter* sc = nullptr;
    if (merged) {
      const auto it = merged->scatters.find(j);
      if (it != merged->scatters.end()) sc = &it->second;
    }
    if (sc) {
      // A merged add of slice gradients (see Scatter): each piece copied in place into its
      // window of the output's last axis; the pieces cover it (plan() checked).
      const recurra_tensor_desc whole = desc_on(j, sp.backend);
      const int last = whole.ndim - 1;
      for (size_t k = 0; k < sc->parts.size(); ++k) {
        recurra_node_desc d{};
        d.op = "assign";
        d.n_src = 2;
        d.src[0] = whole;
        d.src[0].shape[last] = sc->end[k] - sc->begin[k];
        d.src[0].offset += static_cast<size_t>(sc->begin[k]) * dtype_size(nd.dtype);
        d.src[1] = sc->from.empty() ? desc_on(sc->parts[k], sp.backend) : folded_desc(sc->parts[k], sc->from[k]);
        d.dst = d.src[0];  // assign's (1,) result: the window's first element
        d.dst.ndim = 1;
        d.dst.shape[0] = 1;
        d.dst.strides[0] = 1;
        descs.push_back(d);
      }
      continue;
    }
    // A widened product (see MergedAdds::widened): the cast runs as its 2-byte product,
    // writing the cast's float32 output.
    const auto w = merged ? merged->widened.find(j) : std::unordered_map<int, int>::const_iterator{};
    const Node& op = merged && w != merged->widened.end() ? nodes_[w->second] : nd;
    recurra_node_desc d{};
    d.op = tab.at(op.op).name.c_str();
    d.dst = desc_on(nd.id, sp.backend);
    d.n_src = static_cast<int32_t>(op.src.size());
    const auto rd = merged ? merged->folded.find(j) : std::unordered_map<int, std::vector<int>>::const_iterator{};
    const bool rounds = merged && rd != merged->folded.end();
    for (size_t i = 0; i < op.src.size(); ++i) {
      d.src[i] = rounds ? folded_desc(op.src[i], rd->second[i]) : desc_on(op.src[i], sp.backend);
    }
    d.n_ip = static_cast<int32_t>(op.ip.size());
    d.ip = op.ip.data();
    d.n_fp = static_cast<int32_t>(op.fp.size());
    d.fp = op.fp.data();
    descs.push_back(d);
  }
  descs.insert(descs.end(), extra.begin(), extra.end());
  check_status(sp.backend, e.table->compute(e.table->ctx, e.device, descs.data(), static_cast<int32_t>(descs.size())),
               "compute");
  if (wait) check_status(sp.backend, e.table->synchronize(e.table->ctx, e.device), "synchronize");
}

void Graph::check_ready() const {
  for (const Node& n : nodes_)
    if (n.is_leaf() && !n.data && !n.dbuf && n.numel() > 0)
      throw StateError("compute: leaf " + std::to_string(n.id) +
                       (n.name.empty() ? "" : " ('" + n.name + "')") +
                       " has no data; set it before computing");
}

void Graph::make_own_buffers() {
  for (int j = 0; j < size(); ++j) {
    if (!owns_memory(j)) continue;
    Node& nd = nodes_[j];
    const int b = place_.where[j];
    if (b == kCpuBackend) {
      nd.dbuf.reset();
      if (!nd.hbuf) nd.hbuf = std::make_shared<HostBuffer>(std::max<size_t>(nd.nbytes(), 1), Pool::persistent);
      nd.data = nd.hbuf->data();
    } else {
      nd.hbuf.reset();
      nd.data = nullptr;
      if (!nd.dbuf && nd.given && nd.given.use_count() == 1)  // see Node::given
        nd.dbuf = std::move(nd.given);
      nd.given.reset();  // (still held elsewhere: that memory is its holder's now)
      if (!nd.dbuf || nd.dbuf->backend() != b || !nd.dbuf->valid() || nd.dbuf->nbytes() < nd.nbytes())
        nd.dbuf = std::make_shared<DeviceBuffer>(b, std::max<size_t>(nd.nbytes(), 4), Pool::persistent);
    }
  }
  for (int j = 0; j < size(); ++j)  // nodes computed into those buffers (own chains)
    if (memory_owner(plan_, j) != j) nodes_[j].data = nodes_[memory_owner(plan_, j)].data;
}

void Graph::check_own_held(int id, const char* what) const {
  const Node& n = nodes_[id];
  if (owns_memory(id) && !n.hbuf && !n.dbuf)
    throw StateError(std::string(what) + ": the value of node " + std::to_string(id) +
                     " was handed over (take); compute the graph again first");
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

void Graph::compute(const std::vector<std::vector<int>>& groups, const std::function<void(int)>& ready,
                    const std::vector<std::shared_ptr<DeviceBuffer>>& targets) {
  plan();
  check_ready();
  make_own_buffers();
  staged_at_.clear();
  targets_ = &targets;
  struct Unstage {  // staged values are read only while their compute reports
    Graph& g;
    ~Unstage() {
      g.staged_at_.clear();
      g.targets_ = nullptr;
      for (Staged& st : g.staged_)
        if (st.target) st = Staged{};  // the caller's memory is not kept
    }
  } unstage{*this};
  // fire[p]: the groups whose nodes are all final once the first p nodes (in the order the
  // splits run them) are computed. A view is final with its base, a leaf at once; a node
  // that runs in no split (merged away) counts as final at the end.
  std::vector<std::vector<int>> fire;
  if (ready && !groups.empty()) {
    std::vector<int64_t> pos(nodes_.size(), -1);
    int64_t total = 0;
    for (const auto& sp : place_.splits)
      for (int j : sp.nodes) pos[j] = total++;
    fire.assign(static_cast<size_t>(total) + 1, {});
    for (size_t k = 0; k < groups.size(); ++k) {
      int64_t at = 0;
      for (int id : groups[k]) {
        int b = node(id).id;
        while (nodes_[b].is_view()) b = nodes_[b].view_base;
        if (!nodes_[b].is_leaf()) at = std::max(at, pos[b] >= 0 ? pos[b] + 1 : total);
      }
      fire[at].push_back(static_cast<int>(k));
    }
  }
  int64_t done = 0;  // nodes computed so far
  auto report = [&]() {
    if (!fire.empty())
      for (int k : fire[done]) ready(k);
  };
  report();
  const OpTable& tab = OpTable::get();
  const PoolLease lease;  // set_num_threads waits for this computation to end
  ThreadPool& tp = lease.pool();
  const int cast_op = tab.find("cast");
  for (const auto& sp : place_.splits) {
    for (int m : sp.mirrors) {
      Placement::Mirror& mr = place_.mirrors[m];
      if (mr.filled) continue;
      fill_mirror(mr);
      mr.filled = (nodes_[mr.base].flags & kConst) != 0;
    }
    if (sp.backend != kCpuBackend) {
      // In parts ending where a group completes. Synchronous: each part is computed and
      // waited for, then its groups are reported. Asynchronous reads: each part also copies
      // the nodes of the groups it completes into their host-visible buffers and is not
      // waited for; a part's groups are reported once kAheadParts more parts are submitted
      // (the device has work while the host reads and uses them), the last ones at the end
      // of the split. (A backend may hold back a submission until an older one is done:
      // recurra_vulkan keeps 4 in flight; reporting later would find the device idle.)
      constexpr size_t kAheadParts = 3;
      const int64_t first = done;  // the split's first node's position
      const bool async = !fire.empty() && async_reads_on(sp.backend);
      std::deque<std::pair<size_t, int>> fired;  // async: (part, group) not yet reported
      size_t parts = 0;
      size_t begin = 0;
      for (size_t k = 0; k < sp.nodes.size(); ++k) {
        const bool cut = !fire.empty() && !fire[first + static_cast<int64_t>(k) + 1].empty();
        if (!cut && k + 1 < sp.nodes.size()) continue;
        const auto t0 = std::chrono::steady_clock::now();
        if (async) {
          std::vector<recurra_node_desc> copies;
          const auto& now = fire[first + static_cast<int64_t>(k) + 1];
          for (int g : now) stage_group(g, groups[g], sp.backend, copies);
          run_device_split(sp, begin, k + 1, copies, false);
          const uint64_t m = backend_mark(sp.backend);
          for (int g : now) {
            staged_[g].mark = m;
            staged_[g].waited = false;
            fired.push_back({parts, g});
          }
          ++parts;
          while (!fired.empty() && fired.front().first + kAheadParts < parts) {
            const int g = fired.front().second;
            fired.pop_front();
            ready(g);
          }
        } else {
          run_device_split(sp, begin, k + 1);
        }
        if (profile_enabled()) profile_record(backend_name(sp.backend) + " split", elapsed_ns(t0));
        done = first + static_cast<int64_t>(k + 1);
        begin = k + 1;
        if (!async) report();
      }
      if (async) {
        for (const auto& [part, g] : fired) ready(g);
        staged_at_.clear();
        const BackendEntry& e = backend_entry(sp.backend);
        check_status(sp.backend, e.table->synchronize(e.table->ctx, e.device), "synchronize");
      }
      continue;
    }
    const MergedAdds* merged = merged_adds(this);
    for (int j : sp.nodes) {
      const Node& n = nodes_[j];
      const bool prof = profile_enabled();
      const auto t0 = std::chrono::steady_clock::now();
      if (merged && merged->scatters.count(j)) {
        const Scatter& sc = merged->scatters.at(j);
        std::vector<TensorView> parts, plus(sc.parts.size());
        for (size_t i = 0; i < sc.parts.size(); ++i) {
          parts.push_back(host_view(sc.parts[i], kCpuBackend));
          if (!sc.written.empty() && sc.written[i]) parts.back().data = nullptr;  // its producer wrote it
          if (sc.lhs.empty() || sc.lhs[i] < 0) continue;
          // the part as the add's two dense sources, in the part's shape
          TensorView& p = parts.back();
          p.data = host_view(sc.lhs[i], kCpuBackend).data;
          contiguous_strides(p.shape, p.strides);
          plus[i] = p;
          plus[i].data = host_view(sc.rhs[i], kCpuBackend).data;
        }
        scatter_last_axis(host_view(j, kCpuBackend), parts, plus, sc.begin, tp);
        if (prof) profile_record(profile_key(n, "scatter", parts), elapsed_ns(t0));
        ++done;
        report();
        continue;
      }
      if (merged && merged->rows.count(j)) {
        const RowsAdd& ra = merged->rows.at(j);
        const std::vector<TensorView> src{host_view(ra.base, kCpuBackend), host_view(ra.grad, kCpuBackend),
                                          host_view(ra.idx, kCpuBackend)};
        add_rows_back(host_view(j, kCpuBackend), src[0], src[1], src[2], tp);
        if (prof) profile_record(profile_key(n, "add_rows_back", src), elapsed_ns(t0));
        ++done;
        report();
        continue;
      }
      KernelCtx ctx{n, host_view(j, kCpuBackend), {}, tp};
      if (merged && merged->redirects.count(j))
        for (const Redirect& r : merged->redirects.at(j))
          ctx.pieces.push_back({r.offset, host_view(r.scatter, kCpuBackend).f32() + r.col, r.stride});
      if (merged && merged->written_slices.count(j)) {  // its slice written by its producer
        zeros_around(ctx.dst, n.ip[1], n.ip[2], tp);
        if (prof) profile_record(profile_key(n, "slice_grad", {host_view(n.src[0], kCpuBackend)}), elapsed_ns(t0));
        ++done;
        report();
        continue;
      }
      ctx.src.reserve(n.src.size());
      for (int s : n.src) ctx.src.push_back(host_view(s, kCpuBackend));
      if (n.op != cast_op && touches_half(ctx))
        run_in_f32(ctx, tab.at(n.op).forward);
      else
        tab.at(n.op).forward(ctx);
      if (prof) profile_record(profile_key(n, tab.at(n.op).name, ctx.src), elapsed_ns(t0));
      ++done;
      report();
    }
  }
}

void Graph::read(int id, void* out) {
  const Node& n = node(id);
  plan();
  if (const uint8_t* staged = staged_bytes(id)) {
    if (staged != out) std::memcpy(out, staged, n.nbytes());  // (a target: there already)
    return;
  }
  const int base = n.is_view() ? n.view_base : id;
  const int loc = location(base);
  const size_t esz = dtype_size(n.dtype);
  const int owner = memory_owner(plan_, base);
  check_own_held(owner, "read");
  std::vector<uint8_t> staging;
  const uint8_t* mem;
  if (loc == kCpuBackend) {
    mem = static_cast<const uint8_t*>(nodes_[base].data);
    if (!mem && n.numel() > 0)
      throw StateError("read: node " + std::to_string(id) + " has no data yet; compute the graph first");
  } else {
    const Node& b = nodes_[base];
    staging.resize(b.nbytes());
    if (b.is_leaf() || owns_memory(owner))
      nodes_[owner].dbuf->download(0, staging.data(), b.nbytes());
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

namespace {

// A "contiguous" node copying node n (seen as `src`) densely to `offset` bytes into dst.
recurra_node_desc dense_copy(const Node& n, const recurra_tensor_desc& src, const DeviceBuffer& dst,
                             size_t offset) {
  recurra_node_desc d{};
  d.op = "contiguous";
  d.dst = shape_desc(n);
  int64_t st[kMaxDims];
  contiguous_strides(n.shape, st);
  for (int i = 0; i < n.shape.ndim; ++i) d.dst.strides[i] = st[i];
  d.dst.buffer = dst.handle();
  d.dst.offset = offset;
  d.n_src = 1;
  d.src[0] = src;
  return d;
}

}  // namespace

void Graph::stage_group(int k, const std::vector<int>& group, int backend, std::vector<recurra_node_desc>& descs) {
  // The group's nodes computed on `backend` (leaves and nodes elsewhere are read directly).
  // (with a target: at each node's place in the group's packed layout)
  std::vector<std::pair<int, size_t>> ids;  // (node, its place in the group's packed layout)
  size_t bytes = 0, packed = 0;
  for (int id : group) {
    const Node& n = node(id);
    const int base = n.is_view() ? n.view_base : id;
    packed += n.nbytes();
    if (n.numel() == 0 || nodes_[base].is_leaf() || location(base) != backend || staged_at_.count(id)) continue;
    ids.push_back({id, packed - n.nbytes()});
    bytes += n.nbytes();
  }
  if (staged_.size() <= static_cast<size_t>(k)) staged_.resize(static_cast<size_t>(k) + 1);
  Staged& st = staged_[k];
  if (ids.empty()) return;
  std::shared_ptr<DeviceBuffer> target;
  if (targets_ && static_cast<size_t>(k) < targets_->size()) target = (*targets_)[k];
  const bool into = target && target->backend() == backend && target->valid() && target->host() &&
                    target->nbytes() >= packed;
  if (into) {
    st.buf = target;
  } else if (!st.buf || st.target || st.buf->backend() != backend || st.buf->nbytes() != bytes ||
             !st.buf->valid()) {
    st.buf = std::make_shared<DeviceBuffer>(backend, bytes, DeviceBuffer::HostVisible{});
  }
  st.target = into;
  size_t at = 0;
  for (const auto& [id, place] : ids) {
    const Node& n = nodes_[id];
    check_own_held(memory_owner(plan_, n.is_view() ? n.view_base : id), "read");
    const size_t to = into ? place : at;
    descs.push_back(dense_copy(n, desc_on(id, backend), *st.buf, to));
    staged_at_[id] = {k, to};
    at += n.nbytes();
  }
}

const uint8_t* Graph::staged_bytes(int id) {
  const auto it = staged_at_.find(id);
  if (it == staged_at_.end()) return nullptr;
  Staged& st = staged_[it->second.first];
  if (!st.waited) {
    backend_wait_mark(st.buf->backend(), st.mark);
    st.waited = true;
  }
  return st.buf->host() + it->second.second;
}

void Graph::read_packed(const std::vector<int>& ids, void* out) {
  plan();
  auto* dst = static_cast<uint8_t*>(out);
  std::map<int, std::vector<std::pair<int, size_t>>> by_backend;  // (node, offset in out)
  size_t off = 0;
  for (int id : ids) {
    const Node& n = node(id);
    const int base = n.is_view() ? n.view_base : id;
    const int loc = location(base);
    if (loc == kCpuBackend || n.numel() == 0 || staged_bytes(id))
      read(id, dst + off);
    else
      by_backend[loc].push_back({id, off});
    off += n.nbytes();
  }
  for (const auto& [loc, items] : by_backend) {
    size_t bytes = 0;
    for (const auto& it : items) bytes += nodes_[it.first].nbytes();
    DeviceBuffer packed(loc, std::max<size_t>(bytes, 4), Pool::persistent);
    const BackendEntry& e = backend_entry(loc);
    std::vector<recurra_node_desc> descs(items.size());
    size_t at = 0;
    for (size_t q = 0; q < items.size(); ++q) {
      const Node& n = nodes_[items[q].first];
      const int owner = memory_owner(plan_, n.is_view() ? n.view_base : n.id);
      check_own_held(owner, "read");
      descs[q] = dense_copy(n, desc_on(n.id, loc), packed, at);
      at += n.nbytes();
    }
    check_status(loc, e.table->compute(e.table->ctx, e.device, descs.data(), static_cast<int32_t>(descs.size())),
                 "copy");
    check_status(loc, e.table->synchronize(e.table->ctx, e.device), "synchronize");
    std::vector<uint8_t> staging(bytes);
    packed.download(0, staging.data(), bytes);
    at = 0;
    for (const auto& [id, o] : items) {
      const size_t nb = nodes_[id].nbytes();
      std::memcpy(dst + o, staging.data() + at, nb);
      at += nb;
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
      descs[q] = dense_copy(nodes_[ids[ks[q]]], desc_on(ids[ks[q]], loc), *out[ks[q]], 0);
    }
    check_status(loc, e.table->compute(e.table->ctx, e.device, descs.data(), static_cast<int32_t>(descs.size())),
                 "copy");
    check_status(loc, e.table->synchronize(e.table->ctx, e.device), "synchronize");
  }
  return out;
}

std::vector<std::shared_ptr<DeviceBuffer>> Graph::take_buffers(const std::vector<int>& ids) {
  plan();
  std::vector<std::shared_ptr<DeviceBuffer>> out(ids.size());
  std::vector<int> copy_ids;
  std::vector<size_t> copy_at, hand;
  std::vector<char> handed(nodes_.size(), 0);
  for (size_t k = 0; k < ids.size(); ++k) {
    const int id = ids[k];
    node(id);
    if (owns_memory(id) && location(id) != kCpuBackend && !handed[id]) {
      check_own_held(id, "take_buffers");
      handed[id] = 1;
      hand.push_back(k);
    } else {
      copy_ids.push_back(id);
      copy_at.push_back(k);
    }
  }
  // Copies first: a node asked for twice is copied from the buffer it then hands over.
  if (!copy_ids.empty()) {
    auto copies = copy_to_device_buffers(copy_ids);
    for (size_t q = 0; q < copies.size(); ++q) out[copy_at[q]] = std::move(copies[q]);
  }
  for (size_t k : hand) {
    Node& nd = nodes_[ids[k]];
    out[k] = nd.dbuf;
    nd.given = std::move(nd.dbuf);
  }
  return out;
}

std::shared_ptr<HostBuffer> Graph::take_host(int id) {
  Node& n = node(id);
  plan();
  if (!owns_memory(id) || location(id) != kCpuBackend) return nullptr;
  check_own_held(id, "take");
  n.data = nullptr;
  return std::move(n.hbuf);
}

}  // namespace recurra

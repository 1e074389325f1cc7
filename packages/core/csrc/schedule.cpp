// The scheduler and the executor: placing nodes on backends, planning memory per backend,
// copying tensors across split boundaries, and running the splits.
//
// Placement: each op node goes to the first backend of set_backends() whose supports_op
// accepts it, the CPU otherwise (or an error in strict mode). Leaves live where their data
// is bound; views live with their base. Input flags play no part, so an input never drags
// the graph onto the CPU.
////
// Memory planning is in memory_plan.cpp, running the splits in execute.cpp.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include "graph.h"
#include "memory.h"
#include "schedule.h"

namespace recurra {

using namespace sched;

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
  if (n.is_leaf()) return n.leaf_backend;
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
      place_.where[j] = nd.leaf_backend;
      continue;
    }
    if (nd.is_view()) {
      place_.where[j] = place_.where[nd.view_base];
      continue;
    }
    const OpDef& def = tab.at(nd.op);
    if (def.writes_any_src(nd)) {
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
        std::string names, why;
        for (int b : backends_) {
          names += (names.empty() ? "" : ", ") + backend_name(b);
          const auto* t = backend_entry(b).table;
          const char* m = t->get_last_error ? t->get_last_error(t->ctx) : nullptr;  // its supports_op's reason
          if (m && *m) why += " (" + backend_name(b) + ": " + m + ")";
        }
        throw StateError("strict placement: op '" + tab.at(nd.op).name + "' with shapes " +
                         shapes_str(*this, nd) + " -> " + nd.shape.str() + " " + dtype_name(nd.dtype) +
                         " is not supported by " + names + why +
                         "; allow CPU fallback (strict=False) or change the graph");
      }
      chosen = kCpuBackend;
    }
    place_.where[j] = chosen;
  }
}

}  // namespace recurra

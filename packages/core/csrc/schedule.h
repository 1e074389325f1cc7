// What the scheduler's three parts share: placement (schedule.cpp), memory planning
// (memory_plan.cpp) and running the splits (execute.cpp).
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "graph.h"

namespace recurra {
namespace sched {

constexpr size_t kAlign = 64;
inline size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// shape_desc (a node's dense descriptor): graph.h, defined in decompose.cpp.

// The node whose memory holds node id's result: id itself, or for a node computed straight
// into the own buffer of a later one (an own chain, see memory_plan.cpp: no arena slot, its
// MemoryPlan::segments entry is -2 - that node) that node.
inline int memory_owner(const MemoryPlan& p, int id) {
  return id < static_cast<int>(p.segments.size()) && p.segments[id] <= -2 ? -2 - p.segments[id] : id;
}

// ---- merged slice gradients ----------------------------------------------------------
//
// A tensor cut into pieces along its last axis (a projection split into its parts) gets the
// gradient add(slice_grad(g_1), slice_grad(g_2)), add(that, slice_grad(g_3)), ...: every
// slice_grad writes a whole zero-padded tensor and every add reads two. When all of it runs
// on the CPU, plan() has each such add run instead as one scatter of the pieces' gradients
// g_i (each output element written once), and the slice_grads and inner adds, now unread,
// are not run. On a device the same add runs as one in-place copy ("assign") of each piece
// into its window of the output, when the pieces cover the last axis and the backend takes
// such windows. The graph's nodes stay as they are; the substitution lives here, per graph.

struct Scatter {
  std::vector<int> parts;      // the nodes written into the output, by begin
  std::vector<int64_t> begin;  // their first column on the last axis
  std::vector<int64_t> end;
};

// The merged adds of each planned graph, by add node: plan() writes them, compute() runs
// them (memory_plan.cpp).
extern std::mutex g_scatter_mu;
extern std::unordered_map<const Graph*, std::unordered_map<int, Scatter>> g_scatters;


}  // namespace sched
}  // namespace recurra

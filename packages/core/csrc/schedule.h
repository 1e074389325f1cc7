// What the scheduler's three parts share: placement (schedule.cpp), memory planning
// (memory_plan.cpp) and running the splits (execute.cpp).
#pragma once

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
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

// Whether node n's strides are those of a dense tensor of its shape.
inline bool is_dense(const Node& n) {
  TensorView v;
  v.shape = n.shape;
  std::copy(n.strides, n.strides + kMaxDims, v.strides);
  return v.is_contiguous();
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
  // On the CPU, per part: the two dense sources of an add whose result the part is (a dense
  // view of it, read by nothing else), summed straight into the output instead of running
  // that add (a Mamba-2 x's gradient from the scan and from the D skip); -1 when the part
  // is copied as it is.
  std::vector<int> lhs, rhs;
  // Per part: 1 when its producer writes it into the output itself (see Redirect); the
  // scatter leaves those columns as they are.
  std::vector<char> written;
  // On a device, per part: the float32 node whose cast to the output's 2-byte dtype the part
  // is (the cast itself or a dense view of it, read by nothing else), or -1. The part's
  // assign reads that node instead and rounds each element (a backend's rounding assign),
  // so the cast does not run (RECURRA_FOLD_CASTS=0: it does).
  std::vector<int> from;
};

// On the CPU, a scatter part that is a piece of a packed result whose kernel can write that
// piece anywhere (KernelCtx::pieces: gated_rms_norm_back's dz, causal_conv_silu_back's dx;
// Mamba-2's z and xBC gradients) and that nothing else reads: the producer writes it
// straight into its window of the scatter's output, whose memory is planned from the
// producer on. That part is then neither written twice nor read again.
// The same for a slice_grad of a 1-D packed gradient whose slice is such a piece: the
// producer writes it there, the slice_grad writes only the zeros around it.
struct Redirect {
  int scatter;     // the merged add (or slice_grad) whose output takes the piece
  int64_t offset;  // the piece's first element in the producer's packed result
  int64_t col;     // its first column in the scatter's output (the slice's first element)
  int64_t stride;  // floats between the piece's rows there
};

// A tied embedding's gradient is add(A, get_rows_back(g, idx)): the LM head's dense (V, D)
// product and the few rows the lookup touched. On the CPU, plan() runs that add as A with
// the row sums of g added into the rows of idx (the add writes over A when A dies there, as
// the own chain of a parameter's gradient does), so the zeroed (V, D) scatter and the full
// add are not run; each row sum is taken in index order first, then added: the same float
// operations as before.
struct RowsAdd {
  int base, grad, idx;
};

// The merged adds of each planned graph, by add node: plan() writes them, compute() runs
// them (memory_plan.cpp).
struct MergedAdds {
  std::unordered_map<int, Scatter> scatters;
  std::unordered_map<int, RowsAdd> rows;
  std::unordered_map<int, std::vector<Redirect>> redirects;  // by producer node
  std::unordered_set<int> written_slices;                     // slice_grads so written
  // On a device, adds of a 2-byte dtype and slice_grads with a source that is a cast (after
  // the loss, read by nothing else; see Scatter::from) of another float node to their dtype:
  // per source, that node, which the backend's kernel reads and converts where it loads
  // each value, as the cast did (the cast is not run), or -1. RECURRA_FOLD_CASTS=0: none.
  std::unordered_map<int, std::vector<int>> folded;
  // On a device, casts to float32 (after the loss) of a 2-byte matmul or out_prod that
  // nothing else reads (a weight's gradient under autocast, widened for its float32
  // parameter), by cast node: that product, which the backend runs writing the cast's float32
  // output itself, its sums not rounded to the 2-byte type first (the product is not run).
  // RECURRA_WIDEN_PRODUCTS=0: none (comparisons; RECURRA_FOLD_CASTS does not change it).
  std::unordered_map<int, int> widened;
};
// Whether device backend b (not closed) runs node d, by its supports_op.
bool backend_runs(int b, const recurra_node_desc& d);
// Whether device backend b copies into a strided window of a tensor of dtype dt in place (an
// assign whose destination is a window of a wider row), as a merged add runs there, from a
// source of dtype src_dt (float32 into a 2-byte dt: rounding it, see Scatter::from).
bool assigns_into_windows(int b, DType dt, DType src_dt);

// Fills Scatter::from of the merged adds, `folded` (MergedAdds::folded) and `widened`
// (MergedAdds::widened) for graph g, placed by `where`, whose node j has readers[j] readers
// (fold_casts.cpp).
void fold_casts(const Graph& g, const std::vector<int>& where, const std::vector<int>& readers,
                std::unordered_map<int, Scatter>& merged, std::unordered_map<int, std::vector<int>>& folded,
                std::unordered_map<int, int>& widened);

extern std::mutex g_scatter_mu;
extern std::unordered_map<const Graph*, MergedAdds> g_scatters;


}  // namespace sched
}  // namespace recurra

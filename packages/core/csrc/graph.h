// The computation graph: nodes, the op table, the builder, autodiff, the memory planner and
// the CPU executor.
//
// A Graph is an append-only list of nodes in topological order (a node's sources always
// come before it). Leaves (constants, inputs, parameters) hold memory owned by the caller;
// every other node gets memory from the plan made by Graph::plan(). View nodes (reshape,
// permute, slice, broadcast) own nothing: they point into their base with their own strides.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend_registry.h"
#include "memory.h"
#include "recurra/op_spec.h"
#include "common.h"
#include "threadpool.h"

namespace recurra {

enum NodeFlags : uint32_t {
  kParam = 1u << 0,   // a trainable leaf: build_backward makes a gradient for it
  kInput = 1u << 1,   // fed from outside (placement hint only, never pins to a backend)
  kOutput = 1u << 2,  // read after compute: its memory is never reused within the graph
  kLoss = 1u << 3,    // the scalar that build_backward differentiates
  kConst = 1u << 4,   // a leaf whose data does not change while bound: a device copy of it
                      // (a mirror) is filled once, not at every compute
  // An output (a parameter's gradient; build_backward sets it) with memory of its own
  // instead of a place in the arena: a persistent buffer on the backend that computes it,
  // made by compute() when the node holds none. take_buffers()/take_host() hand it to the
  // caller (no copy; the graph then holds none until the next compute), so a result is
  // never held twice (in the arena and in its copy). Views and leaves ignore the flag.
  kOwnMemory = 1u << 5,
};

// A strided window on memory that a kernel reads or writes.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  int64_t strides[kMaxDims] = {0, 0, 0, 0};

  float* f32() const { return static_cast<float*>(data); }
  int32_t* i32() const { return static_cast<int32_t*>(data); }
  int64_t numel() const { return shape.numel(); }
  bool is_contiguous() const;
};

struct Node {
  int id = -1;
  int op = -1;  // index into the op table
  DType dtype = DType::f32;
  Shape shape;
  int64_t strides[kMaxDims] = {0, 0, 0, 0};  // memory strides in elements (views differ)
  std::vector<int> src;
  std::vector<int64_t> ip;  // integer parameters of the op
  std::vector<double> fp;   // float parameters of the op
  uint32_t flags = 0;
  std::string name;

  // Views: the node whose memory this one looks into, and the element offset in it.
  int view_base = -1;  // -1: owns its memory (or is a leaf)
  int64_t view_offset = 0;

  int grad = -1;  // after build_backward: the node holding d(loss)/d(this), or -1

  // Recomputation segment (0: none). build_backward differentiates the op nodes of a
  // segment on copies of them appended just before their gradient nodes, so the
  // originals are read by the forward only and their memory is reused once it is done.
  int segment = 0;

  // Runtime state, filled by plan()/bind(): where the data lives. A leaf is bound either to
  // host memory (`data`) or to a buffer of a plugin backend (`dbuf`); an op node with memory
  // of its own (kOwnMemory) holds it in `hbuf` (host) or `dbuf` (device) until it is taken.
  void* data = nullptr;
  std::shared_ptr<DeviceBuffer> dbuf;
  std::shared_ptr<HostBuffer> hbuf;
  // An own-memory node's device buffer as last handed over by take_buffers: the next compute
  // writes into it again when nobody else holds it any more (a gradient the optimizer used
  // and let go), so the node list names the same buffer and a device can replay its recording.
  std::shared_ptr<DeviceBuffer> given;
  // A leaf: the backend of the memory it was last bound to (kept by unbind(), so that binding
  // the same kind of memory again keeps the plan).
  int leaf_backend = kCpuBackend;

  bool is_leaf() const;
  bool is_view() const { return view_base >= 0; }
  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
};

class Graph;

// What a CPU kernel sees: its output and its sources, already resolved to memory.
struct KernelCtx {
  const Node& node;
  TensorView dst;
  std::vector<TensorView> src;
  ThreadPool& pool;
  // Pieces of a packed float32 result that go elsewhere (on the CPU, straight into their
  // window of a merged scatter's output: see Redirect in schedule.h): the piece starting at
  // element `offset` of dst has its rows `stride` floats apart from `data`.
  struct Piece {
    int64_t offset;
    float* data;
    int64_t stride;
  };
  std::vector<Piece> pieces = {};
  // Row r of the piece of rows of `len` floats at element `offset` of dst: where the kernel
  // writes it (kernels that take pieces: gated_rms_norm_back's dz, causal_conv_silu_back's dx).
  float* piece_row(int64_t offset, int64_t r, int64_t len) const {
    for (const Piece& p : pieces)
      if (p.offset == offset) return p.data + r * p.stride;
    return dst.f32() + offset + r * len;
  }
};

// Collects the gradient contributions of one node's backward rule.
struct GradSink {
  Graph& g;
  const Node& node;  // copy of the node being differentiated (the graph may grow)
  int grad_out;      // d(loss)/d(node)
  std::vector<int> contributions;  // per source: gradient node id, or -1
  const std::vector<char>* needs_ = nullptr;  // per node id: a parameter flows into it
  // Adds a gradient for source i. The shape must equal the source's shape (use
  // Graph::reduce_to to undo broadcasting first).
  void add(int i, int grad_node);
  bool needs(int i) const;  // does a parameter flow into source i? (skip its gradient if not)
};

// One entry of the op table: everything about an op side by side.
struct OpDef {
  std::string name;
  // Checks the sources and parameters and sets node.dtype and node.shape. Throws
  // ValueError/TypeError naming the op and the shapes.
  std::function<void(Graph& g, Node& node)> infer;
  // The CPU kernel. Null for view ops (they run no code).
  std::function<void(KernelCtx& ctx)> forward;
  // Builds gradient nodes for the sources. Null: the op is not differentiable, and
  // build_backward raises if a parameter depends on it.
  std::function<void(GradSink& sink)> backward;
  // Bit i set: source i must be contiguous; the builder inserts a `contiguous` node if not.
  uint32_t contiguous_srcs = 0;
  // Set for reshape/permute/slice/broadcast_to: infer also sets strides and the view.
  bool is_view = false;
  // Null: the CPU kernel takes every node infer accepts. Else whether it takes node n (one
  // it refuses is decomposed, see decompose.cpp; e.g. ssm_scan refuses to save checkpoints
  // its CPU backward would not read).
  std::function<bool(const Graph& g, const Node& n)> cpu_supports;
  // Null for ordinary ops. For ops that update sources in place (the optimizer steps,
  // assign, ssm_scan with RECURRA_SSM_SCAN_STATE_IN_PLACE): whether source i is written.
  // The scheduler runs such a node where the written memory lives, never on a copy of it.
  std::function<bool(const Node& node, size_t src)> writes_src;
  // Whether node n (of this op) writes any of its sources.
  bool writes_any_src(const Node& n) const {
    if (!writes_src) return false;
    for (size_t i = 0; i < n.src.size(); ++i)
      if (writes_src(n, i)) return true;
    return false;
  }
};

// The op table. Each ops/*.cpp file has a register_*_ops(OpTable&) function; ops.cpp
// calls them all once, in the order of recurra/op_spec.h (checked at start-up).
class OpTable {
 public:
  static OpTable& get();
  int add(OpDef def);
  int find(const std::string& name) const;  // -1 when unknown
  const OpDef& at(int id) const { return ops_[id]; }
  int size() const { return static_cast<int>(ops_.size()); }
  // The op's declaration in recurra/op_spec.h (its id is its index there).
  const recurra_op_spec& spec(int id) const;
  // Raises StateError unless `t` holds exactly the ops of the spec, in its order.
  static void check_against_spec(const OpTable& t);

 private:
  std::vector<OpDef> ops_;
  std::unordered_map<std::string, int> by_name_;
};

struct MemoryPlan {
  size_t arena_bytes = 0;      // the peak: bytes of the arenas all intermediates share
  size_t unplanned_bytes = 0;  // what the same intermediates would take without reuse
  // The most bytes live at once (arena_bytes less what fragmentation adds), the node at
  // which that happens, and the live bytes there by the op that made them.
  size_t peak_live_bytes = 0;
  int peak_node = -1;
  std::vector<std::pair<std::string, size_t>> live_at_peak;
  std::vector<int> live_nodes_at_peak;  // the same, node by node (ids in graph order)
  size_t n_planned = 0;        // nodes given memory in an arena
  // Outputs with memory of their own (kOwnMemory): per node, and their bytes in all.
  std::vector<char> own;
  size_t own_bytes = 0;
  // Nodes that write their result over a source that dies there (elementwise ops; see
  // memory_plan.cpp), and the bytes that saved.
  size_t n_in_place = 0;
  size_t in_place_bytes = 0;
  // Pieces of packed CPU results their kernels write straight into a merged scatter's
  // output (see Redirect in schedule.h), instead of the scatter copying them.
  size_t n_redirected = 0;
  // Casts of gradients whose sources a device's merged scatter, add or slice_grad reads
  // instead, converting each value itself (Scatter::from, MergedAdds::folded): not run.
  size_t n_folded_casts = 0;
  // Casts to float32 of 2-byte products that nothing else reads, run as the product writing
  // float32 (MergedAdds::widened): the product's node is not run.
  size_t n_widened_products = 0;
  // Per node: the segment of its backend's arena and the byte offset in it (SIZE_MAX: none).
  // A device backend's arena is split into segments no larger than its largest buffer; the
  // host's arena is one segment.
  std::vector<size_t> offsets;
  std::vector<int> segments;
};

// Where each node runs, and the copies between backends (see schedule.cpp).
struct Placement {
  std::vector<int> where;  // per node: backend id that computes it / holds its data
  struct Mirror {          // a copy of node `base` on another backend
    int base, backend;
    size_t offset;    // in that backend's arena
    int segment = 0;  // which segment of it
    bool filled = false;  // a kConst base's mirror, filled since the plan or the last bind
  };
  std::vector<Mirror> mirrors;
  std::map<std::pair<int, int>, int> mirror_of;  // (base, backend) -> index in mirrors
  struct Split {
    int backend;
    std::vector<int> nodes;    // op nodes (no views, no leaves) in order
    std::vector<int> mirrors;  // mirrors to fill before the split runs
  };
  std::vector<Split> splits;
  std::map<int, size_t> arena_bytes;                // per backend id: all its segments
  std::map<int, std::vector<size_t>> segment_bytes;  // per backend id: each segment
  std::map<int, DeviceLimits> limits;                // per device backend considered
};

class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // --- building -----------------------------------------------------------------
  // A leaf with memory the caller binds later (bind()).
  int leaf(DType dtype, Shape shape, uint32_t flags = 0, const std::string& name = "");
  // A node of op `name` on `src` with parameters; returns its id. Validates through the
  // op's infer and inserts `contiguous` nodes where the op requires them.
  int op(const std::string& name, std::vector<int> src, std::vector<int64_t> ip = {},
         std::vector<double> fp = {});

  // Builder helpers used by backward rules (and by the bindings).
  int add(int a, int b) { return op("add", {a, b}); }
  int sub(int a, int b) { return op("sub", {a, b}); }
  int mul(int a, int b) { return op("mul", {a, b}); }
  int div(int a, int b) { return op("div", {a, b}); }
  int neg(int a) { return op("neg", {a}); }
  int scale(int a, double s) { return op("scale", {a}, {}, {s}); }
  int reshape(int a, Shape s) { return op("reshape", {a}, s.vec()); }
  int permute(int a, const std::vector<int64_t>& perm) { return op("permute", {a}, perm); }
  int contiguous(int a) { return op("contiguous", {a}); }
  int broadcast_to(int a, Shape s) { return op("broadcast_to", {a}, s.vec()); }
  // Sums `a` down to `target` (numpy broadcasting in reverse): the gradient rule of every
  // broadcasting op. Returns `a` itself when the shapes already match.
  // Builders take shapes by value: a caller may pass a node's shape, and the node table can
  // grow (and move) while the builder appends nodes.
  int reduce_to(int a, Shape target);
  // A contiguous piece of a packed 1-D result (multi-output ops pack their results).
  int unpack(int packed, int64_t offset, Shape s) {
    return reshape(op("slice", {packed}, {offset, offset + s.numel(), 1}), s);
  }
  // A node filled with a constant.
  int fill(Shape s, double value, DType dt = DType::f32) {
    return op("fill", {}, s.vec(), {value, static_cast<double>(static_cast<int>(dt))});
  }

  // The recomputation segment given to the op nodes built from now on (0: none; see
  // Node::segment). Leaves never belong to one.
  void set_segment(int seg);
  int segment() const { return cur_segment_; }

  // --- autodiff -----------------------------------------------------------------
  // Appends the backward graph of scalar node `loss` (seed 1, or `seed` when >= 0, a node
  // of the loss's shape); sets Node::grad of every node a parameter depends on. The op
  // nodes of a recomputation segment are copied (their sources inside the segment
  // replaced by the copies) when the sweep first reaches one of them, and their backward
  // rules read the copies: the forward of the segment runs again there instead of being
  // kept. Raises ValueError for a segment holding an op that updates memory in place.
  //
  // Casts are recomputed the same way, one at a time (set_recompute_casts): a rule, or a
  // segment's copy, that reads a cast of the forward (not one of that segment's own), or a
  // view of one, reads a copy of it made right before, when the cast widens (bfloat16 or
  // float16 -> float32: keeping the 2-byte source is half the memory) or casts a leaf (a
  // parameter's 2-byte copy: the leaf is kept anyway). The original is then freed after
  // its last forward reader. Gradients are bitwise the same: a cast repeats exactly.
  void build_backward(int loss, int seed = -1);

  // --- running ------------------------------------------------------------------
  // Places every node on a backend (the scheduler: set_backends' order, the CPU last),
  // then plans the memory of all non-leaf, non-view nodes in one arena per backend, reusing
  // the memory of intermediates after their last use. Idempotent until the graph changes.
  const MemoryPlan& plan();
  // Binds a leaf to caller-owned host memory (must stay alive during compute).
  void bind(int id, void* data);
  // Binds a leaf to memory of a plugin backend.
  void bind_device(int id, std::shared_ptr<DeviceBuffer> buf);
  // Lets go of a leaf's memory (compute() then raises until it is bound again); the plan is
  // kept: binding memory of the same backend again costs no planning.
  void unbind(int id);
  // Plugin backends to try, in priority order, before the CPU. Strict: a node no listed
  // backend supports raises instead of falling back to the CPU.
  void set_backends(std::vector<int> ids, bool strict);
  int backend_of(int id);  // after plan()
  int n_splits();          // after plan()
  const Placement& placement() { plan(); return place_; }
  // Copies a node's value to host memory `out` (numel * 4 bytes, contiguous).
  void read(int id, void* out);
  // The values of `ids`, one after the other (dense), into `out`: the nodes on a device are
  // packed there first (one compute call, one wait and one download per device).
  void read_packed(const std::vector<int>& ids, void* out);
  // A new persistent buffer on the node's backend holding a dense copy of its value.
  std::shared_ptr<DeviceBuffer> copy_to_device_buffer(int id);
  // The same for several nodes: one compute call and one wait per backend.
  std::vector<std::shared_ptr<DeviceBuffer>> copy_to_device_buffers(const std::vector<int>& ids);
  // As copy_to_device_buffers, but a node with memory of its own (kOwnMemory) hands its
  // buffer over instead of copying it (a node asked for twice is copied for the others).
  std::vector<std::shared_ptr<DeviceBuffer>> take_buffers(const std::vector<int>& ids);
  // Host result of a node computed on the CPU with memory of its own: its buffer, handed
  // over (the graph then holds none until the next compute). Null for any other node.
  std::shared_ptr<HostBuffer> take_host(int id);
  // Whether node id has memory of its own (after plan()).
  bool owns_memory(int id) const { return id >= 0 && id < static_cast<int>(plan_.own.size()) && plan_.own[id]; }
  // Runs every non-leaf node on the CPU, in order. Raises if a leaf is unbound.
  void compute() { compute({}, nullptr); }
  // The same, calling ready(k) as soon as every node of groups[k] holds its final value
  // while the rest still runs (a device split is cut there). Groups are reported in the
  // order they complete (ties: by index).
  // On a backend with asynchronous reads (has_async_reads; RECURRA_ASYNC_READS=0 turns them
  // off), the part of the split that completes a group also copies the group's nodes into a
  // host-visible buffer of the graph (kept for the next compute), and no part is waited for;
  // a part's groups are reported a few parts later (the device keeps work queued), and while
  // ready(k) runs, read() and read_packed() of a node of a reported group wait for the part
  // that copied it only (the device runs on with the rest). Elsewhere each part is computed
  // and waited for before its groups are reported.
  // targets[k] (optional, asynchronous reads only): host-visible memory of the backend
  // (alloc_host's or imported) that group k's nodes are copied into instead of the graph's
  // own buffer, packed in the group's order as read_packed(groups[k]) lays them out; then
  // read_packed(groups[k], that memory) copies nothing. Used only where it is on the
  // group's backend and large enough; not kept after the compute.
  void compute(const std::vector<std::vector<int>>& groups, const std::function<void(int)>& ready,
               const std::vector<std::shared_ptr<DeviceBuffer>>& targets = {});

  // Whether node n (inferred, need not be in the graph yet) runs as it is where it would be
  // placed: on the first open backend of set_backends() that takes it, or, with none
  // listed, on the CPU when its kernel takes it (OpDef::cpu_supports). See decompose.cpp.
  bool runs_as_is(const Node& n) const;

  // --- inspection ---------------------------------------------------------------
  Node& node(int id);
  const Node& node(int id) const;
  int size() const { return static_cast<int>(nodes_.size()); }
  const std::vector<Node>& nodes() const { return nodes_; }
  TensorView view_of(int id) const;  // host view, for nodes whose data is on the CPU
  uint64_t generation() const { return generation_; }

 private:
  int push(Node n);
  DType half_dtype_of(const std::string& name, const std::vector<int>& src) const;
  void clone_segment(int seg, int end, std::vector<int>& clone_of, std::vector<char>& needs,
                     std::map<int, int>& leaf_casts);
  bool of_leaf(int s) const;
  int recast(int s, int end, std::map<int, int>& made);
  void recast_sources(Node& n, int end, std::map<int, int>& made, std::vector<char>& needs);
  void check_ready() const;
  int location(int id) const;  // backend holding node id's data (views: their base's)
  void assign_backends();
  int place_in_place_op(int j) const;
  bool backend_supports(int backend, int j) const;
  bool backend_supports(int backend, const Node& n) const;  // n need not be in the graph yet
  bool cpu_supports(const Node& n) const;
  // decompose.cpp: if node n (inferred, not yet added) does not run as it is where it would
  // be placed and its op has a decomposition, builds that and returns its result's id (else
  // -1).
  int decompose_unless_taken(const Node& n);
  recurra_tensor_desc desc_on(int id, int backend) const;  // node id as seen from backend
  const DeviceLimits& limits_of(int backend);
  // Raises MemoryError when node j (or its mirror, `mirror`) cannot be one buffer of backend b.
  void check_fits(int b, int j, bool mirror);
  DeviceBuffer& arena_segment(int backend, int segment) const;
  TensorView host_view(int id, int consumer_backend) const;
  void fill_mirror(const Placement::Mirror& m);
  void make_own_buffers();  // compute(): memory for the kOwnMemory nodes that hold none
  void check_own_held(int id, const char* what) const;  // raises if a taken result is read
  // Runs nodes [begin, end) of a device split, then the `extra` nodes; waits for them unless
  // !wait.
  void run_device_split(const Placement::Split& sp, size_t begin, size_t end,
                        const std::vector<recurra_node_desc>& extra = {}, bool wait = true);
  // Asynchronous reads (see compute()): appends to `descs` the copies of group k's nodes on
  // `backend` into its host-visible buffer and records where each one lands.
  void stage_group(int k, const std::vector<int>& group, int backend, std::vector<recurra_node_desc>& descs);
  // The bytes of node id staged by the compute now reporting (its part waited for first), or
  // null when it was not staged.
  const uint8_t* staged_bytes(int id);

  std::vector<Node> nodes_;
  MemoryPlan plan_;
  Placement place_;
  bool planned_ = false;
  std::vector<int> backends_;
  bool strict_ = false;
  std::map<int, std::vector<std::shared_ptr<DeviceBuffer>>> dev_arena_;  // per backend: its segments
  struct AlignedFree { void operator()(void* p) const; };
  std::unique_ptr<void, AlignedFree> arena_;
  size_t arena_capacity_ = 0;
  uint64_t generation_ = 1;
  int cur_segment_ = 0;
  struct Staged {  // a group's host-visible copy (asynchronous reads)
    std::shared_ptr<DeviceBuffer> buf;
    uint64_t mark = 0;  // the backend's mark after the part that fills it
    bool waited = false;
    bool target = false;  // buf is the caller's (compute()'s targets): let go of after it
  };
  std::vector<Staged> staged_;                                  // per group, kept
  std::unordered_map<int, std::pair<int, size_t>> staged_at_;  // node -> (group, byte offset)
  const std::vector<std::shared_ptr<DeviceBuffer>>* targets_ = nullptr;  // compute()'s, while it runs
};

// ---- helpers for ops ------------------------------------------------------------

// numpy broadcasting of two shapes; throws ValueError naming `op`.
Shape broadcast_shapes(const char* op, const Shape& a, const Shape& b);
// "op: shapes (2, 3) and (4,)" style message pieces.
std::string shapes_str(const Graph& g, const Node& n);
// Throws ValueError "<op>: <msg>; got shapes ..." for node n.
[[noreturn]] void fail_shape(const Graph& g, const Node& n, const std::string& msg);
// Requires source i to have a float dtype (TypeError otherwise): f32, or bf16/f16 for the
// ops that take them (Graph::op refuses them for the others before infer runs).
void require_f32(const Graph& g, const Node& n, int i);
// Strides of `src` broadcast up to `shape` (0 on broadcast axes); the view's own strides
// are aligned right like numpy.
void broadcast_strides(const TensorView& src, const Shape& shape, int64_t* out);

void register_all_ops(OpTable& t);

// decompose.cpp: a node's shapes as a backend sees them (no buffer); the start-up check that
// the decompositions are those recurra/op_spec.h declares; the test knob making the CPU
// refuse ops (so that their decompositions run on the CPU).
recurra_tensor_desc shape_desc(const Node& n);
void check_decompositions_against_spec(const OpTable& t);
void set_cpu_refused_ops(const std::vector<std::string>& names);

// graph.cpp: whether build_backward recomputes casts for the backward rules that read them
// (see Graph::build_backward; on by default). Process-wide; for tests and measurements.
void set_recompute_casts(bool on);
bool recompute_casts();

}  // namespace recurra

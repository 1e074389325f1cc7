// Neural-net ops along the last axis and the lookup ops: softmax, log_softmax, rms_norm,
// layer_norm and their *_back kernels, cross_entropy(+_back), get_rows(+_back).
// Shaders: softmax_norm.comp, reduce.comp (the mean of cross_entropy), get_rows.comp,
// get_rows_back.comp.
//
//   R = rows (all axes but the last), C = the last axis; every source dense
//   softmax / log_softmax / rms_norm / layer_norm:  x (..., C) -> (..., C)
//   *_back:          (grad, y or x) -> x's shape
//   cross_entropy:   logits (N, C) f32, targets (N,) i32 -> () mean loss
//   cross_entropy_back: (grad (), logits, targets) -> (N, C)
//   get_rows:        table (V, D), idx I (1-3 axes) i32 -> I + (D,)
//   get_rows_back:   grad I + (D,), idx I, ip [V] -> (V, D)
// Indices known only at run time (targets, idx) are checked on the GPU: a bad one sets an
// error flag that synchronize() reports as RECURRA_ERR_INVALID.
// The row ops, get_rows and get_rows_back take bfloat16/float16 tensors through their "_h"
// shader variants: float32 maths, each output rounded once (a lookup moves the bits; the
// scatter-add sums in float32).
#include <cstring>

#include "half_ops.h"
#include "ops.h"

namespace recurra_vk {

namespace {

struct RowsPC {
  uint64_t x, g, y, t, err;
  uint32_t rows, C;
  float eps;
};

enum RowOp {
  kSoftmax, kLogSoftmax, kSoftmaxBack, kLogSoftmaxBack, kRmsNorm, kRmsNormBack, kLayerNorm, kLayerNormBack,
  kCrossEntropyRows, kCrossEntropyBack
};

// (rows, C) of a row op's output.
void rows_of(const recurra_tensor_desc& d, int64_t& rows, int64_t& C) {
  C = d.ndim ? d.shape[d.ndim - 1] : 1;
  rows = C ? numel(d) / C : 0;
}

template <int OP, int NSRC, bool EPS>
std::string row_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, NSRC);
  if (why.empty()) why = require_float(n, NSRC);
  if (!why.empty()) return why;
  if (EPS && (n.n_fp != 1 || !(n.fp[RECURRA_P_EPS] >= 0.0))) return "takes eps >= 0";
  for (int i = 0; i < NSRC; ++i)
    if (!is_dense(n.src[i]) || !same_shape(n.src[i], n.dst)) return "needs dense sources of the output's shape";
  return "";
}

template <int OP, int NSRC, bool EPS>
void row_record(NodeCall& c) {
  int64_t rows, C;
  rows_of(*c.dst.d, rows, C);
  if (rows * C == 0) return;
  RowsPC pc{};
  // One-source ops read x; backward ops read (grad, x-or-y).
  pc.x = NSRC == 1 ? addr(c.src[0]) : addr(c.src[1]);
  pc.g = NSRC == 1 ? 0 : addr(c.src[0]);
  pc.y = addr(c.dst);
  pc.rows = static_cast<uint32_t>(rows);
  pc.C = static_cast<uint32_t>(C);
  pc.eps = static_cast<float>(fp(c.node, RECURRA_P_EPS));
  uint32_t gx, gy;
  grid_2d(rows, gx, gy);
  // 2-byte tensors: softmax_norm_h, the dtypes of x, g and y its specialization constants 1-3.
  const bool half = has_half(c.node, NSRC);
  std::vector<int32_t> spec{OP};
  if (half)
    spec.insert(spec.end(), {dt_code(c.src[NSRC - 1].d->dtype), dt_code(c.src[0].d->dtype), dt_code(c.dst.d->dtype)});
  if (NSRC == 1)
    c.rec.dispatch(variant("softmax_norm", half), spec, pc, gx, gy, 1, {c.src[0].range}, {c.dst.range});
  else
    c.rec.dispatch(variant("softmax_norm", half), spec, pc, gx, gy, 1, {c.src[0].range, c.src[1].range},
                   {c.dst.range});
}

// ---- cross_entropy --------------------------------------------------------------------

std::string cross_entropy_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  if (!why.empty()) return why;
  const recurra_tensor_desc &l = n.src[0], &t = n.src[1];
  // 2-byte logits read as they are (RECURRA_OPS_HALF_IN): softmax_norm_h
  if (!is_float(l.dtype) || t.dtype != RECURRA_I32 || n.dst.dtype != RECURRA_F32)
    return "cross_entropy takes float32, bfloat16 or float16 logits and int32 targets";
  if (l.ndim != 2 || t.ndim != 1 || t.shape[0] != l.shape[0] || numel(n.dst) != 1) return "needs (N, C), (N,) -> ()";
  if (l.shape[0] == 0 || l.shape[1] == 0) return "needs at least one row and one class";
  if (!is_dense(l) || !is_dense(t)) return "needs dense sources";
  return "";
}

void cross_entropy_record(NodeCall& c) {
  const int64_t N = c.src[0].d->shape[0], C = c.src[0].d->shape[1];
  const Recorder::Scratch losses = c.rec.scratch(static_cast<size_t>(N) * 4);
  RowsPC pc{};
  pc.x = addr(c.src[0]);
  pc.t = addr(c.src[1]);
  pc.y = losses.addr;
  pc.err = c.rec.device().error_flags_address();
  pc.rows = static_cast<uint32_t>(N);
  pc.C = static_cast<uint32_t>(C);
  uint32_t gx, gy;
  grid_2d(N, gx, gy);
  const recurra_dtype ldt = c.src[0].d->dtype;
  std::vector<int32_t> spec{kCrossEntropyRows};
  if (is_half(ldt)) spec.insert(spec.end(), {dt_code(ldt), dt_code(RECURRA_F32), dt_code(RECURRA_F32)});
  c.rec.dispatch(variant("softmax_norm", is_half(ldt)), spec, pc, gx, gy, 1, {c.src[0].range, c.src[1].range},
                 {losses.range});
  // The mean over rows, summed in a fixed order.
  ReduceSpec r;
  r.sn = 1;
  r.sshape[0] = N;
  r.sst[0] = 1;
  r.scale = 1.0f / static_cast<float>(N);
  record_reduce(c.rec, r, losses.addr, losses.range, addr(c.dst), c.dst.range);
}

std::string cross_entropy_back_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 3);
  if (!why.empty()) return why;
  const recurra_tensor_desc &g = n.src[0], &l = n.src[1], &t = n.src[2];
  // 2-byte logits read as they are, their gradient written in their dtype (RECURRA_OPS_HALF_IN)
  if (g.dtype != RECURRA_F32 || !is_float(l.dtype) || t.dtype != RECURRA_I32 || n.dst.dtype != l.dtype)
    return "cross_entropy_back takes (float32 grad, float logits, int32 targets) -> the logits' dtype";
  if (numel(g) != 1 || l.ndim != 2 || t.ndim != 1 || t.shape[0] != l.shape[0] || !same_shape(l, n.dst))
    return "needs grad (), logits (N, C), targets (N,)";
  if (l.shape[0] == 0 || l.shape[1] == 0) return "needs at least one row and one class";
  if (!is_dense(l) || !is_dense(t)) return "needs dense sources";
  return "";
}

void cross_entropy_back_record(NodeCall& c) {
  const int64_t N = c.src[1].d->shape[0], C = c.src[1].d->shape[1];
  RowsPC pc{};
  pc.g = addr(c.src[0]);
  pc.x = addr(c.src[1]);
  pc.t = addr(c.src[2]);
  pc.y = addr(c.dst);
  pc.err = c.rec.device().error_flags_address();
  pc.rows = static_cast<uint32_t>(N);
  pc.C = static_cast<uint32_t>(C);
  uint32_t gx, gy;
  grid_2d(N, gx, gy);
  const bool half = has_half(c.node, 2);
  std::vector<int32_t> spec{kCrossEntropyBack};
  if (half) spec.insert(spec.end(), {dt_code(c.src[1].d->dtype), dt_code(RECURRA_F32), dt_code(c.dst.d->dtype)});
  c.rec.dispatch(variant("softmax_norm", half), spec, pc, gx, gy, 1, {c.src[0].range, c.src[1].range, c.src[2].range},
                 {c.dst.range});
}

// ---- get_rows -------------------------------------------------------------------------

struct GetRowsPC {
  uint64_t table, idx, out, err;
  uint32_t N, D, V;
};

std::string get_rows_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  if (!why.empty()) return why;
  const recurra_tensor_desc &tb = n.src[0], &ix = n.src[1], &d = n.dst;
  if (!is_float(tb.dtype) || ix.dtype != RECURRA_I32 || !is_float(d.dtype))
    return "get_rows takes a float32, bfloat16 or float16 table and int32 indices";
  if (tb.ndim != 2 || ix.ndim < 1 || ix.ndim > 3 || d.ndim != ix.ndim + 1) return "needs table (V, D) and 1-3 index axes";
  for (int i = 0; i < ix.ndim; ++i)
    if (d.shape[i] != ix.shape[i]) return "wrong output shape";
  if (d.shape[d.ndim - 1] != tb.shape[1]) return "wrong output shape";
  if (!is_dense(tb) || !is_dense(ix)) return "needs dense sources";
  return "";
}

void get_rows_record(NodeCall& c) {
  const int64_t V = c.src[0].d->shape[0], D = c.src[0].d->shape[1], N = numel(*c.src[1].d);
  if (N * D == 0) return;
  GetRowsPC pc{addr(c.src[0]), addr(c.src[1]), addr(c.dst), c.rec.device().error_flags_address(),
               static_cast<uint32_t>(N), static_cast<uint32_t>(D), static_cast<uint32_t>(V)};
  const recurra_dtype tdt = c.src[0].d->dtype, odt = c.dst.d->dtype;
  if (is_half(tdt) || is_half(odt))
    c.rec.dispatch("get_rows_h", {dt_code(tdt), dt_code(odt)}, pc, grid_groups(N * D, 256), 1, 1,
                   {c.src[0].range, c.src[1].range}, {c.dst.range});
  else
    c.rec.dispatch("get_rows", {}, pc, grid_groups(N * D, 256), 1, 1, {c.src[0].range, c.src[1].range}, {c.dst.range});
}

struct GetRowsBackPC {
  uint64_t g, idx, out, err, counts, start, rank, pos;
  uint32_t N, V, D;
};

// The ranking pass compares every index with the ones before it (O(N^2) cheap integer
// work); past this many indices the CPU's kernel is the better place.
constexpr int64_t kMaxScatterIndices = int64_t(1) << 18;

std::string get_rows_back_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  if (!why.empty()) return why;
  const recurra_tensor_desc &g = n.src[0], &ix = n.src[1], &d = n.dst;
  if (!is_float(g.dtype) || ix.dtype != RECURRA_I32 || !is_float(d.dtype))
    return "get_rows_back takes a float32, bfloat16 or float16 grad and int32 indices";
  if (n.n_ip != 1 || n.ip[RECURRA_P_N_ROWS] < 0 || d.ndim != 2 || d.shape[0] != n.ip[RECURRA_P_N_ROWS]) return "takes the row count V";
  if (ix.ndim < 1 || g.ndim != ix.ndim + 1 || g.shape[g.ndim - 1] != d.shape[1]) return "wrong shapes";
  for (int i = 0; i < ix.ndim; ++i)
    if (g.shape[i] != ix.shape[i]) return "wrong shapes";
  if (!is_dense(g) || !is_dense(ix)) return "needs dense sources";
  if (numel(ix) > kMaxScatterIndices) return "more than 2^18 indices (the CPU kernel is faster there)";
  return "";
}

void get_rows_back_record(NodeCall& c) {
  const int64_t V = c.dst.d->shape[0], D = c.dst.d->shape[1], N = numel(*c.src[1].d);
  if (V * D == 0) return;
  Recorder& rec = c.rec;
  const auto counts = rec.scratch(static_cast<size_t>(V) * 4);
  const auto start = rec.scratch(static_cast<size_t>(V) * 4);
  const auto rank = rec.scratch(static_cast<size_t>(std::max<int64_t>(N, 1)) * 4);
  const auto pos = rec.scratch(static_cast<size_t>(std::max<int64_t>(N, 1)) * 4);
  FillPC zero{counts.addr, static_cast<uint32_t>(V), 0u};
  rec.dispatch("fill", {}, zero, grid_groups(V, 256), 1, 1, {}, {counts.range});
  zero.d = rank.addr;
  zero.n = static_cast<uint32_t>(N);
  if (N > 0) rec.dispatch("fill", {}, zero, grid_groups(N, 256), 1, 1, {}, {rank.range});
  GetRowsBackPC pc{addr(c.src[0]), addr(c.src[1]), addr(c.dst), rec.device().error_flags_address(),
                   counts.addr, start.addr, rank.addr, pos.addr,
                   static_cast<uint32_t>(N), static_cast<uint32_t>(V), static_cast<uint32_t>(D)};
  const Range& gr = c.src[0].range;
  const Range& ir = c.src[1].range;
  if (N > 0) {
    uint32_t gx, gy;
    grid_2d((N + 255) / 256, gx, gy);
    // The rank walk in blocks of j (get_rows_back.comp's RANK_BLOCK): lavapipe's loop limit.
    constexpr int64_t kRankBlock = 16384;
    const auto gz = static_cast<uint32_t>((N + kRankBlock - 1) / kRankBlock);
    rec.dispatch("get_rows_back", {0}, pc, gx, gy, gz, {ir}, {rank.range, counts.range});
  }
  rec.dispatch("get_rows_back", {1}, pc, 1, 1, 1, {counts.range}, {start.range});
  if (N > 0) rec.dispatch("get_rows_back", {2}, pc, grid_groups(N, 256), 1, 1, {ir, start.range, rank.range}, {pos.range});
  const recurra_dtype gdt = c.src[0].d->dtype, odt = c.dst.d->dtype;
  if (is_half(gdt) || is_half(odt))  // the sums: 2-byte grad or output (passes 0-2 touch only integers)
    rec.dispatch("get_rows_back_h", {3, dt_code(gdt), dt_code(odt)}, pc, grid_groups(V * D, 256), 1, 1,
                 {gr, counts.range, start.range, pos.range}, {c.dst.range});
  else
    rec.dispatch("get_rows_back", {3}, pc, grid_groups(V * D, 256), 1, 1, {gr, counts.range, start.range, pos.range},
                 {c.dst.range});
}

}  // namespace

void register_nn_ops() {
  add_op("softmax", {row_check<kSoftmax, 1, false>, row_record<kSoftmax, 1, false>});
  add_op("log_softmax", {row_check<kLogSoftmax, 1, false>, row_record<kLogSoftmax, 1, false>});
  add_op("softmax_back", {row_check<kSoftmaxBack, 2, false>, row_record<kSoftmaxBack, 2, false>});
  add_op("log_softmax_back", {row_check<kLogSoftmaxBack, 2, false>, row_record<kLogSoftmaxBack, 2, false>});
  add_op("rms_norm", {row_check<kRmsNorm, 1, true>, row_record<kRmsNorm, 1, true>});
  add_op("rms_norm_back", {row_check<kRmsNormBack, 2, true>, row_record<kRmsNormBack, 2, true>});
  add_op("layer_norm", {row_check<kLayerNorm, 1, true>, row_record<kLayerNorm, 1, true>});
  add_op("layer_norm_back", {row_check<kLayerNormBack, 2, true>, row_record<kLayerNormBack, 2, true>});
  add_op("cross_entropy", {cross_entropy_check, cross_entropy_record});
  add_op("cross_entropy_back", {cross_entropy_back_check, cross_entropy_back_record});
  add_op("get_rows", {get_rows_check, get_rows_record});
  add_op("get_rows_back", {get_rows_back_check, get_rows_back_record});
}

}  // namespace recurra_vk

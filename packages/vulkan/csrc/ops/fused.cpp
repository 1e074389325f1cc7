// The fused ops of Mamba's blocks: causal_conv_silu(+_back) and gated_rms_norm(+_back).
// Shaders: causal_conv.comp, gated_norm.comp (each explains its passes).
//
// Shapes, sources and packed results exactly as the core's CPU kernels
// (packages/core/csrc/ops/ssm_conv.cpp and gated_norm.cpp; docs/ops.md):
//   causal_conv_silu       (x (S, T, D), c (D, W)[, bias (D,)]) -> (S, T, D)
//   causal_conv_silu_back  (dy, x, c[, bias]) -> packed dx (S, T, D), dc (D, W)[, d_bias (D,)]
//   gated_rms_norm         (y, w), (y, z, w) or (y, z, w, x, D); ip [group_size], fp [eps]
//                          -> y's shape (..., C)
//   gated_rms_norm_back    (grad, the forward's sources) -> packed dy, [dz], dw, [dx, dD]
// Any strides on the sources (the core passes x, y, z as slices of projections); the
// backward's grad and every output dense. The weight gradients (dc, d_bias, dw, dD) are
// sums over all rows: per-block partial sums in scratch, then a reduce in a fixed order
// (deterministic, no atomics).
//
// Sources may be bfloat16/float16 (RECURRA_OPS_HALF_IN: Mamba's activations under
// autocast): the "_h" shader variants read them as they are, each value converted exactly
// to float32 where it is loaded, so no up-cast dispatch runs before the node; the outputs
// and the scratch stay float32. The float32 variants run when every source is float32.
//
// RECURRA_VK_UNFUSED=1 turns the four off (read at every check: the core then decomposes
// them, as before these kernels; for comparisons of memory and speed). Also refused (the
// core then builds the op from other ops): tensors past 2^31 elements or
// offsets (32-bit indices), more than 2^28 rows, d_conv above 4096, more than two leading
// row axes that do not merge (gated_rms_norm), heads wider than 16384 channels (D skip).
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "half_ops.h"
#include "ops.h"

namespace recurra_vk {

namespace {

constexpr int64_t kMax32 = (int64_t(1) << 31) - 1;
constexpr int64_t kMaxRows = int64_t(1) << 28;

std::string unfused(const recurra_node_desc& n) {
  const char* e = std::getenv("RECURRA_VK_UNFUSED");
  return e && std::strcmp(e, "0") != 0 ? std::string(n.op) + ": turned off by RECURRA_VK_UNFUSED" : "";
}

bool fits32(const recurra_tensor_desc& d) {
  for (int i = 0; i < d.ndim; ++i)
    if (d.strides[i] < 0) return false;
  return numel(d) <= kMax32 && max_offset(d) <= kMax32;
}

// Rows per block of the partial sums: at most 16384 blocks and TB rows each (lavapipe ends
// an invocation's loops after 65535 iterations). gated_norm.comp uses the same rule.
int64_t rows_per_block(int64_t rows) { return std::max<int64_t>(32, (rows + 16383) / 16384); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Zeros over the whole output (gradients of an empty input).
void record_zero(NodeCall& c) {
  const int64_t n = numel(*c.dst.d);
  if (n == 0) return;
  const FillPC z{addr(c.dst), static_cast<uint32_t>(n), 0u};
  c.rec.dispatch("fill", {}, z, grid_groups(n, 256), 1, 1, {}, {c.dst.range});
}

// ---- causal_conv_silu -----------------------------------------------------------------

struct ConvPC {
  uint64_t x, c, b, dy, out, g, part;
  int32_t S, T, D, W;
  int32_t xs0, xs1, xs2, cs0, cs1, bs;
  int32_t TB, np;
};

// (x, c[, bias]) from source `off` on: "" or why not.
std::string conv_srcs_check(const recurra_node_desc& n, int off) {
  const int ns = n.n_src - off;
  if (!unfused(n).empty()) return unfused(n);
  if (ns != 2 && ns != 3) return std::string(n.op) + " takes (x, c) or (x, c, bias) after its gradient";
  // the forward's output dtype: ip[RECURRA_P_CONV_OUT_DTYPE] when given, else float32
  std::string why = require_float(n, n.n_src);
  if (!why.empty()) return why;
  if (n.n_ip > (off == 0 ? 1 : 0) || n.n_fp != 0) return std::string(n.op) + ": unexpected parameters";
  if (n.dst.dtype != (n.n_ip == 1 ? static_cast<recurra_dtype>(n.ip[RECURRA_P_CONV_OUT_DTYPE]) : RECURRA_F32))
    return std::string(n.op) + ": the output dtype does not match its parameter";
  const recurra_tensor_desc &x = n.src[off], &c = n.src[off + 1];
  if (x.ndim != 3) return std::string(n.op) + ": x must be (n_seqs, n_tok, d_inner)";
  if (c.ndim != 2 || c.shape[0] != x.shape[2] || c.shape[1] < 1) return std::string(n.op) + ": c must be (d_inner, d_conv)";
  if (ns == 3 && (n.src[off + 2].ndim != 1 || n.src[off + 2].shape[0] != x.shape[2]))
    return std::string(n.op) + ": bias must be (d_inner,)";
  if (c.shape[1] > 4096) return std::string(n.op) + ": d_conv above 4096";
  if (x.shape[0] * x.shape[1] > kMaxRows) return std::string(n.op) + ": more than 2^28 tokens";
  for (int i = 0; i < n.n_src; ++i)
    if (!fits32(n.src[i])) return std::string(n.op) + ": tensors past 2^31 elements (or negative strides)";
  if (!is_dense(n.dst) || !fits32(n.dst)) return std::string(n.op) + " needs a dense output below 2^31 elements";
  return "";
}

std::string causal_conv_check(const recurra_node_desc& n) {
  std::string why = conv_srcs_check(n, 0);
  if (!why.empty()) return why;
  const recurra_tensor_desc& x = n.src[0];
  if (n.dst.ndim != 3 || n.dst.shape[0] != x.shape[0] || n.dst.shape[1] != x.shape[1] || n.dst.shape[2] != x.shape[2])
    return "causal_conv_silu: the output must have x's shape";
  return "";
}

std::string causal_conv_back_check(const recurra_node_desc& n) {
  if (n.n_src < 3) return "causal_conv_silu_back takes (dy, x, c[, bias])";
  std::string why = conv_srcs_check(n, 1);
  if (!why.empty()) return why;
  const recurra_tensor_desc &dy = n.src[0], &x = n.src[1], &c = n.src[2];
  if (dy.ndim != 3 || dy.shape[0] != x.shape[0] || dy.shape[1] != x.shape[1] || dy.shape[2] != x.shape[2] ||
      !is_dense(dy))
    return "causal_conv_silu_back: dy must be dense, of x's shape";
  const int64_t want = numel(x) + numel(c) + (n.n_src == 4 ? c.shape[0] : 0);
  if (n.dst.ndim != 1 || n.dst.shape[0] != want) return "causal_conv_silu_back: the output must be the packed (dx, dc[, d_bias])";
  return "";
}

ConvPC conv_pc(NodeCall& c, int off) {
  const recurra_tensor_desc &x = *c.src[off].d, &w = *c.src[off + 1].d;
  ConvPC pc{};
  pc.x = addr(c.src[off]);
  pc.c = addr(c.src[off + 1]);
  pc.b = c.node.n_src == off + 3 ? addr(c.src[off + 2]) : 0;
  pc.out = addr(c.dst);
  pc.S = int32_t(x.shape[0]), pc.T = int32_t(x.shape[1]), pc.D = int32_t(x.shape[2]), pc.W = int32_t(w.shape[1]);
  pc.xs0 = int32_t(x.strides[0]), pc.xs1 = int32_t(x.strides[1]), pc.xs2 = int32_t(x.strides[2]);
  pc.cs0 = int32_t(w.strides[0]), pc.cs1 = int32_t(w.strides[1]);
  pc.bs = c.node.n_src == off + 3 ? int32_t(c.src[off + 2].d->strides[0]) : 0;
  return pc;
}

// causal_conv or its 2-byte variant, and the specialization constants (OP, HAS_B, then the
// dtypes of x, c, bias and dy, and the forward's output dtype) of node c whose (x, c[, bias])
// start at source `off` (dy: 0).
std::string conv_module(const NodeCall& c) { return variant("causal_conv", has_half(c.node, c.node.n_src)); }

std::vector<int32_t> conv_spec(int op, int has_b, const NodeCall& c, int off) {
  auto dt = [&](int i) { return i < c.node.n_src ? dt_code(c.node.src[i].dtype) : 0; };
  return {op, has_b, dt(off), dt(off + 1), has_b ? dt(off + 2) : 0, off == 1 ? dt(0) : 0,
          off == 0 ? dt_code(c.node.dst.dtype) : 0};
}

// The grid of OP 0-2: 64 channels x 4 rows per workgroup.
void conv_grid(int64_t rows, int64_t D, uint32_t& gx, uint32_t& gy, uint32_t& gz) {
  gx = static_cast<uint32_t>(ceil_div(D, 64));
  grid_2d(ceil_div(rows, 4), gy, gz);
}

void causal_conv_record(NodeCall& c) {
  const ConvPC pc = conv_pc(c, 0);
  const int64_t rows = int64_t(pc.S) * pc.T;
  if (rows * pc.D == 0) return;
  uint32_t gx, gy, gz;
  conv_grid(rows, pc.D, gx, gy, gz);
  const int has_b = c.node.n_src == 3 ? 1 : 0;
  if (has_b)
    c.rec.dispatch(conv_module(c), conv_spec(0, 1, c, 0), pc, gx, gy, gz, {c.src[0].range, c.src[1].range, c.src[2].range},
                   {c.dst.range});
  else
    c.rec.dispatch(conv_module(c), conv_spec(0, 0, c, 0), pc, gx, gy, gz, {c.src[0].range, c.src[1].range}, {c.dst.range});
}

void causal_conv_back_record(NodeCall& c) {
  ConvPC pc = conv_pc(c, 1);
  const int64_t rows = int64_t(pc.S) * pc.T, D = pc.D, W = pc.W;
  if (rows * D == 0) return record_zero(c);
  const int has_b = c.node.n_src == 4 ? 1 : 0;
  const int64_t tb = rows_per_block(rows), np = ceil_div(rows, tb), nk = W + has_b;
  Recorder& rec = c.rec;
  const auto g = rec.scratch(static_cast<size_t>(rows * D) * 4);
  const auto part = rec.scratch(static_cast<size_t>(np * nk * D) * 4);
  pc.dy = addr(c.src[0]);
  pc.g = g.addr;
  pc.part = part.addr;
  pc.TB = int32_t(tb);
  pc.np = int32_t(np);
  const Range &dyr = c.src[0].range, &xr = c.src[1].range, &cr = c.src[2].range;
  const Range& br = has_b ? c.src[3].range : c.src[2].range;
  uint32_t gx, gy, gz;
  conv_grid(rows, D, gx, gy, gz);
  rec.dispatch(conv_module(c), conv_spec(1, has_b, c, 1), pc, gx, gy, gz, {dyr, xr, cr, br}, {g.range});
  rec.dispatch(conv_module(c), conv_spec(2, has_b, c, 1), pc, gx, gy, gz, {g.range, cr}, {c.dst.range});
  rec.dispatch(conv_module(c), conv_spec(3, has_b, c, 1), pc, gx, static_cast<uint32_t>(np), static_cast<uint32_t>(ceil_div(nk, 4)),
               {g.range, xr}, {part.range});
  rec.dispatch(conv_module(c), conv_spec(4, has_b, c, 1), pc, grid_groups(nk * D, 256), 1, 1, {part.range}, {c.dst.range});
}

// ---- gated_rms_norm -------------------------------------------------------------------

struct GatedPC {
  uint64_t y, z, w, x, d, g, out, aux;
  int32_t R, C, gs, n1, P, ws, ds;
  int32_t ys0, ys1, ysc, zs0, zs1, zsc, xs0, xs1, xsc;
};

// Where each source sits (-1: absent), from `first` on: (y, w), (y, z, w), (y, z, w, x, D).
struct Layout {
  int y = -1, z = -1, w = -1, x = -1, d = -1;
};

Layout layout_of(int n_src, int first) {
  const int k = n_src - first;
  if (k == 2) return {first, -1, first + 1, -1, -1};
  if (k == 3) return {first, first + 1, first + 2, -1, -1};
  return {first, first + 1, first + 2, first + 3, first + 4};
}

// The rows (all axes but the last) of up to three operands of one shape as (n0, n1) with a
// stride each: adjacent axes merge where every operand walks them uniformly. False when
// more than two axes remain.
struct RowAxes {
  int64_t n0 = 1, n1 = 1;
  int64_t s0[3] = {0, 0, 0}, s1[3] = {0, 0, 0};
};

bool row_axes(const recurra_tensor_desc* const* ops, int n_ops, RowAxes& out) {
  const recurra_tensor_desc& ref = *ops[0];
  int64_t sh[RECURRA_MAX_DIMS], st[3][RECURRA_MAX_DIMS];
  int m = 0;  // merged axes, innermost first
  for (int i = ref.ndim - 2; i >= 0; --i) {
    if (ref.shape[i] == 1) continue;
    bool merge = m > 0;
    for (int k = 0; k < n_ops && merge; ++k) merge = ops[k]->strides[i] == st[k][m - 1] * sh[m - 1];
    if (merge) {
      sh[m - 1] *= ref.shape[i];
      continue;
    }
    sh[m] = ref.shape[i];
    for (int k = 0; k < n_ops; ++k) st[k][m] = ops[k]->strides[i];
    ++m;
  }
  if (m > 2) return false;
  if (m >= 1) {
    out.n1 = sh[0];
    for (int k = 0; k < n_ops; ++k) out.s1[k] = st[k][0];
  }
  if (m == 2) {
    out.n0 = sh[1];
    for (int k = 0; k < n_ops; ++k) out.s0[k] = st[k][1];
  }
  return true;
}

// The checks of (y[, z], w[, x, D]) from source `first` on; "" or why not.
std::string gated_srcs_check(const recurra_node_desc& n, int first) {
  const int k = n.n_src - first;
  const std::string op = n.op;
  if (!unfused(n).empty()) return unfused(n);
  if (k != 2 && k != 3 && k != 5) return op + " takes (y, w), (y, z, w) or (y, z, w, x, D)";
  std::string why = require_float(n, n.n_src);
  if (!why.empty()) return why;
  // the forward's output dtype: ip[RECURRA_P_OUT_DTYPE] when given, else float32
  if ((n.n_ip != 1 && (first != 0 || n.n_ip != 2)) || n.n_fp != 1)
    return op + " takes ip [group_size] (the forward: [, out dtype]) and fp [eps]";
  if (n.dst.dtype != (n.n_ip == 2 ? static_cast<recurra_dtype>(n.ip[RECURRA_P_OUT_DTYPE]) : RECURRA_F32))
    return op + ": the output dtype does not match its parameter";
  if (!(n.fp[RECURRA_P_EPS] >= 0.0) || !std::isfinite(n.fp[RECURRA_P_EPS])) return op + ": eps must be finite and >= 0";
  const Layout l = layout_of(n.n_src, first);
  const recurra_tensor_desc& y = n.src[l.y];
  if (y.ndim < 1) return op + ": y needs at least one axis";
  const int64_t C = y.shape[y.ndim - 1], gs = n.ip[RECURRA_P_GROUP_SIZE];
  if (l.z >= 0 && !same_shape(n.src[l.z], y)) return op + ": z must have y's shape";
  if (n.src[l.w].ndim != 1 || n.src[l.w].shape[0] != C) return op + ": w must be (C,)";
  if (gs < 1 || C % gs != 0) return op + ": group_size must divide the channels";
  if (l.x >= 0) {
    if (!same_shape(n.src[l.x], y)) return op + ": x must have y's shape";
    const recurra_tensor_desc& d = n.src[l.d];
    if (d.ndim != 1 || d.shape[0] < 1 || C % d.shape[0] != 0) return op + ": D must be (H,) with H dividing C";
    if (C / d.shape[0] > 16384) return op + ": heads wider than 16384 channels";
  }
  for (int i = 0; i < n.n_src; ++i)
    if (!fits32(n.src[i])) return op + ": tensors past 2^31 elements (or negative strides)";
  if (!is_dense(n.dst) || !fits32(n.dst)) return op + " needs a dense output below 2^31 elements";
  if ((C ? numel(y) / C : 0) > kMaxRows) return op + ": more than 2^28 rows";
  const recurra_tensor_desc* rows[3] = {&y, l.z >= 0 ? &n.src[l.z] : &y, l.x >= 0 ? &n.src[l.x] : &y};
  RowAxes ra;
  if (!row_axes(rows, 3, ra)) return op + ": y, z, x with more than two row axes that do not merge";
  return "";
}

std::string gated_check(const recurra_node_desc& n) {
  std::string why = gated_srcs_check(n, 0);
  if (!why.empty()) return why;
  if (!same_shape(n.dst, n.src[0])) return "gated_rms_norm: the output must have y's shape";
  return "";
}

std::string gated_back_check(const recurra_node_desc& n) {
  if (n.n_src < 3) return "gated_rms_norm_back takes (grad, y[, z], w[, x, D])";
  std::string why = gated_srcs_check(n, 1);
  if (!why.empty()) return why;
  const Layout l = layout_of(n.n_src, 1);
  const recurra_tensor_desc& y = n.src[l.y];
  if (!same_shape(n.src[0], y) || !is_dense(n.src[0])) return "gated_rms_norm_back: grad must be dense, of y's shape";
  const int64_t C = y.shape[y.ndim - 1];
  int64_t want = (l.z >= 0 ? 2 : 1) * numel(y) + C;
  if (l.x >= 0) want += numel(y) + n.src[l.d].shape[0];
  if (n.dst.ndim != 1 || n.dst.shape[0] != want) return "gated_rms_norm_back: the output must be the packed gradients";
  return "";
}

GatedPC gated_pc(NodeCall& c, const Layout& l) {
  const recurra_tensor_desc& y = *c.src[l.y].d;
  const recurra_tensor_desc* rows[3] = {&y, l.z >= 0 ? c.src[l.z].d : &y, l.x >= 0 ? c.src[l.x].d : &y};
  RowAxes ra;
  row_axes(rows, 3, ra);
  GatedPC pc{};
  const int64_t C = y.shape[y.ndim - 1];
  pc.y = addr(c.src[l.y]);
  pc.z = l.z >= 0 ? addr(c.src[l.z]) : 0;
  pc.w = addr(c.src[l.w]);
  pc.x = l.x >= 0 ? addr(c.src[l.x]) : 0;
  pc.d = l.d >= 0 ? addr(c.src[l.d]) : 0;
  pc.out = addr(c.dst);
  pc.R = int32_t(C ? numel(y) / C : 0);
  pc.C = int32_t(C);
  pc.gs = int32_t(c.node.ip[RECURRA_P_GROUP_SIZE]);
  pc.n1 = int32_t(ra.n1);
  pc.P = l.d >= 0 ? int32_t(C / c.src[l.d].d->shape[0]) : std::max<int32_t>(1, pc.C);
  pc.ws = int32_t(c.src[l.w].d->strides[0]);
  pc.ds = l.d >= 0 ? int32_t(c.src[l.d].d->strides[0]) : 0;
  pc.ys0 = int32_t(ra.s0[0]), pc.ys1 = int32_t(ra.s1[0]), pc.ysc = int32_t(y.strides[y.ndim - 1]);
  pc.zs0 = int32_t(ra.s0[1]), pc.zs1 = int32_t(ra.s1[1]), pc.zsc = int32_t(rows[1]->strides[y.ndim - 1]);
  pc.xs0 = int32_t(ra.s0[2]), pc.xs1 = int32_t(ra.s1[2]), pc.xsc = int32_t(rows[2]->strides[y.ndim - 1]);
  return pc;
}

// Specialization constants: OP, HAS_Z, HAS_X, EPS, WIDE, then the dtypes of y, z, w, x, D,
// the backward's grad (source 0 when l.y is 1) and the forward's output.
std::vector<int32_t> gated_spec(int op, const Layout& l, const recurra_node_desc& n) {
  const float eps = static_cast<float>(n.fp[RECURRA_P_EPS]);
  int32_t bits;
  std::memcpy(&bits, &eps, 4);  // a float specialization constant, by its bit pattern
  const bool wide = n.ip[RECURRA_P_GROUP_SIZE] >= 64;
  auto dt = [&](int i) { return i >= 0 ? dt_code(n.src[i].dtype) : 0; };
  return {op, l.z >= 0 ? 1 : 0, l.x >= 0 ? 1 : 0, bits, wide ? 1 : 0, dt(l.y), dt(l.z), dt(l.w), dt(l.x), dt(l.d),
          dt(l.y - 1), op == 0 ? dt_code(n.dst.dtype) : 0};
}

// gated_norm or its 2-byte variant (a bfloat16/float16 source).
std::string gated_module(const NodeCall& c) { return variant("gated_norm", has_half(c.node, c.node.n_src)); }

// OP 0 / 1 over the units (row, group): a workgroup each (wide groups) or a thread each.
void dispatch_units(NodeCall& c, const std::vector<int32_t>& spec, const GatedPC& pc, std::initializer_list<Range> reads,
                    const Range& writes) {
  const int64_t units = int64_t(pc.R) * (pc.C / pc.gs);
  uint32_t gx, gy;
  grid_2d(spec[4] ? units : ceil_div(units, 256), gx, gy);
  c.rec.dispatch(gated_module(c), spec, pc, gx, gy, 1, reads, {writes});
}

void gated_record(NodeCall& c) {
  const Layout l = layout_of(c.node.n_src, 0);
  const GatedPC pc = gated_pc(c, l);
  if (int64_t(pc.R) * pc.C == 0) return;
  // every source may be read: their ranges (at most 5)
  const Range none{};
  auto r = [&](int i) { return i >= 0 ? c.src[i].range : none; };
  dispatch_units(c, gated_spec(0, l, c.node), pc, {r(l.y), r(l.z), r(l.w), r(l.x), r(l.d)}, c.dst.range);
}

void gated_back_record(NodeCall& c) {
  const Layout l = layout_of(c.node.n_src, 1);
  GatedPC pc = gated_pc(c, l);
  const int64_t R = pc.R, C = pc.C;
  if (R * C == 0) return record_zero(c);
  const int64_t units = R * (C / pc.gs), nb = ceil_div(R, rows_per_block(R));
  // scratch: stats (2 per unit), pw, pd (nb * C each), pdc (C)
  const auto aux = c.rec.scratch(static_cast<size_t>(2 * units + 2 * nb * C + C) * 4);
  pc.g = addr(c.src[0]);
  pc.aux = aux.addr;
  const Range none{};
  auto r = [&](int i) { return i >= 0 ? c.src[i].range : none; };
  const Range& gr = c.src[0].range;
  dispatch_units(c, gated_spec(1, l, c.node), pc, {gr, r(l.y), r(l.z), r(l.w), r(l.x), r(l.d)}, aux.range);
  c.rec.dispatch(gated_module(c), gated_spec(2, l, c.node), pc, static_cast<uint32_t>(ceil_div(C, 256)),
                 static_cast<uint32_t>(nb), 1, {gr, r(l.y), r(l.z), r(l.w), r(l.x), r(l.d), aux.range},
                 {c.dst.range, aux.range});
  c.rec.dispatch(gated_module(c), gated_spec(3, l, c.node), pc, grid_groups(C, 256), 1, 1, {aux.range},
                 {c.dst.range, aux.range});
  if (l.x >= 0) {
    const int64_t H = c.src[l.d].d->shape[0];
    c.rec.dispatch(gated_module(c), gated_spec(4, l, c.node), pc, grid_groups(H, 256), 1, 1, {aux.range}, {c.dst.range});
  }
}

}  // namespace

void register_fused_ops() {
  add_op("causal_conv_silu", {causal_conv_check, causal_conv_record});
  add_op("causal_conv_silu_back", {causal_conv_back_check, causal_conv_back_record});
  add_op("gated_rms_norm", {gated_check, gated_record});
  add_op("gated_rms_norm_back", {gated_back_check, gated_back_record});
}

}  // namespace recurra_vk

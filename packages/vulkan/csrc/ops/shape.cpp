// Ops that move data: contiguous, fill, slice_grad, concat, pad, cumsum. Elements are moved
// as 4-byte words, so float32 and int32 share the kernels; bfloat16/float16 ones as 16-bit
// words by the "_h" variants (bits untouched; fill and pad round their float32 value once).
// cumsum sums 2-byte elements in float32 and rounds each output once. Shaders: copy.comp,
// fill.comp, pad.comp, cumsum.comp.
//
//   concat:     a, b (.., A|B, ..), ip [axis] -> (.., A + B, ..)
//   pad:        x, ip [before0, after0, ...], fp [value] -> padded
//   slice_grad: g (the slice's shape), ip [full shape..., (start, stop, step) per axis] -> zeros
//               of the full shape with g written into the slice
//   cumsum:     x dense, ip [axis, reverse]
#include <algorithm>
#include <cstring>
#include <vector>

#include "half_ops.h"
#include "ops.h"

namespace recurra_vk {

namespace {

struct CopyPC {
  uint64_t s, d;
  uint32_t n;
  int32_t shape[4], ss[4], sd[4];
};

// d[view] = s[view] over `shape` (nd axes) with the given element strides; `half`: 2-byte
// elements. With `from` and `to` (float dtypes that differ, one of them 2-byte): s has dtype
// `from`, d dtype `to`, each element converted as a cast does (copy.comp's FROM).
void copy_view(Recorder& rec, bool half, int nd, const int64_t* shape, uint64_t s_addr, const int64_t* s_st, const Range& s_range,
               uint64_t d_addr, const int64_t* d_st, const Range& d_range, recurra_dtype from = RECURRA_F32,
               recurra_dtype to = RECURRA_F32) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= shape[i];
  if (n == 0) return;
  int64_t st[2][4];
  for (int i = 0; i < nd; ++i) st[0][i] = s_st[i], st[1][i] = d_st[i];
  const Collapsed col = collapse(2, nd, shape, st);
  CopyPC pc{};
  pc.s = s_addr;
  pc.d = d_addr;
  pc.n = static_cast<uint32_t>(n);
  std::memcpy(pc.shape, col.shape, sizeof pc.shape);
  std::memcpy(pc.ss, col.strides[0], sizeof pc.ss);
  std::memcpy(pc.sd, col.strides[1], sizeof pc.sd);
  const bool flat = col.nd == 0 || (col.nd == 1 && col.strides[0][3] == 1 && col.strides[1][3] == 1);
  // copy.comp's RUN: a strided copy moves runs of 4 elements along its innermost axis; its
  // MODE 2: a flat one moves 4 elements at a time where both ends are aligned to 4 of theirs
  const uint64_t s_size = from != to ? elem_bytes(from) : half ? 2 : 4, d_size = from != to ? elem_bytes(to) : s_size;
  const bool vec = flat && n % 4 == 0 && s_addr % (4 * s_size) == 0 && d_addr % (4 * d_size) == 0;
  const int run = !flat && col.shape[3] % 4 == 0 ? 4 : 1, mode = vec ? 2 : flat ? 1 : 0;
  const uint32_t groups = grid_groups(n / (vec ? 4 : run), 256);
  if (from != to) {
    rec.dispatch("copy_h", {mode, std::max(col.nd, 1), dt_code(from), dt_code(to), run}, pc, groups, 1, 1, {s_range},
                 {d_range});
    return;
  }
  // (FROM -1 and DT: copy_h's bit moves; the float32 module has no constants 2 and 3)
  rec.dispatch(variant("copy", half), {mode, std::max(col.nd, 1), -1, 2, run}, pc, groups, 1, 1, {s_range}, {d_range});
}

// n elements of dtype dt = bits (value_bits).
void fill_words(Recorder& rec, recurra_dtype dt, uint64_t d_addr, int64_t n, uint32_t bits, const Range& range) {
  if (n == 0) return;
  FillPC pc{d_addr, static_cast<uint32_t>(n), bits};
  // fill.comp's VEC: four elements an invocation where the whole fill is aligned to four
  const int vec = n % 4 == 0 && d_addr % (4 * static_cast<uint64_t>(elem_bytes(dt))) == 0 ? 1 : 0;
  const uint32_t groups = grid_groups(vec ? n / 4 : n, 256);
  if (is_half(dt))
    rec.dispatch("fill_h", {dt_code(dt), vec}, pc, groups, 1, 1, {}, {range});
  else
    rec.dispatch("fill", {0, vec}, pc, groups, 1, 1, {}, {range});
}

// The bits fill.comp / pad.comp take for value v: float32 ones for the float dtypes (the
// 2-byte variants round them once to bfloat16/float16, as the CPU does), int32 ones else.
uint32_t value_bits(recurra_dtype dt, double v) {
  uint32_t bits;
  if (is_float(dt)) {
    const float f = static_cast<float>(v);
    std::memcpy(&bits, &f, 4);
  } else {
    const int32_t i = static_cast<int32_t>(v);
    std::memcpy(&bits, &i, 4);
  }
  return bits;
}

// ---- contiguous -----------------------------------------------------------------------

std::string contiguous_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 1);
  if (!why.empty()) return why;
  if (n.src[0].dtype != n.dst.dtype) return "contiguous keeps the dtype";
  if (!same_shape(n.src[0], n.dst)) return "contiguous keeps the shape";
  return "";
}

void contiguous_record(NodeCall& c) {
  const recurra_tensor_desc& d = *c.dst.d;
  int64_t dst_st[4];
  dense_strides(d, dst_st);
  copy_view(c.rec, is_half(d.dtype), d.ndim, d.shape, addr(c.src[0]), c.src[0].d->strides, c.src[0].range, addr(c.dst), dst_st,
            c.dst.range);
}

// ---- assign (in place into source 0) ---------------------------------------------------

// Whether no two elements of the view share memory: its axes, by stride, each step past
// everything the smaller ones reach.
bool apart(const recurra_tensor_desc& d) {
  std::vector<int> ax;
  for (int i = 0; i < d.ndim; ++i)
    if (d.shape[i] > 1) ax.push_back(i);
  std::sort(ax.begin(), ax.end(), [&](int a, int b) { return d.strides[a] < d.strides[b]; });
  int64_t reach = 0;  // the largest offset the smaller axes reach
  for (int i : ax) {
    if (d.strides[i] <= reach) return false;
    reach += d.strides[i] * (d.shape[i] - 1);
  }
  return true;
}

std::string assign_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  if (!why.empty()) return why;
  // a float32 source into a 2-byte tensor is rounded once (the core's merged slice gradients
  // reading the float32 source of a cast to the gradient's dtype)
  const bool rounds = is_half(n.src[0].dtype) && n.src[1].dtype == RECURRA_F32;
  if ((n.src[0].dtype != n.src[1].dtype && !rounds) || !same_shape(n.src[0], n.src[1]))
    return "assign keeps shape and dtype (or rounds float32 into bfloat16/float16)";
  // a dense tensor, or a window of one (the core's merged slice gradients, one piece each)
  if (!apart(n.src[0])) return "assign writes a tensor whose elements lie apart";
  return "";
}

void assign_record(NodeCall& c) {
  const recurra_tensor_desc& d = *c.src[0].d;
  copy_view(c.rec, is_half(d.dtype), d.ndim, d.shape, addr(c.src[1]), c.src[1].d->strides, c.src[1].range, addr(c.src[0]),
            d.strides, c.src[0].range, c.src[1].d->dtype, d.dtype);
}

// ---- fill -----------------------------------------------------------------------------

std::string fill_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 0);
  if (!why.empty()) return why;
  if (n.n_fp != 2) return "fill takes (value, dtype)";
  if (static_cast<int>(n.fp[RECURRA_P_DTYPE]) != static_cast<int>(n.dst.dtype)) return "fill: dtype code and output dtype differ";
  return "";
}

void fill_record(NodeCall& c) {
  fill_words(c.rec, c.dst.d->dtype, addr(c.dst), numel(*c.dst.d), value_bits(c.dst.d->dtype, c.node.fp[RECURRA_P_VALUE]), c.dst.range);
}

// ---- slice_grad -----------------------------------------------------------------------

std::string slice_grad_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 1);
  if (why.empty()) why = require_float(n, 1);
  if (!why.empty()) return why;
  // (another float dtype: converted as a cast does, the core's folded casts)
  const int nd = n.dst.ndim;
  if (n.n_ip != 4 * nd || n.src[0].ndim != nd) return "slice_grad takes the full shape and (start, stop, step) per axis";
  for (int i = 0; i < nd; ++i) {
    const int64_t b = n.ip[nd + 3 * i], st = n.ip[nd + 3 * i + 2], len = n.src[0].shape[i];
    if (n.ip[i] != n.dst.shape[i]) return "slice_grad: the output must have the full shape";
    if (st <= 0 || b < 0 || (len > 0 && b + (len - 1) * st >= n.dst.shape[i])) return "slice_grad: the slice lies outside";
  }
  return "";
}

void slice_grad_record(NodeCall& c) {
  const recurra_tensor_desc& d = *c.dst.d;
  const int nd = d.ndim;
  const bool half = is_half(d.dtype);
  int64_t dense[4], wst[4];
  dense_strides(d, dense);
  int64_t off = 0;
  for (int i = 0; i < nd; ++i) {
    off += c.node.ip[nd + 3 * i] * dense[i];
    wst[i] = dense[i] * c.node.ip[nd + 3 * i + 2];
  }
  const int64_t total = numel(d), len = numel(*c.src[0].d);
  const size_t eb = elem_bytes(d.dtype);
  Range window = c.dst.range;
  if (nd == 1 && c.node.ip[3] == 1) {
    // One run (a piece of a packed 1-D gradient): zeros around it only; the three parts'
    // byte ranges are apart, so the recorder orders none of them after another.
    auto bytes = [&](int64_t lo, int64_t hi) { return Range{window.block, window.lo + lo * eb, window.lo + hi * eb}; };
    fill_words(c.rec, d.dtype, addr(c.dst), off, 0u, bytes(0, off));
    fill_words(c.rec, d.dtype, addr(c.dst) + static_cast<uint64_t>(off + len) * eb, total - off - len, 0u, bytes(off + len, total));
    window = bytes(off, off + len);
  } else {
    fill_words(c.rec, d.dtype, addr(c.dst), total, 0u, c.dst.range);
  }
  copy_view(c.rec, half, nd, c.src[0].d->shape, addr(c.src[0]), c.src[0].d->strides, c.src[0].range,
            addr(c.dst) + static_cast<uint64_t>(off) * eb, wst, window, c.src[0].d->dtype, d.dtype);
}

// ---- concat ---------------------------------------------------------------------------

std::string concat_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  if (!why.empty()) return why;
  const recurra_tensor_desc &a = n.src[0], &b = n.src[1], &d = n.dst;
  if (a.dtype != d.dtype || b.dtype != d.dtype) return "concat: sources and output must share one dtype";
  if (n.n_ip != 1 || a.ndim != d.ndim || b.ndim != d.ndim || d.ndim == 0) return "concat takes an axis and equal ranks";
  const int64_t ax = n.ip[RECURRA_P_AXIS];
  if (ax < 0 || ax >= d.ndim) return "concat: axis out of range";
  for (int i = 0; i < d.ndim; ++i) {
    const int64_t want = i == ax ? a.shape[i] + b.shape[i] : a.shape[i];
    if (d.shape[i] != want || (i != ax && b.shape[i] != a.shape[i])) return "concat: shapes do not fit";
  }
  return "";
}

void concat_record(NodeCall& c) {
  const recurra_tensor_desc& d = *c.dst.d;
  const int ax = static_cast<int>(c.node.ip[RECURRA_P_AXIS]);
  int64_t dense[4];
  dense_strides(d, dense);
  const bool half = is_half(d.dtype);
  copy_view(c.rec, half, d.ndim, c.src[0].d->shape, addr(c.src[0]), c.src[0].d->strides, c.src[0].range, addr(c.dst),
            dense, c.dst.range);
  const uint64_t off = static_cast<uint64_t>(c.src[0].d->shape[ax] * dense[ax]) * elem_bytes(d.dtype);
  copy_view(c.rec, half, d.ndim, c.src[1].d->shape, addr(c.src[1]), c.src[1].d->strides, c.src[1].range, addr(c.dst) + off,
            dense, c.dst.range);
}

// ---- pad ------------------------------------------------------------------------------

struct PadPC {
  uint64_t x, y;
  uint32_t n;
  uint32_t bits;
  int32_t shape[4], xshape[4], sx[4], before[4];
};

std::string pad_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 1);
  if (!why.empty()) return why;
  const recurra_tensor_desc &x = n.src[0], &d = n.dst;
  if (x.dtype != d.dtype) return "pad keeps the dtype";
  if (n.n_ip != 2 * x.ndim || n.n_fp != 1 || d.ndim != x.ndim) return "pad takes (before, after) per axis and a value";
  for (int i = 0; i < x.ndim; ++i)
    if (n.ip[2 * i] < 0 || n.ip[2 * i + 1] < 0 || d.shape[i] != x.shape[i] + n.ip[2 * i] + n.ip[2 * i + 1])
      return "pad: shapes do not fit";
  return "";
}

void pad_record(NodeCall& c) {
  const recurra_tensor_desc &x = *c.src[0].d, &d = *c.dst.d;
  const int64_t n = numel(d);
  if (n == 0) return;
  PadPC pc{};
  pc.x = addr(c.src[0]);
  pc.y = addr(c.dst);
  pc.n = static_cast<uint32_t>(n);
  pc.bits = value_bits(d.dtype, c.node.fp[RECURRA_P_VALUE]);
  for (int j = 0; j < 4; ++j) pc.shape[j] = 1, pc.xshape[j] = 1, pc.sx[j] = 0, pc.before[j] = 0;
  for (int i = 0; i < d.ndim; ++i) {
    const int j = 4 - d.ndim + i;
    pc.shape[j] = static_cast<int32_t>(d.shape[i]);
    pc.xshape[j] = static_cast<int32_t>(x.shape[i]);
    pc.sx[j] = static_cast<int32_t>(x.strides[i]);
    pc.before[j] = static_cast<int32_t>(c.node.ip[2 * i]);
  }
  if (is_half(d.dtype))
    c.rec.dispatch("pad_h", {dt_code(d.dtype)}, pc, grid_groups(n, 256), 1, 1, {c.src[0].range}, {c.dst.range});
  else
    c.rec.dispatch("pad", {}, pc, grid_groups(n, 256), 1, 1, {c.src[0].range}, {c.dst.range});
}

// ---- cumsum ---------------------------------------------------------------------------

struct CumsumPC {
  uint64_t x, y;
  uint32_t O, L, I;
};

std::string cumsum_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 1);
  if (why.empty()) why = require_float(n, 1);
  if (!why.empty()) return why;
  if (n.n_ip != 2 || n.ip[RECURRA_P_AXIS] < 0 || n.ip[RECURRA_P_AXIS] >= n.dst.ndim ||
      (n.ip[RECURRA_P_REVERSE] != 0 && n.ip[RECURRA_P_REVERSE] != 1))
    return "cumsum takes (axis, reverse)";
  if (!is_dense(n.src[0]) || !same_shape(n.src[0], n.dst)) return "cumsum needs a dense source of the output's shape";
  return "";
}

void cumsum_record(NodeCall& c) {
  const recurra_tensor_desc& d = *c.dst.d;
  const int ax = static_cast<int>(c.node.ip[RECURRA_P_AXIS]);
  int64_t O = 1, I = 1;
  for (int i = 0; i < ax; ++i) O *= d.shape[i];
  for (int i = ax + 1; i < d.ndim; ++i) I *= d.shape[i];
  const int64_t L = d.shape[ax];
  if (O * I * L == 0) return;
  CumsumPC pc{addr(c.src[0]), addr(c.dst), static_cast<uint32_t>(O), static_cast<uint32_t>(L), static_cast<uint32_t>(I)};
  const int32_t rev = static_cast<int32_t>(c.node.ip[RECURRA_P_REVERSE]);
  // 2-byte tensors: cumsum_h, the dtypes of x and y its specialization constants 2 and 3.
  const bool half = has_half(c.node, 1);
  const std::string module = variant("cumsum", half);
  auto spec = [&](int32_t mode) {
    std::vector<int32_t> s{mode, rev};
    if (half) s.insert(s.end(), {dt_code(c.src[0].d->dtype), dt_code(d.dtype)});
    return s;
  };
  // A thread walking a long axis would pass lavapipe's 65535 loop iterations per invocation.
  constexpr int64_t kLongAxis = 16384;
  if (I == 1 || L > kLongAxis) {
    uint32_t gx, gy;
    grid_2d(O * I, gx, gy);
    c.rec.dispatch(module, spec(0), pc, gx, gy, 1, {c.src[0].range}, {c.dst.range});
  } else {
    c.rec.dispatch(module, spec(1), pc, grid_groups(O * I, 256), 1, 1, {c.src[0].range}, {c.dst.range});
  }
}

}  // namespace

void register_shape_ops() {
  add_op("contiguous", {contiguous_check, contiguous_record});
  add_op("fill", {fill_check, fill_record});
  add_op("assign", {assign_check, assign_record});
  add_op("slice_grad", {slice_grad_check, slice_grad_record});
  add_op("concat", {concat_check, concat_record});
  add_op("pad", {pad_check, pad_record});
  add_op("cumsum", {cumsum_check, cumsum_record});
}

}  // namespace recurra_vk

// Elementwise ops: add sub mul div (numpy broadcasting, strided sources), the unary maths
// and activations (strided source), act_grad (dense sources), every unary op of
// recurra/op_spec.h by its code, cast (float32 <-> bfloat16 <-> float16, strided source).
// Shaders: binary.comp, unary.comp, act_grad.comp, cast.comp.
//
// bfloat16/float16: every tensor of such a node has the one dtype (the core refuses mixes),
// except an add's float32 source rounded to the output's dtype on load (the core's folded casts);
// the "_h" variants of the shaders (built with -DHALF, shaders/half_ew.glsl) load it, compute
// in float32 and round once on store, as the CPU does (check_node has refused such nodes on
// a device without 16-bit storage).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "half_ops.h"
#include "ops.h"

namespace recurra_vk {

namespace {

// Flat loops: "dense" when every operand walks the one collapsed axis with stride 1; mode 2
// (four elements an invocation) when every operand k is aligned to align[k] bytes (16 for
// float32, 8 for 2-byte dtypes: four elements).
int flat_mode(const Collapsed& c, int n_operands, const uint64_t* addrs, int64_t n, const int* align) {
  bool dense = c.nd == 0;
  if (c.nd == 1) {
    dense = true;
    for (int k = 0; k < n_operands; ++k) dense = dense && c.strides[k][3] == 1;
  }
  if (!dense) return 0;
  bool aligned = n >= 4;
  for (int k = 0; k < n_operands; ++k) aligned = aligned && addrs[k] % align[k] == 0;
  return aligned ? 2 : 1;
}

// ---- binary -------------------------------------------------------------------------

// Bytes four elements of dt take: the alignment of flat_mode's four-element access.
int vec4_align(recurra_dtype dt) { return 4 * elem_bytes(dt); }

// "" when the output and the first n_src sources are all float32, or all one 2-byte dtype;
// else why not.
std::string require_one_float(const recurra_node_desc& n, int n_src) {
  if (!is_half(n.dst.dtype)) return require_f32(n, n_src);
  for (int i = 0; i < n_src && i < n.n_src; ++i)
    if (n.src[i].dtype != n.dst.dtype)
      return std::string(n.op) + ": source " + std::to_string(i) + " must have the output's dtype";
  return "";
}

// The shader module of a float32 kernel, or its 2-byte variant for the node's dtype, whose
// dtype code is then the specialization constant after `spec` (the variants' DT).
std::string dt_variant(const char* module, recurra_dtype dt, std::vector<int32_t>& spec) {
  if (is_half(dt)) spec.push_back(dt_code(dt));
  return variant(module, is_half(dt));
}

// A dense output and one source of any strides (unary, cast): their index space collapsed,
// the flat mode and the workgroups.
struct OneSource {
  Collapsed col;
  int mode = 0;
  uint32_t groups = 0;
};

OneSource one_source(const NodeCall& c) {
  const recurra_tensor_desc& d = *c.dst.d;
  const int64_t n = numel(d);
  int64_t st[2][4];
  dense_strides(d, st[0]);
  for (int i = 0; i < d.ndim; ++i) st[1][i] = c.src[0].d->strides[i];
  OneSource r;
  r.col = collapse(2, d.ndim, d.shape, st);
  const uint64_t addrs[2] = {addr(c.src[0]), addr(c.dst)};
  const int align[2] = {vec4_align(c.src[0].d->dtype), vec4_align(d.dtype)};
  r.mode = flat_mode(r.col, 2, addrs, n, align);
  r.groups = grid_groups(r.mode == 2 ? (n + 3) / 4 : n, 256);
  return r;
}

struct BinaryPC {
  uint64_t a, b, d;
  uint32_t n;
  int32_t shape[4], sa[4], sb[4];
};

// Whether source i of a 2-byte add is float32, rounded to the output's dtype where the
// kernel loads it (the core's folded casts, MergedAdds::rounded).
bool rounds_source(const recurra_tensor_desc& src, const recurra_tensor_desc& dst, int op) {
  return op == 0 && is_half(dst.dtype) && src.dtype == RECURRA_F32;
}

template <int OP>
std::string binary_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  if (why.empty() && (rounds_source(n.src[0], n.dst, OP) || rounds_source(n.src[1], n.dst, OP))) {
    for (int i = 0; i < 2; ++i)
      if (n.src[i].dtype != n.dst.dtype && !rounds_source(n.src[i], n.dst, OP))
        why = std::string(n.op) + ": source " + std::to_string(i) + " must have the output's dtype or be float32";
  } else if (why.empty()) {
    why = require_one_float(n, 2);
  }
  if (!why.empty()) return why;
  int64_t st[4];
  if (!broadcast_strides(n.src[0], n.dst, st) || !broadcast_strides(n.src[1], n.dst, st) ||
      n.dst.ndim < std::max(n.src[0].ndim, n.src[1].ndim))
    return "the output shape is not the broadcast of the sources";
  return "";
}

template <int OP>
void binary_record(NodeCall& c) {
  const recurra_tensor_desc& d = *c.dst.d;
  const int64_t n = numel(d);
  if (n == 0) return;
  int64_t st[3][4];
  dense_strides(d, st[0]);
  broadcast_strides(*c.src[0].d, d, st[1]);
  broadcast_strides(*c.src[1].d, d, st[2]);
  const Collapsed col = collapse(3, d.ndim, d.shape, st);
  BinaryPC pc{};
  pc.a = addr(c.src[0]);
  pc.b = addr(c.src[1]);
  pc.d = addr(c.dst);
  pc.n = static_cast<uint32_t>(n);
  std::memcpy(pc.shape, col.shape, sizeof pc.shape);
  std::memcpy(pc.sa, col.strides[1], sizeof pc.sa);
  std::memcpy(pc.sb, col.strides[2], sizeof pc.sb);
  const uint64_t addrs[3] = {pc.a, pc.b, pc.d};
  const int align[3] = {vec4_align(c.src[0].d->dtype), vec4_align(c.src[1].d->dtype), vec4_align(d.dtype)};
  const int mode = flat_mode(col, 3, addrs, n, align);
  const uint32_t groups = grid_groups(mode == 2 ? (n + 3) / 4 : n, 256);
  std::vector<int32_t> spec = {OP, mode, std::max(col.nd, 1)};
  const std::string module = dt_variant("binary", d.dtype, spec);
  const bool ra = rounds_source(*c.src[0].d, d, OP), rb = rounds_source(*c.src[1].d, d, OP);
  if (ra || rb) spec.insert(spec.end(), {ra ? dt_code(RECURRA_F32) : -1, rb ? dt_code(RECURRA_F32) : -1});
  c.rec.dispatch(module, spec, pc, groups, 1, 1, {c.src[0].range, c.src[1].range}, {c.dst.range});
}

// ---- unary --------------------------------------------------------------------------

struct UnaryPC {
  uint64_t x, y;
  uint32_t n;
  float p0, p1;
  int32_t shape[4], sx[4];
};

// The op's RECURRA_UNARY_* code and float parameter count come from recurra/op_spec.h;
// unary.comp switches on the code.
std::string unary_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 1);
  if (why.empty()) why = require_one_float(n, 1);
  if (!why.empty()) return why;
  const recurra_op_spec* sp = recurra_op_find(n.op);
  if (!sp || sp->unary < 0) return std::string(n.op) + " is not an elementwise unary op";
  if (n.n_fp != sp->fp_max) return std::string(n.op) + " takes " + std::to_string(sp->fp_max) + " float parameter(s)";
  if (numel(n.src[0]) != numel(n.dst) || n.src[0].ndim != n.dst.ndim) return "output and source shapes differ";
  for (int i = 0; i < n.dst.ndim; ++i)
    if (n.src[0].shape[i] != n.dst.shape[i]) return "output and source shapes differ";
  return "";
}

void unary_record(NodeCall& c) {
  const recurra_tensor_desc& d = *c.dst.d;
  const int64_t n = numel(d);
  if (n == 0) return;
  const OneSource o = one_source(c);
  UnaryPC pc{};
  pc.x = addr(c.src[0]);
  pc.y = addr(c.dst);
  pc.n = static_cast<uint32_t>(n);
  pc.p0 = static_cast<float>(fp(c.node, RECURRA_P_MIN));  // scale: RECURRA_P_SCALE, the same 0
  pc.p1 = static_cast<float>(fp(c.node, RECURRA_P_MAX));
  std::memcpy(pc.shape, o.col.shape, sizeof pc.shape);
  std::memcpy(pc.sx, o.col.strides[1], sizeof pc.sx);
  const int32_t code = recurra_op_find(c.node.op)->unary;
  std::vector<int32_t> spec = {code, o.mode, std::max(o.col.nd, 1)};
  const std::string module = dt_variant("unary", d.dtype, spec);
  c.rec.dispatch(module, spec, pc, o.groups, 1, 1, {c.src[0].range}, {c.dst.range});
}

// ---- act_grad -----------------------------------------------------------------------

struct ActGradPC {
  uint64_t g, x, y, d;
  uint32_t n;
  float p0, p1;
};

std::string act_grad_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 3);
  if (why.empty()) why = require_one_float(n, 3);
  if (!why.empty()) return why;
  const recurra_op_spec* act = n.n_ip == 1 ? recurra_unary_op(n.ip[RECURRA_P_ACT]) : nullptr;
  if (!act || std::strcmp(act->backward, "act_grad") != 0)
    return "act_grad takes the RECURRA_UNARY_* code of an op whose backward is act_grad";
  if (n.n_fp != act->fp_max) return std::string("act_grad of ") + act->name + " takes " + act->fp;
  const int64_t total = numel(n.dst);
  for (int i = 0; i < 3; ++i)
    if (!is_dense(n.src[i]) || numel(n.src[i]) != total) return "act_grad needs dense sources of the output's size";
  return "";
}

void act_grad_record(NodeCall& c) {
  const int64_t n = numel(*c.dst.d);
  if (n == 0) return;
  ActGradPC pc{};
  pc.g = addr(c.src[0]);
  pc.x = addr(c.src[1]);
  pc.y = addr(c.src[2]);
  pc.d = addr(c.dst);
  pc.n = static_cast<uint32_t>(n);
  pc.p0 = static_cast<float>(fp(c.node, RECURRA_P_MIN));  // scale: RECURRA_P_SCALE, the same 0
  pc.p1 = static_cast<float>(fp(c.node, RECURRA_P_MAX));
  const recurra_dtype dt = c.dst.d->dtype;
  std::vector<int32_t> spec = {static_cast<int32_t>(c.node.ip[RECURRA_P_ACT])};
  const std::string module = dt_variant("act_grad", dt, spec);
  int64_t items = n;
  if (is_half(dt)) {  // four elements an invocation where every tensor is 8-byte aligned
    bool vec = n >= 4;
    for (const uint64_t a : {pc.g, pc.x, pc.y, pc.d}) vec = vec && a % vec4_align(dt) == 0;
    spec.push_back(vec ? 1 : 0);
    if (vec) items = (n + 3) / 4;
  }
  c.rec.dispatch(module, spec, pc, grid_groups(items, 256), 1, 1, {c.src[0].range, c.src[1].range, c.src[2].range},
                 {c.dst.range});
}

// ---- cast ---------------------------------------------------------------------------

struct CastPC {
  uint64_t x, y;
  uint32_t n;
  int32_t shape[4], sx[4];
};

std::string cast_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 1);
  if (!why.empty()) return why;
  if (n.n_ip != 1 || n.ip[RECURRA_P_TO_DTYPE] != n.dst.dtype) return "cast takes the output's dtype code";
  for (const recurra_dtype dt : {n.src[0].dtype, n.dst.dtype})
    if (dt != RECURRA_F32 && !is_half(dt)) return "cast converts between float32, bfloat16 and float16";
  if (!same_shape(n.src[0], n.dst)) return "output and source shapes differ";
  // (the shader declares 16-bit storage, which check_node asks for only with a 2-byte tensor)
  if (!is_half(n.src[0].dtype) && !is_half(n.dst.dtype)) return "cast from float32 to float32 converts nothing";
  return "";
}

void cast_record(NodeCall& c) {
  const recurra_tensor_desc& d = *c.dst.d;
  const int64_t n = numel(d);
  if (n == 0) return;
  const OneSource o = one_source(c);
  CastPC pc{};
  pc.x = addr(c.src[0]);
  pc.y = addr(c.dst);
  pc.n = static_cast<uint32_t>(n);
  std::memcpy(pc.shape, o.col.shape, sizeof pc.shape);
  std::memcpy(pc.sx, o.col.strides[1], sizeof pc.sx);
  const int32_t from = static_cast<int32_t>(c.src[0].d->dtype);
  c.rec.dispatch("cast", {from, static_cast<int32_t>(d.dtype), o.mode, std::max(o.col.nd, 1)}, pc, o.groups, 1, 1,
                 {c.src[0].range}, {c.dst.range});
}

}  // namespace

void register_elementwise_ops() {
  add_op("add", {binary_check<0>, binary_record<0>});
  add_op("sub", {binary_check<1>, binary_record<1>});
  add_op("mul", {binary_check<2>, binary_record<2>});
  add_op("div", {binary_check<3>, binary_record<3>});
  int32_t n_spec = 0;
  const recurra_op_spec* spec = recurra_op_specs(&n_spec);
  for (int32_t i = 0; i < n_spec; ++i)
    if (spec[i].unary >= 0) add_op(spec[i].name, {unary_check, unary_record});
  add_op("act_grad", {act_grad_check, act_grad_record});
  add_op("cast", {cast_check, cast_record});
}

}  // namespace recurra_vk

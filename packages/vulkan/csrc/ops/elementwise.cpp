// Elementwise ops: add sub mul div (numpy broadcasting, strided sources), the unary maths
// and activations (strided source), act_grad (dense sources), every unary op of
// recurra/op_spec.h by its code. Shaders: binary.comp, unary.comp, act_grad.comp.
#include <algorithm>
#include <cstring>

#include "ops.h"

namespace recurra_vk {

namespace {

// Flat loops: "dense" when every operand walks the one collapsed axis with stride 1.
int flat_mode(const Collapsed& c, int n_operands, const uint64_t* addrs, int64_t n) {
  bool dense = c.nd == 0;
  if (c.nd == 1) {
    dense = true;
    for (int k = 0; k < n_operands; ++k) dense = dense && c.strides[k][3] == 1;
  }
  if (!dense) return 0;
  bool aligned = n >= 4;
  for (int k = 0; k < n_operands; ++k) aligned = aligned && addrs[k] % 16 == 0;
  return aligned ? 2 : 1;
}

// ---- binary -------------------------------------------------------------------------

struct BinaryPC {
  uint64_t a, b, d;
  uint32_t n;
  int32_t shape[4], sa[4], sb[4];
};

template <int OP>
std::string binary_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  if (why.empty()) why = require_f32(n, 2);
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
  const int mode = flat_mode(col, 3, addrs, n);
  const uint32_t groups = grid_groups(mode == 2 ? (n + 3) / 4 : n, 256);
  c.rec.dispatch("binary", {OP, mode, std::max(col.nd, 1)}, pc, groups, 1, 1, {c.src[0].range, c.src[1].range}, {c.dst.range});
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
  if (why.empty()) why = require_f32(n, 1);
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
  int64_t st[2][4];
  dense_strides(d, st[0]);
  for (int i = 0; i < d.ndim; ++i) st[1][i] = c.src[0].d->strides[i];
  const Collapsed col = collapse(2, d.ndim, d.shape, st);
  UnaryPC pc{};
  pc.x = addr(c.src[0]);
  pc.y = addr(c.dst);
  pc.n = static_cast<uint32_t>(n);
  pc.p0 = static_cast<float>(fp(c.node, RECURRA_P_MIN));  // scale: RECURRA_P_SCALE, the same 0
  pc.p1 = static_cast<float>(fp(c.node, RECURRA_P_MAX));
  std::memcpy(pc.shape, col.shape, sizeof pc.shape);
  std::memcpy(pc.sx, col.strides[1], sizeof pc.sx);
  const uint64_t addrs[2] = {pc.x, pc.y};
  const int mode = flat_mode(col, 2, addrs, n);
  const uint32_t groups = grid_groups(mode == 2 ? (n + 3) / 4 : n, 256);
  const int32_t code = recurra_op_find(c.node.op)->unary;
  c.rec.dispatch("unary", {code, mode, std::max(col.nd, 1)}, pc, groups, 1, 1, {c.src[0].range}, {c.dst.range});
}

// ---- act_grad -----------------------------------------------------------------------

struct ActGradPC {
  uint64_t g, x, y, d;
  uint32_t n;
  float p0, p1;
};

std::string act_grad_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 3);
  if (why.empty()) why = require_f32(n, 3);
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
  c.rec.dispatch("act_grad", {static_cast<int32_t>(c.node.ip[RECURRA_P_ACT])}, pc, grid_groups(n, 256), 1, 1,
                 {c.src[0].range, c.src[1].range, c.src[2].range}, {c.dst.range});
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
}

}  // namespace recurra_vk

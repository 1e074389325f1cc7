// Elementwise ops: binary with numpy broadcasting (add sub mul div), unary maths and
// activations, and act_grad (the backward of the unary ops that need more than a mul).
#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>

#include "../graph.h"
#include "kernel_util.h"
#include "lane_math.h"

namespace recurra {

namespace {

// ---- binary -----------------------------------------------------------------------

enum class Bin { add, sub, mul, div };

#define RC_BIN_ROW(NAME, EXPR)                                                                 \
  RC_SIMD void NAME##_row(float* __restrict d, const float* __restrict a,                      \
                          const float* __restrict b, int64_t n, int64_t sa, int64_t sb) {     \
    if (sa == 1 && sb == 1)                                                                    \
      for (int64_t i = 0; i < n; ++i) { float x = a[i], y = b[i]; d[i] = EXPR; }               \
    else if (sa == 1 && sb == 0)                                                               \
      for (int64_t i = 0; i < n; ++i) { float x = a[i], y = b[0]; d[i] = EXPR; }               \
    else if (sa == 0 && sb == 1)                                                               \
      for (int64_t i = 0; i < n; ++i) { float x = a[0], y = b[i]; d[i] = EXPR; }               \
    else                                                                                       \
      for (int64_t i = 0; i < n; ++i) { float x = a[i * sa], y = b[i * sb]; d[i] = EXPR; }     \
  }

RC_BIN_ROW(add, x + y)
RC_BIN_ROW(sub, x - y)
RC_BIN_ROW(mul, x * y)
RC_BIN_ROW(div, x / y)

using BinRow = void (*)(float*, const float*, const float*, int64_t, int64_t, int64_t);

void binary_forward(KernelCtx& c, BinRow row) {
  const TensorView& d = c.dst;
  const int64_t total = d.numel();
  if (total == 0) return;
  int64_t sa[kMaxDims], sb[kMaxDims];
  broadcast_strides(c.src[0], d.shape, sa);
  broadcast_strides(c.src[1], d.shape, sb);
  const float* a = c.src[0].f32();
  const float* b = c.src[1].f32();
  float* o = d.f32();
  // Same shape, both dense: one flat range split across threads.
  if (c.src[0].is_contiguous() && c.src[1].is_contiguous() && c.src[0].shape.numel() == total &&
      c.src[1].shape.numel() == total) {
    c.pool.parallel_for(total, kGrainElems, [&](int64_t b0, int64_t e0, int) {
      row(o + b0, a + b0, b + b0, e0 - b0, 1, 1);
    });
    return;
  }
  const int64_t len = row_len(d.shape), rows = n_rows(d.shape);
  const int64_t la = last_stride(sa, d.shape), lb = last_stride(sb, d.shape);
  c.pool.parallel_for(rows, row_grain(len), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r)
      row(o + r * len, a + row_offset(d.shape, sa, r), b + row_offset(d.shape, sb, r), len, la, lb);
  });
}

void binary_infer(Graph& g, Node& n) {
  if (n.src.size() != 2) fail_shape(g, n, "takes two inputs");
  require_f32(g, n, 0);
  require_f32(g, n, 1);
  n.dtype = DType::f32;
  n.shape = broadcast_shapes(OpTable::get().at(n.op).name.c_str(), g.node(n.src.at(0)).shape,
                             g.node(n.src.at(1)).shape);
}

void add_binary(OpTable& t, const char* name, BinRow row, std::function<void(GradSink&)> bw) {
  OpDef d;
  d.name = name;
  d.infer = binary_infer;
  d.forward = [row](KernelCtx& c) { binary_forward(c, row); };
  d.backward = std::move(bw);
  t.add(std::move(d));
}

// ---- unary ------------------------------------------------------------------------

// The kernels of the elementwise unary ops, one per RECURRA_UNARY_* code of
// recurra/op_spec.h (the spec names each op, its parameters and its backward).

// o[i] = f(a[i]) over a dense row; p0, p1 are the op's float parameters (scale, clamp).
using UnRow = void (*)(float*, const float*, int64_t, float, float);
// o[i] = g[i] * f'(x[i]) over dense rows, y = f(x) (act_grad).
using GradRow = void (*)(float*, const float*, const float*, const float*, int64_t, float, float);

// The kernels of code CODE: `row`, and `grad` (null unless the op's backward is act_grad).
template <int64_t CODE>
struct UnaryKernel;

#define RC_UN_ROW(NAME, EXPR)                                                                  \
  RC_SIMD void NAME##_row(float* __restrict o, const float* __restrict a, int64_t n,           \
                          [[maybe_unused]] float p0, [[maybe_unused]] float p1) {              \
    for (int64_t i = 0; i < n; ++i) {                                                          \
      const float x = a[i];                                                                    \
      o[i] = EXPR;                                                                             \
    }                                                                                          \
  }

#define RC_GRAD_ROW(NAME, EXPR)                                                                \
  RC_SIMD void NAME##_grad_row(float* __restrict o, const float* __restrict gp,                \
                               const float* __restrict xp, const float* __restrict yp,         \
                               int64_t n, [[maybe_unused]] float p0, [[maybe_unused]] float p1) { \
    for (int64_t i = 0; i < n; ++i) {                                                          \
      [[maybe_unused]] const float x = xp[i], y = yp[i];                                       \
      o[i] = gp[i] * (EXPR);                                                                   \
    }                                                                                          \
  }

// A unary op whose backward is built from other ops: y = F(x) (NAME: the code's name).
#define RC_MATHS(NAME, CODE, F)                                                                \
  RC_UN_ROW(unary_##NAME, F)                                                                    \
  template <>                                                                                  \
  struct UnaryKernel<CODE> {                                                                   \
    static constexpr UnRow row = unary_##NAME##_row;                                            \
    static constexpr GradRow grad = nullptr;                                                   \
  };

// An activation: y = F(x) and its derivative D(x, y) for act_grad.
#define RC_ACT(NAME, CODE, F, D)                                                               \
  RC_UN_ROW(unary_##NAME, F)                                                                    \
  RC_GRAD_ROW(unary_##NAME, D)                                                                  \
  template <>                                                                                  \
  struct UnaryKernel<CODE> {                                                                   \
    static constexpr UnRow row = unary_##NAME##_row;                                            \
    static constexpr GradRow grad = unary_##NAME##_grad_row;                                    \
  };

// The spec's formulas (RECURRA_UNARY_MATHS and RECURRA_ACTIVATIONS of recurra/op_spec.h),
// their portable functions mapped onto lane_math.h's vectorizable ones where libm's would
// not vectorize.
#define rc_abs(x) std::fabs(x)
#define rc_sqrt(x) std::sqrt(x)
#define rc_exp(x) exp_lane(x)
#define rc_log(x) std::log(x)
#define rc_erf(x) std::erf(x)
#define rc_tanh(x) tanh_lane(x)
#define rc_sigmoid(x) sigmoid_lane(x)
#define rc_softplus(x) softplus_lane(x)
#define rc_min(a, b) std::min(a, b)
#define rc_max(a, b) std::max(a, b)
#define rc_isnan(x) ((x) != (x))
#define rc_relu(x) ((x) < 0.0f ? 0.0f : (x))  // NaN and -0 pass through
RECURRA_UNARY_MATHS(RC_MATHS)
RECURRA_ACTIVATIONS(RC_ACT)

#undef RC_ACT
#undef RC_MATHS
#undef RC_GRAD_ROW
#undef RC_UN_ROW

// The kernels by code (a code without a UnaryKernel does not compile).
template <size_t... C>
constexpr std::array<UnRow, sizeof...(C)> unary_rows(std::index_sequence<C...>) {
  return {UnaryKernel<C>::row...};
}
template <size_t... C>
constexpr std::array<GradRow, sizeof...(C)> grad_rows(std::index_sequence<C...>) {
  return {UnaryKernel<C>::grad...};
}
constexpr auto kUnaryRows = unary_rows(std::make_index_sequence<RECURRA_UNARY_COUNT>{});
constexpr auto kGradRows = grad_rows(std::make_index_sequence<RECURRA_UNARY_COUNT>{});

void unary_forward(KernelCtx& c, UnRow row) {
  const TensorView& s = c.src[0];
  float* o = c.dst.f32();
  const int64_t total = c.dst.numel();
  if (total == 0) return;
  const auto& fp = c.node.fp;
  const float p0 = fp.size() > 0 ? static_cast<float>(fp[0]) : 0.0f;
  const float p1 = fp.size() > 1 ? static_cast<float>(fp[1]) : 0.0f;
  if (s.is_contiguous()) {
    const float* a = s.f32();
    c.pool.parallel_for(total, kGrainElems, [&](int64_t b, int64_t e, int) { row(o + b, a + b, e - b, p0, p1); });
    return;
  }
  const int64_t len = row_len(s.shape), rows = n_rows(s.shape), ss = last_stride(s.strides, s.shape);
  c.pool.parallel_for(rows, row_grain(len), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = s.f32() + row_offset(s.shape, s.strides, r);
      float* orow = o + r * len;
      if (ss == 1) {
        row(orow, a, len, p0, p1);
        continue;
      }
      // Strided row: gather it into the output, then transform in place.
      for (int64_t i = 0; i < len; ++i) orow[i] = a[i * ss];
      row(orow, orow, len, p0, p1);
    }
  });
}

void unary_infer(Graph& g, Node& n) {
  if (n.src.size() != 1) fail_shape(g, n, "takes one input");
  require_f32(g, n, 0);
  n.dtype = DType::f32;
  n.shape = g.node(n.src.at(0)).shape;
}

// The activations whose derivative reads y = f(x) only (the rest read x only), here and in
// the device kernels (the DERIV column above; act.glsl's). ReLU's reads x, but gives the
// same at y = relu(x) (y > 0 exactly where x > 0, a NaN stays NaN): handed y, its backward
// keeps the output that sqr(relu(k)) (RWKV's channel mixing) keeps anyway, not the input.
bool act_grad_reads_y(int64_t code) {
  return code == RECURRA_UNARY_SQRT || code == RECURRA_UNARY_SIGMOID || code == RECURRA_UNARY_TANH ||
         code == RECURRA_UNARY_RELU;
}

// Backward through act_grad(g, x, y): g * f'(x) for activation `code`. The slot f' does not
// read gets the tensor of the other, so that the backward keeps the activation's input
// (sigmoid, tanh, sqrt) or its output (the others) alive only where f' needs it: both kept,
// a step held twice an activation's bytes until its gradient (Mamba-2's silu outputs, RWKV's
// sigmoid inputs).
std::function<void(GradSink&)> act_backward(int64_t code) {
  return [code](GradSink& k) {
    std::vector<double> fp = k.node.fp;
    int v = act_grad_reads_y(code) ? k.node.id : k.node.src[0];
    const Node& nv = k.g.node(v);
    TensorView tv;
    tv.shape = nv.shape;
    std::copy(nv.strides, nv.strides + kMaxDims, tv.strides);
    if (!tv.is_contiguous()) v = k.g.contiguous(v);  // once, not once per slot
    k.add(0, k.g.op("act_grad", {k.grad_out, v, v}, {code}, fp));
  };
}

// The backward of a unary op: act_grad where the spec says so, else built from other ops.
std::function<void(GradSink&)> unary_backward(const recurra_op_spec& sp) {
  const int64_t code = sp.unary;
  if (std::string(sp.backward) == "act_grad") {
    if (!kGradRows[code]) throw StateError(std::string("internal: ") + sp.name + " has no act_grad kernel");
    return act_backward(code);
  }
  switch (code) {
    case RECURRA_UNARY_NEG: return [](GradSink& k) { k.add(0, k.g.neg(k.grad_out)); };
    case RECURRA_UNARY_SQR:
      return [](GradSink& k) { k.add(0, k.g.mul(k.grad_out, k.g.scale(k.node.src[0], 2.0))); };
    case RECURRA_UNARY_EXP: return [](GradSink& k) { k.add(0, k.g.mul(k.grad_out, k.node.id)); };
    case RECURRA_UNARY_SCALE:
      return [](GradSink& k) { k.add(0, k.g.scale(k.grad_out, k.node.fp[RECURRA_P_SCALE])); };
    default: throw StateError(std::string("internal: no backward for unary op ") + sp.name);
  }
}

void add_unary(OpTable& t, const recurra_op_spec& sp) {
  const size_t n_fp = static_cast<size_t>(sp.fp_max);
  OpDef d;
  d.name = sp.name;
  d.infer = [n_fp](Graph& g, Node& n) {
    if (n.fp.size() != n_fp) fail_shape(g, n, "takes " + std::to_string(n_fp) + " float parameter(s)");
    if (n_fp == 2 && n.fp.at(RECURRA_P_MIN) > n.fp.at(RECURRA_P_MAX)) fail_shape(g, n, "min must not exceed max");
    unary_infer(g, n);
  };
  const UnRow row = kUnaryRows[sp.unary];
  d.forward = [row](KernelCtx& c) { unary_forward(c, row); };
  d.backward = unary_backward(sp);
  t.add(std::move(d));
}

}  // namespace

void register_elementwise_ops(OpTable& t) {
  // Shapes are copied before any node is added: adding a node may move the node list.
  add_binary(t, "add", add_row, [](GradSink& k) {
    const Shape sa = k.g.node(k.node.src[0]).shape, sb = k.g.node(k.node.src[1]).shape;
    if (k.needs(0)) k.add(0, k.g.reduce_to(k.grad_out, sa));
    if (k.needs(1)) k.add(1, k.g.reduce_to(k.grad_out, sb));  // a constant needs no sum_to
  });
  add_binary(t, "sub", sub_row, [](GradSink& k) {
    const Shape sa = k.g.node(k.node.src[0]).shape, sb = k.g.node(k.node.src[1]).shape;
    if (k.needs(0)) k.add(0, k.g.reduce_to(k.grad_out, sa));
    if (k.needs(1)) k.add(1, k.g.reduce_to(k.g.neg(k.grad_out), sb));
  });
  add_binary(t, "mul", mul_row, [](GradSink& k) {
    const int a = k.node.src[0], b = k.node.src[1];
    const Shape sa = k.g.node(a).shape, sb = k.g.node(b).shape;
    if (k.needs(0)) k.add(0, k.g.reduce_to(k.g.mul(k.grad_out, b), sa));
    if (k.needs(1)) k.add(1, k.g.reduce_to(k.g.mul(k.grad_out, a), sb));
  });
  add_binary(t, "div", div_row, [](GradSink& k) {
    const int a = k.node.src[0], b = k.node.src[1];
    const Shape sa = k.g.node(a).shape, sb = k.g.node(b).shape;
    if (k.needs(0)) k.add(0, k.g.reduce_to(k.g.div(k.grad_out, b), sa));
    if (k.needs(1)) {
      // d(a/b)/db = -(a/b)/b
      int gb = k.g.neg(k.g.mul(k.grad_out, k.g.div(k.node.id, b)));
      k.add(1, k.g.reduce_to(gb, sb));
    }
  });

  int32_t n_spec = 0;
  const recurra_op_spec* spec = recurra_op_specs(&n_spec);
  for (int32_t i = 0; i < n_spec; ++i)
    if (spec[i].unary >= 0) add_unary(t, spec[i]);

  {
    // act_grad(g, x, y): g * f'(x) (y = f(x), used where cheaper). Dense inputs.
    OpDef d;
    d.name = "act_grad";
    d.contiguous_srcs = 0b111;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 3 || n.ip.size() != 1) fail_shape(g, n, "takes (grad, x, y) and a code");
      for (int i = 0; i < 3; ++i) require_f32(g, n, i);
      if (g.node(n.src[0]).shape != g.node(n.src[1]).shape || g.node(n.src[2]).shape != g.node(n.src[1]).shape)
        fail_shape(g, n, "grad, x and y must have one shape");
      const int64_t code = n.ip[RECURRA_P_ACT];
      if (code < 0 || code >= RECURRA_UNARY_COUNT || !kGradRows[code]) fail_shape(g, n, "unknown activation code");
      if (n.fp.size() != static_cast<size_t>(recurra_unary_op(code)->fp_max))
        fail_shape(g, n, std::string(recurra_unary_op(code)->name) + " needs " + recurra_unary_op(code)->fp);
      n.dtype = DType::f32;
      n.shape = g.node(n.src.at(1)).shape;
    };
    d.forward = [](KernelCtx& c) {
      const float* gp = c.src[0].f32();
      const float* x = c.src[1].f32();
      const float* y = c.src[2].f32();
      float* o = c.dst.f32();
      const GradRow row = kGradRows[c.node.ip[RECURRA_P_ACT]];
      const auto& fp = c.node.fp;
      const float p0 = fp.size() == 2 ? static_cast<float>(fp[0]) : 0.0f;
      const float p1 = fp.size() == 2 ? static_cast<float>(fp[1]) : 0.0f;
      c.pool.parallel_for(c.dst.numel(), kGrainElems, [&](int64_t b, int64_t e, int) {
        row(o + b, gp + b, x + b, y + b, e - b, p0, p1);
      });
    };
    t.add(std::move(d));
  }
}

}  // namespace recurra

// Elementwise ops: binary with numpy broadcasting (add sub mul div), unary maths and
// activations, and act_grad (the backward of the unary ops that need more than a mul).
#include <cmath>

#include "../graph.h"
#include "kernel_util.h"

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

// Activation codes shared by the unary forward and act_grad.
enum Act : int64_t { kAbs, kSqrt, kLog, kClamp, kRelu, kSilu, kGelu, kSigmoid, kTanh, kSoftplus };

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplusf(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

template <class F>
void unary_forward(KernelCtx& c, F f) {
  const TensorView& s = c.src[0];
  float* o = c.dst.f32();
  const int64_t total = c.dst.numel();
  if (total == 0) return;
  if (s.is_contiguous()) {
    const float* a = s.f32();
    c.pool.parallel_for(total, kGrainElems, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) o[i] = f(a[i]);
    });
    return;
  }
  const int64_t len = row_len(s.shape), rows = n_rows(s.shape), ss = last_stride(s.strides, s.shape);
  c.pool.parallel_for(rows, row_grain(len), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = s.f32() + row_offset(s.shape, s.strides, r);
      for (int64_t i = 0; i < len; ++i) o[r * len + i] = f(a[i * ss]);
    }
  });
}

void unary_infer(Graph& g, Node& n) {
  if (n.src.size() != 1) fail_shape(g, n, "takes one input");
  require_f32(g, n, 0);
  n.dtype = DType::f32;
  n.shape = g.node(n.src.at(0)).shape;
}

template <class F>
void add_unary(OpTable& t, const char* name, F f, std::function<void(GradSink&)> bw, size_t n_fp = 0) {
  OpDef d;
  d.name = name;
  d.infer = [n_fp](Graph& g, Node& n) {
    if (n.fp.size() != n_fp) fail_shape(g, n, "takes " + std::to_string(n_fp) + " float parameter(s)");
    if (n_fp == 2 && n.fp.at(0) > n.fp.at(1)) fail_shape(g, n, "min must not exceed max");
    unary_infer(g, n);
  };
  d.forward = [f](KernelCtx& c) {
    const auto& fp = c.node.fp;
    unary_forward(c, [&](float x) { return f(x, fp); });
  };
  d.backward = std::move(bw);
  t.add(std::move(d));
}

// Backward through act_grad(g, x, y): g * f'(x) for activation `code`.
std::function<void(GradSink&)> act_backward(Act code) {
  return [code](GradSink& k) {
    std::vector<double> fp = k.node.fp;
    k.add(0, k.g.op("act_grad", {k.grad_out, k.node.src[0], k.node.id}, {code}, fp));
  };
}

float act_derivative(int64_t code, float x, float y, const std::vector<double>& fp) {
  switch (code) {
    case kAbs: return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    case kSqrt: return 0.5f / y;
    case kLog: return 1.0f / x;
    case kClamp: return (x >= static_cast<float>(fp[0]) && x <= static_cast<float>(fp[1])) ? 1.0f : 0.0f;
    case kRelu: return x > 0.0f ? 1.0f : 0.0f;
    case kSilu: {
      float s = sigmoidf(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case kGelu: {
      float cdf = 0.5f * (1.0f + std::erf(x * kInvSqrt2));
      return cdf + x * kInvSqrt2Pi * std::exp(-0.5f * x * x);
    }
    case kSigmoid: return y * (1.0f - y);
    case kTanh: return 1.0f - y * y;
    case kSoftplus: return x > 20.0f ? 1.0f : sigmoidf(x);
  }
  return 0.0f;
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

  using FP = const std::vector<double>&;
  add_unary(t, "neg", [](float x, FP) { return -x; }, [](GradSink& k) { k.add(0, k.g.neg(k.grad_out)); });
  add_unary(t, "abs", [](float x, FP) { return std::fabs(x); }, act_backward(kAbs));
  add_unary(t, "sqr", [](float x, FP) { return x * x; },
            [](GradSink& k) { k.add(0, k.g.mul(k.grad_out, k.g.scale(k.node.src[0], 2.0))); });
  add_unary(t, "sqrt", [](float x, FP) { return std::sqrt(x); }, act_backward(kSqrt));
  add_unary(t, "exp", [](float x, FP) { return std::exp(x); },
            [](GradSink& k) { k.add(0, k.g.mul(k.grad_out, k.node.id)); });
  add_unary(t, "log", [](float x, FP) { return std::log(x); }, act_backward(kLog));
  add_unary(t, "scale", [](float x, FP fp) { return x * static_cast<float>(fp[0]); },
            [](GradSink& k) { k.add(0, k.g.scale(k.grad_out, k.node.fp[0])); }, 1);
  add_unary(t, "clamp",
            [](float x, FP fp) {
              return std::min(std::max(x, static_cast<float>(fp[0])), static_cast<float>(fp[1]));
            },
            act_backward(kClamp), 2);
  add_unary(t, "relu", [](float x, FP) { return x > 0.0f ? x : 0.0f; }, act_backward(kRelu));
  add_unary(t, "silu", [](float x, FP) { return x * sigmoidf(x); }, act_backward(kSilu));
  add_unary(t, "gelu", [](float x, FP) { return 0.5f * x * (1.0f + std::erf(x * kInvSqrt2)); },
            act_backward(kGelu));
  add_unary(t, "sigmoid", [](float x, FP) { return sigmoidf(x); }, act_backward(kSigmoid));
  add_unary(t, "tanh", [](float x, FP) { return std::tanh(x); }, act_backward(kTanh));
  add_unary(t, "softplus", [](float x, FP) { return softplusf(x); }, act_backward(kSoftplus));

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
      if (n.ip[0] < kAbs || n.ip[0] > kSoftplus) fail_shape(g, n, "unknown activation code");
      if (n.ip[0] == kClamp && n.fp.size() != 2) fail_shape(g, n, "clamp needs (min, max)");
      n.dtype = DType::f32;
      n.shape = g.node(n.src.at(1)).shape;
    };
    d.forward = [](KernelCtx& c) {
      const float* gp = c.src[0].f32();
      const float* x = c.src[1].f32();
      const float* y = c.src[2].f32();
      float* o = c.dst.f32();
      const int64_t code = c.node.ip[0];
      const auto& fp = c.node.fp;
      c.pool.parallel_for(c.dst.numel(), kGrainElems, [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) o[i] = gp[i] * act_derivative(code, x[i], y[i], fp);
      });
    };
    t.add(std::move(d));
  }
}

}  // namespace recurra

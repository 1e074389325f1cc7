// Shape ops that move data: concat, pad (constant) and cumsum. Their gradients are slices
// of the output gradient (concat, pad) or a cumsum running the other way.
//
// Shapes (numpy order):
//   concat:  a (..., A, ...), b (..., B, ...), ip [axis] -> (..., A + B, ...)
//   pad:     x (d0, d1, ...), ip [before0, after0, before1, after1, ...], fp [value]
//            -> (before0 + d0 + after0, ...)
//   cumsum:  x, ip [axis, reverse] -> the shape of x; seen as (O, L, I) around the axis
#include <algorithm>
#include <cstring>
#include <string>

#include "../graph.h"
#include "kernel_util.h"

namespace recurra {

namespace {

// ---- row kernels --------------------------------------------------------------------

// y = x (4-byte elements, x strided by sx)
RC_SIMD void copy_row(uint32_t* __restrict y, const uint32_t* __restrict x, int64_t n, int64_t sx) {
  if (sx == 1)
    for (int64_t i = 0; i < n; ++i) y[i] = x[i];
  else
    for (int64_t i = 0; i < n; ++i) y[i] = x[i * sx];
}
RC_SIMD void fill_row(uint32_t* __restrict y, int64_t n, uint32_t v) {
  for (int64_t i = 0; i < n; ++i) y[i] = v;
}
// y = prev + x: one step of a cumsum along a non-last axis
RC_SIMD void add_row(float* __restrict y, const float* __restrict prev, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = prev[i] + x[i];
}
// Inclusive prefix sums along a row (a serial chain: nothing to vectorize).
void prefix_row(float* __restrict y, const float* __restrict x, int64_t n, bool reverse) {
  float acc = 0.0f;
  if (reverse)
    for (int64_t i = n - 1; i >= 0; --i) y[i] = acc += x[i];
  else
    for (int64_t i = 0; i < n; ++i) y[i] = acc += x[i];
}

// dst = src, both strided, same shape, 4-byte elements; split by rows across the pool.
void copy_into(const TensorView& dst, const TensorView& src, ThreadPool& tp) {
  const int64_t len = row_len(src.shape), rows = n_rows(src.shape);
  if (len == 0 || rows == 0) return;
  const int64_t sd = last_stride(dst.strides, dst.shape), ss = last_stride(src.strides, src.shape);
  auto* d = static_cast<uint32_t*>(dst.data);
  const auto* s = static_cast<const uint32_t*>(src.data);
  tp.parallel_for(rows, row_grain(len), [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      uint32_t* dp = d + row_offset(dst.shape, dst.strides, r);
      const uint32_t* sp = s + row_offset(src.shape, src.strides, r);
      if (sd == 1)
        copy_row(dp, sp, len, ss);
      else
        for (int64_t i = 0; i < len; ++i) dp[i * sd] = sp[i * ss];
    }
  });
}

// The contiguous slice [start_i, start_i + shape_i) of `of` along every axis.
int slice_of(Graph& g, int of, const int64_t* start, const Shape& shape) {
  std::vector<int64_t> ip;
  for (int i = 0; i < shape.ndim; ++i) {
    ip.push_back(start[i]);
    ip.push_back(start[i] + shape.d[i]);
    ip.push_back(1);
  }
  return g.contiguous(g.op("slice", {of}, ip));
}

// ---- concat -------------------------------------------------------------------------

void concat_infer(Graph& g, Node& n) {
  if (n.src.size() != 2) fail_shape(g, n, "takes two inputs");
  if (n.ip.size() != 1) fail_shape(g, n, "takes one int parameter (axis)");
  const Node& a = g.node(n.src.at(0));
  const Node& b = g.node(n.src.at(1));
  if (a.dtype != b.dtype)
    throw TypeError(std::string("concat: inputs must have one dtype, got ") + dtype_name(a.dtype) + " and " +
                    dtype_name(b.dtype));
  if (a.shape.ndim != b.shape.ndim || a.shape.ndim == 0) fail_shape(g, n, "inputs must have the same number of axes (>= 1)");
  const int ax = norm_axis("concat", n.ip.at(RECURRA_P_AXIS), a.shape.ndim);
  for (int i = 0; i < a.shape.ndim; ++i)
    if (i != ax && a.shape.d[i] != b.shape.d[i])
      fail_shape(g, n, "inputs must agree on every axis but " + std::to_string(ax));
  n.ip.at(RECURRA_P_AXIS) = ax;
  n.dtype = a.dtype;
  n.shape = a.shape;
  n.shape.d[ax] += b.shape.d[ax];
}

void concat_forward(KernelCtx& c) {
  const int ax = static_cast<int>(c.node.ip[RECURRA_P_AXIS]);
  const size_t esz = dtype_size(c.dst.dtype);
  TensorView part = c.dst;
  part.shape = c.src[0].shape;
  copy_into(part, c.src[0], c.pool);
  part.shape = c.src[1].shape;
  part.data = static_cast<uint8_t*>(c.dst.data) + c.src[0].shape.d[ax] * c.dst.strides[ax] * esz;
  copy_into(part, c.src[1], c.pool);
}

void concat_backward(GradSink& k) {
  const int ax = static_cast<int>(k.node.ip[RECURRA_P_AXIS]);
  const Shape sa = k.g.node(k.node.src[0]).shape;
  const Shape sb = k.g.node(k.node.src[1]).shape;
  int64_t start[kMaxDims] = {0, 0, 0, 0};
  if (k.needs(0)) k.add(0, slice_of(k.g, k.grad_out, start, sa));
  start[ax] = sa.d[ax];
  if (k.needs(1)) k.add(1, slice_of(k.g, k.grad_out, start, sb));
}

// ---- pad ----------------------------------------------------------------------------

void pad_infer(Graph& g, Node& n) {
  if (n.src.size() != 1) fail_shape(g, n, "takes one input");
  const Node& x = g.node(n.src.at(0));
  if (n.ip.size() != 2 * static_cast<size_t>(x.shape.ndim))
    fail_shape(g, n, "needs a (before, after) pair per axis: " + std::to_string(2 * x.shape.ndim) +
                         " ints, got " + std::to_string(n.ip.size()));
  if (n.fp.size() != 1) fail_shape(g, n, "takes one float parameter (the value)");
  for (int64_t p : n.ip)
    if (p < 0) fail_shape(g, n, "pad widths must be >= 0, got " + std::to_string(p));
  n.dtype = x.dtype;
  n.shape = x.shape;
  for (int i = 0; i < x.shape.ndim; ++i) n.shape.d[i] += n.ip.at(2 * i) + n.ip.at(2 * i + 1);
}

void pad_forward(KernelCtx& c) {
  const TensorView& x = c.src[0];
  const Shape& os = c.dst.shape;
  const int nd = os.ndim;
  const int64_t len = row_len(os), rows = n_rows(os);
  if (len == 0 || rows == 0) return;
  const int64_t* pw = c.node.ip.data();
  uint32_t fill_bits;
  if (c.dst.dtype == DType::f32) {
    const float v = static_cast<float>(c.node.fp[RECURRA_P_VALUE]);
    std::memcpy(&fill_bits, &v, sizeof fill_bits);
  } else {
    const int32_t v = static_cast<int32_t>(c.node.fp[RECURRA_P_VALUE]);
    std::memcpy(&fill_bits, &v, sizeof fill_bits);
  }
  const int64_t before = nd ? pw[2 * (nd - 1)] : 0;
  const int64_t xlen = row_len(x.shape), xs = last_stride(x.strides, x.shape);
  auto* out = static_cast<uint32_t*>(c.dst.data);
  const auto* src = static_cast<const uint32_t*>(x.data);
  c.pool.parallel_for(rows, row_grain(len), [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      uint32_t* o = out + r * len;
      // Where does output row r come from? Outside the input on any leading axis: fill only.
      int64_t rem = r, off = 0;
      bool inside = true;
      for (int i = nd - 2; i >= 0; --i) {
        const int64_t xi = rem % os.d[i] - pw[2 * i];
        rem /= os.d[i];
        if (xi < 0 || xi >= x.shape.d[i]) inside = false;
        off += xi * x.strides[i];
      }
      if (!inside) {
        fill_row(o, len, fill_bits);
        continue;
      }
      fill_row(o, before, fill_bits);
      copy_row(o + before, src + off, xlen, xs);
      fill_row(o + before + xlen, len - before - xlen, fill_bits);
    }
  });
}

void pad_backward(GradSink& k) {
  const Shape s = k.g.node(k.node.src[0]).shape;
  int64_t start[kMaxDims] = {0, 0, 0, 0};
  for (int i = 0; i < s.ndim; ++i) start[i] = k.node.ip[2 * i];
  k.add(0, slice_of(k.g, k.grad_out, start, s));
}

// ---- cumsum -------------------------------------------------------------------------

void cumsum_infer(Graph& g, Node& n) {
  if (n.src.size() != 1) fail_shape(g, n, "takes one input");
  require_f32(g, n, 0);
  if (n.ip.size() != 2) fail_shape(g, n, "takes two int parameters (axis, reverse)");
  const Node& x = g.node(n.src.at(0));
  n.ip.at(RECURRA_P_AXIS) = norm_axis("cumsum", n.ip.at(RECURRA_P_AXIS), x.shape.ndim);
  if (n.ip.at(1) != 0 && n.ip.at(1) != 1) fail_shape(g, n, "reverse must be 0 or 1, got " + std::to_string(n.ip.at(1)));
  n.dtype = DType::f32;
  n.shape = x.shape;
}

void cumsum_forward(KernelCtx& c) {
  const Shape& s = c.dst.shape;
  const int ax = static_cast<int>(c.node.ip[RECURRA_P_AXIS]);
  const bool reverse = c.node.ip[RECURRA_P_REVERSE] != 0;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < ax; ++i) outer *= s.d[i];
  for (int i = ax + 1; i < s.ndim; ++i) inner *= s.d[i];
  const int64_t L = s.d[ax];
  if (outer == 0 || inner == 0 || L == 0) return;
  const float* x = c.src[0].f32();
  float* y = c.dst.f32();
  if (inner == 1) {  // along the last axis: one serial chain per row
    c.pool.parallel_for(outer, row_grain(L), [&](int64_t b, int64_t e, int) {
      for (int64_t o = b; o < e; ++o) prefix_row(y + o * L, x + o * L, L, reverse);
    });
    return;
  }
  // Otherwise whole rows of `inner` elements are added at once: y[o, l] = y[o, l -+ 1] + x[o, l].
  constexpr int64_t kBlock = 1024;  // columns per task
  const int64_t n_blocks = (inner + kBlock - 1) / kBlock;
  c.pool.parallel_for(outer * n_blocks, std::max<int64_t>(1, kGrainElems / (L * std::min(inner, kBlock))),
                      [&](int64_t b, int64_t e, int) {
    for (int64_t task = b; task < e; ++task) {
      const int64_t o = task / n_blocks, c0 = (task % n_blocks) * kBlock;
      const int64_t w = std::min(inner, c0 + kBlock) - c0;
      const float* xo = x + o * L * inner + c0;
      float* yo = y + o * L * inner + c0;
      const int64_t first = reverse ? L - 1 : 0, step = reverse ? -1 : 1;
      std::memcpy(yo + first * inner, xo + first * inner, w * sizeof(float));
      for (int64_t l = first + step; l >= 0 && l < L; l += step)
        add_row(yo + l * inner, yo + (l - step) * inner, xo + l * inner, w);
    }
  });
}

}  // namespace

void register_shape_ops(OpTable& t) {
  {
    OpDef d;
    d.name = "concat";
    d.infer = concat_infer;
    d.forward = concat_forward;
    d.backward = concat_backward;
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "pad";
    d.infer = pad_infer;
    d.forward = pad_forward;
    d.backward = pad_backward;
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "cumsum";
    d.infer = cumsum_infer;
    d.forward = cumsum_forward;
    d.contiguous_srcs = 0b1;
    d.backward = [](GradSink& k) {
      k.add(0, k.g.op("cumsum", {k.grad_out}, {k.node.ip[RECURRA_P_AXIS], 1 - k.node.ip[RECURRA_P_REVERSE]}));
    };
    t.add(std::move(d));
  }
}

}  // namespace recurra

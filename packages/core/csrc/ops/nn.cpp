// Neural-net ops that work along the last axis (softmax, log_softmax, rms_norm, layer_norm),
// the classification loss cross_entropy and the embedding lookup get_rows. Each backward rule
// is a dedicated *_back kernel that recomputes the row statistics it needs from the forward
// input or output, so the forward keeps nothing alive besides its result.
//
// Shapes (numpy order):
//   R = rows (the product of all axes but the last), C = the last axis
//   softmax / log_softmax / rms_norm / layer_norm:  x (..., C) -> (..., C)
//   cross_entropy:  logits (N, C) f32, targets (N,) i32 -> () = mean_n -log_softmax(logits)[n, t_n]
//   get_rows:       table (V, D) f32, idx I i32 (1 to 3 axes) -> I + (D,)
//   get_rows_back:  grad I + (D,), idx I, ip [V] -> (V, D)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "../graph.h"
#include "kernel_util.h"
#include "lane_math.h"

namespace recurra {

namespace {

// ---- row kernels --------------------------------------------------------------------
//
// Reductions keep kLanes independent partial sums: GCC vectorizes them without
// -ffast-math (no reassociation is needed), and the result does not depend on threads.

constexpr int kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Floats mapped to int32 keys of the same order (max over ints vectorizes; over floats it
// needs -ffinite-math-only). The map is its own inverse.
inline int32_t order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7FFFFFFF); }
inline int32_t order_key(float x) {
  int32_t s;
  std::memcpy(&s, &x, sizeof s);
  return order_key(s);
}

#define RC_ROW_REDUCE(NAME, PARAMS, TERM)                                   \
  RC_SIMD float NAME PARAMS {                                               \
    float acc[kLanes] = {};                                                 \
    int64_t i = 0;                                                          \
    for (; i + kLanes <= n; i += kLanes)                                    \
      for (int j = 0; j < kLanes; ++j) {                                    \
        const int64_t k = i + j;                                            \
        acc[j] += TERM;                                                     \
      }                                                                     \
    float s = 0.0f;                                                         \
    for (int64_t k = i; k < n; ++k) s += TERM;                              \
    for (int j = 0; j < kLanes; ++j) s += acc[j];                           \
    return s;                                                               \
  }

RC_ROW_REDUCE(sum_row, (const float* __restrict x, int64_t n), x[k])
RC_ROW_REDUCE(dot_row, (const float* __restrict a, const float* __restrict b, int64_t n), a[k] * b[k])
RC_ROW_REDUCE(sumsq_row, (const float* __restrict x, int64_t n), x[k] * x[k])
RC_ROW_REDUCE(sumsq_centered_row, (const float* __restrict x, int64_t n, float mu),
              (x[k] - mu) * (x[k] - mu))
RC_ROW_REDUCE(dot_centered_row, (const float* __restrict g, const float* __restrict x, int64_t n, float mu),
              g[k] * (x[k] - mu))
RC_ROW_REDUCE(sum_exp_shift_row, (const float* __restrict x, int64_t n, float m), exp_ftz_lane(x[k] - m))

#undef RC_ROW_REDUCE

// Largest element (-inf for an empty row); a NaN with the sign bit clear wins, like np.max.
RC_SIMD float max_row(const float* __restrict x, int64_t n) {
  int32_t m = order_key(kNegInf);
  for (int64_t i = 0; i < n; ++i) m = std::max(m, order_key(x[i]));
  m = order_key(m);
  float r;
  std::memcpy(&r, &m, sizeof r);
  return r;
}

// y = exp(x - m)
RC_SIMD void exp_shift_row(float* __restrict y, const float* __restrict x, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_ftz_lane(x[i] - m);
}
// y = exp(y - m)
RC_SIMD void exp_shift_inplace_row(float* __restrict y, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_ftz_lane(y[i] - m);
}
// y *= s
RC_SIMD void scale_inplace_row(float* __restrict y, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) y[i] *= s;
}
// y = x * s
RC_SIMD void scale_row(float* __restrict y, const float* __restrict x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s;
}
// y = x - c
RC_SIMD void shift_row(float* __restrict y, const float* __restrict x, int64_t n, float c) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] - c;
}
// dx = y * (g - d)
RC_SIMD void softmax_back_row(float* __restrict dx, const float* __restrict g, const float* __restrict y,
                              int64_t n, float d) {
  for (int64_t i = 0; i < n; ++i) dx[i] = y[i] * (g[i] - d);
}
// dx = g - exp(y) * s
RC_SIMD void log_softmax_back_row(float* __restrict dx, const float* __restrict g,
                                  const float* __restrict y, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) dx[i] = g[i] - exp_ftz_lane(y[i]) * s;
}
// dx = r * g - c * x
RC_SIMD void rms_norm_back_row(float* __restrict dx, const float* __restrict g, const float* __restrict x,
                               int64_t n, float r, float c) {
  for (int64_t i = 0; i < n; ++i) dx[i] = r * g[i] - c * x[i];
}
// y = (x - mu) * r
RC_SIMD void layer_norm_row(float* __restrict y, const float* __restrict x, int64_t n, float mu, float r) {
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mu) * r;
}
// dx = r * (g - a - (x - mu) * r * b)
RC_SIMD void layer_norm_back_row(float* __restrict dx, const float* __restrict g, const float* __restrict x,
                                 int64_t n, float mu, float r, float a, float b) {
  const float rb = r * b;
  for (int64_t i = 0; i < n; ++i) dx[i] = r * (g[i] - a - (x[i] - mu) * rb);
}
// y += x
RC_SIMD void add_inplace_row(float* __restrict y, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// ---- shared checks ------------------------------------------------------------------


void require_i32(const Graph& g, const Node& n, int i, const char* what) {
  const Node& s = g.node(n.src.at(i));
  if (s.dtype != DType::i32)
    throw TypeError(op_name(n) + ": " + what + " must be int32, got " + dtype_name(s.dtype));
}

void require_srcs(const Graph& g, const Node& n, size_t count, const char* what) {
  if (n.src.size() != count) fail_shape(g, n, std::string("takes ") + what);
}

// fp = [eps] with eps >= 0.
float eps_param(const Graph& g, const Node& n) {
  if (n.fp.size() != 1) fail_shape(g, n, "takes one float parameter (eps)");
  if (!(n.fp.at(RECURRA_P_EPS) >= 0.0) || !std::isfinite(n.fp.at(RECURRA_P_EPS)))
    fail_shape(g, n, "eps must be finite and >= 0, got " + std::to_string(n.fp.at(RECURRA_P_EPS)));
  return static_cast<float>(n.fp.at(RECURRA_P_EPS));
}

// Backward ops (grad, x_or_y) -> the shape of x: both f32 and of one shape.
void row_back_infer(Graph& g, Node& n) {
  require_srcs(g, n, 2, "(grad, x)");
  require_f32(g, n, 0);
  require_f32(g, n, 1);
  if (g.node(n.src.at(0)).shape != g.node(n.src.at(1)).shape) fail_shape(g, n, "grad and x must have one shape");
  n.dtype = DType::f32;
  n.shape = g.node(n.src.at(1)).shape;
}

void row_infer(Graph& g, Node& n) {
  require_srcs(g, n, 1, "one input");
  require_f32(g, n, 0);
  n.dtype = DType::f32;
  n.shape = g.node(n.src.at(0)).shape;
}

// Runs fn(row index) over the rows of dst, split across the pool.
template <class F>
void for_rows(KernelCtx& c, const Shape& s, F fn) {
  const int64_t rows = n_rows(s), len = row_len(s);
  if (rows == 0 || len == 0) return;
  c.pool.parallel_for(rows, row_grain(len), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) fn(r, len);
  });
}

// Throws ValueError if any of the n indices lies outside [0, bound).
void check_indices(const char* op, const char* what, const int32_t* idx, int64_t n, int64_t bound) {
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= bound)
      throw ValueError(std::string(op) + ": " + what + " " + std::to_string(idx[i]) + " at position " +
                       std::to_string(i) + " is out of range [0, " + std::to_string(bound) + ")");
}

// ---- softmax ------------------------------------------------------------------------

void softmax_forward(KernelCtx& c) {
  const float* x = c.src[0].f32();
  float* y = c.dst.f32();
  for_rows(c, c.dst.shape, [&](int64_t r, int64_t len) {
    const float* xr = x + r * len;
    float* yr = y + r * len;
    const float m = max_row(xr, len);
    exp_shift_row(yr, xr, len, m);
    scale_inplace_row(yr, len, 1.0f / sum_row(yr, len));
  });
}

// (grad, y): dx = y * (g - sum(g * y))
void softmax_back_forward(KernelCtx& c) {
  const float* gp = c.src[0].f32();
  const float* y = c.src[1].f32();
  float* dx = c.dst.f32();
  for_rows(c, c.dst.shape, [&](int64_t r, int64_t len) {
    const int64_t o = r * len;
    softmax_back_row(dx + o, gp + o, y + o, len, dot_row(gp + o, y + o, len));
  });
}

// ---- log_softmax --------------------------------------------------------------------

void log_softmax_forward(KernelCtx& c) {
  const float* x = c.src[0].f32();
  float* y = c.dst.f32();
  for_rows(c, c.dst.shape, [&](int64_t r, int64_t len) {
    const float* xr = x + r * len;
    const float m = max_row(xr, len);
    const float lse = m + std::log(sum_exp_shift_row(xr, len, m));
    shift_row(y + r * len, xr, len, lse);
  });
}

// (grad, y): dx = g - exp(y) * sum(g)
void log_softmax_back_forward(KernelCtx& c) {
  const float* gp = c.src[0].f32();
  const float* y = c.src[1].f32();
  float* dx = c.dst.f32();
  for_rows(c, c.dst.shape, [&](int64_t r, int64_t len) {
    const int64_t o = r * len;
    log_softmax_back_row(dx + o, gp + o, y + o, len, sum_row(gp + o, len));
  });
}

// ---- cross_entropy ------------------------------------------------------------------

void cross_entropy_infer(Graph& g, Node& n) {
  require_srcs(g, n, 2, "(logits, targets)");
  require_f32(g, n, 0);
  require_i32(g, n, 1, "targets");
  const Shape& l = g.node(n.src.at(0)).shape;
  const Shape& t = g.node(n.src.at(1)).shape;
  if (l.ndim != 2) fail_shape(g, n, "logits must be (N, C)");
  if (t.ndim != 1 || t.d[0] != l.d[0]) fail_shape(g, n, "targets must be (N,) for logits (N, C)");
  if (l.d[0] == 0 || l.d[1] == 0) fail_shape(g, n, "needs at least one row and one class");
  n.dtype = DType::f32;
  n.shape = Shape();  // a scalar
}

void cross_entropy_forward(KernelCtx& c) {
  const TensorView& lv = c.src[0];
  const int64_t N = lv.shape.d[0], C = lv.shape.d[1];
  const float* x = lv.f32();
  const int32_t* t = c.src[1].i32();
  check_indices("cross_entropy", "target", t, N, C);
  // Per-row losses summed afterwards in row order: the result does not depend on threads.
  std::vector<double> loss(N);
  c.pool.parallel_for(N, row_grain(C), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * C;
      const float m = max_row(xr, C);
      const double lse = static_cast<double>(m) + std::log(static_cast<double>(sum_exp_shift_row(xr, C, m)));
      loss[r] = lse - static_cast<double>(xr[t[r]]);
    }
  });
  double total = 0.0;
  for (double v : loss) total += v;
  c.dst.f32()[0] = static_cast<float>(total / static_cast<double>(N));
}

// (grad (), logits (N, C), targets (N,)) -> (softmax(logits) - onehot(targets)) * grad / N
void cross_entropy_back_infer(Graph& g, Node& n) {
  require_srcs(g, n, 3, "(grad, logits, targets)");
  require_f32(g, n, 0);
  require_f32(g, n, 1);
  require_i32(g, n, 2, "targets");
  const Shape& l = g.node(n.src.at(1)).shape;
  const Shape& t = g.node(n.src.at(2)).shape;
  if (g.node(n.src.at(0)).numel() != 1) fail_shape(g, n, "grad must be a scalar");
  if (l.ndim != 2 || t.ndim != 1 || t.d[0] != l.d[0]) fail_shape(g, n, "needs logits (N, C) and targets (N,)");
  if (l.d[0] == 0 || l.d[1] == 0) fail_shape(g, n, "needs at least one row and one class");
  // the logits' gradient in their dtype (RECURRA_OPS_HALF_IN): rounded once, no cast after
  n.dtype = is_float(g.node(n.src[1]).dtype) ? g.node(n.src[1]).dtype : DType::f32;
  n.shape = l;
}

void cross_entropy_back_forward(KernelCtx& c) {
  const TensorView& lv = c.src[1];
  const int64_t N = lv.shape.d[0], C = lv.shape.d[1];
  const float* x = lv.f32();
  const int32_t* t = c.src[2].i32();
  check_indices("cross_entropy_back", "target", t, N, C);
  const float gs = c.src[0].f32()[0] / static_cast<float>(N);
  float* dx = c.dst.f32();
  c.pool.parallel_for(N, row_grain(C), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * C;
      float* dr = dx + r * C;
      const float m = max_row(xr, C);
      if (dr == xr)  // the plan gave the gradient the logits' memory (row by row)
        exp_shift_inplace_row(dr, C, m);
      else
        exp_shift_row(dr, xr, C, m);
      scale_inplace_row(dr, C, gs / sum_row(dr, C));
      dr[t[r]] -= gs;
    }
  });
}

// ---- rms_norm -----------------------------------------------------------------------

void rms_norm_forward(KernelCtx& c) {
  const float eps = static_cast<float>(c.node.fp[RECURRA_P_EPS]);
  const float* x = c.src[0].f32();
  float* y = c.dst.f32();
  for_rows(c, c.dst.shape, [&](int64_t r, int64_t len) {
    const float* xr = x + r * len;
    const float rs = 1.0f / std::sqrt(sumsq_row(xr, len) / static_cast<float>(len) + eps);
    scale_row(y + r * len, xr, len, rs);
  });
}

// (grad, x): with r = 1/sqrt(mean(x^2) + eps), dx = r g - x r^3 sum(g x) / C
void rms_norm_back_forward(KernelCtx& c) {
  const float eps = static_cast<float>(c.node.fp[RECURRA_P_EPS]);
  const float* gp = c.src[0].f32();
  const float* x = c.src[1].f32();
  float* dx = c.dst.f32();
  for_rows(c, c.dst.shape, [&](int64_t r, int64_t len) {
    const int64_t o = r * len;
    const float n = static_cast<float>(len);
    const float rs = 1.0f / std::sqrt(sumsq_row(x + o, len) / n + eps);
    const float cx = rs * rs * rs * dot_row(gp + o, x + o, len) / n;
    rms_norm_back_row(dx + o, gp + o, x + o, len, rs, cx);
  });
}

// ---- layer_norm ---------------------------------------------------------------------

struct RowMoments {
  float mu, r;  // mean and 1/sqrt(var + eps)
};

// Two passes (mean, then centred squares): stable when |mean| >> std.
RowMoments row_moments(const float* x, int64_t len, float eps) {
  const float n = static_cast<float>(len);
  const float mu = sum_row(x, len) / n;
  const float var = sumsq_centered_row(x, len, mu) / n;
  return {mu, 1.0f / std::sqrt(var + eps)};
}

void layer_norm_forward(KernelCtx& c) {
  const float eps = static_cast<float>(c.node.fp[RECURRA_P_EPS]);
  const float* x = c.src[0].f32();
  float* y = c.dst.f32();
  for_rows(c, c.dst.shape, [&](int64_t r, int64_t len) {
    const float* xr = x + r * len;
    const RowMoments mo = row_moments(xr, len, eps);
    layer_norm_row(y + r * len, xr, len, mo.mu, mo.r);
  });
}

// (grad, x): with xhat = (x - mu) r, dx = r (g - mean(g) - xhat mean(g xhat))
void layer_norm_back_forward(KernelCtx& c) {
  const float eps = static_cast<float>(c.node.fp[RECURRA_P_EPS]);
  const float* gp = c.src[0].f32();
  const float* x = c.src[1].f32();
  float* dx = c.dst.f32();
  for_rows(c, c.dst.shape, [&](int64_t r, int64_t len) {
    const int64_t o = r * len;
    const float n = static_cast<float>(len);
    const RowMoments mo = row_moments(x + o, len, eps);
    const float a = sum_row(gp + o, len) / n;
    const float b = dot_centered_row(gp + o, x + o, len, mo.mu) * mo.r / n;
    layer_norm_back_row(dx + o, gp + o, x + o, len, mo.mu, mo.r, a, b);
  });
}

// ---- get_rows -----------------------------------------------------------------------

void get_rows_infer(Graph& g, Node& n) {
  require_srcs(g, n, 2, "(table, idx)");
  require_f32(g, n, 0);
  require_i32(g, n, 1, "indices");
  const Shape& tb = g.node(n.src.at(0)).shape;
  const Shape& ix = g.node(n.src.at(1)).shape;
  if (tb.ndim != 2) fail_shape(g, n, "the table must be (V, D)");
  if (ix.ndim < 1 || ix.ndim > 3) fail_shape(g, n, "the indices must have 1 to 3 axes");
  n.dtype = DType::f32;
  n.shape = ix;
  n.shape.d[n.shape.ndim++] = tb.d[1];
}

void get_rows_forward(KernelCtx& c) {
  const int64_t V = c.src[0].shape.d[0], D = c.src[0].shape.d[1];
  const int64_t N = c.src[1].numel();
  const int32_t* idx = c.src[1].i32();
  check_indices("get_rows", "index", idx, N, V);
  const float* tb = c.src[0].f32();
  float* y = c.dst.f32();
  if (D == 0) return;
  c.pool.parallel_for(N, row_grain(D), [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) std::memcpy(y + i * D, tb + idx[i] * D, D * sizeof(float));
  });
}

void get_rows_back_infer(Graph& g, Node& n) {
  require_srcs(g, n, 2, "(grad, idx)");
  require_f32(g, n, 0);
  require_i32(g, n, 1, "indices");
  if (n.ip.size() != 1 || n.ip.at(RECURRA_P_N_ROWS) < 0) fail_shape(g, n, "takes one int parameter: the table's row count V >= 0");
  const Shape& gs = g.node(n.src.at(0)).shape;
  const Shape& ix = g.node(n.src.at(1)).shape;
  bool ok = ix.ndim >= 1 && gs.ndim == ix.ndim + 1;
  for (int i = 0; ok && i < ix.ndim; ++i) ok = gs.d[i] == ix.d[i];
  if (!ok) fail_shape(g, n, "grad must have the indices' shape plus one axis (D)");
  n.dtype = DType::f32;
  n.shape = Shape{n.ip.at(RECURRA_P_N_ROWS), gs.d[gs.ndim - 1]};
}

// Scatter-add without races or atomics: a task owns a block of table rows x a block of
// columns and walks all indices in order, so every sum is taken in index order whatever the
// split and the thread count.
void get_rows_back_forward(KernelCtx& c) {
  const int64_t V = c.dst.shape.d[0], D = c.dst.shape.d[1];
  const int64_t N = c.src[1].numel();
  const int32_t* idx = c.src[1].i32();
  check_indices("get_rows_back", "index", idx, N, V);
  const float* gp = c.src[0].f32();
  float* out = c.dst.f32();
  if (V == 0 || D == 0) return;
  constexpr int64_t kColBlock = 256;
  const int64_t n_cb = (D + kColBlock - 1) / kColBlock;
  const int64_t want = 2 * static_cast<int64_t>(c.pool.size());
  const int64_t n_rb = std::min<int64_t>(V, std::max<int64_t>(1, (want + n_cb - 1) / n_cb));
  c.pool.run(n_cb * n_rb, [&](int64_t task, int) {
    const int64_t cb = task % n_cb, rb = task / n_cb;
    const int64_t c0 = cb * kColBlock, w = std::min(D, c0 + kColBlock) - c0;
    const int64_t v0 = V * rb / n_rb, v1 = V * (rb + 1) / n_rb;
    for (int64_t v = v0; v < v1; ++v) std::memset(out + v * D + c0, 0, w * sizeof(float));
    for (int64_t i = 0; i < N; ++i) {
      const int64_t v = idx[i];
      if (v >= v0 && v < v1) add_inplace_row(out + v * D + c0, gp + i * D + c0, w);
    }
  });
}

OpDef make_op(const char* name, std::function<void(Graph&, Node&)> infer,
              std::function<void(KernelCtx&)> fwd, uint32_t contiguous,
              std::function<void(GradSink&)> bw = nullptr) {
  OpDef d;
  d.name = name;
  d.infer = std::move(infer);
  d.forward = std::move(fwd);
  d.backward = std::move(bw);
  d.contiguous_srcs = contiguous;
  return d;
}

}  // namespace

// add(base, get_rows_back(grad, idx)) as plan() merges it (see RowsAdd in schedule.h):
// dst = base (nothing copied when dst is base's memory) with each row v that idx names
// added its sum of grad rows, in index order, as get_rows_back sums them. base and dst
// (V, D) dense, grad (..., D) dense, idx the lookup's indices.
void add_rows_back(const TensorView& dst, const TensorView& base, const TensorView& grad, const TensorView& idx,
                   ThreadPool& tp) {
  const int64_t V = dst.shape.d[0], D = dst.shape.d[1], N = idx.numel();
  const int32_t* ix = idx.i32();
  check_indices("get_rows_back", "index", ix, N, V);
  float* out = dst.f32();
  const float* a = base.f32();
  if (out != a) {
    const int64_t total = V * D;
    tp.parallel_for(total, kGrainElems * 8, [&](int64_t lo, int64_t hi, int) {
      std::memcpy(out + lo, a + lo, (hi - lo) * sizeof(float));
    });
  }
  if (D == 0 || N == 0) return;
  std::vector<int64_t> order(N);  // positions grouped by row, each group in index order
  for (int64_t i = 0; i < N; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return ix[x] < ix[y]; });
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < N; ++i)
    if (i == 0 || ix[order[i]] != ix[order[i - 1]]) starts.push_back(i);
  starts.push_back(N);
  const float* gp = grad.f32();
  const int64_t n_groups = static_cast<int64_t>(starts.size()) - 1;
  tp.parallel_for(n_groups, row_grain(D), [&](int64_t b, int64_t e, int) {
    std::vector<float> acc(D);
    for (int64_t q = b; q < e; ++q) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = starts[q]; i < starts[q + 1]; ++i) add_inplace_row(acc.data(), gp + order[i] * D, D);
      add_inplace_row(out + ix[order[starts[q]]] * D, acc.data(), D);
    }
  });
}

void register_gated_norm_ops(OpTable& t);  // gated_norm.cpp

void register_nn_ops(OpTable& t) {
  register_gated_norm_ops(t);
  t.add(make_op("softmax", row_infer, softmax_forward, 0b1, [](GradSink& k) {
    k.add(0, k.g.op("softmax_back", {k.grad_out, k.node.id}));
  }));
  t.add(make_op("softmax_back", row_back_infer, softmax_back_forward, 0b11));

  t.add(make_op("log_softmax", row_infer, log_softmax_forward, 0b1, [](GradSink& k) {
    k.add(0, k.g.op("log_softmax_back", {k.grad_out, k.node.id}));
  }));
  t.add(make_op("log_softmax_back", row_back_infer, log_softmax_back_forward, 0b11));

  t.add(make_op("cross_entropy", cross_entropy_infer, cross_entropy_forward, 0b11, [](GradSink& k) {
    if (k.needs(0))
      k.add(0, k.g.op("cross_entropy_back", {k.grad_out, k.node.src[0], k.node.src[1]}));
  }));
  t.add(make_op("cross_entropy_back", cross_entropy_back_infer, cross_entropy_back_forward, 0b111));

  auto eps_row_infer = [](Graph& g, Node& n) {
    eps_param(g, n);
    row_infer(g, n);
  };
  auto eps_back_infer = [](Graph& g, Node& n) {
    eps_param(g, n);
    row_back_infer(g, n);
  };
  t.add(make_op("rms_norm", eps_row_infer, rms_norm_forward, 0b1, [](GradSink& k) {
    k.add(0, k.g.op("rms_norm_back", {k.grad_out, k.node.src[0]}, {}, k.node.fp));
  }));
  t.add(make_op("rms_norm_back", eps_back_infer, rms_norm_back_forward, 0b11));

  t.add(make_op("layer_norm", eps_row_infer, layer_norm_forward, 0b1, [](GradSink& k) {
    k.add(0, k.g.op("layer_norm_back", {k.grad_out, k.node.src[0]}, {}, k.node.fp));
  }));
  t.add(make_op("layer_norm_back", eps_back_infer, layer_norm_back_forward, 0b11));

  t.add(make_op("get_rows", get_rows_infer, get_rows_forward, 0b11, [](GradSink& k) {
    if (k.needs(0)) {
      const int64_t V = k.g.node(k.node.src[0]).shape.d[0];
      k.add(0, k.g.op("get_rows_back", {k.grad_out, k.node.src[1]}, {V}));
    }
  }));
  t.add(make_op("get_rows_back", get_rows_back_infer, get_rows_back_forward, 0b11));
}

}  // namespace recurra

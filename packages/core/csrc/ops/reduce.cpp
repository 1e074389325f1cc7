// Reductions along one axis: sum and max (keepdims), and max_grad, the backward of max.
//
// Shape legend (one reduction):
//   x     (..., L, ...)   any strides; L = x.shape[axis] is the reduced length
//   out   (..., 1, ...)   x.shape with the reduced axis kept as size 1 (contiguous)
// Internally x is seen as [K, L, V]: K enumerates the kept axes, V is the last axis when it
// is not the reduced one (the "vector" axis, summed across in SIMD lanes), otherwise 1.
//
// Determinism: how a reduction is split into partial results depends on the shape only,
// never on the thread count, and partials are combined in a fixed order.
#include <cmath>
#include <cstring>
#include <vector>

#include "../graph.h"
#include "kernel_util.h"

namespace recurra {

namespace {

// Elements of the reduced axis per partial result when one long axis is split across tasks.
constexpr int64_t kReduceChunk = 1 << 15;
// Columns of the vector axis handled by one task (its accumulators live on the stack).
constexpr int64_t kVBlock = 1024;

// x seen as [K, L, V] (see the legend), with the strides of x and of a dense x-shaped buffer.
struct ReduceLayout {
  Shape kept;                     // the kept axes (row-major order of the output)
  int64_t kst[kMaxDims] = {};     // x strides of the kept axes
  int64_t kdst[kMaxDims] = {};    // dense x-shaped strides of the kept axes
  int64_t L = 1, sr = 0, dr = 0;  // reduced axis: length, x stride, dense stride
  int64_t V = 1, sv = 0, dv = 0;  // vector axis: length, x stride, dense stride
  int64_t K() const { return kept.numel(); }
  int64_t x_off(int64_t k) const { return off(k, kst); }
  int64_t dense_off(int64_t k) const { return off(k, kdst); }
  int64_t off(int64_t k, const int64_t* st) const {
    int64_t o = 0;
    for (int i = kept.ndim - 1; i >= 0; --i) {
      o += (k % kept.d[i]) * st[i];
      k /= kept.d[i];
    }
    return o;
  }
};

ReduceLayout make_layout(const TensorView& x, int axis) {
  const int nd = x.shape.ndim;
  int64_t dense[kMaxDims];
  contiguous_strides(x.shape, dense);
  ReduceLayout lo;
  lo.L = x.shape.d[axis];
  lo.sr = x.strides[axis];
  lo.dr = dense[axis];
  // The last axis is the vector axis unless it is the reduced one, or it is strided while
  // the reduced axis is dense (then summing along the reduced axis reads memory in order).
  bool vec = axis != nd - 1 && x.shape.d[nd - 1] > 1 &&
             !(x.strides[nd - 1] != 1 && lo.sr == 1);
  for (int i = 0; i < nd; ++i) {
    if (i == axis || (vec && i == nd - 1)) continue;
    lo.kst[lo.kept.ndim] = x.strides[i];
    lo.kdst[lo.kept.ndim] = dense[i];
    lo.kept.d[lo.kept.ndim++] = x.shape.d[i];
  }
  if (vec) {
    lo.V = x.shape.d[nd - 1];
    lo.sv = x.strides[nd - 1];
    lo.dv = 1;
  }
  return lo;
}

// ---- sum ------------------------------------------------------------------------------

// acc[v] += sum over l < nl of x[l * sr + v * sv], v < nv.
RC_SIMD void sum_rows(double* __restrict acc, const float* __restrict x, int64_t nv, int64_t nl,
                      int64_t sr, int64_t sv) {
  if (sv == 1) {
    for (int64_t l = 0; l < nl; ++l) {
      const float* row = x + l * sr;
      for (int64_t v = 0; v < nv; ++v) acc[v] += static_cast<double>(row[v]);
    }
  } else {
    for (int64_t l = 0; l < nl; ++l) {
      const float* row = x + l * sr;
      for (int64_t v = 0; v < nv; ++v) acc[v] += static_cast<double>(row[v * sv]);
    }
  }
}

// ---- max ------------------------------------------------------------------------------

// The max that numpy gives: NaN wins.
inline float max_nan(float m, float v) { return ((v > m) | (v != v)) ? v : m; }

RC_SIMD void max_rows(float* __restrict acc, const float* __restrict x, int64_t nv, int64_t nl,
                      int64_t sr, int64_t sv) {
  for (int64_t l = 0; l < nl; ++l) {
    const float* row = x + l * sr;
    if (sv == 1)
      for (int64_t v = 0; v < nv; ++v) acc[v] = max_nan(acc[v], row[v]);
    else
      for (int64_t v = 0; v < nv; ++v) acc[v] = max_nan(acc[v], row[v * sv]);
  }
}

// One dense line: kLineLanes independent accumulators (registers) let the compiler vectorize
// without reassociating (no -ffast-math); the lanes are then combined in a fixed order.
constexpr int kLineLanes = 32;

RC_SIMD double sum_dense(const float* __restrict x, int64_t n) {
  double lane[kLineLanes] = {0.0};
  int64_t i = 0;
  for (; i + kLineLanes <= n; i += kLineLanes)
    for (int j = 0; j < kLineLanes; ++j) lane[j] += static_cast<double>(x[i + j]);
  double tail = 0.0;
  for (; i < n; ++i) tail += static_cast<double>(x[i]);
  for (int w = kLineLanes / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0] + tail;
}

// n >= 1.
RC_SIMD float max_dense(const float* __restrict x, int64_t n) {
  float m = x[0];
  int64_t i = 1;
  if (n >= 2 * kLineLanes) {
    float lane[kLineLanes];
    for (int j = 0; j < kLineLanes; ++j) lane[j] = x[j];
    for (i = kLineLanes; i + kLineLanes <= n; i += kLineLanes)
      for (int j = 0; j < kLineLanes; ++j) lane[j] = max_nan(lane[j], x[i + j]);
    for (int j = 0; j < kLineLanes; ++j) m = max_nan(m, lane[j]);
  }
  for (; i < n; ++i) m = max_nan(m, x[i]);
  return m;
}

// Sum of n floats with stride s, accumulated in double.
double sum_line(const float* x, int64_t n, int64_t s) {
  if (s == 1) return sum_dense(x, n);
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i * s]);
  return acc;
}

// Max of n >= 1 floats with stride s (NaN wins).
float max_line(const float* x, int64_t n, int64_t s) {
  if (s == 1) return max_dense(x, n);
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = max_nan(m, x[i * s]);
  return m;
}

// ---- the shared driver ----------------------------------------------------------------

// Runs a reduction over the layout. Acc is double (sum) or float (max). `Ops` supplies:
//   Acc line(const float* x, n, stride)                    a whole strided line
//   void init(Acc* acc, const float* row, nv, sv)          accumulator start (first row)
//   int64_t first()                                        rows consumed by init
//   void rows(Acc* acc, const float* x, nv, nl, sr, sv)    accumulate rows
//   Acc combine(Acc a, Acc b)                              join two partials (in order)
template <class Acc, class Ops>
void reduce_forward(KernelCtx& c, const Ops& ops) {
  const TensorView& x = c.src[0];
  const ReduceLayout lo = make_layout(x, static_cast<int>(c.node.ip[RECURRA_P_AXIS]));
  const int64_t K = lo.K(), L = lo.L, V = lo.V;
  float* out = c.dst.f32();
  const float* xp = x.f32();
  if (K * V == 0) return;
  if (L == 0) {  // an empty sum (max rejects empty axes in infer)
    std::fill(out, out + K * V, 0.0f);
    return;
  }

  if (V == 1) {
    // One strided line per output; long lines are cut into fixed chunks.
    const int64_t n_chunks = std::max<int64_t>(1, (L + kReduceChunk - 1) / kReduceChunk);
    if (n_chunks == 1) {
      c.pool.parallel_for(K, row_grain(L), [&](int64_t b, int64_t e, int) {
        for (int64_t k = b; k < e; ++k)
          out[k] = static_cast<float>(ops.line(xp + lo.x_off(k), L, lo.sr));
      });
      return;
    }
    std::vector<Acc> part(K * n_chunks);
    c.pool.run(K * n_chunks, [&](int64_t t, int) {
      const int64_t k = t / n_chunks, ch = t % n_chunks;
      const int64_t l0 = ch * kReduceChunk, n = std::min(kReduceChunk, L - l0);
      part[t] = ops.line(xp + lo.x_off(k) + l0 * lo.sr, n, lo.sr);
    });
    for (int64_t k = 0; k < K; ++k) {
      Acc a = part[k * n_chunks];
      for (int64_t ch = 1; ch < n_chunks; ++ch) a = ops.combine(a, part[k * n_chunks + ch]);
      out[k] = static_cast<float>(a);
    }
    return;
  }

  // Vector axis: tasks over (K, blocks of V); when those are few, the reduced axis is cut
  // into chunks as well, each writing its own partial row.
  const int64_t nvb = (V + kVBlock - 1) / kVBlock;
  const int64_t block_work = std::max<int64_t>(1, L * std::min(V, kVBlock));
  int64_t n_lc = 1;
  if (K * nvb < 16) n_lc = std::max<int64_t>(1, std::min<int64_t>({64, L, block_work / kGrainElems}));
  const int64_t lc_len = std::max<int64_t>(1, (L + n_lc - 1) / n_lc);
  n_lc = std::max<int64_t>(1, (L + lc_len - 1) / lc_len);
  std::vector<Acc> part(n_lc > 1 ? n_lc * K * V : 0);
  // Task t: chunk t / (K * nvb) of the reduced axis, block of V, kept index.
  auto task = [&](int64_t t) {
    const int64_t lc = t / (K * nvb), kv = t % (K * nvb), k = kv / nvb, vb = kv % nvb;
    const int64_t v0 = vb * kVBlock, nv = std::min(kVBlock, V - v0);
    const int64_t l0 = lc * lc_len, nl = std::max<int64_t>(0, std::min(lc_len, L - l0));
    const float* base = xp + lo.x_off(k) + v0 * lo.sv + l0 * lo.sr;
    Acc acc[kVBlock];
    ops.init(acc, base, nv, lo.sv);
    const int64_t f = std::min(ops.first(), nl);
    ops.rows(acc, base + f * lo.sr, nv, nl - f, lo.sr, lo.sv);
    if (n_lc == 1) {
      for (int64_t v = 0; v < nv; ++v) out[k * V + v0 + v] = static_cast<float>(acc[v]);
    } else {
      std::copy(acc, acc + nv, part.begin() + (lc * K + k) * V + v0);
    }
  };
  if (n_lc == 1) {
    c.pool.parallel_for(K * nvb, std::max<int64_t>(1, kGrainElems / block_work),
                        [&](int64_t b, int64_t e, int) {
                          for (int64_t t = b; t < e; ++t) task(t);
                        });
    return;
  }
  c.pool.run(n_lc * K * nvb, [&](int64_t t, int) { task(t); });
  const int64_t KV = K * V;
  c.pool.parallel_for(KV, kGrainElems, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      Acc a = part[i];
      for (int64_t lc = 1; lc < n_lc; ++lc) a = ops.combine(a, part[lc * KV + i]);
      out[i] = static_cast<float>(a);
    }
  });
}

struct SumOps {
  double line(const float* x, int64_t n, int64_t s) const { return sum_line(x, n, s); }
  void init(double* acc, const float*, int64_t nv, int64_t) const { std::fill(acc, acc + nv, 0.0); }
  int64_t first() const { return 0; }
  void rows(double* acc, const float* x, int64_t nv, int64_t nl, int64_t sr, int64_t sv) const {
    sum_rows(acc, x, nv, nl, sr, sv);
  }
  double combine(double a, double b) const { return a + b; }
};

struct MaxOps {
  float line(const float* x, int64_t n, int64_t s) const { return max_line(x, n, s); }
  void init(float* acc, const float* row, int64_t nv, int64_t sv) const {
    for (int64_t v = 0; v < nv; ++v) acc[v] = row[v * sv];
  }
  int64_t first() const { return 1; }
  void rows(float* acc, const float* x, int64_t nv, int64_t nl, int64_t sr, int64_t sv) const {
    max_rows(acc, x, nv, nl, sr, sv);
  }
  float combine(float a, float b) const { return max_nan(a, b); }
};

// ---- max_grad -------------------------------------------------------------------------

// dx (x.shape, dense): grad at the first index along the axis where x equals the max (or is
// NaN when the max is NaN), zero elsewhere. All three sources are dense.
void max_grad_forward(KernelCtx& c) {
  const TensorView& x = c.src[1];
  const ReduceLayout lo = make_layout(x, static_cast<int>(c.node.ip[RECURRA_P_AXIS]));
  const int64_t K = lo.K(), L = lo.L, V = lo.V;
  float* dx = c.dst.f32();
  const float* gp = c.src[0].f32();
  const float* xp = x.f32();
  const float* mp = c.src[2].f32();
  const int64_t total = c.dst.numel();
  c.pool.parallel_for(total, kGrainElems, [&](int64_t b, int64_t e, int) {
    std::memset(dx + b, 0, (e - b) * sizeof(float));
  });
  if (K * V == 0) return;
  const int64_t nvb = (V + kVBlock - 1) / kVBlock;
  c.pool.parallel_for(K * nvb, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, L * std::min(V, kVBlock))),
                      [&](int64_t b, int64_t e, int) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t k = t / nvb, v0 = (t % nvb) * kVBlock, nv = std::min(kVBlock, V - v0);
      const float* xb = xp + lo.x_off(k) + v0 * lo.sv;
      float* db = dx + lo.dense_off(k) + v0 * lo.dv;
      const float* m = mp + k * V + v0;
      const float* g = gp + k * V + v0;
      bool found[kVBlock] = {false};
      int64_t left = nv;
      for (int64_t l = 0; l < L && left > 0; ++l) {
        for (int64_t v = 0; v < nv; ++v) {
          const float xv = xb[l * lo.sr + v * lo.sv];
          if (!found[v] && (xv == m[v] || (m[v] != m[v] && xv != xv))) {
            found[v] = true;
            --left;
            db[l * lo.dr + v * lo.dv] = g[v];
          }
        }
      }
    }
  });
}

// ---- infer ----------------------------------------------------------------------------

void reduce_infer(Graph& g, Node& n, bool allow_empty) {
  if (n.src.size() != 1) fail_shape(g, n, "takes one input");
  require_f32(g, n, 0);
  const Shape& s = g.node(n.src.at(0)).shape;
  if (n.ip.size() != 1) fail_shape(g, n, "takes one axis");
  if (n.ip.at(RECURRA_P_AXIS) < 0 || n.ip.at(RECURRA_P_AXIS) >= s.ndim)
    fail_shape(g, n, "axis " + std::to_string(n.ip.at(RECURRA_P_AXIS)) + " is out of range for a tensor of " +
                         std::to_string(s.ndim) + " axes");
  if (!allow_empty && s.d[n.ip.at(RECURRA_P_AXIS)] == 0) fail_shape(g, n, "cannot reduce an axis of length 0");
  n.dtype = DType::f32;
  n.shape = s;
  n.shape.d[n.ip.at(RECURRA_P_AXIS)] = 1;
}

}  // namespace

void register_reduce_ops(OpTable& t) {
  {
    OpDef d;
    d.name = "sum";
    d.infer = [](Graph& g, Node& n) { reduce_infer(g, n, true); };
    d.forward = [](KernelCtx& c) { reduce_forward<double>(c, SumOps{}); };
    d.backward = [](GradSink& k) {
      k.add(0, k.g.contiguous(k.g.broadcast_to(k.grad_out, k.g.node(k.node.src[0]).shape)));
    };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "max";
    d.infer = [](Graph& g, Node& n) { reduce_infer(g, n, false); };
    d.forward = [](KernelCtx& c) { reduce_forward<float>(c, MaxOps{}); };
    d.backward = [](GradSink& k) {
      k.add(0, k.g.op("max_grad", {k.grad_out, k.node.src[0], k.node.id}, k.node.ip));
    };
    t.add(std::move(d));
  }
  {
    // max_grad(grad, x, out; axis) -> x.shape.
    OpDef d;
    d.name = "max_grad";
    d.contiguous_srcs = 0b111;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 3 || n.ip.size() != 1) fail_shape(g, n, "takes (grad, x, out) and an axis");
      for (int i = 0; i < 3; ++i) require_f32(g, n, i);
      const Shape& xs = g.node(n.src.at(1)).shape;
      if (n.ip.at(RECURRA_P_AXIS) < 0 || n.ip.at(RECURRA_P_AXIS) >= xs.ndim) fail_shape(g, n, "axis out of range");
      Shape r = xs;
      r.d[n.ip.at(RECURRA_P_AXIS)] = 1;
      if (g.node(n.src.at(0)).shape != r || g.node(n.src.at(2)).shape != r)
        fail_shape(g, n, "grad and out must have x's shape with the axis reduced to 1");
      n.dtype = DType::f32;
      n.shape = xs;
    };
    d.forward = max_grad_forward;
    t.add(std::move(d));
  }
}

}  // namespace recurra

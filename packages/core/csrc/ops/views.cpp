// View ops (reshape, permute, slice, broadcast_to) run no code: they give a node new
// strides into its base's memory. Also here: contiguous (the copy that turns a view into
// dense memory), fill, sum_to (broadcasting in reverse) and slice_grad.
#include <algorithm>
#include <cstring>
#include <vector>

#include "../graph.h"
#include "../half.h"
#include "kernel_util.h"

namespace recurra {

namespace {

void make_view_of(const Graph& g, Node& n, int src) {
  const Node& s = g.node(src);
  n.dtype = s.dtype;
  n.view_base = s.is_view() ? s.view_base : s.id;
  n.view_offset = s.is_view() ? s.view_offset : 0;
}

// dst (R x C, dense) = the matrix src(r, c) = s[r + c * sc] of each batch entry: a
// transposed view, copied in tiles of kT x kT. Within a tile the writes run down a column
// (reads contiguous), unless C is a multiple of 256 floats: then the rows of a column fall
// into a few cache sets and evict each other, and the writes run along the rows instead.
void copy_transposed(float* dst, const float* s, int64_t nb, const Shape& bshape, const int64_t* bstr,
                     int64_t R, int64_t C, int64_t sc, ThreadPool& tp) {
  constexpr int64_t kT = 32;
  const int64_t rt = (R + kT - 1) / kT, ct = (C + kT - 1) / kT;
  tp.parallel_for(nb * rt * ct, std::max<int64_t>(1, kGrainElems / (kT * kT)), [&](int64_t b, int64_t e, int) {
    for (int64_t task = b; task < e; ++task) {
      const int64_t bi = task / (rt * ct), r0 = (task / ct) % rt * kT, c0 = task % ct * kT;
      int64_t off = 0;
      for (int64_t i = bshape.ndim - 1, q = bi; i >= 0; --i) {
        off += (q % bshape.d[i]) * bstr[i];
        q /= bshape.d[i];
      }
      const float* sp = s + off;
      float* dp = dst + bi * R * C;
      const int64_t r1 = std::min(R, r0 + kT), c1 = std::min(C, c0 + kT);
      if (C % 256 == 0) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) dp[r * C + c] = sp[r + c * sc];
      } else {
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t r = r0; r < r1; ++r) dp[r * C + c] = sp[r + c * sc];
      }
    }
  });
}

// dst (contiguous) = src (any strides); dims of equal shape.
void copy_strided(const TensorView& dst, const TensorView& src, ThreadPool& tp) {
  const int64_t len = row_len(dst.shape), rows = n_rows(dst.shape);
  const int64_t ss = last_stride(src.strides, src.shape);
  const int nd = src.shape.ndim;
  if (nd >= 2 && ss != 1 && src.strides[nd - 2] == 1 && src.dtype == DType::f32 && len > 1) {
    // The last two axes transposed (a permuted matrix, e.g. a weight gradient).
    Shape bshape;
    bshape.ndim = nd - 2;
    for (int i = 0; i < nd - 2; ++i) bshape.d[i] = src.shape.d[i];
    copy_transposed(dst.f32(), src.f32(), bshape.numel(), bshape, src.strides, src.shape.d[nd - 2], len, ss, tp);
    return;
  }
  auto* d = static_cast<uint32_t*>(dst.data);
  const auto* s = static_cast<const uint32_t*>(src.data);
  tp.parallel_for(rows, row_grain(len), [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      const uint32_t* sp = s + row_offset(src.shape, src.strides, r);
      uint32_t* dp = d + r * len;
      if (ss == 1)
        std::memcpy(dp, sp, len * 4);
      else
        for (int64_t i = 0; i < len; ++i) dp[i] = sp[i * ss];
    }
  });
}

// slice_grad, any slice: zeros with the gradient written into the slice, each output row
// written once (zeros outside the slice, the gradient inside), rows in parallel.
void slice_grad_rows(KernelCtx& c) {
  const Shape& os = c.dst.shape;
  const int nd = os.ndim;
  const TensorView& s = c.src[0];
  if (nd == 0) {
    c.dst.f32()[0] = s.f32()[0];
    return;
  }
  const int64_t* ip = c.node.ip.data() + nd;  // (start, stop, step) per axis
  const int64_t len = row_len(os), rows = n_rows(os);
  const int64_t b = ip[3 * (nd - 1)], st = ip[3 * (nd - 1) + 2], n = row_len(s.shape);
  const int64_t ss = last_stride(s.strides, s.shape);
  float* out = c.dst.f32();
  c.pool.parallel_for(rows, row_grain(len), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      float* dp = out + r * len;
      // Whether output row r lies in the slice on the outer axes, and its source row.
      int64_t q = r, src_off = 0;
      bool inside = true;
      for (int i = nd - 2; i >= 0 && inside; --i) {
        const int64_t idx = q % os.d[i];
        q /= os.d[i];
        const int64_t bi = ip[3 * i], ei = ip[3 * i + 1], sti = ip[3 * i + 2];
        inside = idx >= bi && idx < ei && (idx - bi) % sti == 0;
        src_off += (idx - bi) / sti * s.strides[i];
      }
      if (!inside || n == 0) {
        std::fill(dp, dp + len, 0.0f);
        continue;
      }
      const float* sp = s.f32() + src_off;
      if (st == 1 && ss == 1) {
        std::fill(dp, dp + b, 0.0f);
        std::memcpy(dp + b, sp, n * sizeof(float));
        std::fill(dp + b + n, dp + len, 0.0f);
      } else {
        std::fill(dp, dp + len, 0.0f);
        for (int64_t i = 0; i < n; ++i) dp[b + i * st] = sp[i * ss];
      }
    }
  });
}

// The gradient of a transposed matrix (x @ W.T: W.T's gradient is the product A @ B) is
// wanted dense in W's layout: (A @ B)^T = B^T @ A^T computed as such, instead of the product
// and a transposed copy of it (the product itself is then unread and not run, see
// Graph::plan). Returns the new node, or -1 when `grad` is not a plain 2-D matmul or the
// permutation not a transpose.
int transposed_product(Graph& g, int grad, const std::vector<int64_t>& inv) {
  const Node& m = g.node(grad);
  if (inv.size() != 2 || inv[0] != 1 || m.is_leaf() || m.is_view() || m.shape.ndim != 2 ||
      OpTable::get().at(m.op).name != "matmul")
    return -1;
  const int a = m.src[0], b = m.src[1];
  if (g.node(a).shape.ndim != 2 || g.node(b).shape.ndim != 2) return -1;
  const int bt = g.permute(b, {1, 0});
  const int at = g.permute(a, {1, 0});
  return g.op("matmul", {bt, at});
}

// d = a + b
RC_SIMD void sum_into_row(float* __restrict d, const float* __restrict a, const float* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = a[i] + b[i];
}

}  // namespace

// dst (1-D) = zeros outside [b, e), which is left as it is (written by the producer of the
// slice's gradient: see Redirect in schedule.h).
void zeros_around(const TensorView& dst, int64_t b, int64_t e, ThreadPool& tp) {
  float* d = dst.f32();
  const int64_t total = dst.numel();
  tp.parallel_for(total, kGrainElems * 8, [&](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < std::min(hi, b); ++i) d[i] = 0.0f;
    for (int64_t i = std::max(lo, e); i < hi; ++i) d[i] = 0.0f;
  });
}

// dst (..., C) = zeros with parts[i] (..., e_i - b_i) written at columns [b_i, e_i) of every
// row; the parts are sorted by begin and disjoint. Where plus[i] has data (a dense tensor of
// parts[i]'s shape, parts[i] then dense too), parts[i] + plus[i] is written instead; where
// parts[i] has none, its columns are left as they are (its producer wrote them). Each
// output row is written once.
void scatter_last_axis(const TensorView& dst, const std::vector<TensorView>& parts,
                       const std::vector<TensorView>& plus, const std::vector<int64_t>& begin,
                       ThreadPool& tp) {
  const int64_t len = row_len(dst.shape), rows = n_rows(dst.shape);
  float* out = dst.f32();
  tp.parallel_for(rows, row_grain(len), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      float* dp = out + r * len;
      int64_t at = 0;
      for (size_t i = 0; i < parts.size(); ++i) {
        const TensorView& p = parts[i];
        const int64_t n = row_len(p.shape), ps = last_stride(p.strides, p.shape);
        std::fill(dp + at, dp + begin[i], 0.0f);
        at = begin[i] + n;
        if (!p.data) continue;
        const float* sp = p.f32() + row_offset(p.shape, p.strides, r);
        if (plus[i].data)
          sum_into_row(dp + begin[i], sp, plus[i].f32() + r * n, n);
        else if (ps == 1)
          std::memcpy(dp + begin[i], sp, n * sizeof(float));
        else
          for (int64_t k = 0; k < n; ++k) dp[begin[i] + k] = sp[k * ps];
      }
      std::fill(dp + at, dp + len, 0.0f);
    }
  });
}

// sum_to: every output element is the sum of its preimage in double, always in the same
// order (never dependent on the thread count). The rows of `a` (its last axis) are the unit
// of work, so the index arithmetic is per row, not per element:
// * last axis kept (a bias gradient: (B, T, D) -> (D,)): a task owns an output row and a
//   block of up to 256 columns and adds the preimage rows into it, vectorized along the row;
// * last axis summed (-> () or (H, 1)): the preimage rows of an output element are cut into
//   chunks of ~kGrainElems elements, each summed by one task (8 interleaved partial sums,
//   so the loop vectorizes), and the chunk sums are added in order.
static void sum_to_forward(KernelCtx& c) {
  const TensorView& a = c.src[0];
  const int nd = a.shape.ndim;
  float* out = c.dst.f32();
  const float* src = a.f32();
  const int64_t n_out = c.dst.numel();
  if (nd == 0 || a.numel() == 0) {
    for (int64_t i = 0; i < n_out; ++i) out[i] = nd == 0 ? src[0] : 0.0f;
    return;
  }
  bool red[kMaxDims] = {false, false, false, false};
  int64_t tst[kMaxDims] = {0, 0, 0, 0};  // target strides aligned to a's axes
  for (int i = 0; i < nd; ++i) {
    const int it = c.dst.shape.ndim - nd + i;
    red[i] = it < 0 || (c.dst.shape.d[it] == 1 && a.shape.d[i] != 1);
    tst[i] = (it < 0 || red[i]) ? 0 : c.dst.strides[it];
  }
  // Outer axes (all but the last), kept and summed.
  Shape ko, so;
  int64_t ko_a[kMaxDims], ko_t[kMaxDims], so_a[kMaxDims];
  for (int i = 0; i < nd - 1; ++i) {
    if (red[i]) {
      so_a[so.ndim] = a.strides[i];
      so.d[so.ndim++] = a.shape.d[i];
    } else {
      ko_a[ko.ndim] = a.strides[i];
      ko_t[ko.ndim] = tst[i];
      ko.d[ko.ndim++] = a.shape.d[i];
    }
  }
  const int64_t L = a.shape.d[nd - 1], sl = a.strides[nd - 1];
  const int64_t n_ko = ko.numel(), n_so = so.numel();
  auto kept_off = [&](int64_t q, int64_t* oa, int64_t* ot) {
    int64_t x = 0, y = 0;
    for (int i = ko.ndim - 1; i >= 0; --i) {
      const int64_t idx = q % ko.d[i];
      q /= ko.d[i];
      x += idx * ko_a[i];
      y += idx * ko_t[i];
    }
    *oa = x;
    *ot = y;
  };
  auto summed_off = [&](int64_t r) {
    int64_t x = 0;
    for (int i = so.ndim - 1; i >= 0; --i) {
      x += (r % so.d[i]) * so_a[i];
      r /= so.d[i];
    }
    return x;
  };
  if (!red[nd - 1]) {
    constexpr int64_t kCB = 256;
    const int64_t tl = tst[nd - 1], ncb = (L + kCB - 1) / kCB;
    c.pool.parallel_for(n_ko * ncb, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, n_so * kCB)),
                        [&](int64_t b, int64_t e, int) {
      double acc[kCB];
      for (int64_t task = b; task < e; ++task) {
        const int64_t q = task / ncb, j0 = task % ncb * kCB, nj = std::min(kCB, L - j0);
        int64_t oa, ot;
        kept_off(q, &oa, &ot);
        std::fill(acc, acc + nj, 0.0);
        for (int64_t r = 0; r < n_so; ++r) {
          const float* p = src + oa + summed_off(r) + j0 * sl;
          if (sl == 1)
            for (int64_t j = 0; j < nj; ++j) acc[j] += p[j];
          else
            for (int64_t j = 0; j < nj; ++j) acc[j] += p[j * sl];
        }
        float* o = out + ot + j0 * tl;
        for (int64_t j = 0; j < nj; ++j) o[j * tl] = static_cast<float>(acc[j]);
      }
    });
    return;
  }
  const int64_t rows_per_chunk = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, L));
  const int64_t nch = (n_so + rows_per_chunk - 1) / rows_per_chunk;
  std::vector<double> part(static_cast<size_t>(n_ko * nch));
  c.pool.parallel_for(n_ko * nch, 1, [&](int64_t b, int64_t e, int) {
    for (int64_t task = b; task < e; ++task) {
      const int64_t q = task / nch, r0 = task % nch * rows_per_chunk, r1 = std::min(n_so, r0 + rows_per_chunk);
      int64_t oa, ot;
      kept_off(q, &oa, &ot);
      double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t r = r0; r < r1; ++r) {
        const float* p = src + oa + summed_off(r);
        int64_t j = 0;
        if (sl == 1)
          for (; j + 8 <= L; j += 8)
            for (int k = 0; k < 8; ++k) lane[k] += p[j + k];
        for (; j < L; ++j) lane[j % 8] += p[j * sl];
      }
      part[task] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
  });
  for (int64_t q = 0; q < n_ko; ++q) {
    int64_t oa, ot;
    kept_off(q, &oa, &ot);
    double acc = 0.0;
    for (int64_t ch = 0; ch < nch; ++ch) acc += part[q * nch + ch];
    out[ot] = static_cast<float>(acc);
  }
}

void register_view_ops(OpTable& t) {
  {
    OpDef d;
    d.name = "reshape";
    d.is_view = true;
    d.contiguous_srcs = 1;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 1) fail_shape(g, n, "takes one input");
      Shape s = Shape::from(n.ip);
      if (s.numel() != g.node(n.src.at(0)).numel())
        fail_shape(g, n, "cannot reshape to " + s.str() + ": element counts differ");
      make_view_of(g, n, n.src.at(0));
      n.shape = s;
      contiguous_strides(s, n.strides);
    };
    d.backward = [](GradSink& k) { k.add(0, k.g.reshape(k.grad_out, k.g.node(k.node.src[0]).shape)); };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "permute";
    d.is_view = true;
    d.infer = [](Graph& g, Node& n) {
      const Node& s = g.node(n.src.at(0));
      if (static_cast<int>(n.ip.size()) != s.shape.ndim)
        fail_shape(g, n, "the permutation must name every axis once");
      bool seen[kMaxDims] = {false, false, false, false};
      make_view_of(g, n, n.src.at(0));
      n.shape.ndim = s.shape.ndim;
      for (int i = 0; i < s.shape.ndim; ++i) {
        int a = norm_axis("permute", n.ip.at(i), s.shape.ndim);
        if (seen[a]) fail_shape(g, n, "the permutation repeats an axis");
        seen[a] = true;
        n.ip.at(i) = a;
        n.shape.d[i] = s.shape.d[a];
        n.strides[i] = s.strides[a];
      }
    };
    d.backward = [](GradSink& k) {
      std::vector<int64_t> inv(k.node.ip.size());
      for (size_t i = 0; i < inv.size(); ++i) inv[k.node.ip[i]] = static_cast<int64_t>(i);
      if (const int t = transposed_product(k.g, k.grad_out, inv); t >= 0) {
        k.add(0, t);
        return;
      }
      k.add(0, k.g.contiguous(k.g.permute(k.grad_out, inv)));
    };
    t.add(std::move(d));
  }
  {
    // ip: (start, stop, step) per axis, already clipped to the axis (Python does that).
    OpDef d;
    d.name = "slice";
    d.is_view = true;
    d.infer = [](Graph& g, Node& n) {
      const Node& s = g.node(n.src.at(0));
      if (static_cast<int>(n.ip.size()) != 3 * s.shape.ndim) fail_shape(g, n, "needs (start, stop, step) per axis");
      make_view_of(g, n, n.src.at(0));
      n.shape.ndim = s.shape.ndim;
      for (int i = 0; i < s.shape.ndim; ++i) {
        int64_t b = n.ip.at(3 * i), e = n.ip.at(3 * i + 1), st = n.ip.at(3 * i + 2);
        if (st <= 0) fail_shape(g, n, "slice steps must be positive");
        if (b < 0 || e > s.shape.d[i] || b > e) {
          if (!(b == e && b >= 0 && b <= s.shape.d[i]))
            fail_shape(g, n, "slice bounds out of range on axis " + std::to_string(i));
        }
        n.shape.d[i] = (e - b + st - 1) / st;
        n.strides[i] = s.strides[i] * st;
        n.view_offset += b * s.strides[i];
      }
    };
    d.backward = [](GradSink& k) {
      std::vector<int64_t> ip = k.g.node(k.node.src[0]).shape.vec();
      ip.insert(ip.end(), k.node.ip.begin(), k.node.ip.end());
      k.add(0, k.g.op("slice_grad", {k.grad_out}, ip));
    };
    t.add(std::move(d));
  }
  {
    // ip: the full source shape, then (start, stop, step) per axis. Output: zeros of the
    // source shape with the gradient written into the slice.
    OpDef d;
    d.name = "slice_grad";
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 1 || n.ip.size() % 4 != 0) fail_shape(g, n, "takes one input, a shape and a slice");
      require_f32(g, n, 0);
      int nd = static_cast<int>(n.ip.size()) / 4;
      n.dtype = DType::f32;
      n.shape = Shape::from(std::vector<int64_t>(n.ip.begin(), n.ip.begin() + nd));
      const Shape& gs = g.node(n.src[0]).shape;
      if (gs.ndim != nd) fail_shape(g, n, "the gradient and the shape differ in axes");
      for (int i = 0; i < nd; ++i) {  // the slice must fit the shape and match the gradient
        int64_t b = n.ip[nd + 3 * i], e = n.ip[nd + 3 * i + 1], st = n.ip[nd + 3 * i + 2];
        if (st <= 0 || b < 0 || e > n.shape.d[i] || b > e || (e - b + st - 1) / st != gs.d[i])
          fail_shape(g, n, "the slice does not match the gradient on axis " + std::to_string(i));
      }
    };
    d.forward = [](KernelCtx& c) {
      const int64_t total = c.dst.numel();
      float* dst = c.dst.f32();
      if (c.dst.shape.ndim == 1 && c.node.ip[3] == 1 && c.src[0].is_contiguous()) {
        // A piece of a packed 1-D result (the usual case): zeros around it, the gradient in
        // it, each element written once, in parallel.
        const int64_t b = c.node.ip[1], e = b + c.src[0].numel();
        const float* src = c.src[0].f32();
        c.pool.parallel_for(total, kGrainElems * 8, [&](int64_t lo, int64_t hi, int) {
          for (int64_t i = lo; i < std::min(hi, b); ++i) dst[i] = 0.0f;
          const int64_t cb = std::max(lo, b), ce = std::min(hi, e);
          if (ce > cb) std::memcpy(dst + cb, src + (cb - b), (ce - cb) * sizeof(float));
          for (int64_t i = std::max(lo, e); i < hi; ++i) dst[i] = 0.0f;
        });
        return;
      }
      slice_grad_rows(c);
    };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "broadcast_to";
    d.is_view = true;
    d.infer = [](Graph& g, Node& n) {
      const Node& s = g.node(n.src.at(0));
      Shape target = Shape::from(n.ip);
      Shape b = broadcast_shapes("broadcast_to", s.shape, target);
      if (b != target) fail_shape(g, n, "cannot broadcast to " + target.str());
      make_view_of(g, n, n.src.at(0));
      n.shape = target;
      TensorView sv;
      sv.shape = s.shape;
      std::copy(s.strides, s.strides + kMaxDims, sv.strides);
      broadcast_strides(sv, target, n.strides);
    };
    d.backward = [](GradSink& k) { k.add(0, k.g.reduce_to(k.grad_out, k.g.node(k.node.src[0]).shape)); };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "contiguous";
    d.infer = [](Graph& g, Node& n) {
      const Node& s = g.node(n.src.at(0));
      n.dtype = s.dtype;
      n.shape = s.shape;
    };
    d.forward = [](KernelCtx& c) { copy_strided(c.dst, c.src[0], c.pool); };
    d.backward = [](GradSink& k) { k.add(0, k.grad_out); };
    t.add(std::move(d));
  }
  {
    // assign(dst, src): writes src's values into dst in place (dst: a dense leaf, e.g. a
    // recurrent state carried from one run of a graph to the next). The node's own value is
    // a dummy (1,). Runs after every earlier reader of dst (nodes run in order).
    OpDef d;
    d.name = "assign";
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 2 || !n.ip.empty() || !n.fp.empty())
        fail_shape(g, n, "takes (dst, src) and no parameters");
      const Node& dst = g.node(n.src[0]);
      const Node& src = g.node(n.src[1]);
      if (!dst.is_leaf()) fail_shape(g, n, "writes into a leaf only (dst is a computed tensor)");
      if (dst.dtype != src.dtype || dst.shape != src.shape)
        fail_shape(g, n, "dst and src differ in shape or dtype");
      n.dtype = DType::f32;
      n.shape = Shape{1};
    };
    d.forward = [](KernelCtx& c) { copy_strided(c.src[0], c.src[1], c.pool); };
    d.writes_src = [](const Node&, size_t i) { return i == 0; };
    t.add(std::move(d));
  }
  {
    // fp: (value, dtype code)
    OpDef d;
    d.name = "fill";
    d.infer = [](Graph& g, Node& n) {
      if (!n.src.empty() || n.fp.size() != 2) fail_shape(g, n, "takes no inputs and (value, dtype)");
      const double code = n.fp[RECURRA_P_DTYPE];
      if (code != 0.0 && code != 1.0 && code != 2.0 && code != 3.0)
        fail_shape(g, n, "dtype code must be 0 (float32), 1 (int32), 2 (bfloat16) or 3 (float16)");
      n.shape = Shape::from(n.ip);
      n.dtype = static_cast<DType>(static_cast<int>(n.fp.at(1)));
    };
    d.forward = [](KernelCtx& c) {
      int64_t n = c.dst.numel();
      if (c.dst.dtype == DType::f32) {
        float v = static_cast<float>(c.node.fp[RECURRA_P_VALUE]);
        std::fill(c.dst.f32(), c.dst.f32() + n, v);
      } else {
        std::fill(c.dst.i32(), c.dst.i32() + n, static_cast<int32_t>(c.node.fp[RECURRA_P_VALUE]));
      }
    };
    t.add(std::move(d));
  }
  {
    // Sum `a` down to the shape in ip (numpy broadcasting in reverse).
    OpDef d;
    d.name = "sum_to";
    d.infer = [](Graph& g, Node& n) {
      require_f32(g, n, 0);
      const Node& s = g.node(n.src.at(0));
      Shape target = Shape::from(n.ip);
      if (broadcast_shapes("sum_to", target, s.shape) != s.shape)
        fail_shape(g, n, "cannot sum down to " + target.str());
      n.dtype = DType::f32;
      n.shape = target;
    };
    d.forward = sum_to_forward;
    d.backward = [](GradSink& k) {
      k.add(0, k.g.contiguous(k.g.broadcast_to(k.grad_out, k.g.node(k.node.src[0]).shape)));
    };
    t.add(std::move(d));
  }
  {
    // cast(x) to the float dtype ip[0]: f32 <-> bf16/f16 (through f32 between the two).
    OpDef d;
    d.name = "cast";
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 1 || n.ip.size() != 1) fail_shape(g, n, "takes one input and a dtype code");
      const Node& s = g.node(n.src[0]);
      const int64_t code = n.ip[RECURRA_P_TO_DTYPE];
      if (code < 0 || code >= kNumDTypes || !is_float(static_cast<DType>(code)))
        throw TypeError("cast: the target dtype code must be 0 (float32), 2 (bfloat16) or 3 (float16), got " +
                        std::to_string(code));
      if (!is_float(s.dtype)) throw TypeError(std::string("cast: converts float tensors, got ") + dtype_name(s.dtype));
      n.dtype = static_cast<DType>(code);
      n.shape = s.shape;
    };
    d.contiguous_srcs = 1u;
    d.forward = [](KernelCtx& c) {
      const DType from = c.src[0].dtype, to = c.dst.dtype;
      const int64_t total = c.dst.numel();
      const void* sp = c.src[0].data;
      void* dp = c.dst.data;
      c.pool.parallel_for(total, kGrainElems * 4, [&](int64_t b, int64_t e, int) {
        float buf[256];
        for (int64_t i = b; i < e; i += 256) {
          const int64_t m = std::min<int64_t>(256, e - i);
          const float* f = buf;
          if (from == DType::f32)
            f = static_cast<const float*>(sp) + i;
          else
            half_to_f32(from, static_cast<const uint16_t*>(sp) + i, buf, m);
          if (to == DType::f32)
            std::memcpy(static_cast<float*>(dp) + i, f, m * sizeof(float));
          else
            f32_to_half(to, f, static_cast<uint16_t*>(dp) + i, m);
        }
      });
    };
    d.backward = [](GradSink& k) {
      const DType from = k.g.node(k.node.src[0]).dtype;
      k.add(0, k.g.op("cast", {k.grad_out}, {static_cast<int64_t>(from)}));
    };
    t.add(std::move(d));
  }
}

}  // namespace recurra

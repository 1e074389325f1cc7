// gated_rms_norm: Mamba-2's output norm, and an RMS norm with its weight, in one pass over
// memory (here and on Vulkan, gated_norm.comp; on a backend without a kernel the scheduler
// builds it from elementwise ops and rms_norm, csrc/decompose.cpp):
//
//   u   = y + x * D[c / P]            (the D skip; without x and D: u = y)
//   h   = u * silu(z)                 (without z: h = u)
//   out = h / sqrt(mean_group(h^2) + eps) * w      (RMS over groups of `gs` channels)
//
// Sources: (y, w), (y, z, w) or (y, z, w, x, D). Shapes (numpy order): y, z, x (..., C) (x
// and z may be views whose last axis has stride 1, like slices of a projection), w (C,),
// D (H,) with P = C / H; out (..., C). ip: [gs] (gs divides C); fp: [eps].
// gated_rms_norm_back (g, sources...) -> packed 1-D: dy (..., C), dz (..., C) when z is
// given, dw (C,), then dx (..., C) and dD (H,) when x and D are given.
//
// The weight and D gradients are sums over rows: each block of kRowsPerPart rows (fixed by
// the shapes, not the thread count) keeps per-channel partial sums, added in block order,
// so results are the same for any number of threads.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../graph.h"
#include "kernel_util.h"
#include "lane_math.h"

namespace recurra {

namespace {

constexpr int64_t kRowsPerPart = 16;

// h = (y + x * d) * silu(z) (x == nullptr: no skip; z == nullptr: no gate); sg = sigmoid(z)
// too when sg != nullptr (the backward keeps it). Each case is its own loop: a select
// between sigmoid and 1 inside one loop would not vectorize.
RC_SIMD void gate_row(float* __restrict h, const float* __restrict y, const float* __restrict x,
                      const float* __restrict d, const float* __restrict z, float* __restrict sg, int64_t n) {
  if (x)
    for (int64_t i = 0; i < n; ++i) h[i] = y[i] + x[i] * d[i];
  else
    for (int64_t i = 0; i < n; ++i) h[i] = y[i];
  if (z && sg)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = sigmoid_lane(z[i]);
      h[i] *= z[i] * sg[i];
    }
  else if (z)
    for (int64_t i = 0; i < n; ++i) h[i] *= z[i] * sigmoid_lane(z[i]);
}

// acc[j] += a[i] * b[i] * c[i] over the whole chunks of 16 (i = 16 q + j); returns the plain
// sum of the rest (n % 16 elements). Over a group cut into blocks whose sizes are
// multiples of 16 but the last, the same sums in the same order as over the whole group.
RC_SIMD float dot3_acc(float* __restrict acc, const float* __restrict a, const float* __restrict b,
                       const float* __restrict c, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j] * c[i + j];
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i] * c[i];
  return s;
}

// The sum of a group from dot3_acc's partial sums and rest (16 interleaved partial sums:
// vectorizes without reassociation).
inline float dot3_total(const float* acc, float rest) {
  for (int j = 0; j < 16; ++j) rest += acc[j];
  return rest;
}

// Channels per block of a group's passes (a multiple of 16, see dot3_acc): a row's pieces
// of y, z, x, the gradients and the partial sums of one block stay in L1, where whole
// groups of Mamba-2's width (1536 or more channels, 6 KB per row of each of ~11 arrays) did
// not (Mamba2-130m 4 x 256: backward 2.34 -> 2.14 ms, forward 1.06 -> 0.89 ms; 128 the same,
// 512 no gain).
constexpr int64_t kNormChannels = 256;

// h *= r * w
RC_SIMD void scale_weight_row(float* __restrict h, const float* __restrict w, float r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = h[i] * r * w[i];
}

// With n = h * r and dh = r * (g w - n c1): dy = dh * silu(z), dz = dh * u * silu'(z),
// dx = dy * d, pw += g * n, pd += dy * x. kX: the D skip (x, d, dx, pd); kZ: the gate
// (z, dz, which holds sigmoid(z) on entry; without the gate dy = dh).
template <bool kX, bool kZ>
inline __attribute__((always_inline)) void gate_back(float* __restrict dy, float* __restrict dz,
                                                     float* __restrict dx, float* __restrict pw,
                                                     float* __restrict pd, const float* __restrict g,
                                                     const float* __restrict y, const float* __restrict x,
                                                     const float* __restrict d, const float* __restrict z,
                                                     const float* __restrict w, float r, float c1, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float u = kX ? y[i] + x[i] * d[i] : y[i];
    const float sg = kZ ? dz[i] : 1.0f;
    const float s = kZ ? z[i] * sg : 1.0f;
    const float nv = u * s * r;
    const float dh = r * (g[i] * w[i] - nv * c1);
    const float du = dh * s;
    dy[i] = du;
    if (kZ) dz[i] = dh * u * sg * (1.0f + z[i] * (1.0f - sg));
    pw[i] += g[i] * nv;
    if (kX) {
      dx[i] = du * d[i];
      pd[i] += du * x[i];
    }
  }
}

// gate_back for the sources present (x == nullptr: no skip; z == nullptr: no gate).
RC_SIMD void gate_back_row(float* dy, float* dz, float* dx, float* pw, float* pd, const float* g,
                           const float* y, const float* x, const float* d, const float* z, const float* w,
                           float r, float c1, int64_t n) {
  if (x && z)
    gate_back<true, true>(dy, dz, dx, pw, pd, g, y, x, d, z, w, r, c1, n);
  else if (z)
    gate_back<false, true>(dy, dz, dx, pw, pd, g, y, x, d, z, w, r, c1, n);
  else if (x)
    gate_back<true, false>(dy, dz, dx, pw, pd, g, y, x, d, z, w, r, c1, n);
  else
    gate_back<false, false>(dy, dz, dx, pw, pd, g, y, x, d, z, w, r, c1, n);
}

// Where each source sits among a node's sources (-1: absent), from `first` on.
struct NormLayout {
  int y = -1, z = -1, w = -1, x = -1, d = -1;
};

NormLayout layout_of(size_t n_src, size_t first) {
  const int f = static_cast<int>(first);
  if (n_src - first == 2) return {f, -1, f + 1, -1, -1};
  if (n_src - first == 3) return {f, f + 1, f + 2, -1, -1};
  return {f, f + 1, f + 2, f + 3, f + 4};
}

struct Rows {
  const TensorView* v = nullptr;
  const float* at(int64_t r) const {
    if (!v) return nullptr;
    return v->f32() + row_offset(v->shape, v->strides, r);
  }
};

const TensorView* opt_src(const KernelCtx& c, int i) { return i >= 0 ? &c.src[i] : nullptr; }

// D expanded to one value per channel (c / P).
std::vector<float> per_channel(const KernelCtx& c, int i, int64_t C) {
  std::vector<float> d(C, 0.0f);
  if (i < 0) return d;
  const TensorView& D = c.src[i];
  const int64_t H = D.shape.d[0], P = C / H;
  for (int64_t k = 0; k < C; ++k) d[k] = D.f32()[(k / P) * D.strides[0]];
  return d;
}

void check_row_stride(Graph& g, Node& n, int i) {
  const Node& s = g.node(n.src.at(i));
  if (s.shape.ndim > 0 && s.strides[s.shape.ndim - 1] != 1 && s.shape.d[s.shape.ndim - 1] > 1)
    n.src[i] = g.contiguous(n.src[i]);
}

// Shared checks of (y[, z], w[, x, D]) from source `first` on; sets the forward's dtype and
// shape (y's) and returns C.
int64_t gated_infer(Graph& g, Node& n, size_t first) {
  const size_t ns = n.src.size() - first;
  if (ns != 2 && ns != 3 && ns != 5) fail_shape(g, n, "takes (y, w), (y, z, w) or (y, z, w, x, D)");
  for (size_t i = 0; i < n.src.size(); ++i) require_f32(g, n, static_cast<int>(i));
  // the forward may ask for its output's dtype (RECURRA_P_OUT_DTYPE): rounded once
  const size_t n_ip = n.ip.size();
  if ((n_ip != 1 && (first != 0 || n_ip != 2)) || n.fp.size() != 1)
    fail_shape(g, n, first == 0 ? "takes ip [group_size[, out dtype]] and fp [eps]" : "takes ip [group_size] and fp [eps]");
  DType out = DType::f32;
  if (n_ip == 2) {
    const int64_t code = n.ip[RECURRA_P_OUT_DTYPE];
    if (code < 0 || code >= kNumDTypes || !is_float(static_cast<DType>(code)))
      throw TypeError("gated_rms_norm: the output dtype code must be 0 (float32), 2 (bfloat16) or 3 (float16), got " +
                      std::to_string(code));
    out = static_cast<DType>(code);
  }
  if (!(n.fp[RECURRA_P_EPS] >= 0.0) || !std::isfinite(n.fp[RECURRA_P_EPS])) fail_shape(g, n, "eps must be finite and >= 0");
  const NormLayout l = layout_of(n.src.size(), first);
  const Shape ys = g.node(n.src[l.y]).shape;
  if (ys.ndim < 1) fail_shape(g, n, "y needs at least one axis");
  const int64_t C = ys.d[ys.ndim - 1];
  if (l.z >= 0 && g.node(n.src[l.z]).shape != ys) fail_shape(g, n, "z must have y's shape");
  const Shape ws = g.node(n.src[l.w]).shape;
  if (ws.ndim != 1 || ws.d[0] != C) fail_shape(g, n, "w must be (C,) for y (..., C)");
  if (n.ip[RECURRA_P_GROUP_SIZE] < 1 || C % n.ip[RECURRA_P_GROUP_SIZE] != 0) fail_shape(g, n, "group_size must divide the channels");
  if (l.x >= 0) {
    if (g.node(n.src[l.x]).shape != ys) fail_shape(g, n, "x must have y's shape");
    const Shape ds = g.node(n.src[l.d]).shape;
    if (ds.ndim != 1 || ds.d[0] < 1 || C % ds.d[0] != 0) fail_shape(g, n, "D must be (H,) with H dividing C");
  }
  for (size_t i = first; i < n.src.size(); ++i) check_row_stride(g, n, static_cast<int>(i));
  n.dtype = out;
  n.shape = ys;  // the forward's result
  return C;
}

void gated_forward(KernelCtx& c) {
  const Shape& s = c.dst.shape;
  const int64_t C = row_len(s), R = n_rows(s), gs = c.node.ip[0];
  const float eps = static_cast<float>(c.node.fp[0]);
  const NormLayout l = layout_of(c.src.size(), 0);
  const Rows y{&c.src[l.y]}, z{opt_src(c, l.z)}, x{opt_src(c, l.x)};
  const float* w = c.src[l.w].f32();
  const std::vector<float> d = per_channel(c, l.d, C), ones(gs, 1.0f);
  float* out = c.dst.f32();
  const int64_t cb = kNormChannels;
  c.pool.parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      float* o = out + r * C;
      const float *yr = y.at(r), *zr = z.at(r), *xr = x.at(r);
      for (int64_t k = 0; k < C; k += gs) {
        float acc[16] = {}, rest = 0.0f;
        for (int64_t b0 = k; b0 < k + gs; b0 += cb) {
          const int64_t n = std::min(cb, k + gs - b0);
          gate_row(o + b0, yr + b0, xr ? xr + b0 : nullptr, d.data() + b0, zr ? zr + b0 : nullptr, nullptr, n);
          rest += dot3_acc(acc, o + b0, o + b0, ones.data(), n);
        }
        const float ss = dot3_total(acc, rest);
        const float rr = 1.0f / std::sqrt(ss / static_cast<float>(gs) + eps);
        scale_weight_row(o + k, w + k, rr, gs);
      }
    }
  });
}

void gated_back_forward(KernelCtx& c) {
  const Shape& s = c.src[1].shape;
  const int64_t C = row_len(s), R = n_rows(s), gs = c.node.ip[0];
  const float eps = static_cast<float>(c.node.fp[0]);
  const NormLayout l = layout_of(c.src.size(), 1);
  const bool skip = l.x >= 0;
  const Rows g{&c.src[0]}, y{&c.src[l.y]}, z{opt_src(c, l.z)}, x{opt_src(c, l.x)};
  const float* w = c.src[l.w].f32();
  const std::vector<float> d = per_channel(c, l.d, C), ones(gs, 1.0f);
  const int64_t RC = R * C;
  float* dy = c.dst.f32();
  float* dz = l.z >= 0 ? dy + RC : nullptr;
  float* dw = dy + (l.z >= 0 ? 2 : 1) * RC;
  float* dx = dw + C;
  float* dD = dx + RC;
  const int64_t n_part = (R + kRowsPerPart - 1) / kRowsPerPart;
  std::vector<float> pw(n_part * C, 0.0f), pd(skip ? n_part * C : 0, 0.0f);
  const int64_t cb = kNormChannels;
  c.pool.run(n_part, [&](int64_t part, int) {
    float* pwp = pw.data() + part * C;
    float* pdp = skip ? pd.data() + part * C : nullptr;
    for (int64_t r = part * kRowsPerPart; r < std::min(R, (part + 1) * kRowsPerPart); ++r) {
      const float *gr = g.at(r), *yr = y.at(r), *zr = z.at(r), *xr = x.at(r);
      float* dyr = c.piece_row(0, r, C);  // in dst, or where the piece goes
      float* dzr = dz ? c.piece_row(RC, r, C) : nullptr;  // in dst, or a scatter's window
      for (int64_t k = 0; k < C; k += gs) {
        // h into dy's row first: its sum of squares and <g w, h> give r and c1.
        float acc_h[16] = {}, acc_g[16] = {}, rest_h = 0.0f, rest_g = 0.0f;
        for (int64_t b0 = k; b0 < k + gs; b0 += cb) {
          const int64_t n = std::min(cb, k + gs - b0);
          gate_row(dyr + b0, yr + b0, xr ? xr + b0 : nullptr, d.data() + b0, zr ? zr + b0 : nullptr,
                   dzr ? dzr + b0 : nullptr, n);  // sigmoid(z) into dz's row
          rest_h += dot3_acc(acc_h, dyr + b0, dyr + b0, ones.data(), n);
          rest_g += dot3_acc(acc_g, gr + b0, w + b0, dyr + b0, n);
        }
        const float ss = dot3_total(acc_h, rest_h);
        const float rr = 1.0f / std::sqrt(ss / static_cast<float>(gs) + eps);
        const float c1 = rr * dot3_total(acc_g, rest_g) / static_cast<float>(gs);
        for (int64_t b0 = k; b0 < k + gs; b0 += cb) {
          const int64_t n = std::min(cb, k + gs - b0);
          gate_back_row(dyr + b0, dzr ? dzr + b0 : nullptr, skip ? dx + r * C + b0 : nullptr, pwp + b0,
                        pdp ? pdp + b0 : nullptr, gr + b0, yr + b0, xr ? xr + b0 : nullptr, d.data() + b0,
                        zr ? zr + b0 : nullptr, w + b0, rr, c1, n);
        }
      }
    }
  });
  for (int64_t k = 0; k < C; ++k) {
    double a = 0.0;
    for (int64_t p = 0; p < n_part; ++p) a += pw[p * C + k];
    dw[k] = static_cast<float>(a);
  }
  if (!skip) return;
  const int64_t H = c.src[l.d].shape.d[0], P = C / H;
  for (int64_t h = 0; h < H; ++h) {
    double a = 0.0;
    for (int64_t p = 0; p < n_part; ++p)
      for (int64_t k = h * P; k < (h + 1) * P; ++k) a += pd[p * C + k];
    dD[h] = static_cast<float>(a);
  }
}

}  // namespace

void register_gated_norm_ops(OpTable& t) {
  {
    OpDef d;
    d.name = "gated_rms_norm";
    d.infer = [](Graph& g, Node& n) { gated_infer(g, n, 0); };
    d.forward = gated_forward;
    d.backward = [](GradSink& k) {
      Graph& g = k.g;
      const NormLayout l = layout_of(k.node.src.size(), 0);
      const std::vector<int64_t> gs{k.node.ip[RECURRA_P_GROUP_SIZE]};  // not the output dtype
      const int packed = g.op("gated_rms_norm_back", grad_and_srcs(k), gs, k.node.fp);
      const Shape ys = g.node(k.node.src[l.y]).shape, ws = g.node(k.node.src[l.w]).shape;
      int64_t at = 0;  // the packed layout: dy, [dz], dw, [dx, dD]
      auto next = [&](int i, const Shape& sh) {
        if (i >= 0 && k.needs(i)) k.add(i, g.unpack(packed, at, sh));
        at += i >= 0 ? sh.numel() : 0;
      };
      next(l.y, ys);
      next(l.z, ys);
      next(l.w, ws);
      if (l.x >= 0) {
        const Shape ds = g.node(k.node.src[l.d]).shape;
        next(l.x, ys);
        next(l.d, ds);
      }
    };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "gated_rms_norm_back";
    d.contiguous_srcs = 0b1;  // the gradient
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() < 3) fail_shape(g, n, "takes (grad, y[, z], w[, x, D])");
      const int64_t C = gated_infer(g, n, 1);
      const NormLayout l = layout_of(n.src.size(), 1);
      const Shape ys = g.node(n.src[l.y]).shape;
      if (g.node(n.src[0]).shape != ys) fail_shape(g, n, "grad must have y's shape");
      int64_t total = (l.z >= 0 ? 2 : 1) * ys.numel() + C;
      if (l.x >= 0) total += ys.numel() + g.node(n.src[l.d]).shape.d[0];
      n.shape = Shape{total};
    };
    d.forward = gated_back_forward;
    t.add(std::move(d));
  }
}

}  // namespace recurra

// ssm_conv: Mamba's depthwise causal convolution, forward and backward, on the CPU.
//
// Shapes (numpy order; see docs/ops.md, "ssm_conv"):
//   sx (S, D, W - 1 + T)  the W - 1 positions of left context come first
//   c  (D, W)
//   ssm_conv      -> y (S, T, D),  y[s, t, ch] = sum_k sx[s, ch, t + k] c[ch, k]
//   ssm_conv_back (dy (S, T, D), sx, c) -> packed 1-D: d_sx (S, D, W - 1 + T), then d_c (D, W)
//
//   causal_conv_silu (x (S, T, D), c (D, W)[, bias (D,)]) -> y (S, T, D),
//       y[s, t, ch] = silu(bias[ch] + sum_k x[s, t - W + 1 + k, ch] c[ch, k]), x = 0 before t = 0
//   causal_conv_silu_back (dy, x, c[, bias]) -> packed 1-D: dx (S, T, D), dc (D, W), then
//       d_bias (D,) when there is a bias
// (the convolution of a training step, no initial state, in the tokens-major layout of the
// projection that feeds it: x may be a view whose rows are further apart than D, and no
// transposes or padded copies are needed; also on Vulkan, causal_conv.comp; elsewhere the
// scheduler builds pad + ssm_conv + add + silu, csrc/decompose.cpp).
//
// ssm_conv's output is transposed relative to its input, so the kernels work on tiles of 16
// channels: the input rows are transposed (16 x 16 blocks in registers) into a
// [position][16 channels] tile, and every output row y[s, t, ch0 : ch0 + 16] is then a
// sum of W vector FMAs. The backward transposes d_sx back the same way. d_c is summed by
// the one task that owns its 16 channels, in a fixed order (no thread-count dependence).
#include <cmath>

#include "lane_math.h"
#include "ssm.h"

namespace recurra {

namespace {

using namespace ssm;

constexpr int64_t kTB = 64;  // positions per tile

// dst[j * ds + i] = src[i * ss + j] for i, j < 16: four rounds of pairwise shuffles, each
// halving the block size (16 -> 8 -> 4 -> 2 -> 1); vector j ends up holding column j.
RC_INLINE void transpose16(const float* src, int64_t ss, float* dst, int64_t ds) {
  const vi m1l = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi m1h = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi m2l = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const vi m2h = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const vi m3l = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi m3h = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vi m4l = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi m4h = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  vf v[16], w[16];
  for (int i = 0; i < 16; ++i) v[i] = vload(src + i * ss);
  for (int i = 0; i < 8; ++i) {
    w[i] = __builtin_shuffle(v[i], v[i + 8], m1l);
    w[i + 8] = __builtin_shuffle(v[i], v[i + 8], m1h);
  }
  for (int g = 0; g < 16; g += 8)
    for (int i = 0; i < 4; ++i) {
      v[g + i] = __builtin_shuffle(w[g + i], w[g + i + 4], m2l);
      v[g + i + 4] = __builtin_shuffle(w[g + i], w[g + i + 4], m2h);
    }
  for (int g = 0; g < 16; g += 4)
    for (int i = 0; i < 2; ++i) {
      w[g + i] = __builtin_shuffle(v[g + i], v[g + i + 2], m3l);
      w[g + i + 2] = __builtin_shuffle(v[g + i], v[g + i + 2], m3h);
    }
  for (int g = 0; g < 16; g += 2) {
    vstore(dst + g * ds, __builtin_shuffle(w[g], w[g + 1], m4l));
    vstore(dst + (g + 1) * ds, __builtin_shuffle(w[g], w[g + 1], m4h));
  }
}

// tile[p * 16 + l] = src[l * ss + p] for p < len; lanes l >= nr are zero.
RC_INLINE void gather_tile(const float* src, int64_t ss, int64_t nr, int64_t len, float* tile) {
  int64_t p = 0;
  if (nr == 16)
    for (; p + 16 <= len; p += 16) transpose16(src + p, ss, tile + p * 16, 16);
  for (; p < len; ++p)
    for (int64_t l = 0; l < 16; ++l) tile[p * 16 + l] = l < nr ? src[l * ss + p] : 0.0f;
}

// dst[l * ds + p] = tile[p * 16 + l] for p < len, l < nr.
RC_INLINE void scatter_tile(const float* tile, int64_t nr, int64_t len, float* dst, int64_t ds) {
  int64_t p = 0;
  if (nr == 16)
    for (; p + 16 <= len; p += 16) transpose16(tile + p * 16, 16, dst + p, ds);
  for (; p < len; ++p)
    for (int64_t l = 0; l < nr; ++l) dst[l * ds + p] = tile[p * 16 + l];
}

RC_INLINE vf lanes_of(const float* p, int64_t nr) { return nr == 16 ? vload(p) : vload_part(p, nr); }

// One sequence, 16 channels: y[t, 0:nr] (row stride D) from sx rows (stride L).
RC_SIMD void conv_fwd_block(const float* sx, int64_t L, const float* c, int64_t W, int64_t nr, int64_t T,
                            float* y, int64_t D, float* work) {
  float* cT = work;            // [W][16]
  float* tile = cT + W * 16;   // [kTB + W - 1][16]
  for (int64_t k = 0; k < W; ++k)
    for (int64_t l = 0; l < 16; ++l) cT[k * 16 + l] = l < nr ? c[l * W + k] : 0.0f;
  for (int64_t t0 = 0; t0 < T; t0 += kTB) {
    const int64_t n = std::min(kTB, T - t0);
    // The next tile's output rows are D floats apart, its input rows L apart: ask for them
    // now (for writing / reading) so that the misses overlap this tile's work.
    const int64_t t2 = std::min(T, t0 + 2 * kTB);
    for (int64_t t = t0 + kTB; t < t2; ++t) __builtin_prefetch(y + t * D, 1);
    if (t0 + kTB < T)
      for (int64_t l = 0; l < nr; ++l)
        for (int64_t p = t0 + kTB; p < t2 + W - 1; p += 16) __builtin_prefetch(sx + l * L + p);
    gather_tile(sx + t0, L, nr, n + W - 1, tile);
    for (int64_t t = 0; t < n; ++t) {
      vf acc = {};
      for (int64_t k = 0; k < W; ++k) acc += vload(cT + k * 16) * vload(tile + (t + k) * 16);
      float* yt = y + (t0 + t) * D;
      if (nr == 16)
        vstore(yt, acc);
      else
        vstore_part(yt, acc, nr);
    }
  }
}

// 16 channels over all sequences: d_sx rows (stride L) and d_c[0:nr, :].
RC_SIMD void conv_bwd_block(const float* dy, const float* sx, const float* c, int64_t S, int64_t T, int64_t W,
                            int64_t D, int64_t nr, float* dsx, float* dc, float* work) {
  const int64_t L = W - 1 + T;
  float* cT = work;                    // [W][16]
  float* acc = cT + W * 16;            // [W][16]: d_c
  float* tile = acc + W * 16;          // [kTB + W - 1][16]: sx
  float* dyt = tile + (kTB + W) * 16;  // [W - 1 + kTB][16]: dy[t0 - W + 1 .. t0 + kTB)
  float* out = dyt + (kTB + W) * 16;   // [kTB + W - 1][16]: d_sx
  for (int64_t k = 0; k < W; ++k)
    for (int64_t l = 0; l < 16; ++l) {
      cT[k * 16 + l] = l < nr ? c[l * W + k] : 0.0f;
      acc[k * 16 + l] = 0.0f;
    }
  for (int64_t s = 0; s < S; ++s) {
    const float* sxs = sx + s * D * L;
    const float* dys = dy + s * T * D;
    float* dsxs = dsx + s * D * L;
    for (int64_t t0 = 0; t0 < T; t0 += kTB) {
      const int64_t n = std::min(kTB, T - t0);
      const bool last = t0 + n == T;
      const int64_t t2 = std::min(T, t0 + 2 * kTB);
      for (int64_t t = t0 + kTB; t < t2; ++t) __builtin_prefetch(dys + t * D);
      if (t0 + kTB < T)
        for (int64_t l = 0; l < nr; ++l)
          for (int64_t p = t0 + kTB; p < t2 + W - 1; p += 16) {
            __builtin_prefetch(sxs + l * L + p);
            __builtin_prefetch(dsxs + l * L + p, 1);
          }
      // dy rows t0 - W + 1 .. t0 + n - 1 (zero before 0)
      for (int64_t r = 0; r < n + W - 1; ++r) {
        const int64_t t = t0 - (W - 1) + r;
        vstore(dyt + r * 16, t >= 0 ? lanes_of(dys + t * D, nr) : vf{});
      }
      gather_tile(sxs + t0, L, nr, n + W - 1, tile);
      for (int64_t t = 0; t < n; ++t) {
        const vf g = vload(dyt + (t + W - 1) * 16);
        for (int64_t k = 0; k < W; ++k) vstore(acc + k * 16, vload(acc + k * 16) + g * vload(tile + (t + k) * 16));
      }
      // d_sx[p] = sum_k c[k] dy[p - k] for positions p = t0 .. t0 + n (+ W - 1 at the end)
      const int64_t np = last ? n + W - 1 : n;
      for (int64_t p = 0; p < np; ++p) {
        vf o = {};
        for (int64_t k = 0; k < W; ++k) {
          const int64_t r = p - k + W - 1;  // row of dy[t0 + p - k] in dyt
          if (r < n + W - 1) o += vload(cT + k * 16) * vload(dyt + r * 16);
        }
        vstore(out + p * 16, o);
      }
      scatter_tile(out, nr, np, dsxs + t0, L);
    }
    if (T == 0)  // only context positions: their gradient is zero
      for (int64_t l = 0; l < nr; ++l)
        for (int64_t p = 0; p < L; ++p) dsxs[l * L + p] = 0.0f;
  }
  for (int64_t l = 0; l < nr; ++l)
    for (int64_t k = 0; k < W; ++k) dc[l * W + k] = acc[k * 16 + l];
}

// ---- causal_conv_silu ---------------------------------------------------------------

// pre[i] = b[i] + sum_k c[k][i] * x_k[i] over the rows x_k = rows[k] (nullptr: before t = 0);
// cT is c transposed, [W][n] with row stride ldc.
RC_SIMD void conv_pre_row(float* __restrict pre, const float* const* rows, const float* __restrict cT,
                          int64_t ldc, const float* __restrict b, int64_t W, int64_t n) {
  if (W == 4 && b && rows[0]) {  // Mamba's width, past the start: one pass instead of four
    const float *__restrict x0 = rows[0], *__restrict x1 = rows[1], *__restrict x2 = rows[2],
                *__restrict x3 = rows[3];
    const float *__restrict c0 = cT, *__restrict c1 = cT + ldc, *__restrict c2 = cT + 2 * ldc,
                *__restrict c3 = cT + 3 * ldc;
    for (int64_t i = 0; i < n; ++i) pre[i] = b[i] + c0[i] * x0[i] + c1[i] * x1[i] + c2[i] * x2[i] + c3[i] * x3[i];
    return;
  }
  for (int64_t i = 0; i < n; ++i) pre[i] = b ? b[i] : 0.0f;
  for (int64_t k = 0; k < W; ++k) {
    const float* __restrict xr = rows[k];
    if (!xr) continue;
    const float* __restrict ck = cT + k * ldc;
    for (int64_t i = 0; i < n; ++i) pre[i] += ck[i] * xr[i];
  }
}

RC_SIMD void silu_inplace_row(float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] * sigmoid_lane(y[i]);
}

// One token of the backward, n channels: g = dy * silu'(pre) in place of pre; when acc:
// pb += g and pc[k] += g * rows[k] (pc: W rows ldp apart; rows[k] nullptr before the start).
RC_SIMD void conv_grad_row(float* __restrict g, const float* __restrict dy, const float* const* rows, int64_t W,
                           bool acc, float* __restrict pb, float* __restrict pc, int64_t ldp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float z = g[i], sg = sigmoid_lane(z);
    g[i] = dy[i] * sg * (1.0f + z * (1.0f - sg));
  }
  if (!acc) return;
  for (int64_t i = 0; i < n; ++i) pb[i] += g[i];
  for (int64_t k = 0; k < W; ++k) {
    const float* __restrict xr = rows[k];
    if (!xr) continue;
    float* __restrict pk = pc + k * ldp;
    for (int64_t i = 0; i < n; ++i) pk[i] += g[i] * xr[i];
  }
}

// dx = sum_k cT[k] * grows[k] over the rows present (grows[k] nullptr past the end; cT's
// rows ldc apart).
RC_SIMD void conv_dx_row(float* __restrict dx, const float* const* grows, const float* __restrict cT, int64_t ldc,
                         int64_t W, int64_t n) {
  if (W == 4 && grows[0]) {  // all four rows present (grows[0] is the furthest ahead)
    const float *__restrict g0 = grows[0], *__restrict g1 = grows[1], *__restrict g2 = grows[2],
                *__restrict g3 = grows[3];
    const float *__restrict c0 = cT, *__restrict c1 = cT + ldc, *__restrict c2 = cT + 2 * ldc,
                *__restrict c3 = cT + 3 * ldc;
    for (int64_t i = 0; i < n; ++i) dx[i] = c0[i] * g0[i] + c1[i] * g1[i] + c2[i] * g2[i] + c3[i] * g3[i];
    return;
  }
  for (int64_t i = 0; i < n; ++i) dx[i] = 0.0f;
  for (int64_t k = 0; k < W; ++k) {
    const float* __restrict gr = grows[k];
    if (!gr) continue;
    const float* __restrict ck = cT + k * ldc;
    for (int64_t i = 0; i < n; ++i) dx[i] += ck[i] * gr[i];
  }
}

// Asks for the n floats at p ahead of use. Token rows of a projection lie pages apart, which
// the hardware prefetchers do not cross: without this every row starts with misses.
inline void prefetch_row(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

// The rows a token reads: x rows t - W + 1 .. t (nullptr before the start).
void window_rows(const float* xs, int64_t ld, int64_t t, int64_t W, int64_t off, const float** rows) {
  for (int64_t k = 0; k < W; ++k) {
    const int64_t tt = t - (W - 1) + k;
    rows[k] = tt >= 0 ? xs + tt * ld + off : nullptr;
  }
}

struct ConvDims {
  int64_t S, T, D, W, ld_s, ld_t;  // ld_*: x's strides of the sequence and token axes
};

ConvDims conv_dims(const TensorView& x, const TensorView& c) {
  return {x.shape[0], x.shape[1], x.shape[2], c.shape[1], x.strides[0], x.strides[1]};
}

std::vector<float> transposed(const TensorView& c) {  // (D, W) -> [W][D]
  const int64_t D = c.shape[0], W = c.shape[1];
  std::vector<float> cT(W * D);
  for (int64_t ch = 0; ch < D; ++ch)
    for (int64_t k = 0; k < W; ++k) cT[k * D + ch] = c.f32()[ch * c.strides[0] + k * c.strides[1]];
  return cT;
}

// Channels per block of the token loops: a token's rows of one block (x's window, c, the
// partial sums of the backward) stay in L1, where whole rows of Mamba's widths (1792 to
// 3328 channels: 4 x rows, 4 c rows, 4 partial-sum rows of 7-13 KB each) did not
// (Mamba2-130m, 4 x 256, 2 threads: backward 3.39 -> 1.51 ms, forward 0.93 -> 0.61 ms;
// 128 and 512 measured the same as 256).
constexpr int64_t kConvChannels = 256;

// A task owns a block of kConvTok tokens of one sequence and walks its channel blocks, each
// over the block's tokens (the W - 1 rows of x before a token are read again from L1).
constexpr int64_t kConvTok = 32;

void causal_conv_forward(KernelCtx& c) {
  const ConvDims d = conv_dims(c.src[0], c.src[1]);
  const std::vector<float> cT = transposed(c.src[1]);
  const float* b = c.src.size() == 3 ? c.src[2].f32() : nullptr;
  const float* x = c.src[0].f32();
  float* y = c.dst.f32();
  const int64_t nb = (d.T + kConvTok - 1) / kConvTok, cb = kConvChannels;
  c.pool.run(d.S * nb, [&](int64_t task, int) {
    const int64_t s = task / nb, t0 = task % nb * kConvTok, t1 = std::min(d.T, t0 + kConvTok);
    std::vector<const float*> rows(d.W);
    for (int64_t c0 = 0; c0 < d.D; c0 += cb) {
      const int64_t n = std::min(cb, d.D - c0);
      for (int64_t t = t0; t < t1; ++t) {
        if (t + 2 < t1) prefetch_row(x + s * d.ld_s + (t + 2) * d.ld_t + c0, n);
        window_rows(x + s * d.ld_s, d.ld_t, t, d.W, c0, rows.data());
        float* yr = y + (s * d.T + t) * d.D + c0;
        conv_pre_row(yr, rows.data(), cT.data() + c0, d.D, b ? b + c0 : nullptr, d.W, n);
        silu_inplace_row(yr, n);
      }
    }
  });
}

// A task owns a block of kTok tokens of one sequence, all channels (whole rows: streaming
// access). It recomputes g = dy * silu'(pre) for its tokens and the W - 1 after them (which
// dx needs), keeps partial sums of d_c and d_bias, and writes its rows of dx; the partial
// sums are added in task order (fixed by the shapes, not the thread count).
void causal_conv_back_forward(KernelCtx& c) {
  constexpr int64_t kTok = kConvTok;
  const ConvDims d = conv_dims(c.src[1], c.src[2]);
  const bool has_b = c.src.size() == 4;
  const std::vector<float> cT = transposed(c.src[2]);
  const float* dy = c.src[0].f32();
  const float* x = c.src[1].f32();
  const float* b = has_b ? c.src[3].f32() : nullptr;
  float* dx = c.dst.f32();
  float* dc = dx + d.S * d.T * d.D;
  float* db = dc + d.D * d.W;
  const int64_t nb = (d.T + kTok - 1) / kTok, n_tasks = d.S * nb, D = d.D, W = d.W;
  std::vector<float> pc(n_tasks * W * D, 0.0f), pb(n_tasks * D, 0.0f);
  std::vector<std::vector<float>> work(c.pool.size());
  const int64_t cb = kConvChannels;
  c.pool.run(n_tasks, [&](int64_t task, int tid) {
    const int64_t s = task / nb, t0 = task % nb * kTok, t1 = std::min(d.T, t0 + kTok);
    const int64_t te = std::min(d.T, t1 + W - 1);
    std::vector<float>& g = work[tid];  // g of the block's tokens and the W - 1 after them
    g.resize((kTok + W) * cb);
    std::vector<const float*> rows(W);
    const float* xs = x + s * d.ld_s;
    for (int64_t c0 = 0; c0 < D; c0 += cb) {
      const int64_t n = std::min(cb, D - c0);
      for (int64_t t = t0; t < te; ++t) {
        if (t + 2 < te) {
          prefetch_row(xs + (t + 2) * d.ld_t + c0, n);
          prefetch_row(dy + (s * d.T + t + 2) * D + c0, n);
        }
        float* gt = g.data() + (t - t0) * n;
        window_rows(xs, d.ld_t, t, W, c0, rows.data());
        conv_pre_row(gt, rows.data(), cT.data() + c0, D, b ? b + c0 : nullptr, W, n);
        conv_grad_row(gt, dy + (s * d.T + t) * D + c0, rows.data(), W, t < t1, pb.data() + task * D + c0,
                      pc.data() + task * W * D + c0, D, n);
      }
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t k = 0; k < W; ++k) {
          const int64_t tt = t + W - 1 - k;
          rows[k] = tt < te ? g.data() + (tt - t0) * n : nullptr;
        }
        conv_dx_row(c.piece_row(0, s * d.T + t, D) + c0, rows.data(), cT.data() + c0, D, W, n);
      }
    }
  });
  std::vector<double> ac(W * D, 0.0), ab(D, 0.0);
  for (int64_t q = 0; q < n_tasks; ++q) {
    for (int64_t i = 0; i < W * D; ++i) ac[i] += pc[q * W * D + i];
    for (int64_t i = 0; i < D; ++i) ab[i] += pb[q * D + i];
  }
  for (int64_t ch = 0; ch < D; ++ch) {
    for (int64_t k = 0; k < W; ++k) dc[ch * W + k] = static_cast<float>(ac[k * D + ch]);
    if (has_b) db[ch] = static_cast<float>(ab[ch]);
  }
}

// (x (S, T, D), c (D, W)[, bias (D,)]) from source `off` on; x's last axis must be dense.
// Sets the forward's dtype and shape (x's).
void causal_conv_check(Graph& g, Node& n, size_t off) {
  const size_t ns = n.src.size() - off;
  if (ns != 2 && ns != 3) fail_shape(g, n, "takes (x, c) or (x, c, bias)");
  for (size_t i = 0; i < n.src.size(); ++i) require_f32(g, n, static_cast<int>(i));
  const Shape xs = g.node(n.src[off]).shape, cs = g.node(n.src[off + 1]).shape;
  if (xs.ndim != 3) fail_shape(g, n, "x must be (n_seqs, n_tok, d_inner)");
  if (cs.ndim != 2 || cs[0] != xs[2] || cs[1] < 1) fail_shape(g, n, "c must be (d_inner, d_conv)");
  if (ns == 3 && g.node(n.src[off + 2]).shape != Shape{xs[2]}) fail_shape(g, n, "bias must be (d_inner,)");
  const Node& xn = g.node(n.src[off]);
  if (xs[2] > 1 && xn.strides[2] != 1) n.src[off] = g.contiguous(n.src[off]);
  // the forward may ask for its output's dtype (RECURRA_P_CONV_OUT_DTYPE): rounded once
  DType out = DType::f32;
  if (off == 0 && n.ip.size() == 1) {
    const int64_t code = n.ip[RECURRA_P_CONV_OUT_DTYPE];
    if (code < 0 || code >= kNumDTypes || !is_float(static_cast<DType>(code)))
      throw TypeError("causal_conv_silu: the output dtype code must be 0 (float32), 2 (bfloat16) or 3 (float16), got " +
                      std::to_string(code));
    out = static_cast<DType>(code);
  } else if (!n.ip.empty()) {
    fail_shape(g, n, "takes no integer parameters");
  }
  n.dtype = out;
  n.shape = xs;  // the forward's result
}

void conv_check(Graph& g, Node& n, int off, int64_t* S, int64_t* D, int64_t* W, int64_t* T) {
  require_f32(g, n, off);
  require_f32(g, n, off + 1);
  const Shape &sx = g.node(n.src[off]).shape, &c = g.node(n.src[off + 1]).shape;
  if (sx.ndim != 3) fail_shape(g, n, "sx must be (n_seqs, d_inner, d_conv - 1 + n_tok)");
  if (c.ndim != 2) fail_shape(g, n, "c must be (d_inner, d_conv)");
  if (c[1] < 1) fail_shape(g, n, "d_conv must be >= 1");
  if (c[0] != sx[1]) fail_shape(g, n, "c must be (d_inner, d_conv) with the d_inner of sx");
  if (sx[2] < c[1] - 1) fail_shape(g, n, "sx needs at least d_conv - 1 positions");
  *S = sx[0];
  *D = sx[1];
  *W = c[1];
  *T = sx[2] - (c[1] - 1);
}

// conv_step (state (S, D, W - 1), x (S, 1, D), c (D, W)[, bias (D,)]): one token of a
// generation step. y[s, 0, ch] = silu(bias[ch] + sum_k c[ch, k] window[k]) over the window
// [state[s, ch, :], x[s, 0, ch]], and the state moves on by one position in place (the
// window's last W - 1 values): no concatenated copy, no separate bias, SiLU or state copy
// nodes. A few thousand channels: the calling thread alone.
// x = silu(x) over n values, vectorized (lane_math's sigmoid: no libm call per value).
RC_SIMD void silu_in_place(float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= sigmoid_lane(x[i]);
}

// One sequence of conv_step with d_conv 4 (a state of 3 per channel, Mamba's): the same
// sums as the general loop, written so that the loop over channels vectorizes (the
// general one ran ~13 cycles per channel).
RC_SIMD void conv_step_k3(float* __restrict st, const float* __restrict x, const float* __restrict w,
                          float* __restrict y, int64_t D) {
  for (int64_t ch = 0; ch < D; ++ch) {
    float* sr = st + ch * 3;
    const float* wr = w + ch * 4;
    const float s0 = sr[0], s1 = sr[1], s2 = sr[2], xv = x[ch];
    float acc = 0.0f;
    acc += wr[0] * s0;
    acc += wr[1] * s1;
    acc += wr[2] * s2;
    acc += wr[3] * xv;
    sr[0] = s1;
    sr[1] = s2;
    sr[2] = xv;
    y[ch] = acc;
  }
}

RC_SIMD void add_row_in_place(float* __restrict y, const float* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += b[i];
}

void conv_step_forward(KernelCtx& c) {
  const Shape& ss = c.src[0].shape;
  const int64_t S = ss[0], D = ss[1], K = ss[2], W = K + 1;
  float* st = const_cast<float*>(c.src[0].f32());
  const float* x = c.src[1].f32();
  const float* w = c.src[2].f32();
  const float* b = c.src.size() == 4 ? c.src[3].f32() : nullptr;
  float* y = c.dst.f32();
  for (int64_t s = 0; s < S; ++s) {
    float* ys = y + s * D;
    if (K == 3) {
      conv_step_k3(st + s * D * K, x + s * D, w, ys, D);
    } else {
      for (int64_t ch = 0; ch < D; ++ch) {
        float* sr = st + (s * D + ch) * K;
        const float* wr = w + ch * W;
        const float xv = x[s * D + ch];
        float acc = 0.0f;  // ssm_conv's order, then the bias
        for (int64_t k = 0; k < K; ++k) acc += wr[k] * sr[k];
        acc += wr[K] * xv;
        for (int64_t k = 0; k + 1 < K; ++k) sr[k] = sr[k + 1];
        if (K > 0) sr[K - 1] = xv;
        ys[ch] = acc;
      }
    }
    if (b) add_row_in_place(ys, b, D);
  }
  silu_in_place(y, S * D);
}

}  // namespace

void register_ssm_conv_ops(OpTable& t) {
  {
    OpDef d;
    d.name = "ssm_conv";
    d.contiguous_srcs = 0b11;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 2) fail_shape(g, n, "takes (sx, c)");
      int64_t S, D, W, T;
      conv_check(g, n, 0, &S, &D, &W, &T);
      n.dtype = DType::f32;
      n.shape = Shape{S, T, D};
    };
    d.forward = [](KernelCtx& c) {
      const Shape& sx = c.src[0].shape;
      const int64_t S = sx[0], D = sx[1], L = sx[2], W = c.src[1].shape[1], T = L - (W - 1);
      const int64_t nb = (D + 15) / 16;
      const float* x = c.src[0].f32();
      const float* w = c.src[1].f32();
      float* y = c.dst.f32();
      if (T == 0 || D == 0) return;
      std::vector<Work> work(c.pool.size());
      c.pool.run(S * nb, [&](int64_t task, int tid) {
        const int64_t s = task / nb, b = task % nb, ch0 = b * 16;
        float* wk = work[tid].get((2 * W + kTB) * 16);
        conv_fwd_block(x + (s * D + ch0) * L, L, w + ch0 * W, W, std::min<int64_t>(16, D - ch0), T,
                       y + s * T * D + ch0, D, wk);
      });
    };
    d.backward = [](GradSink& k) {
      if (!k.needs(0) && !k.needs(1)) return;
      const int back = k.g.op("ssm_conv_back", {k.grad_out, k.node.src[0], k.node.src[1]});
      const Shape sx = k.g.node(k.node.src[0]).shape, cs = k.g.node(k.node.src[1]).shape;
      if (k.needs(0)) k.add(0, k.g.unpack(back, 0, sx));
      if (k.needs(1)) k.add(1, k.g.unpack(back, sx.numel(), cs));
    };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "ssm_conv_back";
    d.contiguous_srcs = 0b111;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 3) fail_shape(g, n, "takes (dy, sx, c)");
      require_f32(g, n, 0);
      int64_t S, D, W, T;
      conv_check(g, n, 1, &S, &D, &W, &T);
      if (g.node(n.src[0]).shape != Shape{S, T, D}) fail_shape(g, n, "dy must be (n_seqs, n_tok, d_inner)");
      n.dtype = DType::f32;
      n.shape = Shape{g.node(n.src[1]).numel() + g.node(n.src[2]).numel()};
    };
    d.forward = [](KernelCtx& c) {
      const Shape& sx = c.src[1].shape;
      const int64_t S = sx[0], D = sx[1], L = sx[2], W = c.src[2].shape[1], T = L - (W - 1);
      const int64_t nb = (D + 15) / 16;
      const float* dy = c.src[0].f32();
      const float* x = c.src[1].f32();
      const float* w = c.src[2].f32();
      float* dsx = c.dst.f32();
      float* dc = dsx + S * D * L;
      std::vector<Work> work(c.pool.size());
      c.pool.run(nb, [&](int64_t b, int tid) {
        const int64_t ch0 = b * 16;
        float* wk = work[tid].get((5 * W + 3 * kTB + 3) * 16);
        conv_bwd_block(dy + ch0, x + ch0 * L, w + ch0 * W, S, T, W, D, std::min<int64_t>(16, D - ch0),
                       dsx + ch0 * L, dc + ch0 * W, wk);
      });
    };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "causal_conv_silu";
    d.contiguous_srcs = 0b110;  // c, bias; x may have spread-out rows
    d.infer = [](Graph& g, Node& n) { causal_conv_check(g, n, 0); };
    d.forward = causal_conv_forward;
    d.backward = [](GradSink& k) {
      const int back = k.g.op("causal_conv_silu_back", grad_and_srcs(k));
      const Shape xs = k.g.node(k.node.src[0]).shape, cs = k.g.node(k.node.src[1]).shape;
      if (k.needs(0)) k.add(0, k.g.unpack(back, 0, xs));
      if (k.needs(1)) k.add(1, k.g.unpack(back, xs.numel(), cs));
      if (k.node.src.size() == 3 && k.needs(2)) k.add(2, k.g.unpack(back, xs.numel() + cs.numel(), Shape{cs[0]}));
    };
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "causal_conv_silu_back";
    d.contiguous_srcs = 0b1101;  // dy, c, bias
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() < 3) fail_shape(g, n, "takes (dy, x, c[, bias])");
      causal_conv_check(g, n, 1);
      const Shape xs = g.node(n.src[1]).shape, cs = g.node(n.src[2]).shape;
      if (g.node(n.src[0]).shape != xs) fail_shape(g, n, "dy must have x's shape");
      n.shape = Shape{xs.numel() + cs.numel() + (n.src.size() == 4 ? cs[0] : 0)};
    };
    d.forward = causal_conv_back_forward;
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "conv_step";
    d.contiguous_srcs = 0b1111;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 3 && n.src.size() != 4) fail_shape(g, n, "takes (state, x, c) or (state, x, c, bias)");
      for (size_t i = 0; i < n.src.size(); ++i) require_f32(g, n, static_cast<int>(i));
      const Shape st = g.node(n.src[0]).shape, xs = g.node(n.src[1]).shape, cs = g.node(n.src[2]).shape;
      if (st.ndim != 3) fail_shape(g, n, "state must be (n_seqs, d_inner, d_conv - 1)");
      if (xs != Shape{st[0], 1, st[1]}) fail_shape(g, n, "x must be (n_seqs, 1, d_inner) of the state's sizes");
      if (cs != Shape{st[1], st[2] + 1}) fail_shape(g, n, "c must be (d_inner, d_conv) of the state's sizes");
      if (n.src.size() == 4 && g.node(n.src[3]).shape != Shape{st[1]}) fail_shape(g, n, "bias must be (d_inner,)");
      if (!g.node(n.src[0]).is_leaf()) fail_shape(g, n, "writes the state in place into a leaf only");
      n.dtype = DType::f32;
      n.shape = xs;
    };
    d.writes_src = [](const Node&, size_t i) { return i == 0; };
    d.forward = conv_step_forward;
    d.backward = [](GradSink& k) {
      for (size_t i = 0; i < k.node.src.size(); ++i)
        if (k.needs(static_cast<int>(i)))
          throw ValueError("conv_step: a step that writes its state in place has no gradient");
    };
    t.add(std::move(d));
  }
}

}  // namespace recurra

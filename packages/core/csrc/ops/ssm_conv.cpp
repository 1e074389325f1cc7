// ssm_conv: Mamba's depthwise causal convolution, forward and backward, on the CPU.
//
// Shapes (numpy order; see docs/ops.md):
//   sx (S, D, W - 1 + T)  the W - 1 positions of left context come first
//   c  (D, W)
//   ssm_conv      -> y (S, T, D),  y[s, t, ch] = sum_k sx[s, ch, t + k] c[ch, k]
//   ssm_conv_back (dy (S, T, D), sx, c) -> packed 1-D: d_sx (S, D, W - 1 + T), then d_c (D, W)
//
// The output is transposed relative to the input, so the kernels work on tiles of 16
// channels: the input rows are transposed (16 x 16 blocks in registers) into a
// [position][16 channels] tile, and every output row y[s, t, ch0 : ch0 + 16] is then a
// sum of W vector FMAs. The backward transposes d_sx back the same way. d_c is summed by
// the one task that owns its 16 channels, in a fixed order (no thread-count dependence).
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
}

}  // namespace recurra

// ssm_scan: Mamba's selective scan (Mamba-1 and Mamba-2), forward and backward, on the CPU.
//
// Shapes (numpy order; see docs/ops.md):
//   s    (R, H, P, N)  initial states, R >= S          x   (S, T, H, P)    dt (S, T, H)
//   A    (H, NA)       NA = N (one decay per state) or 1 (one decay per head, Mamba-2)
//   B, C (S, T, G, N)  head h reads group h / (H / G)  ids (S,) int32: sequence i starts
//                                                      from s[ids[i]]
//   ssm_scan      -> packed 1-D: y (S, T, H, P), then the final states (S, H, P, N)
//   ssm_scan_back (packed grad, s, x, dt, A, B, C, ids)
//                 -> packed 1-D: ds (R, H, P, N), dx (S, T, H, P), ddt (S, T, H),
//                    dA (H, NA), dB (S, T, G, N), dC (S, T, G, N)
//
// Two kernel layouts:
// * "rows" (P > 1): units of (sequence, head, block of channels p). The forward keeps the
//   state block transposed, [n][p], and vectorizes along p, so y_t = sum_n C[n] S[n][:]
//   needs no horizontal sums. With one decay per head it keeps S~ = S / P_t, P_t the decay
//   accumulated since the last renormalisation, so a token costs two FMAs per element
//   (S~ += B~ u; y += C S~) instead of three, and two tokens share one pass over the state;
//   S~ is multiplied out whenever P_t leaves [2^-60, 2^60] (and at the end), so nothing
//   overflows or underflows to denormals.
// * "heads" (P == 1, Mamba-1): 16 heads of one group per vector, the state [n][16 heads];
//   every element needs its own exp(), done by a vectorized polynomial (vexp), batched per
//   chunk of tokens so that its latency is hidden.
// A task owns a few units and advances them kChunk tokens at a time, in turn: the rows of
// x, y, dt that it touches are then close together in memory while each unit's state stays
// in L1/L2.
//
// Backward, rows layout. lam_t = dL/dS_t obeys lam_{t-1} = a_t lam_t + dy_{t-1} C_{t-1}^T,
// which needs no state, and dC_t = dy_t^T S_t needs only the forward state, so one forward
// sweep (S, dC) and one reverse sweep (lam, dB, dx) suffice; lam is kept scaled like S.
// The decay gradient g_t = sum lam_t * a_t S_{t-1} would need S_{t-1} in the reverse sweep;
// instead Z_t = sum_p lam_t S_t follows Z_{t-1} = g_t + C_{t-1} . dC_{t-1} with
// g_t = Z_t - B_t . dB_t, and is re-anchored exactly from a stored state every K tokens
// (K a power of two, at most 17 anchors), so rounding cannot accumulate.
// Backward, heads layout: the state is checkpointed every K tokens (at most 64 segments);
// each segment is recomputed (states and exps) into a small buffer and walked in reverse,
// for all blocks of a task before the next segment, so that the per-lane dB and dC terms
// are summed over the blocks and reduced across lanes once per segment.
//
// Determinism: dB, dC, dA, d_s are sums over heads/sequences. Each task owns a fixed slice
// of the work (chosen from the shapes only, never from the thread count) and its own
// partial sums, and partial sums are reduced in a fixed order, so results are bitwise the
// same for any number of threads.
//
// Peak extra memory of the backward, in floats (Np = N rounded up to 16, plp likewise PB):
//   per thread, rows:  U units, U * PB ~ 64 channels, each
//                      PB * Np * (1 + ceil(T / K)) + T * (1 or Np) + 11 Np + 38 plp,
//                      plus 4 T per head (K >= 64 and ceil(T / K) <= 17)
//   per thread, heads: blocks_per_task * 16 N * (3 + ceil(T / K)) + 16 K (2 + N + 3 Np)
//                      (K = max(32, T / 64))
//   shared: (n_split - 1) * 2 * S*T*G*N (partial dB, dC; n_split <= ceil(8 / (S G))),
//   S*H*NA (partial dA), and S*H*P*N when two sequences share a state row.
// For the Mamba-2 case of the benchmark (S 4, T 1024, H 32, P 64, N 128) that is about
// 1.3 MB per thread plus 4 MB of partial sums; storing every state would take 4 GB.
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ssm.h"

namespace recurra {

namespace {

using namespace ssm;

// ---- vectorized maths ---------------------------------------------------------------

// exp(x) to about 1 ulp (max relative error 1e-7): exp(x) = 2^n e^r, |r| <= ln2 / 2, e^r by
// a degree-6 minimax polynomial. Below -87 it returns 0 (never a denormal, which would
// slow every later multiply). The clamps are written as `lo > x ? lo : x`, which is one
// vmaxps and lets NaN through.
RC_INLINE vf vexp(vf x) {
  const vf lo = vsplat(-87.0f), hi = vsplat(88.0f);
  const vi under = x < lo;
  x = lo > x ? lo : x;
  x = hi < x ? hi : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x * 1.44269504088896341f + magic;
  vf n = t - magic;
  vi ni = (vi)t - (vi)vsplat(magic);  // same-size vector casts reinterpret the bits
  vf r = x - n * 0.693359375f;        // ln 2 in two parts (Cody-Waite); n * hi is exact
  r = r - n * -2.12194440054690583e-4f;
  vf p = vsplat(1.3836826e-3f);
  p = p * r + 8.3748158e-3f;
  p = p * r + 4.1668225e-2f;
  p = p * r + 1.6666420e-1f;
  p = p * r + 4.9999991e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  vi e = (ni + 127) << 23;
  vf res = p * (vf)e;
  return under ? vsplat(0.0f) : res;
}

// softplus(z) = z for z > 20, else max(z, 0) + log1p(exp(-|z|)), with
// log1p(w) = 2 atanh(w / (2 + w)) (exact for tiny w, no 1 + w rounding).
RC_INLINE vf vsoftplus(vf z) {
  vf az = (vf)((vi)z & 0x7fffffff);
  vf w = vexp(-az);
  vf s = w / (w + 2.0f);
  vf s2 = s * s;
  vf q = vsplat(1.0f / 13);
  q = q * s2 + 1.0f / 11;
  q = q * s2 + 1.0f / 9;
  q = q * s2 + 1.0f / 7;
  q = q * s2 + 1.0f / 5;
  q = q * s2 + 1.0f / 3;
  q = q * s2 + 1.0f;
  const vf zero = {};
  vf r = (zero > z ? zero : z) + 2.0f * s * q;
  return z > 20.0f ? z : r;
}

// d softplus / dz: sigmoid(z), and 1 where z > 20 (softplus is the identity there).
RC_INLINE vf vsigmoid(vf z) {
  vf r = 1.0f / (vexp(-z) + 1.0f);
  r = z < -87.0f ? vsplat(0.0f) : r;
  return z > 20.0f ? vsplat(1.0f) : r;
}

// x[j] = exp(x[j]) for four vectors, step by step interleaved. A lone exp is a chain of
// ~20 dependent operations; interleaving four keeps both vector ports busy instead of
// waiting on latency. Same arithmetic as vexp.
RC_INLINE void vexp4(vf* x) {
  const vf lo = vsplat(-87.0f), hi = vsplat(88.0f);
  const float magic = 12582912.0f;
  vi under[4], ni[4];
  vf n[4], r[4], p[4];
  for (int j = 0; j < 4; ++j) {
    under[j] = x[j] < lo;
    x[j] = lo > x[j] ? lo : x[j];
    x[j] = hi < x[j] ? hi : x[j];
  }
  for (int j = 0; j < 4; ++j) {
    vf t = x[j] * 1.44269504088896341f + magic;
    n[j] = t - magic;
    ni[j] = (vi)t - (vi)vsplat(magic);
  }
  for (int j = 0; j < 4; ++j) r[j] = x[j] - n[j] * 0.693359375f;
  for (int j = 0; j < 4; ++j) r[j] = r[j] - n[j] * -2.12194440054690583e-4f;
  for (int j = 0; j < 4; ++j) p[j] = r[j] * 1.3836826e-3f + 8.3748158e-3f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 4.1668225e-2f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 1.6666420e-1f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 4.9999991e-1f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 1.0f;
  for (int j = 0; j < 4; ++j) p[j] = p[j] * r[j] + 1.0f;
  for (int j = 0; j < 4; ++j) {
    vi e = (ni[j] + 127) << 23;
    vf res = p[j] * (vf)e;
    x[j] = under[j] ? vsplat(0.0f) : res;
  }
}

// out[t * m + n][:] = exp(d[t][:] * A[n][:]) for t < nt, n < m (rows of 16 lanes).
RC_INLINE void exp_rows(const float* d, const float* A, int64_t m, int64_t nt, float* out) {
  if (m == 1) {
    const vf av = vload(A);
    int64_t t = 0;
    for (; t + 4 <= nt; t += 4) {
      vf x[4];
      for (int j = 0; j < 4; ++j) x[j] = vload(d + (t + j) * 16) * av;
      vexp4(x);
      for (int j = 0; j < 4; ++j) vstore(out + (t + j) * 16, x[j]);
    }
    for (; t < nt; ++t) vstore(out + t * 16, vexp(vload(d + t * 16) * av));
    return;
  }
  for (int64_t t = 0; t < nt; ++t) {
    const vf dv = vload(d + t * 16);
    float* o = out + t * m * 16;
    int64_t n = 0;
    for (; n + 4 <= m; n += 4) {
      vf x[4];
      for (int j = 0; j < 4; ++j) x[j] = dv * vload(A + (n + j) * 16);
      vexp4(x);
      for (int j = 0; j < 4; ++j) vstore(o + (n + j) * 16, x[j]);
    }
    for (; n < m; ++n) vstore(o + n * 16, vexp(dv * vload(A + n * 16)));
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(RECURRA_NO_CLONES)
#define RC_EXP512 1
// exp_rows for AVX-512 with its scaling instructions: exp(x) = 2^n 2^f, n = round(x log2 e),
// f in [-1/2, 1/2], 2^f by its degree-6 Taylor polynomial (relative error <= 1.3e-7),
// 2^n applied by vscalefps; 11 instructions per 16 values instead of vexp's ~19. Values
// below -87 give 0 as in vexp (never a denormal), NaN stays NaN.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp512(__m512 x) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.5403530393381606e-4f), f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);  // x >= -87 or NaN
  return _mm512_maskz_scalef_ps(keep, p, n);
}

__attribute__((target("avx512f"))) void exp_rows_avx512(const float* d, const float* A, int64_t m, int64_t nt,
                                                        float* out) {
  for (int64_t t = 0; t < nt; ++t) {
    const __m512 dv = _mm512_loadu_ps(d + t * 16);
    float* o = out + t * m * 16;
    for (int64_t n = 0; n < m; ++n) _mm512_storeu_ps(o + n * 16, exp512(_mm512_mul_ps(dv, _mm512_loadu_ps(A + n * 16))));
  }
}
#endif

RC_SIMD void exp_rows_clones(const float* d, const float* A, int64_t m, int64_t nt, float* out) {
  exp_rows(d, A, m, nt, out);
}

// out[t][j][:] = exp(d[t][:] * A[j][:]) for nt tokens and m rows: the AVX-512 kernel where
// the CPU has it, else the vexp clones.
void exp_rows_best(const float* d, const float* A, int64_t m, int64_t nt, float* out) {
#ifdef RC_EXP512
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) return exp_rows_avx512(d, A, m, nt, out);
#endif
  exp_rows_clones(d, A, m, nt, out);
}

// Renormalise the scaled state when the accumulated decay leaves this range.
constexpr float kPMin = 8.67361737988e-19f;  // 2^-60
constexpr float kPMax = 1.15292150461e18f;   // 2^60
RC_INLINE bool in_range(float p) { return p >= kPMin && p <= kPMax; }

// dtp[t] = softplus(dt[t * stride]); a[t] = exp(dtp[t] * A) when a != nullptr;
// sig[t] = sigmoid(dt[t * stride]) when sig != nullptr.
RC_SIMD void dt_column(const float* dt, int64_t stride, int64_t T, float A, float* dtp, float* a,
                       float* sig) {
  for (int64_t t0 = 0; t0 < T; t0 += 16) {
    const int64_t m = std::min<int64_t>(16, T - t0);
    vf z = {};
    for (int64_t l = 0; l < m; ++l) z[l] = dt[(t0 + l) * stride];
    vf d = vsoftplus(z);
    vstore_part(dtp + t0, d, m);
    if (a) vstore_part(a + t0, vexp(d * A), m);
    if (sig) vstore_part(sig + t0, vsigmoid(z), m);
  }
}

// out[n] = exp(d * A[n]) for n < N, 0 up to Np (multiple of 16).
RC_SIMD void exp_row(const float* A, float d, int64_t N, int64_t Np, float* out) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) vstore(out + n, vexp(vload(A + n) * d));
  if (n < N) vstore(out + n, vexp(vload_part(A + n, N - n) * d));
  for (int64_t k = ((N + 15) / 16) * 16; k < Np; ++k) out[k] = 0.0f;
}

struct Dims {
  int64_t R, S, T, H, P, N, G, NA, hpg;
  bool per_n;  // one decay per state (NA == N > 1)
};

// Heads layout (P == 1): the backward recomputes the states segment by segment from
// checkpoints taken every heads_seg_len(T) tokens (at most 64 segments). A forward asked to
// (ssm_scan's ip[0] = 1, set by the Python API when a gradient will follow on the CPU) saves
// them after its outputs, as (S, n_seg, H, N), and the backward then skips its own forward
// sweep: a third less work for a training step.
int64_t heads_seg_len(int64_t T) { return std::max<int64_t>(32, (T + 63) / 64); }
int64_t heads_n_seg(int64_t T) { return (T + heads_seg_len(T) - 1) / heads_seg_len(T); }

// Rows layout with one decay per head (Mamba-2): a forward asked to save checkpoints writes
// the state entering each kCkChunk-token chunk, as (S, H, ceil(T / kCkChunk), P, N): what
// the chunked (state-space-duality) backward of the Vulkan backend reads instead of
// recomputing it. The CPU backward has no use for them (its forward sweep is cheap beside
// its reverse sweep) and ignores them.
constexpr int64_t kCkChunk = 64;

Dims dims_of(const std::vector<TensorView>& src, int off) {
  Dims d;
  const Shape &s = src[off + 0].shape, &x = src[off + 1].shape, &A = src[off + 3].shape,
              &B = src[off + 4].shape;
  d.R = s[0];
  d.S = x[0];
  d.T = x[1];
  d.H = x[2];
  d.P = x[3];
  d.N = s[3];
  d.G = B[2];
  d.NA = A[1];
  d.hpg = d.G > 0 ? d.H / d.G : 0;
  d.per_n = d.NA != 1;
  return d;
}

void check_ids(const int32_t* ids, const Dims& d, const char* op) {
  for (int64_t i = 0; i < d.S; ++i)
    if (ids[i] < 0 || ids[i] >= d.R)
      throw ValueError(std::string(op) + ": ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                       " is out of range for " + std::to_string(d.R) + " state rows");
}

// ======================================================================================
// Forward, rows layout: one (sequence, head, block of L channels).
// ======================================================================================

// Work is cut in time as well as across heads: a task owns a few (head, channel block)
// units and advances each by kChunk tokens in turn. The rows of x, y and dt that a task
// touches at one token are then adjacent in memory (the prefetchers and the TLB follow),
// while each unit's state stays in L1/L2 during its chunk.
constexpr int64_t kChunk = 16;

// Whether the CPU has 32 vector registers of 16 floats (AVX-512). The token loops below
// keep up to ~28 16-float vectors live; with AVX2 (16 registers of 8 floats) they must
// work on fewer at a time or every step spills to the stack.
bool wide_registers() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool wide = __builtin_cpu_supports("avx512f");
#else
  static const bool wide = true;
#endif
  return wide;
}

RC_INLINE float hsum(vf v) {
  const vi s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const vi s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const vi s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const vi s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  v += __builtin_shuffle(v, s8);
  v += __builtin_shuffle(v, s4);
  v += __builtin_shuffle(v, s2);
  v += __builtin_shuffle(v, s1);
  return v[0];
}

// One token (T == 1, head_dim > 1: a generation step). The rows kernels' transposed, scaled
// state would cost two passes more over it than the token itself; here each row [p][:] of
// a (sequence, head) state is read once and written once, vectorized along n:
// S'[p][n] = a[n] S[p][n] + B[n] dtp x[p], y[p] = C . S'[p].
RC_SIMD float step_row(const float* __restrict s, const float* __restrict an, float bu,
                       const float* __restrict B, const float* __restrict C, float* __restrict out,
                       int64_t N) {
  vf acc = {};
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    const vf v = vload(an + n) * vload(s + n) + vload(B + n) * bu;
    vstore(out + n, v);
    acc += vload(C + n) * v;
  }
  if (n < N) {
    const int64_t m = N - n;
    const vf v = vload_part(an + n, m) * vload_part(s + n, m) + vload_part(B + n, m) * bu;
    vstore_part(out + n, v, m);
    acc += vload_part(C + n, m) * v;
  }
  return hsum(acc);
}

struct RowsFwd {
  const float* s0;   // s[row, h, p0, 0]: (p, n) at s0[p * N + n]
  const float* x;    // x[i, 0, h, p0]: token stride xs
  const float* dtp;  // softplus(dt[i, :, h]), T
  const float* a;    // exp(dtp * A[h]) per token (one decay per head), else nullptr
  const float* Ah;   // A[h, :] (per-state decay)
  const float* B;    // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* y;     // y[i, 0, h, p0]: token stride xs
  float* sout;  // final state [i, h, p0, 0]
  float* ck;    // checkpoints [i, h, 0, p0, 0] (chunk stride P * N), or nullptr
  int64_t T, N, pl, xs, bs, ck_stride;
  float* St;       // [N][L]: S / P (kept between chunks)
  float* Pv;       // Np: accumulated per-state decay (per-state A)
  float* scratch;  // 4 * Np
  float P;         // accumulated decay (one decay per head)
};

// One token: S[n][:] += b[n] u; out = sum_n c[n] S[n][:]. Even and odd n use separate
// accumulators so that the FMA latency (4 cycles) never limits the loop.
template <int V>
RC_INLINE void rows_fwd_token(float* __restrict St, const float* __restrict b, const float* __restrict c,
                              const vf* u, vf* out, int64_t N) {
  constexpr int L = 16 * V;
  vf e[V], o[V];
  for (int v = 0; v < V; ++v) e[v] = o[v] = vf{};
  int64_t n = 0;
  for (; n + 2 <= N; n += 2) {
    float* sp = St + n * L;
    const float b0 = b[n], c0 = c[n], b1 = b[n + 1], c1 = c[n + 1];
    for (int v = 0; v < V; ++v) {
      vf s0 = vload(sp + 16 * v) + b0 * u[v];
      vf s1 = vload(sp + L + 16 * v) + b1 * u[v];
      vstore(sp + 16 * v, s0);
      vstore(sp + L + 16 * v, s1);
      e[v] += c0 * s0;
      o[v] += c1 * s1;
    }
  }
  if (n < N) {
    float* sp = St + n * L;
    for (int v = 0; v < V; ++v) {
      vf s0 = vload(sp + 16 * v) + b[n] * u[v];
      vstore(sp + 16 * v, s0);
      e[v] += c[n] * s0;
    }
  }
  for (int v = 0; v < V; ++v) out[v] = e[v] + o[v];
}

// M tokens per sweep over the state: each element is loaded and stored once for all M,
// which takes the load/store traffic off the critical path (M FMAs pairs per element).
template <int V, int M>
RC_INLINE void rows_fwd_tokens(float* __restrict St, const float* const* b, const float* const* c,
                               const vf (*u)[V], vf (*out)[V], int64_t N) {
  constexpr int L = 16 * V;
  vf e[M][V], o[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) e[m][v] = o[m][v] = vf{};
  int64_t n = 0;
  for (; n + 2 <= N; n += 2) {
    float* sp = St + n * L;
    for (int v = 0; v < V; ++v) {
      vf s0 = vload(sp + 16 * v), s1 = vload(sp + L + 16 * v);
      for (int m = 0; m < M; ++m) {
        s0 += b[m][n] * u[m][v];
        s1 += b[m][n + 1] * u[m][v];
        e[m][v] += c[m][n] * s0;
        o[m][v] += c[m][n + 1] * s1;
      }
      vstore(sp + 16 * v, s0);
      vstore(sp + L + 16 * v, s1);
    }
  }
  if (n < N) {
    float* sp = St + n * L;
    for (int v = 0; v < V; ++v) {
      vf s0 = vload(sp + 16 * v);
      for (int m = 0; m < M; ++m) {
        s0 += b[m][n] * u[m][v];
        e[m][v] += c[m][n] * s0;
      }
      vstore(sp + 16 * v, s0);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) out[m][v] = e[m][v] + o[m][v];
}

constexpr int64_t kPrefetch = 4;  // tokens ahead: rows of x, y, dt are far apart in memory

// Prefetches the `len` floats at p (for writing when w).
RC_INLINE void prefetch_row(const float* p, int64_t len, bool w) {
  for (int64_t k = 0; k < len; k += 16) {
    if (w)
      __builtin_prefetch(p + k, 1);
    else
      __builtin_prefetch(p + k, 0);
  }
}

template <int V>
RC_INLINE void load_u(const float* xt, int64_t pl, float scale, vf* u) {
  for (int v = 0; v < V; ++v) {
    const int64_t m = std::min<int64_t>(16, pl - 16 * v);
    u[v] = (m >= 16 ? vload(xt + 16 * v) : m > 0 ? vload_part(xt + 16 * v, m) : vf{}) * scale;
  }
}

template <int V>
RC_INLINE void store_y(float* yt, int64_t pl, float scale, const vf* acc) {
  for (int v = 0; v < V; ++v) {
    const int64_t m = std::min<int64_t>(16, pl - 16 * v);
    if (m >= 16)
      vstore(yt + 16 * v, acc[v] * scale);
    else if (m > 0)
      vstore_part(yt + 16 * v, acc[v] * scale, m);
  }
}

template <int V>
void rows_fwd_begin(RowsFwd& f) {
  constexpr int L = 16 * V;
  const int64_t N = f.N, Np = (N + 15) / 16 * 16;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t l = 0; l < L; ++l) f.St[n * L + l] = l < f.pl ? f.s0[l * N + n] : 0.0f;
  for (int64_t n = 0; n < Np; ++n) f.Pv[n] = 1.0f;
  f.P = 1.0f;
}

// The state entering chunk t / kCkChunk into the checkpoints (one decay per head).
template <int V>
void rows_fwd_save(const RowsFwd& f, int64_t t) {
  constexpr int L = 16 * V;
  float* o = f.ck + t / kCkChunk * f.ck_stride;
  for (int64_t l = 0; l < f.pl; ++l)
    for (int64_t n = 0; n < f.N; ++n) o[l * f.N + n] = f.St[n * L + l] * f.P;
}

template <int V>
void rows_fwd_end(const RowsFwd& f) {
  constexpr int L = 16 * V;
  for (int64_t l = 0; l < f.pl; ++l)
    for (int64_t n = 0; n < f.N; ++n) f.sout[l * f.N + n] = f.St[n * L + l] * (f.a ? f.P : f.Pv[n]);
}

// Advances one unit over tokens [t0, t1).
template <int V>
RC_INLINE void rows_fwd_run(RowsFwd& f, int64_t t0, int64_t t1) {
  constexpr int L = 16 * V;
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl, T = f.T;
  float* St = f.St;
  float* Pv = f.Pv;
  float* pn = f.scratch;
  float* an = pn + Np;
  float* bt = an + Np;
  float* ct = bt + Np;
  float P = f.P;
  vf u0[V], o0[V];
  for (int64_t t = t0; t < t1;) {
    for (int64_t k = 0; k < 4; ++k)
      if (t + 2 * kPrefetch + k < T) {
        prefetch_row(f.x + (t + 2 * kPrefetch + k) * f.xs, pl, false);
        prefetch_row(f.y + (t + 2 * kPrefetch + k) * f.xs, pl, true);
      }
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    const float* xt = f.x + t * f.xs;
    float* yt = f.y + t * f.xs;
    if (f.a) {
      // The common case: kM tokens in one sweep, when no renormalisation falls inside.
      constexpr int kM = 2;
      if (t + kM <= t1) {
        float pm[kM];
        bool ok = true;
        float q = P;
        for (int m = 0; m < kM; ++m) {
          q *= f.a[t + m];
          pm[m] = q;
          ok &= in_range(q);
        }
        if (ok) {
          vf um[kM][V], om[kM][V];
          const float* bm[kM];
          const float* cm[kM];
          for (int m = 0; m < kM; ++m) {
            load_u<V>(xt + m * f.xs, pl, f.dtp[t + m] / pm[m], um[m]);
            bm[m] = Bt + m * f.bs;
            cm[m] = Ct + m * f.bs;
          }
          rows_fwd_tokens<V, kM>(St, bm, cm, um, om, N);
          for (int m = 0; m < kM; ++m) store_y<V>(yt + m * f.xs, pl, pm[m], om[m]);
          P = pm[kM - 1];
          t += kM;
          continue;
        }
      }
      const float p0 = P * f.a[t];
      if (!in_range(p0)) {  // multiply the state out (also catches a == 0 and NaN)
        for (int64_t k = 0; k < N * L; ++k) St[k] *= p0;
        P = 1.0f;
      } else {
        P = p0;
      }
      load_u<V>(xt, pl, f.dtp[t] / P, u0);
      rows_fwd_token<V>(St, Bt, Ct, u0, o0, N);
      store_y<V>(yt, pl, P, o0);
    } else {
      exp_row(f.Ah, f.dtp[t], N, Np, an);
      bool renorm = false;
      for (int64_t n = 0; n < N; ++n) {
        pn[n] = Pv[n] * an[n];
        renorm |= !in_range(pn[n]);
      }
      if (renorm) {
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t l = 0; l < L; ++l) St[n * L + l] *= pn[n];
          Pv[n] = 1.0f;
        }
      } else {
        for (int64_t n = 0; n < N; ++n) Pv[n] = pn[n];
      }
      for (int64_t n = 0; n < N; ++n) {
        bt[n] = Bt[n] / Pv[n];
        ct[n] = Ct[n] * Pv[n];
      }
      load_u<V>(xt, pl, f.dtp[t], u0);
      rows_fwd_token<V>(St, bt, ct, u0, o0, N);
      store_y<V>(yt, pl, 1.0f, o0);
    }
    t += 1;
  }
  f.P = P;
}

RC_SIMD void rows_fwd_run16(RowsFwd& f, int64_t t0, int64_t t1) { rows_fwd_run<1>(f, t0, t1); }
RC_SIMD void rows_fwd_run32(RowsFwd& f, int64_t t0, int64_t t1) { rows_fwd_run<2>(f, t0, t1); }

// ======================================================================================
// Forward, heads layout (P == 1): 16 heads of one group per vector.
// ======================================================================================

struct HeadsFwd {
  const float* x;  // x[i, 0, h0, 0]: token stride H (also dt, y)
  const float* dt;
  const float* B;  // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* y;
  int64_t T, N, NA, nl, H, bs;
  float* St;  // [N][16] (kept between chunks)
  float* AT;  // [N][16]: A of the 16 heads
};

// Advances one block of 16 heads over tokens [t0, t1), t1 - t0 <= kChunk. The softplus
// and the exps of the whole chunk come first, in batches: inside the token loop their
// latency would sit on the critical path of every token. `abuf` holds
// kChunk * max(N, 1) rows of 16.
RC_SIMD void heads_fwd_run(const HeadsFwd& f, int64_t t0, int64_t t1, float* abuf) {
  const int64_t N = f.N, nl = f.nl, na = f.NA == 1 ? 1 : N;
  float* St = f.St;
  alignas(64) float dbuf[kChunk * 16], ubuf[kChunk * 16];
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kChunk < f.T) {
      const int64_t o = (t + kChunk) * f.H;
      __builtin_prefetch(f.dt + o);
      __builtin_prefetch(f.x + o);
      __builtin_prefetch(f.y + o, 1);
    }
    const float* dtt = f.dt + t * f.H;
    const float* xt = f.x + t * f.H;
    vf z = nl == 16 ? vload(dtt) : vload_part(dtt, nl);
    vf xv = nl == 16 ? vload(xt) : vload_part(xt, nl);
    vf d = vsoftplus(z);
    vstore(dbuf + (t - t0) * 16, d);
    vstore(ubuf + (t - t0) * 16, xv * d);
  }
  exp_rows_best(dbuf, f.AT, na, t1 - t0, abuf);
  for (int64_t t = t0; t < t1; ++t) {
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    const float* at = abuf + (t - t0) * na * 16;
    const vf u = vload(ubuf + (t - t0) * 16);
    vf acc0 = {}, acc1 = {};
    const int64_t as = na == 1 ? 0 : 16;  // one decay for all n, or one per n
    int64_t n = 0;
    for (; n + 2 <= N; n += 2) {
      vf s0 = vload(St + n * 16) * vload(at + n * as) + Bt[n] * u;
      vf s1 = vload(St + n * 16 + 16) * vload(at + (n + 1) * as) + Bt[n + 1] * u;
      vstore(St + n * 16, s0);
      vstore(St + n * 16 + 16, s1);
      acc0 += Ct[n] * s0;
      acc1 += Ct[n + 1] * s1;
    }
    if (n < N) {
      vf s0 = vload(St + n * 16) * vload(at + n * as) + Bt[n] * u;
      vstore(St + n * 16, s0);
      acc0 += Ct[n] * s0;
    }
    float* yt = f.y + t * f.H;
    if (nl == 16)
      vstore(yt, acc0 + acc1);
    else
      vstore_part(yt, acc0 + acc1, nl);
  }
}

// Rows layout: channels per unit (the state block stays within L1/L2). 32 lanes are two
// 16-float vectors per row of the state: one register each with AVX-512's 32 registers;
// with AVX2's 16 (each vector two registers) the token loops of 32 lanes spill to the
// stack on every element, so there a unit is 16 lanes (5x faster on an AVX2 CPU).
int64_t rows_lanes(const Dims& d) { return d.P <= 16 || !wide_registers() ? 16 : 32; }

void scan_forward(KernelCtx& c) {
  const Dims d = dims_of(c.src, 0);
  const float* s = c.src[0].f32();
  const float* x = c.src[1].f32();
  const float* dt = c.src[2].f32();
  const float* A = c.src[3].f32();
  const float* B = c.src[4].f32();
  const float* C = c.src[5].f32();
  const int32_t* ids = c.src[6].i32();
  check_ids(ids, d, "ssm_scan");
  float* y = c.dst.f32();
  float* sout = y + d.S * d.T * d.H * d.P;
  float* ck = !c.node.ip.empty() && c.node.ip[0] != 0 ? sout + d.S * d.H * d.P * d.N : nullptr;
  const int64_t Np = (d.N + 15) / 16 * 16;
  std::vector<Work> work(c.pool.size());
  if (d.T == 1 && d.P > 1) {  // one token: see step_row
    c.pool.run(d.S * d.H, [&](int64_t task, int tid) {
      const int64_t i = task / d.H, h = task % d.H, g = h / d.hpg;
      float* an = work[tid].get(Np);
      float dtp, a;
      dt_column(dt + i * d.H + h, d.H, 1, A[h * d.NA], &dtp, &a, nullptr);
      if (d.per_n)
        exp_row(A + h * d.NA, dtp, d.N, Np, an);
      else
        std::fill(an, an + d.N, a);
      const float* Bi = B + (i * d.G + g) * d.N;
      const float* Ci = C + (i * d.G + g) * d.N;
      const float* s0 = s + (ids[i] * d.H + h) * d.P * d.N;
      const int64_t ih = i * d.H + h;
      for (int64_t p = 0; p < d.P; ++p)
        y[ih * d.P + p] = step_row(s0 + p * d.N, an, dtp * x[ih * d.P + p], Bi, Ci,
                                   sout + (ih * d.P + p) * d.N, d.N);
      if (ck) std::copy(s0, s0 + d.P * d.N, ck + ih * d.P * d.N);  // the state entering chunk 0
    });
    return;
  }
  if (d.P == 1) {
    const int64_t nbg = (d.hpg + 15) / 16;  // 16-head blocks per group
    const int64_t bpt = 8;                  // blocks per task
    const int64_t ntg = (nbg + bpt - 1) / bpt;
    c.pool.run(d.S * d.G * ntg, [&](int64_t task, int tid) {
      const int64_t i = task / (d.G * ntg), g = task / ntg % d.G, b0 = task % ntg * bpt;
      const int64_t nb = std::min(bpt, nbg - b0);
      float* wk = work[tid].get((nb * 2 + kChunk) * d.N * 16);
      float* abuf = wk + nb * 2 * d.N * 16;
      std::vector<HeadsFwd> fs(nb);
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t h0 = g * d.hpg + (b0 + k) * 16;
        HeadsFwd& f = fs[k];
        f.x = x + (i * d.T * d.H + h0);
        f.dt = dt + (i * d.T * d.H + h0);
        f.B = B + (i * d.T * d.G + g) * d.N;
        f.C = C + (i * d.T * d.G + g) * d.N;
        f.y = y + (i * d.T * d.H + h0);
        f.T = d.T;
        f.N = d.N;
        f.NA = d.NA;
        f.nl = std::min<int64_t>(16, d.hpg - (b0 + k) * 16);
        f.H = d.H;
        f.bs = d.G * d.N;
        f.St = wk + k * 2 * d.N * 16;
        f.AT = f.St + d.N * 16;
        const float* s0 = s + (ids[i] * d.H + h0) * d.N;
        for (int64_t n = 0; n < d.N; ++n)
          for (int64_t l = 0; l < 16; ++l) {
            f.St[n * 16 + l] = l < f.nl ? s0[l * d.N + n] : 0.0f;
            f.AT[n * 16 + l] = l < f.nl ? A[(h0 + l) * d.NA + (d.NA == 1 ? 0 : n)] : 0.0f;
          }
      }
      const int64_t K = heads_seg_len(d.T), nseg = heads_n_seg(d.T);
      auto save = [&](int64_t sg) {  // the state before segment sg, as ck[i, sg, h, :]
        for (int64_t k = 0; k < nb; ++k) {
          float* o = ck + ((i * nseg + sg) * d.H + g * d.hpg + (b0 + k) * 16) * d.N;
          for (int64_t l = 0; l < fs[k].nl; ++l)
            for (int64_t n = 0; n < d.N; ++n) o[l * d.N + n] = fs[k].St[n * 16 + l];
        }
      };
      if (ck && d.T > 0) save(0);
      for (int64_t t0 = 0; t0 < d.T;) {
        int64_t t1 = std::min(d.T, t0 + kChunk);
        if (ck) t1 = std::min(t1, (t0 / K + 1) * K);  // chunks never straddle a checkpoint
        for (int64_t k = 0; k < nb; ++k) heads_fwd_run(fs[k], t0, t1, abuf);
        if (ck && t1 % K == 0 && t1 < d.T) save(t1 / K);
        t0 = t1;
      }
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t h0 = g * d.hpg + (b0 + k) * 16;
        float* so = sout + (i * d.H + h0) * d.N;
        for (int64_t l = 0; l < fs[k].nl; ++l)
          for (int64_t n = 0; n < d.N; ++n) so[l * d.N + n] = fs[k].St[n * 16 + l];
      }
    });
    return;
  }
  const int64_t L = rows_lanes(d), npb = (d.P + L - 1) / L;
  const int64_t hpt = std::max<int64_t>(1, 4 / npb);  // heads per task: about 4 units
  const int64_t nth = (d.H + hpt - 1) / hpt;
  const int64_t unit_floats = d.N * L + 5 * Np + 2 * d.T;
  c.pool.run(d.S * nth, [&](int64_t task, int tid) {
    const int64_t i = task / nth, h0 = task % nth * hpt, nh = std::min(hpt, d.H - h0);
    float* wk = work[tid].get(nh * npb * unit_floats);
    std::vector<RowsFwd> fs(nh * npb);
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = h0 + hh, g = h / d.hpg;
      float* dtp = wk + hh * npb * unit_floats + d.N * L + 5 * Np;  // shared by the head's units
      float* a = dtp + d.T;
      dt_column(dt + i * d.T * d.H + h, d.H, d.T, A[h * d.NA], dtp, d.per_n ? nullptr : a, nullptr);
      for (int64_t pb = 0; pb < npb; ++pb) {
        const int64_t p0 = pb * L;
        RowsFwd& f = fs[hh * npb + pb];
        float* uw = wk + (hh * npb + pb) * unit_floats;
        f.s0 = s + ((ids[i] * d.H + h) * d.P + p0) * d.N;
        f.x = x + (i * d.T * d.H + h) * d.P + p0;
        f.dtp = dtp;
        f.a = d.per_n ? nullptr : a;
        f.Ah = A + h * d.NA;
        f.B = B + (i * d.T * d.G + g) * d.N;
        f.C = C + (i * d.T * d.G + g) * d.N;
        f.y = y + (i * d.T * d.H + h) * d.P + p0;
        f.sout = sout + ((i * d.H + h) * d.P + p0) * d.N;
        f.ck_stride = d.P * d.N;
        f.ck = ck ? ck + ((i * d.H + h) * ((d.T + kCkChunk - 1) / kCkChunk) * d.P + p0) * d.N : nullptr;
        f.T = d.T;
        f.N = d.N;
        f.pl = std::min(L, d.P - p0);
        f.xs = d.H * d.P;
        f.bs = d.G * d.N;
        f.St = uw;
        f.Pv = uw + d.N * L;
        f.scratch = f.Pv + Np;
        if (L == 16)
          rows_fwd_begin<1>(f);
        else
          rows_fwd_begin<2>(f);
      }
    }
    static_assert(kCkChunk % kChunk == 0, "a checkpoint falls on a chunk start");
    for (int64_t t0 = 0; t0 < d.T; t0 += kChunk)
      for (RowsFwd& f : fs) {
        if (f.ck && t0 % kCkChunk == 0) {
          if (L == 16)
            rows_fwd_save<1>(f, t0);
          else
            rows_fwd_save<2>(f, t0);
        }
        if (L == 16)
          rows_fwd_run16(f, t0, std::min(d.T, t0 + kChunk));
        else
          rows_fwd_run32(f, t0, std::min(d.T, t0 + kChunk));
      }
    for (RowsFwd& f : fs) {
      if (L == 16)
        rows_fwd_end<1>(f);
      else
        rows_fwd_end<2>(f);
    }
  });
}

// ======================================================================================
// Backward, rows layout: one (sequence, head, block of PB channels), state [p][n].
// ======================================================================================

// One unit of the rows backward: (sequence, head, block of pl channels), state [p][n]. A
// task advances a few units chunk by chunk, forward then in reverse, so that the dB and dC
// rows of a chunk stay in L1 while every unit adds to them.
struct RowsBwd {
  const float* s0;   // s[row, h, p0, 0]
  const float* x;    // x[i, 0, h, p0]: token stride xs (also dy, dx)
  const float* dy;
  const float* dsf;  // dL/d(final state) [i, h, p0, 0]
  const float* dtp;  // T
  const float* a;    // T (one decay per head) or nullptr
  const float* Ah;   // A[h, :]
  const float* B;    // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* dx;
  float* ddtp;  // T: dL/d softplus(dt), summed over the head's channel blocks
  float* ds;    // [i, h, p0, 0] (pl x N)
  float* dA;    // NA, summed over the head's channel blocks
  float* dB;    // partial-sum slot [i, 0, g, 0]: token stride bs
  float* dC;
  bool first_in_head;  // write ddtp, dA instead of adding
  int64_t T, N, pl, xs, bs, K;
  // state kept between chunks
  float* S;     // [pl][Np]: S / P in the forward sweep, lam / R in the reverse sweep
  float* anch;  // ceil(T / K) x [pl][Np]: S_t at t = K-1, 2K-1, ..., T-1
  float* zc;    // T x (Np or 1): C_t . dC_t
  float* v;     // rows_bwd_scratch(): per-state vectors and staging
  float P, Zs, dAs;
};

// Scratch of a unit (f.v), in floats: per-state vectors, then per-token staging.
//   0 Pv / Rv | 1 pn | 2 an (bh) | 3 bt (cr) | 4 dc | 5 Z | 6 db | 7 dAv   (Np each)
//   8 Np: for each of two tokens: uv, dyv, du (plp each), dupart (16 plp); then bt2, dc2 /
//   cr2, bh2, db2 (Np each) for the second token of a pair.
size_t rows_bwd_scratch(int64_t Np, int64_t plp) { return static_cast<size_t>(8 * Np + 2 * 19 * plp + 3 * Np); }

size_t rows_bwd_unit_floats(int64_t T, int64_t N, int64_t pl, int64_t K, bool per_n) {
  const int64_t Np = (N + 15) / 16 * 16, plp = (pl + 15) / 16 * 16, nanch = (T + K - 1) / K;
  return static_cast<size_t>(pl * Np * (1 + nanch) + T * (per_n ? Np : 1)) + rows_bwd_scratch(Np, plp);
}

void rows_bwd_begin(RowsBwd& f) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, plp = (f.pl + 15) / 16 * 16;
  const size_t nv = rows_bwd_scratch(Np, plp);
  for (size_t k = 0; k < nv; ++k) f.v[k] = 0.0f;
  for (int64_t p = 0; p < f.pl; ++p)
    for (int64_t n = 0; n < Np; ++n) f.S[p * Np + n] = n < N ? f.s0[p * N + n] : 0.0f;
  for (int64_t n = 0; n < Np; ++n) f.v[n] = 1.0f;  // Pv
  f.P = 1.0f;
}

// Forward sweep of M tokens: for each token m in turn, S[p][:] += u[m][p] b[m] and
// dc[m] = sum_p dy[m][p] S[p][:]. One load and one store of the state serve all M tokens.
template <int NV, int M>
RC_INLINE void fwd_pn_chunk(float* __restrict S, const float* const* b, const float* const* u,
                            const float* const* dy, float* const* dc, int64_t n0, int64_t pl, int64_t Np) {
  vf bv[M][NV], acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) {
      bv[m][j] = vload(b[m] + n0 + 16 * j);
      acc[m][j] = vf{};
    }
  for (int64_t p = 0; p < pl; ++p) {
    float* sp = S + p * Np + n0;
    vf sv[NV];
    for (int j = 0; j < NV; ++j) sv[j] = vload(sp + 16 * j);
    for (int m = 0; m < M; ++m) {
      const vf up = vsplat(u[m][p]), dp = vsplat(dy[m][p]);
      for (int j = 0; j < NV; ++j) {
        sv[j] += up * bv[m][j];
        acc[m][j] += dp * sv[j];
      }
    }
    for (int j = 0; j < NV; ++j) vstore(sp + 16 * j, sv[j]);
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) vstore(dc[m] + n0 + 16 * j, acc[m][j]);
}

template <int M>
RC_INLINE void fwd_pn(float* S, const float* const* b, const float* const* u, const float* const* dy,
                      float* const* dc, int64_t pl, int64_t Np) {
  constexpr int NV = 4;  // with AVX2 1 (wide_registers)
  int64_t n = 0;
  if (wide_registers())
    for (; n + 16 * NV <= Np; n += 16 * NV) fwd_pn_chunk<NV, M>(S, b, u, dy, dc, n, pl, Np);
  for (; n < Np; n += 16) fwd_pn_chunk<1, M>(S, b, u, dy, dc, n, pl, Np);
}

// Reverse sweep of M tokens: for each token m in turn, lam[p][:] += dy[m][p] c[m];
// db[m] = sum_p u[m][p] lam[p][:]; du[m][p] = lam[p][:] . bh[m] (lane sums taken at the end
// from dupart[m], 16 lanes per p).
template <int NV, int M, bool FIRST>
RC_INLINE void rev_pn_chunk(float* __restrict lam, const float* const* c, const float* const* bh,
                            const float* const* u, const float* const* dy, float* const* db,
                            float* const* dupart, int64_t n0, int64_t pl, int64_t Np) {
  vf cv[M][NV], bv[M][NV], acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) {
      cv[m][j] = vload(c[m] + n0 + 16 * j);
      bv[m][j] = vload(bh[m] + n0 + 16 * j);
      acc[m][j] = vf{};
    }
  for (int64_t p = 0; p < pl; ++p) {
    float* lp = lam + p * Np + n0;
    vf lv[NV];
    for (int j = 0; j < NV; ++j) lv[j] = vload(lp + 16 * j);
    for (int m = 0; m < M; ++m) {
      const vf up = vsplat(u[m][p]), dp = vsplat(dy[m][p]);
      vf du = FIRST ? vf{} : vload(dupart[m] + 16 * p);
      for (int j = 0; j < NV; ++j) {
        lv[j] += dp * cv[m][j];
        acc[m][j] += up * lv[j];
        du += lv[j] * bv[m][j];
      }
      vstore(dupart[m] + 16 * p, du);
    }
    for (int j = 0; j < NV; ++j) vstore(lp + 16 * j, lv[j]);
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) vstore(db[m] + n0 + 16 * j, acc[m][j]);
}

template <int M>
RC_INLINE void rev_pn(float* lam, const float* const* c, const float* const* bh, const float* const* u,
                      const float* const* dy, float* const* db, float* const* dupart, float* const* du,
                      int64_t pl, int64_t Np) {
  constexpr int NV = 4;  // with AVX2 1 (wide_registers)
  int64_t n = 0;
  const bool wide = wide_registers();
  if (wide && Np >= 16 * NV) {
    rev_pn_chunk<NV, M, true>(lam, c, bh, u, dy, db, dupart, 0, pl, Np);
    n = 16 * NV;
  } else {
    rev_pn_chunk<1, M, true>(lam, c, bh, u, dy, db, dupart, 0, pl, Np);
    n = 16;
  }
  if (wide)
    for (; n + 16 * NV <= Np; n += 16 * NV) rev_pn_chunk<NV, M, false>(lam, c, bh, u, dy, db, dupart, n, pl, Np);
  for (; n < Np; n += 16) rev_pn_chunk<1, M, false>(lam, c, bh, u, dy, db, dupart, n, pl, Np);
  for (int m = 0; m < M; ++m)
    for (int64_t p0 = 0; p0 < pl; p0 += 16) {
      vf r = hsum16x16(dupart[m] + 16 * p0);
      vstore_part(du[m] + p0, r, std::min<int64_t>(16, pl - p0));
    }
}

// z[n] = sum_p lam[p][n] * S[p][n]
RC_INLINE void dot_pn(const float* lam, const float* S, float* z, int64_t pl, int64_t Np) {
  for (int64_t n = 0; n < Np; n += 16) {
    vf acc = {};
    for (int64_t p = 0; p < pl; ++p) acc += vload(lam + p * Np + n) * vload(S + p * Np + n);
    vstore(z + n, acc);
  }
}

RC_INLINE void scale_pn(float* S, const float* f, int64_t pl, int64_t Np) {
  for (int64_t p = 0; p < pl; ++p)
    for (int64_t n = 0; n < Np; n += 16) vstore(S + p * Np + n, vload(S + p * Np + n) * vload(f + n));
}

// Sum of the 16 lanes, in a fixed order.

// Lanes n0 .. n0 + 15 of a row of N floats (zero past N).
RC_INLINE vf row_at(const float* p, int64_t n0, int64_t N) {
  return n0 + 16 <= N ? vload(p + n0) : vload_part(p + n0, N - n0);
}
RC_INLINE void row_put(float* p, int64_t n0, int64_t N, vf v, bool add) {
  if (add) v += row_at(p, n0, N);
  if (n0 + 16 <= N)
    vstore(p + n0, v);
  else
    vstore_part(p + n0, v, N - n0);
}


struct Stage {
  float *uv, *dyv, *du, *dupart;
};
RC_INLINE Stage stage_of(float* v, int64_t Np, int64_t plp, int m) {
  float* b = v + 8 * Np + m * 19 * plp;
  return {b, b + plp, b + 2 * plp, b + 3 * plp};
}

// K is a power of two.
RC_INLINE bool is_anchor(int64_t t, int64_t K, int64_t T) { return (t & (K - 1)) == K - 1 || t == T - 1; }

// uv = x_t * d_t, dyv = dy_t (the rows of this unit's channels).
RC_INLINE void stage_rows(const RowsBwd& f, int64_t t, const Stage& st) {
  const float d = f.dtp[t];
  const float* xt = f.x + t * f.xs;
  const float* dyt = f.dy + t * f.xs;
  for (int64_t p = 0; p < f.pl; ++p) {
    st.uv[p] = xt[p] * d;
    st.dyv[p] = dyt[p];
  }
}

// After a token of the forward sweep: dC_t = P dc into the slot, C_t . dC_t, the anchor.
RC_INLINE void fwd_post(RowsBwd& f, int64_t t, const float* S, const float* dc, const float* Pv, float P,
                        bool first) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl;
  const bool per_n = f.a == nullptr;
  const float* Ct = f.C + t * f.bs;
  float* dCt = f.dC + t * f.bs;
  vf zacc = {};
  for (int64_t n0 = 0; n0 < Np; n0 += 16) {
    const vf dcn = vload(dc + n0) * (per_n ? vload(Pv + n0) : vsplat(P));
    row_put(dCt, n0, N, dcn, !first);
    const vf z = row_at(Ct, n0, N) * dcn;
    if (per_n)
      vstore(f.zc + t * Np + n0, z);
    else
      zacc += z;
  }
  if (!per_n) f.zc[t] = hsum(zacc);
  if (is_anchor(t, f.K, f.T)) {
    float* at = f.anch + (t / f.K) * pl * Np;
    for (int64_t p = 0; p < pl; ++p)
      for (int64_t n0 = 0; n0 < Np; n0 += 16)
        vstore(at + p * Np + n0, vload(S + p * Np + n0) * (per_n ? vload(Pv + n0) : vsplat(P)));
  }
}

// Forward sweep over tokens [t0, t1): S~, dC (added to the slot; `first` writes it), C.dC,
// anchors. Two tokens per sweep over the state where no renormalisation or anchor falls
// between them.
RC_SIMD void rows_bwd_fwd(RowsBwd& f, int64_t t0, int64_t t1, bool first) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl, T = f.T, K = f.K;
  const int64_t plp = (pl + 15) / 16 * 16;
  const bool per_n = f.a == nullptr;
  float* S = f.S;
  float* v = f.v;
  float *Pv = v, *pn = v + Np, *an = v + 2 * Np, *bt = v + 3 * Np, *dc = v + 4 * Np;
  float* ext = v + 8 * Np + 2 * 19 * plp;
  float *bt2 = ext, *dc2 = ext + Np;
  const Stage s0 = stage_of(v, Np, plp, 0), s1 = stage_of(v, Np, plp, 1);
  float P = f.P;
  for (int64_t t = t0; t < t1;) {
    for (int64_t k = 0; k < 2; ++k)
      if (t + 2 * kPrefetch + k < T) {
        prefetch_row(f.x + (t + 2 * kPrefetch + k) * f.xs, pl, false);
        prefetch_row(f.dy + (t + 2 * kPrefetch + k) * f.xs, pl, false);
      }
    const float* Bt = f.B + t * f.bs;
    if (!per_n && t + 1 < t1 && !is_anchor(t, K, T)) {
      const float p0 = P * f.a[t], p1 = p0 * f.a[t + 1];
      if (in_range(p0) && in_range(p1)) {
        const float i0 = 1.0f / p0, i1 = 1.0f / p1;
        for (int64_t n0 = 0; n0 < Np; n0 += 16) {
          vstore(bt + n0, row_at(Bt, n0, N) * i0);
          vstore(bt2 + n0, row_at(Bt + f.bs, n0, N) * i1);
        }
        stage_rows(f, t, s0);
        stage_rows(f, t + 1, s1);
        const float* bb[2] = {bt, bt2};
        const float* uu[2] = {s0.uv, s1.uv};
        const float* dd[2] = {s0.dyv, s1.dyv};
        float* cc[2] = {dc, dc2};
        fwd_pn<2>(S, bb, uu, dd, cc, pl, Np);
        fwd_post(f, t, S, dc, Pv, p0, first);
        fwd_post(f, t + 1, S, dc2, Pv, p1, first);
        P = p1;
        t += 2;
        continue;
      }
    }
    if (!per_n) {
      const float p = P * f.a[t];
      if (!in_range(p)) {
        for (int64_t k = 0; k < pl * Np; k += 16) vstore(S + k, vload(S + k) * p);
        P = 1.0f;
      } else {
        P = p;
      }
      const float ip = 1.0f / P;
      for (int64_t n0 = 0; n0 < Np; n0 += 16) vstore(bt + n0, row_at(Bt, n0, N) * ip);
    } else {
      exp_row(f.Ah, f.dtp[t], N, Np, an);
      vi bad = {};
      for (int64_t n0 = 0; n0 < Np; n0 += 16) {
        vf q = vload(Pv + n0) * vload(an + n0);
        bad |= !(q >= kPMin && q <= kPMax);
        vstore(pn + n0, q);
      }
      bool renorm = false;
      for (int l = 0; l < 16; ++l) renorm |= bad[l] != 0;
      if (renorm) {
        scale_pn(S, pn, pl, Np);
        for (int64_t n = 0; n < Np; ++n) Pv[n] = 1.0f;
      } else {
        for (int64_t n0 = 0; n0 < Np; n0 += 16) vstore(Pv + n0, vload(pn + n0));
      }
      for (int64_t n0 = 0; n0 < Np; n0 += 16) vstore(bt + n0, row_at(Bt, n0, N) / vload(Pv + n0));
    }
    stage_rows(f, t, s0);
    const float* bb[1] = {bt};
    const float* uu[1] = {s0.uv};
    const float* dd[1] = {s0.dyv};
    float* cc[1] = {dc};
    fwd_pn<1>(S, bb, uu, dd, cc, pl, Np);
    fwd_post(f, t, S, dc, Pv, P, first);
    t += 1;
  }
  f.P = P;
}

// Between the sweeps: lam = dL/d(final state), R = 1.
void rows_bwd_mid(RowsBwd& f) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16;
  for (int64_t p = 0; p < f.pl; ++p)
    for (int64_t n = 0; n < Np; ++n) f.S[p * Np + n] = n < N ? f.dsf[p * N + n] : 0.0f;
  for (int64_t n = 0; n < Np; ++n) {
    f.v[n] = 1.0f;           // Rv
    f.v[7 * Np + n] = 0.0f;  // dAv
  }
  f.P = 1.0f;  // R
  f.Zs = f.dAs = 0.0f;
}

// cr = C_t / R, bh = B_t * R (one decay per head).
RC_INLINE void rev_pre(const RowsBwd& f, int64_t t, float R, float* cr, float* bh) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16;
  const float ir = 1.0f / R;
  const float* Bt = f.B + t * f.bs;
  const float* Ct = f.C + t * f.bs;
  for (int64_t n0 = 0; n0 < Np; n0 += 16) {
    vstore(cr + n0, row_at(Ct, n0, N) * ir);
    vstore(bh + n0, row_at(Bt, n0, N) * R);
  }
}

// After a token of the reverse sweep (one decay per head): dx, dB into the slot, the
// decay gradient G_t = Z_t - B_t . dB_t, dA, ddtp, and Z_{t-1}.
RC_INLINE void rev_post(RowsBwd& f, int64_t t, float R, const float* lam, const float* db, const float* du,
                        float* Z, bool first) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl;
  const float d = f.dtp[t];
  const float* Bt = f.B + t * f.bs;
  const float* xt = f.x + t * f.xs;
  float* dBt = f.dB + t * f.bs;
  float* dxt = f.dx + t * f.xs;
  vf ddv = {};
  for (int64_t p0 = 0; p0 < pl; p0 += 16) {
    const int64_t m = std::min<int64_t>(16, pl - p0);
    const vf dv = vload(du + p0);  // du is padded to a multiple of 16
    if (m == 16)
      vstore(dxt + p0, dv * d);
    else
      vstore_part(dxt + p0, dv * d, m);
    ddv += dv * (m == 16 ? vload(xt + p0) : vload_part(xt + p0, m));
  }
  float dd = hsum(ddv);
  if (is_anchor(t, f.K, f.T)) {  // Z_t exactly from the stored state
    dot_pn(lam, f.anch + (t / f.K) * pl * Np, Z, pl, Np);
    vf z = {};
    for (int64_t n0 = 0; n0 < Np; n0 += 16) z += vload(Z + n0);
    f.Zs = hsum(z) * R;
  }
  vf bdb = {};
  for (int64_t n0 = 0; n0 < Np; n0 += 16) {
    const vf dbn = vload(db + n0) * R;
    row_put(dBt, n0, N, dbn, !first);
    bdb += row_at(Bt, n0, N) * dbn;
  }
  const float G = f.Zs - hsum(bdb);
  f.dAs += G * d;
  dd += G * f.Ah[0];
  if (t > 0) f.Zs = G + f.zc[t - 1];
  f.ddtp[t] = f.first_in_head ? dd : f.ddtp[t] + dd;
}

// Reverse sweep over tokens t1 - 1 down to t0: lam~, dB (added to the slot; `first` writes
// it), dx, ddtp, dA. Two tokens per sweep where no renormalisation or anchor falls between.
RC_SIMD void rows_bwd_rev(RowsBwd& f, int64_t t0, int64_t t1, bool first) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16, pl = f.pl, T = f.T, K = f.K;
  const int64_t plp = (pl + 15) / 16 * 16;
  const bool per_n = f.a == nullptr;
  float* lam = f.S;
  float* v = f.v;
  float *Rv = v, *an = v + 2 * Np, *cr = v + 3 * Np, *Z = v + 5 * Np, *db = v + 6 * Np, *dAv = v + 7 * Np;
  float* bh = an;  // B * R (dead by the time `an` is needed)
  float* ext = v + 8 * Np + 2 * 19 * plp;
  float *cr2 = ext, *bh2 = ext + Np, *db2 = ext + 2 * Np;
  const Stage s0 = stage_of(v, Np, plp, 0), s1 = stage_of(v, Np, plp, 1);
  for (int64_t t = t1 - 1; t >= t0;) {
    for (int64_t k = 0; k < 2; ++k)
      if (t - 2 * kPrefetch - k >= 0) {
        const int64_t o = (t - 2 * kPrefetch - k) * f.xs;
        prefetch_row(f.x + o, pl, false);
        prefetch_row(f.dy + o, pl, false);
        prefetch_row(f.dx + o, pl, true);
      }
    if (!per_n && t - 1 >= t0 && !is_anchor(t, K, T)) {
      const float R0 = f.P, R1 = R0 * f.a[t];
      if (in_range(R1)) {
        rev_pre(f, t, R0, cr, bh);
        rev_pre(f, t - 1, R1, cr2, bh2);
        stage_rows(f, t, s0);
        stage_rows(f, t - 1, s1);
        const float* cc[2] = {cr, cr2};
        const float* bb[2] = {bh, bh2};
        const float* uu[2] = {s0.uv, s1.uv};
        const float* dd[2] = {s0.dyv, s1.dyv};
        float* dbs[2] = {db, db2};
        float* dup[2] = {s0.dupart, s1.dupart};
        float* dus[2] = {s0.du, s1.du};
        rev_pn<2>(lam, cc, bb, uu, dd, dbs, dup, dus, pl, Np);
        rev_post(f, t, R0, lam, db, s0.du, Z, first);
        rev_post(f, t - 1, R1, lam, db2, s1.du, Z, first);
        float R = R1 * f.a[t - 1];
        if (!in_range(R)) {
          for (int64_t k = 0; k < pl * Np; k += 16) vstore(lam + k, vload(lam + k) * R);
          R = 1.0f;
        }
        f.P = R;
        t -= 2;
        continue;
      }
    }
    const float d = f.dtp[t];
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    if (per_n) {
      for (int64_t n0 = 0; n0 < Np; n0 += 16) {
        vstore(cr + n0, row_at(Ct, n0, N) / vload(Rv + n0));
        vstore(bh + n0, row_at(Bt, n0, N) * vload(Rv + n0));
      }
    } else {
      rev_pre(f, t, f.P, cr, bh);
    }
    stage_rows(f, t, s0);
    {
      const float* cc[1] = {cr};
      const float* bb[1] = {bh};
      const float* uu[1] = {s0.uv};
      const float* dd[1] = {s0.dyv};
      float* dbs[1] = {db};
      float* dup[1] = {s0.dupart};
      float* dus[1] = {s0.du};
      rev_pn<1>(lam, cc, bb, uu, dd, dbs, dup, dus, pl, Np);
    }
    if (!per_n) {
      rev_post(f, t, f.P, lam, db, s0.du, Z, first);
      float R = f.P * f.a[t];
      if (!in_range(R)) {
        for (int64_t k = 0; k < pl * Np; k += 16) vstore(lam + k, vload(lam + k) * R);
        R = 1.0f;
      }
      f.P = R;
      t -= 1;
      continue;
    }
    // One decay per state: the same steps with per-state R.
    const float* xt = f.x + t * f.xs;
    float* dBt = f.dB + t * f.bs;
    float* dxt = f.dx + t * f.xs;
    float dd = 0.0f;
    for (int64_t p = 0; p < pl; ++p) {
      dxt[p] = s0.du[p] * d;
      dd += s0.du[p] * xt[p];
    }
    const bool anchor = is_anchor(t, K, T);
    if (anchor) dot_pn(lam, f.anch + (t / K) * pl * Np, Z, pl, Np);  // Z_t exactly
    vf gs = {};
    for (int64_t n0 = 0; n0 < Np; n0 += 16) {
      const vf rv = vload(Rv + n0);
      const vf dbn = vload(db + n0) * rv;
      row_put(dBt, n0, N, dbn, !first);
      const vf z = anchor ? vload(Z + n0) * rv : vload(Z + n0);
      const vf g = z - row_at(Bt, n0, N) * dbn;  // dL/d log a_t[n]
      vstore(dAv + n0, vload(dAv + n0) + g * d);
      gs += g * row_at(f.Ah, n0, N);
      if (t > 0) vstore(Z + n0, g + vload(f.zc + (t - 1) * Np + n0));
    }
    dd += hsum(gs);
    f.ddtp[t] = f.first_in_head ? dd : f.ddtp[t] + dd;
    exp_row(f.Ah, d, N, Np, an);
    vi bad = {};
    for (int64_t n0 = 0; n0 < Np; n0 += 16) {
      vf q = vload(Rv + n0) * vload(an + n0);
      bad |= !(q >= kPMin && q <= kPMax);
      vstore(Rv + n0, q);
    }
    bool renorm = false;
    for (int l = 0; l < 16; ++l) renorm |= bad[l] != 0;
    if (renorm) {
      scale_pn(lam, Rv, pl, Np);
      for (int64_t n = 0; n < Np; ++n) Rv[n] = 1.0f;
    }
    t -= 1;
  }
}

// After the reverse sweep: d_s = lam (times R) and the unit's dA.
void rows_bwd_end(const RowsBwd& f) {
  const int64_t N = f.N, Np = (N + 15) / 16 * 16;
  const bool per_n = f.a == nullptr;
  const float* Rv = f.v;
  const float* dAv = f.v + 7 * Np;
  for (int64_t p = 0; p < f.pl; ++p)
    for (int64_t n = 0; n < N; ++n) f.ds[p * N + n] = f.S[p * Np + n] * (per_n ? Rv[n] : f.P);
  if (per_n) {
    for (int64_t n = 0; n < N; ++n) f.dA[n] = f.first_in_head ? dAv[n] : f.dA[n] + dAv[n];
  } else {
    f.dA[0] = f.first_in_head ? f.dAs : f.dA[0] + f.dAs;
  }
}

int64_t rows_bwd_block(const Dims& d) {
  const int64_t Np = (d.N + 15) / 16 * 16;
  return std::max<int64_t>(1, std::min<int64_t>(d.P, 4096 / Np));
}

// ======================================================================================
// Backward, heads layout (P == 1): 16 heads of one group per vector, state [n][16].
// ======================================================================================

// One block of 16 heads (P == 1). A task walks the segments of K tokens in reverse and,
// within a segment, all its blocks; the per-lane dB and dC terms of the segment are summed
// over the blocks first and reduced across lanes once.
struct HeadsBwd {
  const float* s0;  // s[row, h0, 0, 0]
  const float* x;   // x[i, 0, h0, 0]: token stride H (also dt, dy, dx, ddt)
  const float* dt;
  const float* dy;
  const float* dsf;  // [i, h0, 0, 0]
  const float* B;    // B[i, 0, g, 0]: token stride bs
  const float* C;
  float* dx;
  float* ddt;
  float* ds;  // [i, h0, 0, 0]
  float* dA;  // partial [i, h0, :]: head stride NA
  int64_t T, N, NA, nl, H, bs;
  float* AT;   // [N][16]: A of the 16 heads
  float* St;   // [N][16]: the state (pass 1), then lam
  float* dAa;  // [N][16]: dA terms
  float* ck;   // nseg x [N][16]: the state before each segment
};

// Softplus, exps and state of one block over tokens [t0, t1), t1 - t0 <= K: d and u = x d
// go to dbuf/ubuf (16 per token), a to abuf (na rows of 16 per token), S_t to sbuf when
// not null. S is advanced in place.
RC_SIMD void heads_seg_forward(const HeadsBwd& f, float* S, int64_t t0, int64_t t1, float* dbuf, float* ubuf,
                               float* abuf, float* sbuf) {
  const int64_t N = f.N, nl = f.nl, na = f.NA == 1 ? 1 : N;
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kChunk < f.T) {
      __builtin_prefetch(f.dt + (t + kChunk) * f.H);
      __builtin_prefetch(f.x + (t + kChunk) * f.H);
    }
    const float* dtt = f.dt + t * f.H;
    const float* xt = f.x + t * f.H;
    vf z = nl == 16 ? vload(dtt) : vload_part(dtt, nl);
    vf xv = nl == 16 ? vload(xt) : vload_part(xt, nl);
    vf d = vsoftplus(z);
    vstore(dbuf + (t - t0) * 16, d);
    vstore(ubuf + (t - t0) * 16, xv * d);
  }
  exp_rows_best(dbuf, f.AT, na, t1 - t0, abuf);
  const int64_t as = na == 1 ? 0 : 16;
  for (int64_t t = t0; t < t1; ++t) {
    const float* Bt = f.B + t * f.bs;
    const float* at = abuf + (t - t0) * na * 16;
    const vf u = vload(ubuf + (t - t0) * 16);
    float* so = sbuf ? sbuf + (t - t0) * N * 16 : nullptr;
    for (int64_t n = 0; n < N; ++n) {
      vf sv = vload(S + n * 16) * vload(at + n * as) + Bt[n] * u;
      vstore(S + n * 16, sv);
      if (so) vstore(so + n * 16, sv);
    }
  }
}

// Reverse walk of one block over tokens t1 - 1 down to t0, given S_t (sbuf), the state
// before t0 (sprev), a_t, d_t, u_t from heads_seg_forward. Adds the per-lane dC and dB
// terms to dcv/dbv ([token][Np][16]); writes dx, ddt; updates lam (f.St) and dA terms.
RC_SIMD void heads_seg_reverse(const HeadsBwd& f, int64_t t0, int64_t t1, const float* sprev, const float* sbuf,
                               const float* abuf, const float* dbuf, const float* ubuf, float* dcv,
                               float* dbv, int64_t Np) {
  const int64_t N = f.N, nl = f.nl, na = f.NA == 1 ? 1 : N, as = na == 1 ? 0 : 16;
  float* lam = f.St;
  float* dAa = f.dAa;
  const float* AT = f.AT;
  auto lanes = [&](const float* p) { return nl == 16 ? vload(p) : vload_part(p, nl); };
  for (int64_t t = t1 - 1; t >= t0; --t) {
    if (t >= kChunk) {
      const int64_t o = (t - kChunk) * f.H;
      __builtin_prefetch(f.dy + o);
      __builtin_prefetch(f.dx + o, 1);
      __builtin_prefetch(f.ddt + o, 1);
    }
    const int64_t tt = t - t0;
    const float* Sc = sbuf + tt * N * 16;
    const float* Sp = tt > 0 ? sbuf + (tt - 1) * N * 16 : sprev;
    const float* at = abuf + tt * na * 16;
    const float* Bt = f.B + t * f.bs;
    const float* Ct = f.C + t * f.bs;
    float* dct = dcv + tt * Np * 16;
    float* dbt = dbv + tt * Np * 16;
    const vf dv = vload(dbuf + tt * 16);
    const vf u = vload(ubuf + tt * 16);
    const vf dyv = lanes(f.dy + t * f.H);
    const vf xv = lanes(f.x + t * f.H);
    vf du = {}, gA = {};
    for (int64_t n = 0; n < N; ++n) {
      const vf av = vload(at + n * as);
      const vf lv = vload(lam + n * 16) + dyv * Ct[n];
      vstore(dct + n * 16, vload(dct + n * 16) + dyv * vload(Sc + n * 16));
      vstore(dbt + n * 16, vload(dbt + n * 16) + lv * u);
      du += lv * Bt[n];
      const vf gv = lv * av * vload(Sp + n * 16);  // dL/d log a_t
      vstore(dAa + n * 16, vload(dAa + n * 16) + gv * dv);
      gA += gv * vload(AT + n * 16);
      vstore(lam + n * 16, lv * av);
    }
    const vf dx = du * dv;
    const vf ddt = (du * xv + gA) * vsigmoid(lanes(f.dt + t * f.H));
    float* dxt = f.dx + t * f.H;
    float* ddtt = f.ddt + t * f.H;
    if (nl == 16) {
      vstore(dxt, dx);
      vstore(ddtt, ddt);
    } else {
      vstore_part(dxt, dx, nl);
      vstore_part(ddtt, ddt, nl);
    }
  }
}

// Sums the lanes of the segment's dC and dB terms into the slot rows of tokens [t0, t1).
RC_SIMD void heads_seg_reduce(const float* dcv, const float* dbv, int64_t t0, int64_t t1, int64_t N, int64_t Np,
                              float* dC, float* dB, int64_t bs) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t tt = t - t0;
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      const int64_t m = std::min<int64_t>(16, N - n0);
      vstore_part(dC + t * bs + n0, hsum16x16(dcv + (tt * Np + n0) * 16), m);
      vstore_part(dB + t * bs + n0, hsum16x16(dbv + (tt * Np + n0) * 16), m);
    }
  }
}

// ---- backward driver ----------------------------------------------------------------

// Tasks are (sequence, group, split); each split covers a fixed range of heads (rows
// layout) or 16-head blocks (heads layout) and owns a slot of partial dB, dC. The split
// count depends on the shapes only, never on the thread count.
int64_t n_splits(const Dims& d, int64_t units_per_group) {
  const int64_t want = (8 + d.S * d.G - 1) / std::max<int64_t>(1, d.S * d.G);
  return std::max<int64_t>(1, std::min(want, units_per_group));
}

void scan_backward(KernelCtx& c) {
  const Dims d = dims_of(c.src, 1);
  const float* gy = c.src[0].f32();
  const float* s = c.src[1].f32();
  const float* x = c.src[2].f32();
  const float* dt = c.src[3].f32();
  const float* A = c.src[4].f32();
  const float* B = c.src[5].f32();
  const float* C = c.src[6].f32();
  const int32_t* ids = c.src[7].i32();
  check_ids(ids, d, "ssm_scan_back");
  const float* gs = gy + d.S * d.T * d.H * d.P;  // dL/d(final states)
  float* o_ds = c.dst.f32();
  float* o_dx = o_ds + d.R * d.H * d.P * d.N;
  float* o_ddt = o_dx + d.S * d.T * d.H * d.P;
  float* o_dA = o_ddt + d.S * d.T * d.H;
  float* o_dB = o_dA + d.H * d.NA;
  float* o_dC = o_dB + d.S * d.T * d.G * d.N;
  const int64_t nB = d.S * d.T * d.G * d.N, nstate = d.H * d.P * d.N;

  // d_s goes straight to row ids[i] when every row is used once; otherwise to a
  // per-sequence buffer summed into the rows in sequence order below.
  std::vector<char> used(d.R, 0);
  bool shared = false;
  for (int64_t i = 0; i < d.S; ++i) {
    shared |= used[ids[i]] != 0;
    used[ids[i]] = 1;
  }
  std::vector<float> ds_seq(shared ? d.S * nstate : 0);
  auto ds_of = [&](int64_t i) { return shared ? ds_seq.data() + i * nstate : o_ds + ids[i] * nstate; };

  const bool heads = d.P == 1;
  const int64_t nbg = (d.hpg + 15) / 16;
  const int64_t units = heads ? nbg : d.hpg;  // per group
  const int64_t nsplit = n_splits(d, units);
  std::vector<float> slots(static_cast<size_t>((nsplit - 1) * 2 * nB));
  auto slot_B = [&](int64_t j) { return j == 0 ? o_dB : slots.data() + (j - 1) * 2 * nB; };
  auto slot_C = [&](int64_t j) { return j == 0 ? o_dC : slots.data() + (j - 1) * 2 * nB + nB; };
  std::vector<float> dA_part(static_cast<size_t>(d.S * d.H * d.NA));
  std::vector<Work> work(c.pool.size());

  if (d.T == 0) {  // no tokens: dB, dC are empty, d_s = dL/d(final state)
    for (int64_t i = 0; i < d.S; ++i) std::memcpy(ds_of(i), gs + i * nstate, nstate * sizeof(float));
  } else if (heads) {
    const int64_t K = heads_seg_len(d.T), nseg = heads_n_seg(d.T);
    const int64_t Np = (d.N + 15) / 16 * 16, na = d.NA == 1 ? 1 : d.N;
    // checkpoints saved by the forward (a 9th source: its packed result), if any
    const float* ckf = c.src.size() > 8 ? c.src[8].f32() + d.S * d.T * d.H + d.S * d.H * d.N : nullptr;
    const int64_t blk_floats = d.N * 16 * (3 + nseg);
    const int64_t seg_floats = K * 16 * (2 + na + d.N + 2 * Np);
    c.pool.run(d.S * d.G * nsplit, [&](int64_t task, int tid) {
      const int64_t i = task / (d.G * nsplit), g = task / nsplit % d.G, j = task % nsplit;
      const int64_t b0 = j * units / nsplit, nb = (j + 1) * units / nsplit - b0;
      float* wk = work[tid].get(nb * blk_floats + seg_floats);
      float* dbuf = wk + nb * blk_floats;
      float* ubuf = dbuf + K * 16;
      float* abuf = ubuf + K * 16;
      float* sbuf = abuf + K * na * 16;
      float* dcv = sbuf + K * d.N * 16;
      float* dbv = dcv + K * Np * 16;
      std::vector<HeadsBwd> fs(nb);
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t h0 = g * d.hpg + (b0 + k) * 16;
        HeadsBwd& f = fs[k];
        f.s0 = s + (ids[i] * d.H + h0) * d.N;
        f.x = x + i * d.T * d.H + h0;
        f.dt = dt + i * d.T * d.H + h0;
        f.dy = gy + i * d.T * d.H + h0;
        f.dsf = gs + (i * d.H + h0) * d.N;
        f.B = B + (i * d.T * d.G + g) * d.N;
        f.C = C + (i * d.T * d.G + g) * d.N;
        f.dx = o_dx + i * d.T * d.H + h0;
        f.ddt = o_ddt + i * d.T * d.H + h0;
        f.ds = ds_of(i) + h0 * d.N;
        f.dA = dA_part.data() + (i * d.H + h0) * d.NA;
        f.T = d.T;
        f.N = d.N;
        f.NA = d.NA;
        f.nl = std::min<int64_t>(16, d.hpg - (b0 + k) * 16);
        f.H = d.H;
        f.bs = d.G * d.N;
        f.AT = wk + k * blk_floats;
        f.St = f.AT + d.N * 16;
        f.dAa = f.St + d.N * 16;
        f.ck = f.dAa + d.N * 16;
        for (int64_t n = 0; n < d.N; ++n)
          for (int64_t l = 0; l < 16; ++l) {
            const bool on = l < f.nl;
            f.AT[n * 16 + l] = on ? A[(h0 + l) * d.NA + (d.NA == 1 ? 0 : n)] : 0.0f;
            f.St[n * 16 + l] = on ? f.s0[l * d.N + n] : 0.0f;
            f.dAa[n * 16 + l] = 0.0f;
          }
      }
      // Pass 1: the state before each segment (the last segment's own run is not needed),
      // read from the forward's checkpoints when it saved them.
      for (int64_t sg = 0; sg < nseg; ++sg) {
        const int64_t t0 = sg * K, t1 = std::min(d.T, t0 + K);
        for (int64_t k = 0; k < nb; ++k) {
          HeadsBwd& f = fs[k];
          float* cks = f.ck + sg * d.N * 16;
          if (ckf) {
            const float* src = ckf + ((i * nseg + sg) * d.H + g * d.hpg + (b0 + k) * 16) * d.N;
            for (int64_t n = 0; n < d.N; ++n)
              for (int64_t l = 0; l < 16; ++l) cks[n * 16 + l] = l < f.nl ? src[l * d.N + n] : 0.0f;
            continue;
          }
          std::memcpy(cks, f.St, d.N * 16 * sizeof(float));
          if (sg + 1 < nseg) heads_seg_forward(f, f.St, t0, t1, dbuf, ubuf, abuf, nullptr);
        }
      }
      // Pass 2: segments in reverse; lam starts as dL/d(final state).
      for (HeadsBwd& f : fs)
        for (int64_t n = 0; n < d.N; ++n)
          for (int64_t l = 0; l < 16; ++l) f.St[n * 16 + l] = l < f.nl ? f.dsf[l * d.N + n] : 0.0f;
      std::vector<float> stmp(d.N * 16);
      for (int64_t sg = nseg - 1; sg >= 0; --sg) {
        const int64_t t0 = sg * K, t1 = std::min(d.T, t0 + K);
        std::fill(dcv, dcv + 2 * K * Np * 16, 0.0f);
        for (HeadsBwd& f : fs) {
          const float* sprev = f.ck + sg * d.N * 16;
          std::memcpy(stmp.data(), sprev, d.N * 16 * sizeof(float));
          heads_seg_forward(f, stmp.data(), t0, t1, dbuf, ubuf, abuf, sbuf);
          heads_seg_reverse(f, t0, t1, sprev, sbuf, abuf, dbuf, ubuf, dcv, dbv, Np);
        }
        heads_seg_reduce(dcv, dbv, t0, t1, d.N, Np, slot_C(j) + (i * d.T * d.G + g) * d.N,
                         slot_B(j) + (i * d.T * d.G + g) * d.N, d.G * d.N);
      }
      for (const HeadsBwd& f : fs) {
        for (int64_t l = 0; l < f.nl; ++l)
          for (int64_t n = 0; n < d.N; ++n) f.ds[l * d.N + n] = f.St[n * 16 + l];
        for (int64_t l = 0; l < f.nl; ++l) {
          if (d.NA == 1) {
            float sacc = 0.0f;
            for (int64_t n = 0; n < d.N; ++n) sacc += f.dAa[n * 16 + l];
            f.dA[l] = sacc;
          } else {
            for (int64_t n = 0; n < d.N; ++n) f.dA[l * d.NA + n] = f.dAa[n * 16 + l];
          }
        }
      }
    });
  } else {
    const int64_t PB = rows_bwd_block(d), npb = (d.P + PB - 1) / PB;
    int64_t K = 64;  // anchor interval: a power of two, at most 16 (+1) anchors
    while (K * 16 < d.T) K *= 2;
    const int64_t hpu = std::max<int64_t>(1, 4 / npb);          // heads advanced together
    const size_t ufl = rows_bwd_unit_floats(d.T, d.N, PB, K, d.per_n);
    c.pool.run(d.S * d.G * nsplit, [&](int64_t task, int tid) {
      const int64_t i = task / (d.G * nsplit), g = task / nsplit % d.G, j = task % nsplit;
      const int64_t hb = g * d.hpg + j * units / nsplit, he = g * d.hpg + (j + 1) * units / nsplit;
      float* wk = work[tid].get(hpu * (npb * ufl + 4 * d.T));
      std::vector<RowsBwd> fs;
      for (int64_t h0 = hb; h0 < he; h0 += hpu) {
        const int64_t nh = std::min(hpu, he - h0);
        fs.clear();
        for (int64_t hh = 0; hh < nh; ++hh) {
          const int64_t h = h0 + hh;
          float* hw = wk + hh * (npb * ufl + 4 * d.T);
          float* dtp = hw + npb * ufl;
          float* a = dtp + d.T;
          float* sig = a + d.T;
          float* ddtp = sig + d.T;  // dL/d softplus(dt) of this head, summed over its blocks
          dt_column(dt + i * d.T * d.H + h, d.H, d.T, A[h * d.NA], dtp, d.per_n ? nullptr : a, sig);
          for (int64_t pb = 0; pb < npb; ++pb) {
            const int64_t p0 = pb * PB;
            RowsBwd f;
            f.s0 = s + ((ids[i] * d.H + h) * d.P + p0) * d.N;
            f.x = x + (i * d.T * d.H + h) * d.P + p0;
            f.dy = gy + (i * d.T * d.H + h) * d.P + p0;
            f.dsf = gs + ((i * d.H + h) * d.P + p0) * d.N;
            f.dtp = dtp;
            f.a = d.per_n ? nullptr : a;
            f.Ah = A + h * d.NA;
            f.B = B + (i * d.T * d.G + g) * d.N;
            f.C = C + (i * d.T * d.G + g) * d.N;
            f.dx = o_dx + (i * d.T * d.H + h) * d.P + p0;
            f.ddtp = ddtp;
            f.ds = ds_of(i) + (h * d.P + p0) * d.N;
            f.dA = dA_part.data() + (i * d.H + h) * d.NA;
            f.dB = slot_B(j) + (i * d.T * d.G + g) * d.N;
            f.dC = slot_C(j) + (i * d.T * d.G + g) * d.N;
            f.first_in_head = pb == 0;
            f.T = d.T;
            f.N = d.N;
            f.pl = std::min(PB, d.P - p0);
            f.xs = d.H * d.P;
            f.bs = d.G * d.N;
            f.K = K;
            const int64_t Np = (d.N + 15) / 16 * 16, nanch = (d.T + K - 1) / K;
            f.S = hw + pb * ufl;
            f.anch = f.S + f.pl * Np;
            f.zc = f.anch + nanch * f.pl * Np;
            f.v = f.zc + d.T * (d.per_n ? Np : 1);
            rows_bwd_begin(f);
            fs.push_back(f);
          }
        }
        const bool first_group = h0 == hb;
        for (int64_t t0 = 0; t0 < d.T; t0 += kChunk)
          for (size_t u = 0; u < fs.size(); ++u)
            rows_bwd_fwd(fs[u], t0, std::min(d.T, t0 + kChunk), first_group && u == 0);
        for (RowsBwd& f : fs) rows_bwd_mid(f);
        for (int64_t t1 = d.T; t1 > 0; t1 -= kChunk)
          for (size_t u = 0; u < fs.size(); ++u)
            rows_bwd_rev(fs[u], std::max<int64_t>(0, t1 - kChunk), t1, first_group && u == 0);
        for (const RowsBwd& f : fs) rows_bwd_end(f);
        for (int64_t hh = 0; hh < nh; ++hh) {
          const float* sig = wk + hh * (npb * ufl + 4 * d.T) + npb * ufl + 2 * d.T;
          const float* ddtp = sig + d.T;
          float* o = o_ddt + i * d.T * d.H + h0 + hh;
          for (int64_t t = 0; t < d.T; ++t) o[t * d.H] = ddtp[t] * sig[t];
        }
      }
    });
  }

  // Fixed-order reductions of the partial sums.
  if (nsplit > 1 && nB > 0) {
    c.pool.parallel_for(nB, kGrainElems, [&](int64_t b, int64_t e, int) {
      for (int64_t j = 1; j < nsplit; ++j) {
        const float* pb = slot_B(j);
        const float* pc = slot_C(j);
        for (int64_t k = b; k < e; ++k) {
          o_dB[k] += pb[k];
          o_dC[k] += pc[k];
        }
      }
    });
  }
  for (int64_t k = 0; k < d.H * d.NA; ++k) {
    float acc = 0.0f;
    for (int64_t i = 0; i < d.S; ++i) acc += dA_part[i * d.H * d.NA + k];
    o_dA[k] = acc;
  }
  if (shared) {
    std::memset(o_ds, 0, static_cast<size_t>(d.R * nstate) * sizeof(float));
    c.pool.parallel_for(nstate, kGrainElems, [&](int64_t b, int64_t e, int) {
      for (int64_t i = 0; i < d.S; ++i) {
        float* dst = o_ds + ids[i] * nstate;
        const float* src = ds_seq.data() + i * nstate;
        for (int64_t k = b; k < e; ++k) dst[k] += src[k];
      }
    });
  } else {
    for (int64_t r = 0; r < d.R; ++r)
      if (!used[r]) std::memset(o_ds + r * nstate, 0, static_cast<size_t>(nstate) * sizeof(float));
  }
}

// ---- op definitions -----------------------------------------------------------------

// Validates (s, x, dt, A, B, C, ids) starting at source `off`; returns the dims.
int64_t scan_packed(const Dims& d) { return d.S * d.T * d.H * d.P + d.S * d.H * d.P * d.N; }

// Floats of the checkpoints a forward saves when asked (ip[0] = 1): head_dim 1 (heads
// layout), or one decay per head (rows layout; see kCkChunk).
int64_t ck_floats(const Dims& d) {
  if (d.P == 1) return d.S * heads_n_seg(d.T) * d.H * d.N;
  return d.S * d.H * ((d.T + kCkChunk - 1) / kCkChunk) * d.P * d.N;
}

Dims scan_check(Graph& g, Node& n, int off) {
  for (int i = off; i < off + 6; ++i) require_f32(g, n, i);
  const Node& idn = g.node(n.src[off + 6]);
  if (idn.dtype != DType::i32)
    throw TypeError(OpTable::get().at(n.op).name + ": ids must be int32, got " + dtype_name(idn.dtype));
  const Shape &s = g.node(n.src[off]).shape, &x = g.node(n.src[off + 1]).shape,
              &dt = g.node(n.src[off + 2]).shape, &A = g.node(n.src[off + 3]).shape,
              &B = g.node(n.src[off + 4]).shape, &C = g.node(n.src[off + 5]).shape, &ids = idn.shape;
  if (s.ndim != 4) fail_shape(g, n, "s must be (n_rows, n_head, head_dim, d_state)");
  if (x.ndim != 4) fail_shape(g, n, "x must be (n_seqs, n_tok, n_head, head_dim)");
  if (dt.ndim != 3) fail_shape(g, n, "dt must be (n_seqs, n_tok, n_head)");
  if (A.ndim != 2) fail_shape(g, n, "A must be (n_head, d_state) or (n_head, 1)");
  if (B.ndim != 4) fail_shape(g, n, "B must be (n_seqs, n_tok, n_group, d_state)");
  if (C != B) fail_shape(g, n, "B and C must have the same shape");
  if (ids.ndim != 1) fail_shape(g, n, "ids must be (n_seqs,)");
  const int64_t S = x[0], T = x[1], H = x[2], P = x[3], N = s[3], G = B[2];
  if (H < 1 || P < 1 || N < 1 || G < 1) fail_shape(g, n, "n_head, head_dim, d_state and n_group must be >= 1");
  if (s[1] != H || s[2] != P) fail_shape(g, n, "s must be (n_rows, n_head, head_dim, d_state) matching x");
  if (s[0] < S) fail_shape(g, n, "s needs at least n_seqs state rows");
  if (dt[0] != S || dt[1] != T || dt[2] != H) fail_shape(g, n, "dt must be (n_seqs, n_tok, n_head) matching x");
  if (A[0] != H || (A[1] != N && A[1] != 1)) fail_shape(g, n, "A must be (n_head, d_state) or (n_head, 1)");
  if (B[0] != S || B[1] != T || B[3] != N) fail_shape(g, n, "B and C must be (n_seqs, n_tok, n_group, d_state)");
  if (H % G != 0) fail_shape(g, n, "n_head must be a multiple of n_group");
  if (ids[0] != S) fail_shape(g, n, "ids must have n_seqs entries");
  Dims d;
  d.R = s[0];
  d.S = S;
  d.T = T;
  d.H = H;
  d.P = P;
  d.N = N;
  d.G = G;
  d.NA = A[1];
  d.hpg = H / G;
  d.per_n = d.NA != 1;
  return d;
}

}  // namespace

void register_ssm_ops(OpTable& t) {
  register_ssm_conv_ops(t);
  {
    OpDef d;
    d.name = "ssm_scan";
    d.contiguous_srcs = 0x7f;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 7) fail_shape(g, n, "takes (s, x, dt, A, B, C, ids)");
      const Dims dm = scan_check(g, n, 0);
      if (n.ip.size() > 1 || (n.ip.size() == 1 && n.ip[0] != 0 && n.ip[0] != 1))
        throw ValueError("ssm_scan: the only parameter is save_checkpoints (0 or 1)");
      const bool ck = n.ip.size() == 1 && n.ip[0] == 1;
      if (ck && dm.P != 1 && dm.per_n)
        throw ValueError("ssm_scan: checkpoints are saved for head_dim 1 or one decay per head only");
      n.dtype = DType::f32;
      n.shape = Shape{scan_packed(dm) + (ck ? ck_floats(dm) : 0)};
    };
    d.forward = scan_forward;
    d.backward = [](GradSink& k) {
      bool any = false;
      for (int i = 0; i < 6; ++i) any |= k.needs(i);
      if (!any) return;
      std::vector<int> src{k.grad_out};
      src.insert(src.end(), k.node.src.begin(), k.node.src.end());
      if (!k.node.ip.empty() && k.node.ip[0] == 1) src.push_back(k.node.id);  // its checkpoints
      const int back = k.g.op("ssm_scan_back", src);
      int64_t off = 0;
      for (int i = 0; i < 6; ++i) {
        const Shape sh = k.g.node(k.node.src[i]).shape;
        if (k.needs(i)) k.add(i, k.g.unpack(back, off, sh));
        off += sh.numel();
      }
    };
    t.add(std::move(d));
  }
  {
    // The gradients of ssm_scan, packed: ds, dx, ddt, dA, dB, dC (shapes of s..C).
    OpDef d;
    d.name = "ssm_scan_back";
    d.contiguous_srcs = 0x1ff;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 8 && n.src.size() != 9)
        fail_shape(g, n, "takes (grad, s, x, dt, A, B, C, ids[, the forward's result with checkpoints])");
      require_f32(g, n, 0);
      const Dims dm = scan_check(g, n, 1);
      const int64_t ck = n.src.size() == 9 ? ck_floats(dm) : 0;
      if (n.src.size() == 9) {
        require_f32(g, n, 8);
        const Shape& fw = g.node(n.src[8]).shape;
        if ((dm.P != 1 && dm.per_n) || fw.ndim != 1 || fw[0] != scan_packed(dm) + ck)
          fail_shape(g, n, "the 9th source must be the forward's packed result with checkpoints");
      }
      const Shape& gr = g.node(n.src[0]).shape;
      if (gr.ndim != 1 || (gr[0] != scan_packed(dm) && gr[0] != scan_packed(dm) + ck))
        fail_shape(g, n, "grad must be the packed (y, final states) gradient");
      int64_t total = 0;
      for (int i = 1; i < 7; ++i) total += g.node(n.src[i]).numel();
      n.dtype = DType::f32;
      n.shape = Shape{total};
    };
    d.forward = scan_backward;
    t.add(std::move(d));
  }
}

}  // namespace recurra

// ssm_scan: Mamba's selective scan (Mamba-1 and Mamba-2), forward and backward, on the CPU:
// what the parts in this directory share. The parts, by job:
//   math.cpp       vectorized exp/softplus rows, dt columns, the dims of a call
//   forward.cpp    the forward, rows and heads layouts (and the checkpoints it saves)
//   back_rows.cpp  the backward, rows layout (P > 1)
//   back_heads.cpp the backward, heads layout (P == 1), from checkpointed segments
//   op.cpp         the op definitions, shape checks and the backward driver (partial sums)
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
//                      PB * Np * (1 + ceil(T / K)) + T * (1 or Np) + 11 Np + 36 plp,
//                      plus 4 T per head (K >= 64 and ceil(T / K) <= 17)
//   per thread, heads: blocks_per_task * 16 N * (3 + ceil(T / K)) + 16 K (2 + N + 3 Np)
//                      (K = max(32, T / 64))
//   shared: (n_split - 1) * 2 * S*T*G*N (partial dB, dC; n_split <= ceil(8 / (S G))),
//   S*H*NA (partial dA), and S*H*P*N when two sequences share a state row.
// For the Mamba-2 case of the benchmark (S 4, T 1024, H 32, P 64, N 128) that is about
// 1.3 MB per thread plus 4 MB of partial sums; storing every state would take 4 GB.
#include <cmath>

#pragma once

#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../ssm.h"

namespace recurra {
namespace ssm {
namespace scan {

// ---- vectorized maths ---------------------------------------------------------------

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


// Renormalise the scaled state when the accumulated decay leaves this range.
constexpr float kPMin = 8.67361737988e-19f;  // 2^-60
constexpr float kPMax = 1.15292150461e18f;   // 2^60
RC_INLINE bool in_range(float p) { return p >= kPMin && p <= kPMax; }

// Sum of the 16 lanes, in a fixed order.
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

// Work is cut in time as well as across heads: a task owns a few (head, channel block)
// units and advances each by kChunk tokens in turn. The rows of x, y and dt that a task
// touches at one token are then adjacent in memory (the prefetchers and the TLB follow),
// while each unit's state stays in L1/L2 during its chunk.
constexpr int64_t kChunk = 16;

// Whether the CPU has 32 vector registers of 16 floats (AVX-512). The token loops of the
// rows layout keep up to ~28 16-float vectors live; with AVX2 (16 registers of 8 floats)
// they must work on fewer at a time or every step spills to the stack.
inline bool wide_registers() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool wide = __builtin_cpu_supports("avx512f");
#else
  static const bool wide = true;
#endif
  return wide;
}

// 8-float vectors for the AVX2 variants of the token loops: one register each there, so a
// loop can be sized to the 16 registers (a 16-float vf is two).
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
RC_INLINE v8 v8load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
RC_INLINE void v8store(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }
RC_INLINE v8 v8splat(float s) { return __builtin_shuffle(v8{s}, v8i{}); }

// Without AVX-512 a 16-float vector that lives across a loop (an accumulator, a select) is
// kept in memory and every broadcast into it is 16 scalar stores, which cost more than a
// token's sweep over the state: the per-token steps around the sweeps use 8-float vectors.
// Lanes n0 .. n0 + 7 of a row of N floats (zero past N), and their store.
RC_INLINE v8 row8_at(const float* p, int64_t n0, int64_t N) {
  if (n0 + 8 <= N) return v8load(p + n0);
  v8 v = {};
  for (int64_t l = 0; n0 + l < N; ++l) v[l] = p[n0 + l];
  return v;
}
RC_INLINE void row8_put(float* p, int64_t n0, int64_t N, v8 v, bool add) {
  if (add) v += row8_at(p, n0, N);
  if (n0 + 8 <= N) {
    v8store(p + n0, v);
  } else {
    for (int64_t l = 0; n0 + l < N; ++l) p[n0 + l] = v[l];
  }
}
RC_INLINE float hsum8(v8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

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

// out[t][j][:] = exp(d[t][:] * A[j][:]) for nt tokens and m rows (rows of 16 lanes): the
// AVX-512 kernel where the CPU has it, else the vexp clones.
void exp_rows_best(const float* d, const float* A, int64_t m, int64_t nt, float* out);

// Heads layout, the per-token vectors of a chunk [t0, t1) of one block of 16 heads (nl of
// them real): d = softplus(dt) and u = x d into dbuf, ubuf (16 floats per token), then
// a = exp(d A) into abuf (na rows of 16 per token, A as AT [na][16]). dt and x have token
// stride H; y, when not null, is prefetched for writing.
RC_INLINE void heads_stage(const float* dt, const float* x, const float* y, const float* AT, int64_t T,
                           int64_t H, int64_t nl, int64_t na, int64_t t0, int64_t t1, float* dbuf, float* ubuf,
                           float* abuf) {
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kChunk < T) {
      const int64_t o = (t + kChunk) * H;
      __builtin_prefetch(dt + o);
      __builtin_prefetch(x + o);
      if (y) __builtin_prefetch(y + o, 1);
    }
    const float* dtt = dt + t * H;
    const float* xt = x + t * H;
    vf z = nl == 16 ? vload(dtt) : vload_part(dtt, nl);
    vf xv = nl == 16 ? vload(xt) : vload_part(xt, nl);
    vf d = vsoftplus(z);
    vstore(dbuf + (t - t0) * 16, d);
    vstore(ubuf + (t - t0) * 16, xv * d);
  }
  exp_rows_best(dbuf, AT, na, t1 - t0, abuf);
}

// (Compiled as clones per x86 level in math.cpp; declared plainly so that callers go
// through the resolver, not to a clone they cannot see.)
// dtp[t] = softplus(dt[t * stride]); a[t] = exp(dtp[t] * A) when a != nullptr;
// sig[t] = sigmoid(dt[t * stride]) when sig != nullptr.
void dt_column(const float* dt, int64_t stride, int64_t T, float A, float* dtp, float* a, float* sig);

// out[n] = exp(d * A[n]) for n < N, 0 up to Np (multiple of 16).
void exp_row(const float* A, float d, int64_t N, int64_t Np, float* out);

struct Dims {
  int64_t R, S, T, H, P, N, G, NA, hpg;
  bool per_n;  // one decay per state (NA == N > 1)
};

// Heads layout (P == 1): the backward recomputes the states segment by segment from
// checkpoints taken every heads_seg_len(T) tokens (at most 64 segments). A forward asked to
// (flag RECURRA_SSM_SCAN_SAVE_CHECKPOINTS, set when a gradient will follow) saves
// them after its outputs, as (S, n_seg, H, N), and the backward then skips its own forward
// sweep: a third less work for a training step.
inline int64_t heads_seg_len(int64_t T) { return std::max<int64_t>(32, (T + 63) / 64); }
inline int64_t heads_n_seg(int64_t T) { return (T + heads_seg_len(T) - 1) / heads_seg_len(T); }

// Rows layout with one decay per head (Mamba-2): a forward asked to save checkpoints writes
// the state entering each kCkChunk-token chunk, as (S, H, ceil(T / kCkChunk), P, N): what
// the chunked (state-space-duality) backward of the Vulkan backend reads instead of
// recomputing it. The CPU backward has no use for them (its forward sweep is cheap beside
// its reverse sweep) and ignores them.
constexpr int64_t kCkChunk = 64;

// The dims of (s, x, dt, A, B, C, ids) at sources off.. of a kernel.
Dims dims_of(const std::vector<TensorView>& src, int off);
// Throws when an id is out of range for the R state rows.
void check_ids(const int32_t* ids, const Dims& d, const char* op);

// ---- the kernels ---------------------------------------------------------------------

void scan_forward(KernelCtx& c);  // forward.cpp

// ---- one token (T == 1), step.cpp ----
// out[n] = exp(d * A[n]) for n < N, zeros up to the next multiple of 16: a head's decays.
using DecayRow = void (*)(const float* A, float d, int64_t N, float* out);
struct StepFwd {
  Dims d;
  const float *s, *x, *dt, *A, *B, *C;
  const int32_t* ids;
  float* y;
  float* sout;  // nullptr: in place
  float* ck;    // the state entering the token, or nullptr
  DecayRow decay;
};
// The kernel a step's shape takes: Mamba-1's (P 1, N 16, per-state decays), Mamba-2's
// (rows of N a multiple of 8, one decay per head; AVX2 + FMA both), else the generic one.
enum class StepKernel { generic, p1n16, rows8 };
StepKernel step_kernel(const Dims& d, const float* ck);
DecayRow step_decay_row();  // the best decay row for this CPU
// Heads [h0, h1) of the flat (sequence, head) index: `an` Np floats, `acc` 16 x 16, `dtps`
// h1 - h0 rounded up to 16 (the p1n16 and rows8 kernels take their scratch from dtps).
void step_heads_run(StepKernel k, const StepFwd& f, int64_t h0, int64_t h1, float* an, float* acc, float* dtps);

// What the backward driver (op.cpp) hands to the kernels of each layout: the sources, the
// outputs, and where each task's partial sums go.
struct Back {
  Dims d;
  const float *gy, *gs, *s, *x, *dt, *A, *B, *C;  // gs: dL/d(final states)
  const int32_t* ids;
  const float* ckf;  // the forward's heads-layout checkpoints, or nullptr
  float *o_dx, *o_ddt;
  int64_t units, nsplit;  // units per group (heads or 16-head blocks), splits per group
  float* dA_part;         // (S, H, NA): each sequence's dA
  // d_s of sequence i: row ids[i] of the output, or a per-sequence buffer when rows are shared
  float *o_ds, *ds_seq;
  int64_t nstate;
  // dB, dC partial-sum slot j: the outputs for j == 0, else slots + (j - 1) * 2 * nB
  float *o_dB, *o_dC, *slots;
  int64_t nB;
  float* ds_of(int64_t i) const { return ds_seq ? ds_seq + i * nstate : o_ds + ids[i] * nstate; }
  float* slot_B(int64_t j) const { return j == 0 ? o_dB : slots + (j - 1) * 2 * nB; }
  float* slot_C(int64_t j) const { return j == 0 ? o_dC : slots + (j - 1) * 2 * nB + nB; }
};

void backward_rows(const Back& b, ThreadPool& pool, std::vector<Work>& work);   // back_rows.cpp
void backward_heads(const Back& b, ThreadPool& pool, std::vector<Work>& work);  // back_heads.cpp

}  // namespace scan
}  // namespace ssm
}  // namespace recurra

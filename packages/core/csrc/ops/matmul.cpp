// Matrix products: matmul and out_prod, on BLAS when one is loaded, else on our own kernel.
//
// Shape legend (B... = batch axes, at most two, broadcast like numpy):
//   matmul    a (B..., m, k) @ b (B..., k, n)      -> out (B..., m, n)
//   out_prod  a (B..., k, m), b (B..., k, n)       -> out (B..., m, n) = a^T @ b
//             (the sum over k of outer products, as ggml's out_prod)
//
// Both ops run one engine: a batch of C = A @ B where A and B are strided matrices. An
// operand whose last two axes are row-major (column stride 1) or transposed (row stride 1)
// with a usable leading dimension goes to BLAS as it is, with the trans flag; anything else
// is copied to a dense scratch first. Without BLAS, or with RECURRA_NO_BLAS=1 in the
// environment (read at every call; tests use it to exercise the fallback), a blocked kernel
// of our own runs instead; it packs its operands, so any strides are fine there.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../blas.h"
#include "../graph.h"
#include "gemv.h"
#include "kernel_util.h"

namespace recurra {

namespace {

// A strided matrix: element (i, j) at p[i * rs + j * cs].
struct Mat {
  const float* p = nullptr;
  int64_t rows = 0, cols = 0, rs = 0, cs = 0;
};

bool env_flag(const char* name) {
  const char* e = std::getenv(name);
  return e && e[0] && std::strcmp(e, "0") != 0;
}

bool blas_disabled() { return env_flag("RECURRA_NO_BLAS"); }

// dst (rows x cols, dense row-major) = m.
void copy_dense(float* __restrict dst, const Mat& m) {
  const int64_t R = m.rows, C = m.cols;
  if (m.cs == 1) {
    for (int64_t i = 0; i < R; ++i) std::memcpy(dst + i * C, m.p + i * m.rs, C * sizeof(float));
  } else if (m.rs == 1) {
    // Transposed source: read down its contiguous columns.
    for (int64_t j = 0; j < C; ++j)
      for (int64_t i = 0; i < R; ++i) dst[i * C + j] = m.p[i + j * m.cs];
  } else {
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < C; ++j) dst[i * C + j] = m.p[i * m.rs + j * m.cs];
  }
}

// ---- the fallback kernel ----------------------------------------------------------------
//
// C is cut into kMC x kNC blocks, one task each; k into kKC slices. Per slice the task packs
// its A block into panels of kMR rows and its B block into panels of kNR columns (zero
// padded, each panel contiguous so it streams through L1), then accumulates a kMR x kNR
// register tile per pair of panels: each step broadcasts kMR values of A against one
// kNR-wide row of B, an inner loop the compiler vectorizes.

constexpr int64_t kMR = 4, kNR = 32;
constexpr int64_t kMC = 64, kKC = 256, kNC = 256;

// tile[r][j] = sum_p a[p][r] * b[p][j] over packed panels a (kc x kMR) and b (kc x kNR).
RC_SIMD void micro_tile(const float* __restrict a, const float* __restrict b, int64_t kc,
                        float* __restrict tile) {
  float c0[kNR] = {}, c1[kNR] = {}, c2[kNR] = {}, c3[kNR] = {};
  for (int64_t p = 0; p < kc; ++p) {
    const float* bp = b + p * kNR;
    const float x0 = a[p * kMR], x1 = a[p * kMR + 1], x2 = a[p * kMR + 2], x3 = a[p * kMR + 3];
    for (int64_t j = 0; j < kNR; ++j) {
      c0[j] += x0 * bp[j];
      c1[j] += x1 * bp[j];
      c2[j] += x2 * bp[j];
      c3[j] += x3 * bp[j];
    }
  }
  for (int64_t j = 0; j < kNR; ++j) {
    tile[j] = c0[j];
    tile[kNR + j] = c1[j];
    tile[2 * kNR + j] = c2[j];
    tile[3 * kNR + j] = c3[j];
  }
}

// Packs the block m(r0 + i, c0 + p), i < nr, p < kc, as panels of `w` rows with p running
// slowest inside a panel: dst[(i / w) * kc * w + p * w + i % w]; rows padded with zeros.
// (B is packed through its transpose, so its panels hold `w` columns.)
void pack_panels(float* __restrict dst, const Mat& m, int64_t r0, int64_t nr, int64_t c0,
                 int64_t kc, int64_t w) {
  const float* src = m.p + r0 * m.rs + c0 * m.cs;
  for (int64_t i0 = 0; i0 < nr; i0 += w) {
    float* panel = dst + (i0 / w) * kc * w;
    const int64_t nv = std::min(w, nr - i0);
    if (nv < w) std::fill(panel, panel + kc * w, 0.0f);
    if (m.cs == 1) {
      // Rows are contiguous: read each one in order.
      for (int64_t i = 0; i < nv; ++i) {
        const float* row = src + (i0 + i) * m.rs;
        for (int64_t p = 0; p < kc; ++p) panel[p * w + i] = row[p];
      }
    } else {
      for (int64_t p = 0; p < kc; ++p) {
        const float* col = src + p * m.cs + i0 * m.rs;
        for (int64_t i = 0; i < nv; ++i) panel[p * w + i] = col[i * m.rs];
      }
    }
  }
}

// One product of the batch: C (m, n, row stride ldc) = A @ B.
struct Gemm {
  Mat a, b;
  float* c = nullptr;
  int64_t ldc = 0;
};

void fallback_gemm(const std::vector<Gemm>& jobs, int64_t m, int64_t n, int64_t k, ThreadPool& tp) {
  const int64_t nib = (m + kMC - 1) / kMC, njb = (n + kNC - 1) / kNC;
  const int64_t per_job = nib * njb;
  struct Scratch {
    std::vector<float> a, b;
  };
  std::vector<Scratch> scratch(tp.size());
  tp.run(static_cast<int64_t>(jobs.size()) * per_job, [&](int64_t t, int tid) {
    const Gemm& g = jobs[t / per_job];
    const int64_t ib = (t % per_job) / njb, jb = t % njb;
    const int64_t i0 = ib * kMC, mc = std::min(kMC, m - i0);
    const int64_t j0 = jb * kNC, nc = std::min(kNC, n - j0);
    Scratch& s = scratch[tid];
    s.a.resize(kMC * kKC);
    s.b.resize(kKC * kNC);
    // B's transpose, so that its columns become the panel rows.
    const Mat bt{g.b.p, g.b.cols, g.b.rows, g.b.cs, g.b.rs};
    float tile[kMR * kNR];
    for (int64_t p0 = 0; p0 < k; p0 += kKC) {
      const int64_t kc = std::min(kKC, k - p0);
      pack_panels(s.a.data(), g.a, i0, mc, p0, kc, kMR);
      pack_panels(s.b.data(), bt, j0, nc, p0, kc, kNR);
      for (int64_t jr = 0; jr < nc; jr += kNR) {
        const int64_t nv = std::min(kNR, nc - jr);
        const float* bpanel = s.b.data() + (jr / kNR) * kc * kNR;
        for (int64_t ir = 0; ir < mc; ir += kMR) {
          micro_tile(s.a.data() + (ir / kMR) * kc * kMR, bpanel, kc, tile);
          const int64_t mv = std::min(kMR, mc - ir);
          for (int64_t r = 0; r < mv; ++r) {
            float* crow = g.c + (i0 + ir + r) * g.ldc + j0 + jr;
            const float* trow = tile + r * kNR;
            if (p0 == 0)
              std::copy(trow, trow + nv, crow);
            else
              for (int64_t j = 0; j < nv; ++j) crow[j] += trow[j];
          }
        }
      }
    }
  });
}

// ---- the BLAS path ----------------------------------------------------------------------

// How BLAS can read m as it is: trans flag and leading dimension; false if it cannot.
bool blas_form(const Mat& m, bool& trans, int64_t& ld) {
  const int64_t R = m.rows, C = m.cols;
  if (m.cs == 1 || C == 1) {
    ld = R == 1 ? std::max<int64_t>(1, C) : m.rs;
    if (ld >= std::max<int64_t>(1, C)) {
      trans = false;
      return true;
    }
  }
  if (m.rs == 1 || R == 1) {
    ld = C == 1 ? std::max<int64_t>(1, R) : m.cs;
    if (ld >= std::max<int64_t>(1, R)) {
      trans = true;
      return true;
    }
  }
  return false;
}

// C = A @ B through BLAS, copying an operand BLAS cannot read. False: no BLAS (or sizes it
// cannot take); nothing was written then.
bool blas_gemm(const Gemm& g, int64_t m, int64_t n, int64_t k, std::vector<float>& sa,
               std::vector<float>& sb) {
  bool ta = false, tb = false;
  int64_t lda = 0, ldb = 0;
  const float* ap = g.a.p;
  const float* bp = g.b.p;
  if (!blas_form(g.a, ta, lda)) {
    sa.resize(m * k);
    copy_dense(sa.data(), g.a);
    ap = sa.data(), ta = false, lda = std::max<int64_t>(1, k);
  }
  if (!blas_form(g.b, tb, ldb)) {
    sb.resize(k * n);
    copy_dense(sb.data(), g.b);
    bp = sb.data(), tb = false, ldb = std::max<int64_t>(1, n);
  }
  return blas_sgemm(ta, tb, m, n, k, 1.0f, ap, lda, bp, ldb, 0.0f, g.c, std::max<int64_t>(1, g.ldc));
}

bool pooled_blas_gemm(std::vector<Gemm> jobs, int64_t m, int64_t n, int64_t k, ThreadPool& tp);

// Products with one row of A whose B is a transposed row-major matrix (x @ W.T, W stored
// (n, k): a Linear layer in a token step), or one column of B whose A is row-major (W @ x):
// matrix-vector products on gemv.h's kernel, which streams W once over the threads. False
// (nothing written) when some product has another layout.
bool try_gemv(const std::vector<Gemm>& jobs, int64_t m, int64_t n, int64_t k, ThreadPool& tp) {
  auto rows_of_b = [&](const Gemm& g) { return g.b.rs == 1 && (n == 1 || g.b.cs >= k); };
  auto rows_of_a = [&](const Gemm& g) { return g.a.cs == 1 && (m == 1 || g.a.rs >= k); };
  for (const Gemm& g : jobs) {
    if (!((m == 1 && rows_of_b(g)) || (n == 1 && rows_of_a(g)))) return false;
  }
  for (const Gemm& g : jobs) {
    if (m == 1 && rows_of_b(g))  // c[0, j] = sum_p a[0, p] * b[p, j], b[p, j] at p + j * cs
      gemv_rows(g.b.p, g.b.cs, g.a.p, g.a.cs, g.c, 1, n, k, tp);
    else  // c[i, 0] = sum_p a[i, p] * b[p, 0]
      gemv_rows(g.a.p, g.a.rs, g.b.p, g.b.rs, g.c, g.ldc, m, k, tp);
  }
  return true;
}

// ---- the batched engine -----------------------------------------------------------------

// Can axes (dims, strides) be walked as one axis of uniform stride? Sets that stride.
bool collapse(const int64_t* dims, const int64_t* strides, int n, int64_t& stride) {
  bool any = false;
  int64_t expect = 0;
  for (int i = n - 1; i >= 0; --i) {
    if (dims[i] == 1) continue;
    if (!any) {
      stride = strides[i];
      any = true;
    } else if (strides[i] != expect) {
      return false;
    }
    expect = strides[i] * dims[i];
  }
  if (!any) stride = 0;
  return true;
}

// out (B..., m, n) = A @ B with A, B views of (B..., m, k) and (B..., k, n) (batch axes
// broadcast; the matrix axes given by their strides).
void batched_gemm(KernelCtx& c, const TensorView& av, const int64_t* a_mat_strides,
                  const TensorView& bv, const int64_t* b_mat_strides, int64_t m, int64_t k,
                  int64_t n) {
  const Shape& os = c.dst.shape;
  float* out = c.dst.f32();
  const int nbd = os.ndim - 2;
  Shape bshape;  // the batch axes of the output
  bshape.ndim = nbd;
  for (int i = 0; i < nbd; ++i) bshape.d[i] = os.d[i];
  const int64_t nbatch = bshape.numel();
  if (nbatch * m * n == 0) return;
  if (k == 0) {
    std::fill(out, out + nbatch * m * n, 0.0f);
    return;
  }
  // Batch strides, aligned right like numpy, 0 where broadcast.
  int64_t sa[kMaxDims] = {0, 0, 0, 0}, sb[kMaxDims] = {0, 0, 0, 0};
  for (int i = 0; i < nbd; ++i) {
    int ia = av.shape.ndim - 2 - nbd + i, ib = bv.shape.ndim - 2 - nbd + i;
    sa[i] = (ia < 0 || av.shape.d[ia] == 1) ? 0 : av.strides[ia];
    sb[i] = (ib < 0 || bv.shape.d[ib] == 1) ? 0 : bv.strides[ib];
  }
  std::vector<Gemm> jobs;
  int64_t mm = m;
  // One shared B and A's (batch, m) rows walkable with one stride: a single product of
  // nbatch * m rows (the usual x @ W of a linear layer) keeps BLAS and the threads busy.
  bool b_shared = true;
  for (int i = 0; i < nbd; ++i) b_shared = b_shared && (sb[i] == 0 || bshape.d[i] == 1);
  int64_t dims[kMaxDims + 1], strides[kMaxDims + 1], row_stride = 0;
  for (int i = 0; i < nbd; ++i) dims[i] = bshape.d[i], strides[i] = sa[i];
  dims[nbd] = m, strides[nbd] = a_mat_strides[0];
  if (nbatch > 1 && b_shared && collapse(dims, strides, nbd + 1, row_stride)) {
    mm = nbatch * m;
    Gemm g;
    g.a = Mat{av.f32(), mm, k, row_stride, a_mat_strides[1]};
    g.b = Mat{bv.f32(), k, n, b_mat_strides[0], b_mat_strides[1]};
    g.c = out;
    g.ldc = n;
    jobs.push_back(g);
  } else {
    jobs.reserve(nbatch);
    for (int64_t bi = 0; bi < nbatch; ++bi) {
      int64_t oa = 0, ob = 0, r = bi;
      for (int i = nbd - 1; i >= 0; --i) {
        const int64_t idx = r % bshape.d[i];
        r /= bshape.d[i];
        oa += idx * sa[i];
        ob += idx * sb[i];
      }
      Gemm g;
      g.a = Mat{av.f32() + oa, m, k, a_mat_strides[0], a_mat_strides[1]};
      g.b = Mat{bv.f32() + ob, k, n, b_mat_strides[0], b_mat_strides[1]};
      g.c = out + bi * m * n;
      g.ldc = n;
      jobs.push_back(g);
    }
  }
  // RECURRA_NO_GEMV=1 (read at every call) sends matrix-vector products to BLAS / the
  // blocked kernel instead, for benchmarks to compare in one process.
  if ((mm == 1 || n == 1) && !env_flag("RECURRA_NO_GEMV") && try_gemv(jobs, mm, n, k, c.pool)) return;
  if (!blas_disabled() && pooled_blas_gemm(jobs, mm, n, k, c.pool)) return;
  fallback_gemm(jobs, mm, n, k, c.pool);
}

// How one product is cut into tasks: pm blocks of rows x pn blocks of columns x pk slices
// of k. Slices of k past the first write partial products to scratch, summed into C after.
struct Split {
  int64_t pm = 1, pn = 1, pk = 1;
};

// The cut of a single (m x k) @ (k x n) product over `threads` threads: one task per thread
// (fewer when the product is small), in the shape that moves the fewest floats. BLAS packs
// (copies into its panel layout) all of A and all of B in every call, so each block of rows
// packs all of B again and each block of columns all of A: a cut into pm x pn tiles packs
// pn * |A| + pm * |B|, and pk slices of k pack A and B once but write and sum pk partial
// products of m x n. The old cut, four blocks of rows (or columns) per thread, took 10-20%
// more CPU time on every product of a Mamba-2 130M step (bench/gemm_shapes.py); more tasks
// than threads would only even out threads that another process interrupts.
Split plan_split(int64_t m, int64_t n, int64_t k, int64_t threads) {
  constexpr int64_t kMinBlock = 32, kMinSlice = 256, kBlockFlops = int64_t{1} << 21;
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const double A = static_cast<double>(m) * k, B = static_cast<double>(k) * n, C = static_cast<double>(m) * n;
  Split best;
  double best_moved = -1.0;
  auto consider = [&](int64_t pm, int64_t pn, int64_t pk) {
    if ((pm > 1 && m / pm < kMinBlock) || (pn > 1 && n / pn < kMinBlock) || (pk > 1 && k / pk < kMinSlice))
      return;
    const double moved = pn * A + pm * B + (2.0 * pk - 1.0) * C;
    if (best_moved < 0 || moved < best_moved) best_moved = moved, best = Split{pm, pn, pk};
  };
  for (int64_t tasks = std::min<int64_t>(threads, static_cast<int64_t>(flops / kBlockFlops)); tasks >= 2; --tasks) {
    for (int64_t pm = 1; pm <= tasks; ++pm)
      if (tasks % pm == 0) consider(pm, tasks / pm, 1);
    consider(1, 1, tasks);
    if (best_moved >= 0) break;
  }
  return best;
}

// One product through BLAS, cut as plan_split says, over the pool.
bool split_blas_gemm(const Gemm& job, int64_t m, int64_t n, int64_t k, Split s, ThreadPool& tp) {
  const int64_t sm = (m + s.pm - 1) / s.pm, sn = (n + s.pn - 1) / s.pn, sk = (k + s.pk - 1) / s.pk;
  s.pm = (m + sm - 1) / sm, s.pn = (n + sn - 1) / sn, s.pk = (k + sk - 1) / sk;
  std::vector<float> partial(static_cast<size_t>((s.pk - 1) * m * n));
  std::atomic<bool> ok{true};
  tp.run(s.pm * s.pn * s.pk, [&](int64_t t, int) {
    if (!ok.load(std::memory_order_relaxed)) return;
    const int64_t ik = t / (s.pm * s.pn), im = (t / s.pn) % s.pm, in = t % s.pn;
    const int64_t r0 = im * sm, c0 = in * sn, k0 = ik * sk;
    const int64_t nm = std::min(sm, m - r0), nn = std::min(sn, n - c0), nk = std::min(sk, k - k0);
    Gemm g = job;
    g.a.p += r0 * g.a.rs + k0 * g.a.cs;
    g.a.rows = nm, g.a.cols = nk;
    g.b.p += k0 * g.b.rs + c0 * g.b.cs;
    g.b.rows = nk, g.b.cols = nn;
    if (ik == 0) {
      g.c += r0 * g.ldc + c0;
    } else {
      g.c = partial.data() + (ik - 1) * m * n + r0 * n + c0;
      g.ldc = n;
    }
    std::vector<float> sa, sb;
    if (!blas_gemm(g, nm, nn, nk, sa, sb)) ok.store(false);
  });
  if (!ok.load()) return false;
  if (s.pk > 1) {  // C += the partials, in blocks of rows
    const int64_t rows = std::max<int64_t>(1, (int64_t{1} << 14) / n);
    tp.parallel_for(m, rows, [&](int64_t i0, int64_t i1, int) {
      for (int64_t i = i0; i < i1; ++i) {
        float* __restrict c = job.c + i * job.ldc;
        for (int64_t p = 0; p + 1 < s.pk; ++p) {
          const float* __restrict q = partial.data() + p * m * n + i * n;
          for (int64_t j = 0; j < n; ++j) c[j] += q[j];
        }
      }
    });
  }
  return true;
}

// The products through BLAS, split over the pool, BLAS single-threaded in every task
// (blas_set_num_threads keeps it at one thread). BLAS's own threads would compete with the
// pool's (and spin after each call); this way one pool with dynamic tasks shares the CPUs.
// One product (the usual x @ W of a layer, and its gradients) is cut by plan_split; a batch
// of products, or a matrix-vector product, into blocks of rows (or of columns, when it has
// fewer rows than columns). RECURRA_GEMM_SPLIT=rows (read at every call) cuts every product
// into blocks of rows or columns, as before plan_split, and RECURRA_GEMM_SPLIT=pm,pn,pk
// makes that cut of a single product, for benchmarks to compare in one process. False when
// BLAS cannot take the sizes.
bool pooled_blas_gemm(std::vector<Gemm> jobs, int64_t m, int64_t n, int64_t k, ThreadPool& tp) {
  if (jobs.empty() || m == 0 || n == 0) return true;
  // Operands BLAS cannot read as they are: one dense copy each, before the split.
  std::vector<std::vector<float>> copies;
  for (Gemm& g : jobs) {
    for (Mat* mat : {&g.a, &g.b}) {
      bool trans;
      int64_t ld;
      if (blas_form(*mat, trans, ld)) continue;
      copies.emplace_back(static_cast<size_t>(mat->rows * mat->cols));
      copy_dense(copies.back().data(), *mat);
      *mat = Mat{copies.back().data(), mat->rows, mat->cols, mat->cols, 1};
    }
  }
  const char* mode = std::getenv("RECURRA_GEMM_SPLIT");
  const bool rows_only = mode && std::strcmp(mode, "rows") == 0;
  if (jobs.size() == 1 && m > 1 && n > 1 && !rows_only) {
    Split s = plan_split(m, n, k, tp.size());
    long long pm, pn, pk;  // "pm,pn,pk": that cut instead of the plan's (for benchmarks)
    if (mode && std::sscanf(mode, "%lld,%lld,%lld", &pm, &pn, &pk) == 3 && pm > 0 && pn > 0 && pk > 0)
      s = Split{std::min<int64_t>(pm, m), std::min<int64_t>(pn, n), std::min<int64_t>(pk, k)};
    return split_blas_gemm(jobs[0], m, n, k, s, tp);
  }
  // Blocks of at least kMinBlock rows (columns) and ~2 MFLOP; at most 4 per thread. A
  // matrix-vector product (one row or one column: a token step's x @ W.T) reads every weight
  // once and is bound by memory, where one thread does not draw what several do: there the
  // blocks are ~256 KFLOP (512 KiB of the matrix), so that a 768 x 1536 projection is shared
  // by the threads instead of running on one.
  constexpr int64_t kMinBlock = 32, kBlockFlops = int64_t{1} << 21, kVectorBlockFlops = kBlockFlops >> 3;
  const bool by_rows = m >= n;
  const int64_t len = by_rows ? m : n;
  const int64_t block_flops = (m == 1 || n == 1) ? kVectorBlockFlops : kBlockFlops;
  int64_t blocks = std::min<int64_t>({(len + kMinBlock - 1) / kMinBlock,
                                      std::max<int64_t>(1, 2 * m * n * std::max<int64_t>(1, k) / block_flops),
                                      static_cast<int64_t>(tp.size()) * 4});
  blocks = std::max<int64_t>(1, blocks);
  const int64_t step = (len + blocks - 1) / blocks;
  blocks = (len + step - 1) / step;
  auto block = [&](int64_t t) {
    Gemm g = jobs[static_cast<size_t>(t / blocks)];
    const int64_t b0 = (t % blocks) * step, nb = std::min(step, len - b0);
    if (by_rows) {
      g.a.p += b0 * g.a.rs;
      g.a.rows = nb;
      g.c += b0 * g.ldc;
    } else {
      g.b.p += b0 * g.b.cs;
      g.b.cols = nb;
      g.c += b0;
    }
    std::vector<float> sa, sb;
    return blas_gemm(g, by_rows ? nb : m, by_rows ? n : nb, k, sa, sb);
  };
  // A block BLAS refuses (no BLAS, or a size past int): the fallback then writes all of C.
  std::atomic<bool> ok{true};
  tp.run(static_cast<int64_t>(jobs.size()) * blocks, [&](int64_t t, int) {
    if (ok.load(std::memory_order_relaxed) && !block(t)) ok.store(false);
  });
  return ok.load();
}

// ---- infer and the ops ------------------------------------------------------------------

// Shared checks: f32, 2 to 4 axes, the contracted axes agree, batch axes broadcast.
// `a_contract` is the axis of a that meets b's axis -2 (-1 for matmul, -2 for out_prod).
void product_infer(Graph& g, Node& n, int a_contract) {
  if (n.src.size() != 2) fail_shape(g, n, "takes two inputs");
  require_f32(g, n, 0);
  require_f32(g, n, 1);
  const Shape& a = g.node(n.src.at(0)).shape;
  const Shape& b = g.node(n.src.at(1)).shape;
  if (a.ndim < 2 || b.ndim < 2) fail_shape(g, n, "both inputs need at least 2 axes");
  const int64_t ka = a.d[a.ndim + a_contract], kb = b.d[b.ndim - 2];
  if (ka != kb)
    fail_shape(g, n, "the contracted dimensions differ (" + std::to_string(ka) + " and " +
                         std::to_string(kb) + ")");
  const int nd = std::max(a.ndim, b.ndim);
  Shape out;
  out.ndim = nd;
  for (int i = 0; i < nd - 2; ++i) {
    const int ia = a.ndim - nd + i, ib = b.ndim - nd + i;
    const int64_t da = ia >= 0 ? a.d[ia] : 1, db = ib >= 0 ? b.d[ib] : 1;
    if (da != db && da != 1 && db != 1) fail_shape(g, n, "the batch axes cannot be broadcast together");
    out.d[i] = da == 1 ? db : da;
  }
  out.d[nd - 2] = a_contract == -1 ? a.d[a.ndim - 2] : a.d[a.ndim - 1];
  out.d[nd - 1] = b.d[b.ndim - 1];
  n.dtype = DType::f32;
  n.shape = out;
}

// The view of x with its last two axes swapped (no copy).
int swap_last(Graph& g, int x) {
  const int nd = g.node(x).shape.ndim;
  std::vector<int64_t> perm(nd);
  for (int i = 0; i < nd; ++i) perm[i] = i;
  std::swap(perm[nd - 1], perm[nd - 2]);
  return g.permute(x, perm);
}

int64_t batch_numel(const Shape& s) {
  int64_t b = 1;
  for (int i = 0; i < s.ndim - 2; ++i) b *= s.d[i];
  return b;
}

void matmul_forward(KernelCtx& c) {
  const TensorView& a = c.src[0];
  const TensorView& b = c.src[1];
  const int na = a.shape.ndim, nb = b.shape.ndim;
  const int64_t as[2] = {a.strides[na - 2], a.strides[na - 1]};
  const int64_t bs[2] = {b.strides[nb - 2], b.strides[nb - 1]};
  batched_gemm(c, a, as, b, bs, a.shape.d[na - 2], a.shape.d[na - 1], b.shape.d[nb - 1]);
}

void out_prod_forward(KernelCtx& c) {
  const TensorView& a = c.src[0];
  const TensorView& b = c.src[1];
  const int na = a.shape.ndim, nb = b.shape.ndim;
  // a^T: rows run along a's last axis.
  const int64_t as[2] = {a.strides[na - 1], a.strides[na - 2]};
  const int64_t bs[2] = {b.strides[nb - 2], b.strides[nb - 1]};
  batched_gemm(c, a, as, b, bs, a.shape.d[na - 1], a.shape.d[na - 2], b.shape.d[nb - 1]);
}

// d(A @ B): dA = G @ B^T, dB = A^T @ G, each summed back over broadcast batch axes.
void matmul_backward(GradSink& k) {
  Graph& g = k.g;
  const int a = k.node.src[0], b = k.node.src[1], G = k.grad_out;
  const Shape as = g.node(a).shape, bs = g.node(b).shape, os = k.node.shape;
  if (k.needs(0)) k.add(0, g.reduce_to(g.op("matmul", {G, swap_last(g, b)}), as));
  if (k.needs(1)) {
    const int64_t nbatch = batch_numel(os);
    bool a_full = as.ndim == os.ndim && batch_numel(as) == nbatch;
    if (nbatch > 1 && batch_numel(bs) == 1 && a_full) {
      // B shared by the whole batch: one (k, batch*m) @ (batch*m, n) product instead of a
      // batch of products summed afterwards.
      const int64_t m = as.d[as.ndim - 2], kk = as.d[as.ndim - 1], n = os.d[os.ndim - 1];
      int a2 = g.reshape(a, Shape{nbatch * m, kk});
      int g2 = g.reshape(G, Shape{nbatch * m, n});
      k.add(1, g.reshape(g.op("matmul", {swap_last(g, a2), g2}), bs));
    } else {
      k.add(1, g.reduce_to(g.op("matmul", {swap_last(g, a), G}), bs));
    }
  }
}

// d(a^T @ b): da = b @ G^T, db = a @ G, each summed back over broadcast batch axes.
void out_prod_backward(GradSink& k) {
  Graph& g = k.g;
  const int a = k.node.src[0], b = k.node.src[1], G = k.grad_out;
  // Shapes copied first: building a node may move the node table.
  const Shape sa = g.node(a).shape, sb = g.node(b).shape;
  if (k.needs(0)) k.add(0, g.reduce_to(g.op("matmul", {b, swap_last(g, G)}), sa));
  if (k.needs(1)) k.add(1, g.reduce_to(g.op("matmul", {a, G}), sb));
}

}  // namespace

void register_matmul_ops(OpTable& t) {
  {
    OpDef d;
    d.name = "matmul";
    d.infer = [](Graph& g, Node& n) { product_infer(g, n, -1); };
    d.forward = matmul_forward;
    d.backward = matmul_backward;
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "out_prod";
    d.infer = [](Graph& g, Node& n) { product_infer(g, n, -2); };
    d.forward = out_prod_forward;
    d.backward = out_prod_backward;
    t.add(std::move(d));
  }
}

}  // namespace recurra

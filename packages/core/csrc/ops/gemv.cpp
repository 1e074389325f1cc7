// x (1, K) @ W.T for W stored (N, K): see gemv.h.
//
// The kernel takes four rows of W at a time and runs down them together with two 8-wide
// accumulators per row (eight FMA chains, each row read once, front to back), then folds the
// four rows' sums with three hadds. The four rows lie a quarter of the task's range apart,
// so that each core reads four long sequential streams (see dot_rows_avx2). Rows left over
// ((r1 - r0) % 4) run alone, folded the same way.
//
// The split over the pool (split_rows) hands out contiguous ranges of rows (multiples of
// four), largest first: each range is a share of what is left (remaining / (2 * threads)),
// down to kMinTaskBytes of W. The long first ranges keep the streams long; the short last
// ones let the threads finish together (with equal ranges the thread that draws the last one
// streams alone for up to a whole range, at one thread's bandwidth, while the other waits).
//
// Prefetch of the next product's weights (see gemv.h): a token step computes the same
// products in the same order every token, so each call records which weights the call after
// it read (keyed by its own W) and, when it ends, offers the start of the next one's second
// range to the pool's idle worker (threadpool.cpp calls gemv_idle_work() while it waits for
// a job; a new job ends the prefetch). The worker streams those bytes into the cache while
// the calling thread runs the small nodes between two products alone (the conv, Mamba-1's
// scan, the norms), when the memory would otherwise sit idle. Only prefetch instructions
// touch those addresses (they never fault, so a stale record of freed weights is harmless);
// results do not depend on it.
#include "gemv.h"

#include "../idle_work.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RC_GEMV_X86 1
#endif

namespace recurra {

namespace {

constexpr int64_t kSerialBytes = int64_t{96} << 10;   // below this, one thread does it all
constexpr int64_t kMinTaskBytes = int64_t{64} << 10;  // of W per task
constexpr int64_t kPrefetchBytes = int64_t{512} << 10;  // of the next product's W, at most
constexpr size_t kMaxRecords = 4096;  // successor records per thread (a bound, not a tuning)

// Rows [r0, r1) without SIMD intrinsics: eight independent partial sums per row (a loop the
// compiler vectorizes without reassociating), folded at the end.
void dot_rows_portable(const float* w, int64_t ldw, const float* x, int64_t k, float* y, int64_t incy,
                       int64_t r0, int64_t r1) {
  constexpr int L = 8;
  const int64_t kl = k - k % L;
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w + r * ldw;
    float acc[L] = {};
    for (int64_t p = 0; p < kl; p += L)
      for (int l = 0; l < L; ++l) acc[l] += row[p + l] * x[p + l];
    float s = 0.0f;
    for (int64_t p = kl; p < k; ++p) s += row[p] * x[p];
    for (int l = 0; l < L; ++l) s += acc[l];
    y[r * incy] = s;
  }
}

#ifdef RC_GEMV_X86

// The sum of row i's two accumulators (a + b), folded as the 4-row group does it: lane pairs,
// then pairs of pairs, then the two halves: ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
// A row read alone folds the same way, so a row's sum does not depend on its group.
__attribute__((target("avx2,fma"))) inline __m128 fold4(__m256 s0, __m256 s1, __m256 s2, __m256 s3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// A mask loading the first `rem` (< 8) lanes.
__attribute__((target("avx2,fma"))) inline __m256i tail_mask(int64_t rem) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rem)), lane);
}

// Rows [r0, r1). The four rows of a group lie a quarter of the range apart (rows r0 + g,
// r0 + g + q, r0 + g + 2q, r0 + g + 3q for q = (r1 - r0) / 4): four long sequential streams
// that the hardware prefetcher follows from one group into the next, where four adjacent
// rows (3 KiB each for K = 768) made four short streams that it picked up anew at every
// group. A single stream per core draws ~11 GB/s here, four ~16 GB/s (bench/gemv.py).
// RECURRA_GEMV_ADJACENT=1 (read at every call, for A/B timings) groups adjacent rows.
__attribute__((target("avx2,fma"))) void dot_rows_avx2(const float* w, int64_t ldw, const float* x,
                                                       int64_t k, float* y, int64_t incy, int64_t r0,
                                                       int64_t r1, bool adjacent) {
  const int64_t k16 = k & ~int64_t{15}, k8 = k & ~int64_t{7}, rem = k - k8;
  const __m256i mask = tail_mask(rem);
  const int64_t q = (r1 - r0) / 4;
  const int64_t gap = adjacent ? 1 : q;  // rows between the rows of a group
  const int64_t step = adjacent ? 4 : 1;  // rows from one group to the next
  for (int64_t g = 0; g < q; ++g) {
    const int64_t r = r0 + g * step;
    const float* w0 = w + r * ldw;
    const float* w1 = w0 + gap * ldw;
    const float* w2 = w1 + gap * ldw;
    const float* w3 = w2 + gap * ldw;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    int64_t p = 0;
    for (; p < k16; p += 16) {
      const __m256 xa = _mm256_loadu_ps(x + p), xb = _mm256_loadu_ps(x + p + 8);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + p), xa, a0);
      b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + p + 8), xb, b0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + p), xa, a1);
      b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + p + 8), xb, b1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + p), xa, a2);
      b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + p + 8), xb, b2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + p), xa, a3);
      b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + p + 8), xb, b3);
    }
    if (p < k8) {
      const __m256 xa = _mm256_loadu_ps(x + p);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + p), xa, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + p), xa, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + p), xa, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + p), xa, a3);
      p += 8;
    }
    if (rem) {  // the last k % 8 columns, masked (nothing past a row's end is read)
      const __m256 xa = _mm256_maskload_ps(x + p, mask);
      b0 = _mm256_fmadd_ps(_mm256_maskload_ps(w0 + p, mask), xa, b0);
      b1 = _mm256_fmadd_ps(_mm256_maskload_ps(w1 + p, mask), xa, b1);
      b2 = _mm256_fmadd_ps(_mm256_maskload_ps(w2 + p, mask), xa, b2);
      b3 = _mm256_fmadd_ps(_mm256_maskload_ps(w3 + p, mask), xa, b3);
    }
    alignas(16) float t[4];
    _mm_store_ps(t, fold4(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), _mm256_add_ps(a2, b2),
                          _mm256_add_ps(a3, b3)));
    for (int i = 0; i < 4; ++i) y[(r + i * gap) * incy] = t[i];
  }
  for (int64_t r = r0 + 4 * q; r < r1; ++r) {  // the rows left over, alone
    const float* w0 = w + r * ldw;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0;
    int64_t p = 0;
    for (; p < k16; p += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + p), _mm256_loadu_ps(x + p), a0);
      b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + p + 8), _mm256_loadu_ps(x + p + 8), b0);
    }
    if (p < k8) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + p), _mm256_loadu_ps(x + p), a0);
      p += 8;
    }
    if (rem) b0 = _mm256_fmadd_ps(_mm256_maskload_ps(w0 + p, mask), _mm256_maskload_ps(x + p, mask), b0);
    const __m256 s = _mm256_add_ps(a0, b0);
    y[r * incy] = _mm_cvtss_f32(fold4(s, s, s, s));
  }
}

bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

#endif

void dot_rows(const float* w, int64_t ldw, const float* x, int64_t k, float* y, int64_t incy, int64_t r0,
              int64_t r1, bool adjacent) {
#ifdef RC_GEMV_X86
  if (has_avx2_fma()) return dot_rows_avx2(w, ldw, x, k, y, incy, r0, r1, adjacent);
#endif
  (void)adjacent;
  dot_rows_portable(w, ldw, x, k, y, incy, r0, r1);
}

// RECURRA_GEMV_PREFETCH=0 (read at every call, for A/B timings) turns the prefetch off.
bool prefetch_enabled() {
  const char* e = std::getenv("RECURRA_GEMV_PREFETCH");
  return !(e && std::strcmp(e, "0") == 0);
}

// Whether environment variable `name` is "1" (the A/B switches, read at every call).
bool env_on(const char* name) {
  const char* e = std::getenv(name);
  return e && std::strcmp(e, "1") == 0;
}

// RECURRA_GEMV_EVEN=1: equal ranges, as before.
bool even_split() { return env_on("RECURRA_GEMV_EVEN"); }

// Row ranges [cuts[t], cuts[t + 1]) of the tasks, largest first (see the top of the file).
std::vector<int64_t> split_rows(int64_t n, int64_t k, int threads) {
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(float));
  const int64_t min_rows = std::max<int64_t>(4, (kMinTaskBytes / row_bytes + 3) & ~int64_t{3});
  std::vector<int64_t> cuts{0};
  if (even_split()) {
    const int64_t tasks = std::max<int64_t>(2, std::min<int64_t>(threads * 4, n * row_bytes / kMinTaskBytes));
    const int64_t step = ((n + tasks - 1) / tasks + 3) & ~int64_t{3};
    for (int64_t r = step; r < n; r += step) cuts.push_back(r);
    cuts.push_back(n);
    return cuts;
  }
  for (int64_t r = 0; r < n;) {
    int64_t rows = (n - r) / (2 * static_cast<int64_t>(threads));
    rows = std::max(min_rows, (rows + 3) & ~int64_t{3});
    r = std::min(n, r + rows);
    cuts.push_back(r);
  }
  return cuts;
}

// The successor records of a calling thread and the one pending prefetch request.
struct Region {
  const char* p = nullptr;
  int64_t bytes = 0;
};

struct Successors {
  std::unordered_map<const float*, Region> next;  // W of a call -> what the call after it read
  const float* last = nullptr;                     // W of this thread's previous call
};

thread_local Successors t_succ;

std::mutex g_req_mu;
Region g_req;  // guarded by g_req_mu: offered by a caller, taken by an idle worker
std::atomic<bool> g_req_pending{false};

// Called when a product over w ends: records `mine` (the region of it worth fetching early)
// as the successor of the previous call's W, and offers this call's recorded successor.
void note_call(const float* w, const Region& mine) {
  Successors& s = t_succ;
  if (s.last && s.last != w) {
    if (s.next.size() >= kMaxRecords) s.next.clear();
    s.next[s.last] = mine;
  }
  s.last = w;
  const auto it = s.next.find(w);
  if (it == s.next.end() || it->second.bytes <= 0) return;
  std::lock_guard<std::mutex> lk(g_req_mu);
  g_req = it->second;
  g_req_pending.store(true, std::memory_order_release);
}

}  // namespace

bool gemv_idle_work(const std::atomic<uint64_t>& epoch, uint64_t seen) {
  if (!g_req_pending.load(std::memory_order_acquire)) return false;
  Region r;
  {
    std::unique_lock<std::mutex> lk(g_req_mu, std::try_to_lock);
    if (!lk.owns_lock() || !g_req_pending.load(std::memory_order_relaxed)) return false;
    r = g_req;
    g_req_pending.store(false, std::memory_order_relaxed);
  }
  // 4 KiB at a time; a new job of the pool ends it (the job comes first).
  for (int64_t off = 0; off < r.bytes; off += 4096) {
    if (epoch.load(std::memory_order_relaxed) != seen) break;
    const int64_t end = std::min(r.bytes, off + 4096);
    for (int64_t o = off; o < end; o += 64) __builtin_prefetch(r.p + o, 0, 3);
  }
  return true;
}

void gemv_rows(const float* w, int64_t ldw, const float* x, int64_t incx, float* y, int64_t incy,
               int64_t n, int64_t k, ThreadPool& tp) {
  if (n <= 0) return;
  if (k <= 0) {
    for (int64_t j = 0; j < n; ++j) y[j * incy] = 0.0f;
    return;
  }
  // A prefetch not taken yet comes too late to help: this product streams its own weights.
  if (g_req_pending.load(std::memory_order_relaxed)) g_req_pending.store(false, std::memory_order_relaxed);
  std::vector<float> xs;
  if (incx != 1) {
    xs.resize(static_cast<size_t>(k));
    for (int64_t p = 0; p < k; ++p) xs[p] = x[p * incx];
    x = xs.data();
  }
  const int64_t row_bytes = ldw * static_cast<int64_t>(sizeof(float));
  const int64_t bytes = n * k * static_cast<int64_t>(sizeof(float));
  const bool split = tp.size() > 1 && bytes >= kSerialBytes;
  // Rows per task: multiples of four (the kernel's row group), so that every row is summed
  // the same way whatever the split.
  const std::vector<int64_t> cuts = split ? split_rows(n, k, tp.size()) : std::vector<int64_t>{0, n};
  const int64_t tasks = static_cast<int64_t>(cuts.size()) - 1;
  const bool adjacent = env_on("RECURRA_GEMV_ADJACENT");
  if (tasks == 1) {
    dot_rows(w, ldw, x, k, y, incy, 0, n, adjacent);
  } else {
    tp.run(tasks, [&](int64_t t, int) { dot_rows(w, ldw, x, k, y, incy, cuts[t], cuts[t + 1], adjacent); });
  }
  if (!prefetch_enabled() || tp.size() == 1) return;
  // Worth fetching before this product runs again: the rows after the first range (the
  // calling thread starts on the first range itself), at most kPrefetchBytes.
  const int64_t r0 = tasks > 1 ? cuts[1] : 0;
  const int64_t avail = (n - r0) * row_bytes;
  note_call(w, Region{reinterpret_cast<const char*>(w + r0 * ldw), std::min(avail, kPrefetchBytes)});
}

}  // namespace recurra

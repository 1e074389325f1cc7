// x (1, K) @ W.T for W stored (N, K): see gemv.h.
//
// The kernel takes four rows of W at a time and runs down them together with two 8-wide
// accumulators per row (eight FMA chains, each row read once, front to back, so the hardware
// prefetcher sees four sequential streams), then folds the four rows' sums with three hadds.
// Rows left over (N % 4) run alone. The split over the pool hands out contiguous ranges of
// rows (a multiple of four) of at least kMinTaskBytes of W each, a few per thread so that a
// thread whose core is taken by another process leaves its share to the others.
#include "gemv.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RC_GEMV_X86 1
#endif

namespace recurra {

namespace {

constexpr int64_t kSerialBytes = int64_t{96} << 10;   // below this, one thread does it all
constexpr int64_t kMinTaskBytes = int64_t{64} << 10;  // of W per task
constexpr int64_t kTasksPerThread = 4;

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

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A mask loading the first `rem` (< 8) lanes.
__attribute__((target("avx2,fma"))) inline __m256i tail_mask(int64_t rem) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rem)), lane);
}

__attribute__((target("avx2,fma"))) void dot_rows_avx2(const float* w, int64_t ldw, const float* x,
                                                       int64_t k, float* y, int64_t incy, int64_t r0,
                                                       int64_t r1) {
  const int64_t k16 = k & ~int64_t{15}, k8 = k & ~int64_t{7}, rem = k - k8;
  const __m256i mask = tail_mask(rem);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const float* w0 = w + r * ldw;
    const float* w1 = w0 + ldw;
    const float* w2 = w1 + ldw;
    const float* w3 = w2 + ldw;
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
    // [row0 pairs, row1 pairs | ...] -> one lane per row in each half, the halves added.
    const __m256 h01 = _mm256_hadd_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1));
    const __m256 h23 = _mm256_hadd_ps(_mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3));
    const __m256 h = _mm256_hadd_ps(h01, h23);
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    if (incy == 1) {
      _mm_storeu_ps(y + r, s);
    } else {
      alignas(16) float t[4];
      _mm_store_ps(t, s);
      for (int i = 0; i < 4; ++i) y[(r + i) * incy] = t[i];
    }
  }
  for (; r < r1; ++r) {
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
    y[r * incy] = hsum8(_mm256_add_ps(a0, b0));
  }
}

bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

#endif

void dot_rows(const float* w, int64_t ldw, const float* x, int64_t k, float* y, int64_t incy, int64_t r0,
              int64_t r1) {
#ifdef RC_GEMV_X86
  if (has_avx2_fma()) return dot_rows_avx2(w, ldw, x, k, y, incy, r0, r1);
#endif
  dot_rows_portable(w, ldw, x, k, y, incy, r0, r1);
}

}  // namespace

void gemv_rows(const float* w, int64_t ldw, const float* x, int64_t incx, float* y, int64_t incy,
               int64_t n, int64_t k, ThreadPool& tp) {
  if (n <= 0) return;
  if (k <= 0) {
    for (int64_t j = 0; j < n; ++j) y[j * incy] = 0.0f;
    return;
  }
  std::vector<float> xs;
  if (incx != 1) {
    xs.resize(static_cast<size_t>(k));
    for (int64_t p = 0; p < k; ++p) xs[p] = x[p * incx];
    x = xs.data();
  }
  const int64_t bytes = n * k * static_cast<int64_t>(sizeof(float));
  int64_t tasks = 1;
  if (tp.size() > 1 && bytes >= kSerialBytes)
    tasks = std::max<int64_t>(2, std::min<int64_t>(tp.size() * kTasksPerThread, bytes / kMinTaskBytes));
  // Rows per task: a multiple of four (the kernel's row group), so that every row is summed
  // the same way whatever the split.
  int64_t step = (n + tasks - 1) / tasks;
  step = (step + 3) & ~int64_t{3};
  tasks = (n + step - 1) / step;
  if (tasks == 1) {
    dot_rows(w, ldw, x, k, y, incy, 0, n);
    return;
  }
  tp.run(tasks, [&](int64_t t, int) {
    const int64_t r0 = t * step;
    dot_rows(w, ldw, x, k, y, incy, r0, std::min(n, r0 + step));
  });
}

}  // namespace recurra

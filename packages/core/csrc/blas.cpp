#include "blas.h"

#include <dlfcn.h>

#include <climits>
#include <string>

namespace recurra {

namespace {
using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                          float, float*, int);
using sgemv_fn = void (*)(int, int, int, int, float, const float*, int, const float*, int, float, float*,
                          int);
using set_threads_fn = void (*)(int);
sgemm_fn g_sgemm = nullptr;
sgemv_fn g_sgemv = nullptr;
set_threads_fn g_set_threads = nullptr;
std::string g_name = "none";
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
}  // namespace

bool load_blas(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) return false;
  for (const char* sym : {"scipy_cblas_sgemm", "cblas_sgemm"}) {
    if (auto f = reinterpret_cast<sgemm_fn>(dlsym(h, sym))) {
      g_sgemm = f;
      break;
    }
  }
  for (const char* sym : {"scipy_cblas_sgemv", "cblas_sgemv"}) {
    if (auto f = reinterpret_cast<sgemv_fn>(dlsym(h, sym))) {
      g_sgemv = f;
      break;
    }
  }
  for (const char* sym : {"scipy_openblas_set_num_threads", "openblas_set_num_threads"}) {
    if (auto f = reinterpret_cast<set_threads_fn>(dlsym(h, sym))) {
      g_set_threads = f;
      break;
    }
  }
  if (!g_sgemm) return false;
  g_name = path;
  // One BLAS thread: matmul splits its products over recurra's pool (ops/matmul.cpp).
  blas_set_num_threads(1);
  return true;
}

std::string blas_name() { return g_name; }

void blas_set_num_threads(int n) {
  if (g_set_threads) g_set_threads(n);
}

bool blas_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (!g_sgemm) return false;
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX || ldc > INT_MAX)
    return false;
  // A product with one row or one column is a matrix-vector product: sgemv reads the matrix
  // once in place, where sgemm would first copy (pack) all of it -- most of the time of a
  // token step in generation (x @ W.T with one row of x).
  if (g_sgemv && m == 1) {  // c[0, :] = a[0, :] @ op(b)
    const int inc = ta ? static_cast<int>(lda) : 1;
    if (tb)  // op(b) = b^T, b stored (n, k)
      g_sgemv(kRowMajor, kNoTrans, static_cast<int>(n), static_cast<int>(k), alpha, b, static_cast<int>(ldb), a, inc,
              beta, c, 1);
    else  // b stored (k, n)
      g_sgemv(kRowMajor, kTrans, static_cast<int>(k), static_cast<int>(n), alpha, b, static_cast<int>(ldb), a, inc,
              beta, c, 1);
    return true;
  }
  if (g_sgemv && n == 1) {  // c[:, 0] = op(a) @ b[:, 0]
    const int inc = tb ? 1 : static_cast<int>(ldb);
    if (ta)  // a stored (k, m)
      g_sgemv(kRowMajor, kTrans, static_cast<int>(k), static_cast<int>(m), alpha, a, static_cast<int>(lda), b, inc,
              beta, c, static_cast<int>(ldc));
    else  // a stored (m, k)
      g_sgemv(kRowMajor, kNoTrans, static_cast<int>(m), static_cast<int>(k), alpha, a, static_cast<int>(lda), b, inc,
              beta, c, static_cast<int>(ldc));
    return true;
  }
  g_sgemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m),
          static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
          static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  return true;
}

}  // namespace recurra

// Optional BLAS for matmul, loaded at run time (OpenBLAS from the scipy-openblas32 wheel).
// Without it matmul uses the core's own blocked kernel.
#pragma once

#include <cstdint>
#include <string>

namespace recurra {

// C = alpha * op(A) @ op(B) + beta * C, row-major, like cblas_sgemm. Returns false when no
// BLAS is loaded (the caller then uses its own kernel).
bool blas_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc);
bool load_blas(const std::string& path);
std::string blas_name();
// Keeps OpenBLAS's own thread count equal to recurra's.
void blas_set_num_threads(int n);

}  // namespace recurra

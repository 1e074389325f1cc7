// Matrix-vector products for one-row inputs: a token step's x (1, K) @ W.T with W stored
// (N, K) row-major, as a Linear layer keeps it. Such a product reads every weight once and
// does two flops per 4 bytes read: it is bound by memory bandwidth, and its speed is how
// evenly and steadily the threads stream W. gemv.cpp has the kernel (AVX2/FMA where the CPU
// has it, a portable loop otherwise) and the split over the pool.
#pragma once

#include <cstdint>

#include "../threadpool.h"

namespace recurra {

// y[j * incy] = sum_p x[p * incx] * w[j * ldw + p] for j < n, p < k (ldw >= k). Rows of W
// are cut into contiguous ranges over the pool's threads; a strided x is gathered once into
// a dense copy first. Each y[j] is summed in the same order whatever the thread count.
void gemv_rows(const float* w, int64_t ldw, const float* x, int64_t incx, float* y, int64_t incy,
               int64_t n, int64_t k, ThreadPool& tp);

}  // namespace recurra

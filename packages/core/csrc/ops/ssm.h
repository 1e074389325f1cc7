// Mamba's operators (ssm_conv, ssm_scan): what ssm_scan/ and ssm_conv.cpp share.
//
// The 16-lane float vectors below are GCC vector extensions: a kernel marked RC_SIMD is
// compiled for AVX-512, AVX2 and baseline x86-64, and these types lower to one zmm, two ymm
// or four xmm registers accordingly, so a hot loop can be register-blocked by hand without
// intrinsics (which would tie it to one instruction set).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "../graph.h"
#include "kernel_util.h"

// The helpers below are always inlined, so the ABI note GCC gives for 64-byte vector
// arguments in baseline (non-AVX-512) code never applies.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace recurra {

void register_ssm_conv_ops(OpTable& t);  // ssm_conv.cpp

// Whether an ssm_scan node with integer parameters `ip` saves the backward's checkpoints.
inline bool saves_checkpoints(const std::vector<int64_t>& ip) {
  return !ip.empty() && (ip[RECURRA_P_SCAN_FLAGS] & RECURRA_SSM_SCAN_SAVE_CHECKPOINTS) != 0;
}

// Whether an ssm_scan node writes its final states into its source s in place.
inline bool state_in_place(const std::vector<int64_t>& ip) {
  return !ip.empty() && (ip[RECURRA_P_SCAN_FLAGS] & RECURRA_SSM_SCAN_STATE_IN_PLACE) != 0;
}

namespace ssm {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
// The same vector at any 4-byte alignment. (GCC gives a vector type the alias set of its
// element type, so these accesses alias float memory only; no may_alias, which would make
// every store clobber every pointer and scalar in reach.)
typedef float vfu __attribute__((vector_size(64), aligned(4)));

#define RC_INLINE inline __attribute__((always_inline))

RC_INLINE vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
RC_INLINE void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
// A broadcast, written as a shuffle of lane 0: GCC expands a uniform initialiser
// (`vf{s, s, ...}`, also what `s - vf{}` folds to) lane by lane in some contexts, and
// `vf{} + s` is a real addition of +0.0 without -ffast-math.
RC_INLINE vf vsplat(float s) { return __builtin_shuffle(vf{s}, vi{}); }
RC_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }
RC_INLINE vf vmin(vf a, vf b) { return a < b ? a : b; }

// Loads the first n (< 16) floats of p; the other lanes are zero.
RC_INLINE vf vload_part(const float* p, int64_t n) {
  vf v = {};
  for (int64_t l = 0; l < n; ++l) v[l] = p[l];
  return v;
}
RC_INLINE void vstore_part(float* p, vf v, int64_t n) {
  for (int64_t l = 0; l < n; ++l) p[l] = v[l];
}

// Lane sums of 16 vectors: r[k] = sum over lanes of v[k], in a fixed butterfly order
// (45 operations for 16 sums instead of 16 separate horizontal reductions).
RC_INLINE vf hsum16x16(const float* v /* 16 rows of 16 */) {
  const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi ev = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi od = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vf w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k) {
    vf a = vload(v + 32 * k), b = vload(v + 32 * k + 16);
    w[k] = __builtin_shuffle(a, b, lo8) + __builtin_shuffle(a, b, hi8);
  }
  for (int k = 0; k < 4; ++k)
    x[k] = __builtin_shuffle(w[2 * k], w[2 * k + 1], lo4) + __builtin_shuffle(w[2 * k], w[2 * k + 1], hi4);
  for (int k = 0; k < 2; ++k)
    y[k] = __builtin_shuffle(x[2 * k], x[2 * k + 1], lo2) + __builtin_shuffle(x[2 * k], x[2 * k + 1], hi2);
  return __builtin_shuffle(y[0], y[1], ev) + __builtin_shuffle(y[0], y[1], od);
}

// Scratch memory of one thread, 64-byte aligned, reused between tasks. Contents are
// whatever the last user left: callers initialise what they read.
class Work {
 public:
  float* get(size_t n) {
    if (buf_.size() < n + 16) buf_.resize(n + 16);
    auto p = reinterpret_cast<uintptr_t>(buf_.data());
    return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
  }

 private:
  std::vector<float> buf_;
};

}  // namespace ssm
}  // namespace recurra

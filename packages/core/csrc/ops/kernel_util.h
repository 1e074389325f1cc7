// Helpers shared by the CPU kernels: row iteration over strided/broadcast views, and the
// attribute that compiles a hot loop for AVX-512, AVX2 and baseline x86-64 and picks one
// at run time (no -march=native in a wheel).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../graph.h"

// The AVX2 clone is x86-64-v3 (AVX2 with FMA, as every AVX2 CPU has): "avx2" alone would
// compile each `a += b * c` as a multiply and an add, half the throughput of one FMA.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(RECURRA_NO_CLONES)
#define RC_SIMD __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define RC_SIMD
#endif

namespace recurra {

// Elements per task below which splitting across threads costs more than it saves.
constexpr int64_t kGrainElems = 1 << 15;

// Offset of "row" r (all axes but the last) of `shape` under `strides`.
inline int64_t row_offset(const Shape& shape, const int64_t* strides, int64_t r) {
  int64_t off = 0;
  for (int i = shape.ndim - 2; i >= 0; --i) {
    int64_t d = shape.d[i];
    off += (r % d) * strides[i];
    r /= d;
  }
  return off;
}

inline int64_t n_rows(const Shape& s) { return s.ndim == 0 ? 1 : s.numel() / std::max<int64_t>(1, s.d[s.ndim - 1]); }
inline int64_t row_len(const Shape& s) { return s.ndim == 0 ? 1 : s.d[s.ndim - 1]; }
inline int64_t last_stride(const int64_t* st, const Shape& s) { return s.ndim == 0 ? 1 : st[s.ndim - 1]; }

// The sources of a backward kernel that reads the output gradient and every forward source:
// (grad_out, src...).
inline std::vector<int> grad_and_srcs(const GradSink& k) {
  std::vector<int> s{k.grad_out};
  s.insert(s.end(), k.node.src.begin(), k.node.src.end());
  return s;
}

// The name of node n's op (for error messages).
inline const std::string& op_name(const Node& n) { return OpTable::get().at(n.op).name; }

// Rows to hand each task so one task has about kGrainElems elements.
inline int64_t row_grain(int64_t len) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, len)); }

}  // namespace recurra

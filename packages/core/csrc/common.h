// Shared basics of the native core: dtypes, shapes, errors.
//
// Shapes are numpy order everywhere in the core: axis ndim-1 is the fastest one.
// Strides are counted in elements, not bytes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace recurra {

constexpr int kMaxDims = 4;

// The codes are recurra_dtype's (backend.h).
enum class DType : int32_t { f32 = 0, i32 = 1, bf16 = 2, f16 = 3 };
constexpr int kNumDTypes = 4;

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::i32: return "int32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
  }
  return "unknown";
}
inline size_t dtype_size(DType t) { return t == DType::bf16 || t == DType::f16 ? 2 : 4; }
// bfloat16 or float16: stored in 2 bytes, computed in float32 (see half.h).
inline bool is_half(DType t) { return t == DType::bf16 || t == DType::f16; }
inline bool is_float(DType t) { return t != DType::i32; }

// Errors. bindings.cpp maps them onto Python's ValueError, TypeError, MemoryError and
// RuntimeError; nothing in the core aborts the process.
struct ValueError : std::runtime_error { using std::runtime_error::runtime_error; };
struct TypeError : std::runtime_error { using std::runtime_error::runtime_error; };
struct StateError : std::runtime_error { using std::runtime_error::runtime_error; };  // -> RuntimeError
// -> MemoryError; the message names the pool, the bytes asked, the limit, what is free and
// what to try (RECURRA_OOM_HINT).
struct OutOfMemory : std::runtime_error { using std::runtime_error::runtime_error; };

struct Shape {
  int ndim = 0;
  int64_t d[kMaxDims] = {1, 1, 1, 1};

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) {
    if (dims.size() > kMaxDims) throw ValueError("at most 4 axes are supported");
    ndim = static_cast<int>(dims.size());
    int i = 0;
    for (int64_t v : dims) d[i++] = v;
  }
  static Shape from(const std::vector<int64_t>& dims) {
    if (dims.size() > kMaxDims)
      throw ValueError("at most 4 axes are supported, got " + std::to_string(dims.size()));
    Shape s;
    s.ndim = static_cast<int>(dims.size());
    for (int i = 0; i < s.ndim; ++i) {
      if (dims[i] < 0) throw ValueError("negative dimension in shape");
      s.d[i] = dims[i];
    }
    return s;
  }
  int64_t operator[](int i) const { return d[i]; }
  int64_t& operator[](int i) { return d[i]; }
  // Wraps around (defined: unsigned arithmetic) for counts past int64; every node's shape is
  // checked for that where it is made (Graph's overflow check), before anything is sized.
  int64_t numel() const {
    uint64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= static_cast<uint64_t>(d[i]);
    return static_cast<int64_t>(n);
  }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(d, d + ndim); }
  bool operator==(const Shape& o) const {
    if (ndim != o.ndim) return false;
    for (int i = 0; i < ndim; ++i)
      if (d[i] != o.d[i]) return false;
    return true;
  }
  bool operator!=(const Shape& o) const { return !(*this == o); }
  // "(2, 3)", "(5,)": built without iostreams, which some hosts' C++ runtimes (an older
  // libstdc++ loaded by the Python process) cannot run from code compiled by a newer g++.
  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < ndim; ++i) s += std::to_string(d[i]) + (i + 1 < ndim ? ", " : ndim == 1 ? "," : "");
    return s + ")";
  }
};

// Contiguous (row-major) strides of a shape.
inline void contiguous_strides(const Shape& s, int64_t* st) {
  uint64_t acc = 1;  // wraps like numel() for shapes the overflow check refuses next
  for (int i = s.ndim - 1; i >= 0; --i) {
    st[i] = static_cast<int64_t>(acc);
    acc *= static_cast<uint64_t>(s.d[i]);
  }
}

// Normalise a possibly negative axis; throws ValueError naming the op.
inline int norm_axis(const char* op, int64_t axis, int ndim) {
  if (axis < -ndim || axis >= ndim || ndim == 0) {
    throw ValueError(std::string(op) + ": axis " + std::to_string(axis) + " is out of range for a tensor of " +
                     std::to_string(ndim) + " axes");
  }
  return static_cast<int>(axis < 0 ? axis + ndim : axis);
}

}  // namespace recurra

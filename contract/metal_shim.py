"""The part of the Metal Shading Language the records' metal sources use, as C++17 a host compiler checks; the
thread attributes and type names MLX's metal_kernel writes; the host's C++ compiler."""

from __future__ import annotations

import os
import shutil

_TYPES = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
          "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
          "float16": "float16_t", "bfloat16": "bfloat16_t", "float32": "float"}

# The thread attributes MLX 0.32's metal_kernel declares, with their types: a body may name these and no others.
ATTRIBUTES = {"dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
              "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
              "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
              "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint",
              "thread_execution_width": "uint", "thread_index_in_quadgroup": "uint",
              "thread_index_in_simdgroup": "uint", "thread_index_in_threadgroup": "uint",
              "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
              "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3", "threads_per_grid": "uint3",
              "threads_per_simdgroup": "uint", "threads_per_threadgroup": "uint3"}


def mtype(dtype) -> str:
    return _TYPES[str(dtype).rsplit(".", 1)[-1]]


def template(launch) -> tuple[str, str]:
    """The launch's template as MLX writes it: the declaration before the kernel ("" where it has none) and the
    arguments of its instance (e.g. "<8, bfloat16_t>")."""
    if not launch.template:
        return "", ""
    kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in launch.template]
    values = [("true" if v else "false") if isinstance(v, bool) else str(v) if isinstance(v, int) else mtype(v)
              for _, v in launch.template]
    declared = ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, launch.template))
    return f"template <{declared}>\n", f"<{', '.join(values)}>"


def compiler() -> str | None:
    """The host's C++ compiler: $CXX, else g++ or clang++ on PATH; None where there is none."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


# MSL's unsigned scalar names, for the check and the emulator alike
SCALARS = """
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
"""

# Not Metal: address spaces vanish, and the SIMD functions and barriers are declared, never defined. What it keeps is
# what a syntax and type check needs: MSL's names, its scalar and vector types, and one overload a type for the
# math functions (so `metal::min(int, uint)` is as ambiguous here as there). A name MLX does not declare (a thread
# attribute it never adds, a helper no header defines, a double, an array sized at run time) fails here as it would
# on an Apple GPU.
SHIM = r"""
#include <cstddef>
#include <cstdint>
#include <cstring>

#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")

#define double metal_has_no_double  // a kernel taking one fails here as on an Apple GPU
#define device
#define constant
#define thread
#define threadgroup

""" + SCALARS + r"""
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f);
  operator float() const;
};
struct half {
  uint16_t bits;
  half() = default;
  half(float f);
  operator float() const;
};
typedef bfloat16_t bfloat;
typedef half float16_t;

template <typename S, int N>
struct tf_vec {
  S x, y, z, w;
  tf_vec() = default;
  explicit tf_vec(S all);
  tf_vec(S a, S b);
  tf_vec(S a, S b, S c);
  tf_vec(S a, S b, S c, S d);
  S& operator[](int i);
  const S& operator[](int i) const;
};
#define TF_VECTORS(S) typedef tf_vec<S, 2> S##2; typedef tf_vec<S, 3> S##3; typedef tf_vec<S, 4> S##4;
TF_VECTORS(uchar) TF_VECTORS(ushort) TF_VECTORS(uint) TF_VECTORS(int) TF_VECTORS(float) TF_VECTORS(half)
TF_VECTORS(short) TF_VECTORS(char) TF_VECTORS(bool)

namespace metal {
#define TF_BINARY(name) float name(float, float); half name(half, half); int name(int, int); uint name(uint, uint); \
  short name(short, short); ushort name(ushort, ushort); long name(long, long); ulong name(ulong, ulong);
TF_BINARY(min) TF_BINARY(max)
#define TF_FLOATS1(name) float name(float); half name(half);
#define TF_FLOATS2(name) float name(float, float); half name(half, half);
TF_FLOATS2(fmax) TF_FLOATS2(fmin) TF_FLOATS2(pow) TF_FLOATS2(fmod) TF_FLOATS2(atan2)
TF_FLOATS1(exp) TF_FLOATS1(exp2) TF_FLOATS1(log) TF_FLOATS1(log2) TF_FLOATS1(sqrt) TF_FLOATS1(rsqrt)
TF_FLOATS1(fabs) TF_FLOATS1(floor) TF_FLOATS1(ceil) TF_FLOATS1(sin) TF_FLOATS1(cos) TF_FLOATS1(tanh)
TF_FLOATS1(round) TF_FLOATS1(trunc)
float fma(float, float, float); half fma(half, half, half);
bool isnan(float); bool isnan(half); bool isinf(float); bool isinf(half); bool isfinite(float);
int abs(int); float abs(float); half abs(half);
namespace precise { TF_FLOATS1(exp) TF_FLOATS1(log) TF_FLOATS1(sin) TF_FLOATS1(cos) TF_FLOATS1(sqrt)
                    TF_FLOATS1(rsqrt) TF_FLOATS1(tanh) TF_FLOATS2(pow) }
namespace fast { TF_FLOATS1(exp) TF_FLOATS1(log) TF_FLOATS1(sin) TF_FLOATS1(cos) TF_FLOATS1(sqrt) TF_FLOATS1(rsqrt) }
}  // namespace metal
using namespace metal;

template <typename T> T simd_shuffle_xor(T value, ushort mask);
template <typename T> T simd_shuffle(T value, ushort lane);
template <typename T> T simd_shuffle_down(T value, ushort delta);
template <typename T> T simd_shuffle_up(T value, ushort delta);
template <typename T> T simd_broadcast(T value, ushort lane);
template <typename T> T simd_sum(T value);
template <typename T> T simd_max(T value);
template <typename T> T simd_min(T value);
template <typename T> T simd_prefix_exclusive_sum(T value);
bool simd_any(bool value);
bool simd_all(bool value);

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
mem_flags operator|(mem_flags a, mem_flags b);
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

template <typename T, typename U>
T as_type(U value) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  T out;
  std::memcpy(&out, &value, sizeof(T));
  return out;
}
"""

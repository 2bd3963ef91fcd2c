"""The C++ a metal source runs on when emulated on the host: MSL's types and functions, and SIMT threads."""

# Each thread of a threadgroup is a context of its own (a stack and its saved registers; a ucontext off x86-64); the
# scheduler runs them one at a time until each is done or waits: at a SIMD shuffle for every live lane of its
# simdgroup (twice: write, then read), at a barrier for every live thread of its group. `threadgroup` arrays become
# statics, so a group's threads share them. The arithmetic is IEEE fp32 with no contraction (`metal::fma` is a
# fused one); Metal compiles with fast math, so a result here can differ from an Apple GPU's in the last bits of exp
# and the like, never in which elements a kernel reads or writes.

from .metal_shim import SCALARS

PRELUDE = r"""
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

""" + SCALARS + r"""
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                                             : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef bfloat16_t bfloat;
typedef _Float16 half;
typedef half float16_t;

#define TF_INDEX S& operator[](int i) { return (&x)[i]; } const S& operator[](int i) const { return (&x)[i]; }
template <typename S, int N> struct tf_vec;
template <typename S> struct tf_vec<S, 2> { S x, y; TF_INDEX };
template <typename S> struct tf_vec<S, 3> { S x, y, z; TF_INDEX };
template <typename S> struct tf_vec<S, 4> { S x, y, z, w; TF_INDEX };
#define TF_VECTORS(S) typedef tf_vec<S, 2> S##2; typedef tf_vec<S, 3> S##3; typedef tf_vec<S, 4> S##4;
TF_VECTORS(uchar) TF_VECTORS(ushort) TF_VECTORS(uint) TF_VECTORS(int) TF_VECTORS(float) TF_VECTORS(half)

namespace metal {
template <typename T> T min(T a, T b) { return b < a ? b : a; }
template <typename T> T max(T a, T b) { return a < b ? b : a; }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float exp(float a) { return std::exp(a); }
inline float exp2(float a) { return std::exp2(a); }
inline float log(float a) { return std::log(a); }
inline float sqrt(float a) { return std::sqrt(a); }
inline float rsqrt(float a) { return 1.0f / std::sqrt(a); }
inline float abs(float a) { return std::fabs(a); }
inline float fabs(float a) { return std::fabs(a); }
inline float sin(float a) { return std::sin(a); }
inline float cos(float a) { return std::cos(a); }
inline float tanh(float a) { return std::tanh(a); }
inline float floor(float a) { return std::floor(a); }
inline float ceil(float a) { return std::ceil(a); }
inline float pow(float a, float b) { return std::pow(a, b); }
inline bool isnan(float a) { return std::isnan(a); }
inline bool isinf(float a) { return std::isinf(a); }
namespace precise {
inline float exp(float a) { return std::exp(a); }
inline float log(float a) { return std::log(a); }
inline float sin(float a) { return std::sin(a); }
inline float cos(float a) { return std::cos(a); }
inline float sqrt(float a) { return std::sqrt(a); }
inline float rsqrt(float a) { return 1.0f / std::sqrt(a); }
}
namespace fast {
inline float exp(float a) { return std::exp(a); }
inline float rsqrt(float a) { return 1.0f / std::sqrt(a); }
}
}  // namespace metal

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((int)a | (int)b); }

enum { TF_RUN, TF_SIMD, TF_BAR, TF_DONE };
#if defined(__x86_64__) && !defined(TF_UCONTEXT)
// a thread switch that saves only the callee-saved registers: swapcontext also saves the signal mask, a system call
// at each of the two switches every lane makes at every SIMD shuffle
extern "C" void tf_switch(void** save_sp, void* load_sp);
asm(".text\n.globl tf_switch\n.type tf_switch,@function\ntf_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n");
struct TfContext { void* sp; };
static void tf_swap(TfContext* save, TfContext* load) { tf_switch(&save->sp, load->sp); }
static void tf_start(TfContext* ctx, std::vector<char>& stack, void (*entry)()) {
  // a stack that `ret`s into entry as if it had been called: six zeroed registers, entry, a never-used return address
  uintptr_t top = ((uintptr_t)(stack.data() + stack.size())) & ~(uintptr_t)15;
  void** sp = (void**)top;
  *--sp = nullptr;
  *--sp = (void*)entry;
  for (int r = 0; r < 6; ++r) *--sp = nullptr;
  ctx->sp = sp;
}
#else
struct TfContext { ucontext_t uc; };
static void tf_swap(TfContext* save, TfContext* load) { swapcontext(&save->uc, &load->uc); }
static void tf_start(TfContext* ctx, std::vector<char>& stack, void (*entry)()) {
  getcontext(&ctx->uc);
  ctx->uc.uc_stack.ss_sp = stack.data();
  ctx->uc.uc_stack.ss_size = stack.size();
  ctx->uc.uc_link = nullptr;
  makecontext(&ctx->uc, entry, 0);
}
#endif
struct TfThread {
  TfContext ctx;
  int state;
  int barriers;  // barriers passed: the group goes on only when every live thread waits at the same one
  unsigned char slot[8];
};
static std::vector<TfThread> tf_threads;
static std::vector<std::vector<char>> tf_stacks;
static TfContext tf_main;
static int tf_cur, tf_count;
static int tf_grid[3], tf_size[3], tf_group[3], tf_actual[3];
static void** tf_buffers;

static void tf_wait(int state) {
  tf_threads[tf_cur].state = state;
  tf_swap(&tf_threads[tf_cur].ctx, &tf_main);
}

inline void threadgroup_barrier(mem_flags) {
  ++tf_threads[tf_cur].barriers;
  tf_wait(TF_BAR);
}
inline void simdgroup_barrier(mem_flags) { tf_wait(TF_SIMD); }

template <typename T> T tf_from_lane(T value, int partner) {
  static_assert(sizeof(T) <= 8, "a shuffled value of more than 8 bytes");
  std::memcpy(tf_threads[tf_cur].slot, &value, sizeof(T));
  tf_wait(TF_SIMD);  // every live lane has written its value
  T out = value;
  if (partner >= 0 && partner < tf_count && tf_threads[partner].state != TF_DONE)
    std::memcpy(&out, tf_threads[partner].slot, sizeof(T));
  tf_wait(TF_SIMD);  // every live lane has read before any writes again
  return out;
}
template <typename T> T simd_shuffle_xor(T v, ushort mask) {
  return tf_from_lane(v, (tf_cur & ~31) | ((tf_cur & 31) ^ mask));
}
template <typename T> T simd_shuffle(T v, ushort lane) { return tf_from_lane(v, (tf_cur & ~31) | (lane & 31)); }
template <typename T> T simd_broadcast(T v, ushort lane) { return simd_shuffle(v, lane); }
template <typename T> T simd_shuffle_down(T v, ushort d) {
  return tf_from_lane(v, (tf_cur & 31) + d < 32 ? tf_cur + d : tf_cur);
}
template <typename T> T simd_sum(T v) { for (ushort o = 16; o > 0; o >>= 1) v += simd_shuffle_xor(v, o); return v; }
template <typename T> T simd_max(T v) {
  for (ushort o = 16; o > 0; o >>= 1) v = metal::max(v, simd_shuffle_xor(v, o));
  return v;
}

template <typename T, typename U> T as_type(U value) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  T out;
  std::memcpy(&out, &value, sizeof(T));
  return out;
}

using namespace metal;
#define INFINITY __builtin_inff()
#define device
#define constant
#define thread
#define threadgroup static
"""

# After the kernel: the launch. `tf_entry` (written per kernel) calls it for thread `tf_cur` of group `tf_group`.
LAUNCH = r"""
static void tf_body() {
  tf_entry();
  tf_wait(TF_DONE);
}

extern "C" int tf_launch(void** buffers, const int* grid, const int* size, char* error, int error_size) {
  tf_buffers = buffers;
  for (int d = 0; d < 3; ++d) tf_grid[d] = grid[d], tf_size[d] = size[d];
  const int groups[3] = {(grid[0] + size[0] - 1) / size[0], (grid[1] + size[1] - 1) / size[1],
                         (grid[2] + size[2] - 1) / size[2]};
  for (int gz = 0; gz < groups[2]; ++gz)
  for (int gy = 0; gy < groups[1]; ++gy)
  for (int gx = 0; gx < groups[0]; ++gx) {
    tf_group[0] = gx, tf_group[1] = gy, tf_group[2] = gz;
    for (int d = 0; d < 3; ++d) {
      const int left = grid[d] - tf_group[d] * size[d];
      tf_actual[d] = left < size[d] ? left : size[d];
    }
    tf_count = tf_actual[0] * tf_actual[1] * tf_actual[2];
    tf_threads.assign(tf_count, TfThread());
    for (auto& t : tf_threads) t.barriers = 0;
    if ((int)tf_stacks.size() < tf_count) tf_stacks.resize(tf_count, std::vector<char>(1 << 16));
    for (int i = 0; i < tf_count; ++i) {
      tf_start(&tf_threads[i].ctx, tf_stacks[i], tf_body);
      tf_threads[i].state = TF_RUN;
    }
    for (;;) {
      for (int i = 0; i < tf_count; ++i) {
        if (tf_threads[i].state == TF_RUN) {
          tf_cur = i;
          tf_swap(&tf_main, &tf_threads[i].ctx);
        }
      }
      int live = 0, at_barrier = 0;
      for (int i = 0; i < tf_count; ++i) {
        live += tf_threads[i].state != TF_DONE;
        at_barrier += tf_threads[i].state == TF_BAR;
      }
      if (live == 0) break;
      bool released = false;
      for (int s = 0; s < tf_count; s += 32) {  // a simdgroup whose live lanes all wait at a SIMD op goes on
        int lanes = 0, waiting = 0;
        for (int i = s; i < s + 32 && i < tf_count; ++i) {
          lanes += tf_threads[i].state != TF_DONE;
          waiting += tf_threads[i].state == TF_SIMD;
        }
        if (lanes > 0 && waiting == lanes) {
          for (int i = s; i < s + 32 && i < tf_count; ++i)
            if (tf_threads[i].state == TF_SIMD) tf_threads[i].state = TF_RUN;
          released = true;
        }
      }
      if (!released && at_barrier == live) {
        int first = -1, same = 1;
        for (int i = 0; i < tf_count; ++i) {
          if (tf_threads[i].state != TF_BAR) continue;
          if (first < 0) first = tf_threads[i].barriers;
          same &= tf_threads[i].barriers == first;
        }
        if (same && live == tf_count) {
          for (int i = 0; i < tf_count; ++i)
            if (tf_threads[i].state == TF_BAR) tf_threads[i].state = TF_RUN;
          released = true;
        } else if (same) {  // some threads returned before it: on a GPU they never arrive, and the rest may hang
          std::snprintf(error, error_size, "threadgroup (%d, %d, %d): %d threads wait at a barrier that %d of the "
                        "group returned before", gx, gy, gz, live, tf_count - live);
          return 1;
        }
      }
      if (!released) {
        std::snprintf(error, error_size, "threadgroup (%d, %d, %d): %d live threads wait at different points "
                      "(a barrier or SIMD op not reached by all): on a GPU this hangs or reads garbage",
                      gx, gy, gz, live);
        return 1;
      }
    }
  }
  return 0;
}
"""

// A small CUDA execution model for running astrai's .cu sources, unchanged, on the CPU (g++).
//
// Blocks run one after another; the threads of a block are cooperative fibers (ucontext) that a
// scheduler resumes in thread order until each reaches __syncthreads, a warp shuffle or its end.
// That is deterministic, and it catches what a GPU would only do sometimes:
//   * a missing barrier: thread 0 runs ahead to its next barrier and reads shared memory the
//     others have not written yet, which is NaN-poisoned for every block;
//   * a deadlock, or a divergent barrier (threads waiting at different __syncthreads, or some
//     exited while others wait), reported with the source line instead of hanging;
//   * a shuffle across exited lanes.
// Warp shuffles exchange through a per-warp buffer between two warp barriers. __half and
// __nv_bfloat16 are 16-bit storage types converted through float with round-to-nearest-even.
// Global buffers come from emu_alloc, which places each one against a PROT_NONE guard page so an
// out-of-bounds read faults; the fault is turned into an error for the launch, not a crash.
// The launcher checks each argument's C type against the kernel's signature.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <csetjmp>
#include <csignal>
#include <pthread.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <tuple>
#include <type_traits>
#include <ucontext.h>
#include <unistd.h>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// ---- 16-bit float types (storage only; kernels compute in float) ----
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return (float)f;
}
inline __half __float2half_rn(float x) {
  _Float16 f = (_Float16)x;  // IEEE round-to-nearest-even, like the GPU's cvt.rn.f16.f32
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
inline __half __float2half(float x) { return __float2half_rn(x); }
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = 0x7fc0;  // NaN stays NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    b.bits = (uint16_t)(u >> 16);
  }
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }
inline float __int_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }

// Fiber switches. glibc's swapcontext makes a sigprocmask system call on every switch, and a
// kernel switches at every barrier and twice per shuffle, so on x86-64 a 14-instruction switch of
// the callee-saved registers (+ MXCSR / x87 control word) replaces it: ~20x faster emulation.
// Elsewhere (or with -DEMU_UCONTEXT) ucontext is used.
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_FAST_SWITCH 1
extern "C" void emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_switch
.hidden emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch, .-emu_switch
)");
#endif

namespace emu {

enum State { READY, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
  ucontext_t ctx;
  void* sp = nullptr;  // saved stack pointer (fast switch)
  dim3 idx;
  int linear = 0;
  unsigned shuffles = 0;
  unsigned syncs = 0, warp_syncs = 0;  // real-thread mode: which of the two barrier objects is next
  State state = READY;
  const char* file = "";
  int line = 0;
};

struct Region {
  char* data;
  size_t nbytes;
  char* map;
  size_t map_len;
};

struct Runtime {
  dim3 grid, block, block_idx;
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  size_t stack_size = 256 * 1024;
  int current = 0;
  ucontext_t sched;
  void* sched_sp = nullptr;
  std::vector<float> smem;  // dynamic shared memory of the running block, NaN-poisoned
  std::vector<uint64_t> shfl;
  void (*body)() = nullptr;
  char* error = nullptr;
  size_t error_len = 0;
  bool failed = false;
  std::vector<Region> regions;
  sigjmp_buf fault_jmp;
  pthread_barrier_t block_barriers[2];
  std::vector<pthread_barrier_t> warp_barriers;
};

inline Runtime& rt() {
  static Runtime r;
  return r;
}
#ifdef EMU_THREADS
// Real-thread mode (for ThreadSanitizer / AddressSanitizer builds): one OS thread per CUDA
// thread, __syncthreads and warp exchanges as pthread barriers, which the sanitizers understand.
inline thread_local int tl_thread = -1;
inline Fiber& cur() { return rt().fibers[tl_thread]; }
#else
inline Fiber& cur() { return rt().fibers[rt().current]; }
#endif

inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void fail(const char* fmt, ...) {
  Runtime& r = rt();
  if (r.failed) return;
  r.failed = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r.error, r.error_len, fmt, ap);
  va_end(ap);
}

inline void yield_to_scheduler() {
#ifdef EMU_FAST_SWITCH
  emu_switch(&cur().sp, rt().sched_sp);
#else
  swapcontext(&cur().ctx, &rt().sched);
#endif
}

inline void syncthreads(const char* file, int line) {
#ifdef EMU_THREADS
  // Two barrier objects, alternately: ThreadSanitizer models a barrier as one sync object, so a
  // fast thread's arrival at the next phase of a reused barrier could hand its later writes to a
  // slow thread still leaving this phase, hiding exactly the races we are looking for.
  (void)file, (void)line;
  pthread_barrier_wait(&rt().block_barriers[cur().syncs++ & 1]);
  return;
#endif
  Fiber& f = cur();
  f.state = AT_BARRIER;
  f.file = file;
  f.line = line;
  yield_to_scheduler();
}

inline void warp_barrier(const char* file, int line) {
#ifdef EMU_THREADS
  (void)file, (void)line;
  pthread_barrier_wait(&rt().warp_barriers[2 * (cur().linear / 32) + (cur().warp_syncs++ & 1)]);
  return;
#endif
  Fiber& f = cur();
  f.state = AT_WARP;
  f.file = file;
  f.line = line;
  yield_to_scheduler();
}

template <typename T>
T shfl_xor(T v, int lane_mask, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  Runtime& r = rt();
  Fiber& f = cur();
  const int me = f.linear;
  const int warp = me / 32, lane = me % 32, src = lane ^ (lane_mask & 31);
  // Two buffers used alternately: a lane can only write buffer b again two shuffles later, after
  // a barrier every lane passed after reading it, so one barrier per shuffle is enough.
  uint64_t* buf = r.shfl.data() + (size_t)(f.shuffles++ & 1) * r.shfl.size() / 2;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  buf[warp * 32 + lane] = bits;
  warp_barrier(file, line);  // every lane has published its value
  if (warp * 32 + src >= (int)r.fibers.size()) fail("shuffle from lane %d of a partial warp (%s:%d)", src, file, line);
  T out;
  std::memcpy(&out, &buf[warp * 32 + src], sizeof(T));
#ifdef EMU_THREADS
  warp_barrier(file, line);  // real threads: no fiber scheduler ordering, keep the second barrier
#endif
  return out;
}

}  // namespace emu

#define threadIdx (emu::cur().idx)
#define blockIdx (emu::rt().block_idx)
#define blockDim (emu::rt().block)
#define gridDim (emu::rt().grid)
#define __syncthreads() emu::syncthreads(__FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, lane_mask) emu::shfl_xor((v), (lane_mask), __FILE__, __LINE__)
#define ASTRAI_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(emu::rt().smem.data())

#include "emu_launch.h"

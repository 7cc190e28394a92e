// The emulator's launcher: the block scheduler, the fault guard and the typed argument check.
// Included at the end of emu.h; the generated wrapper (harness.py) calls emu::launch per kernel.
#pragma once

namespace emu {

// Argument type codes shared with harness.py (ARG_CODES there): pointers by element type, then
// scalars. const and non-const pointers share a code.
enum Code : int { P_F32 = 1, P_F16, P_BF16, P_I32, P_I64, S_I32 = 10, S_I64, S_F32 };

template <typename T> struct code_of;
template <> struct code_of<int> { static constexpr int value = S_I32; };
template <> struct code_of<long long> { static constexpr int value = S_I64; };
template <> struct code_of<float> { static constexpr int value = S_F32; };
template <typename T> struct pointee_code;
template <> struct pointee_code<float> { static constexpr int value = P_F32; };
template <> struct pointee_code<__half> { static constexpr int value = P_F16; };
template <> struct pointee_code<__nv_bfloat16> { static constexpr int value = P_BF16; };
template <> struct pointee_code<int> { static constexpr int value = P_I32; };
template <> struct pointee_code<long long> { static constexpr int value = P_I64; };
template <typename T> struct code_of<T*> {
  static constexpr int value = pointee_code<std::remove_cv_t<T>>::value;
};

inline const char* code_name(int c) {
  switch (c) {
    case P_F32: return "float*";
    case P_F16: return "__half*";
    case P_BF16: return "__nv_bfloat16*";
    case P_I32: return "int*";
    case P_I64: return "long long*";
    case S_I32: return "int";
    case S_I64: return "long long";
    case S_F32: return "float";
  }
  return "?";
}

template <typename T> T unpack(uint64_t bits) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<uintptr_t>(bits));
  } else {
    T v;
    std::memcpy(&v, &bits, sizeof(T));  // little-endian: the low bytes hold the scalar
    return v;
  }
}

inline void fiber_main() {
  rt().body();
  cur().state = DONE;
  yield_to_scheduler();  // never resumed
}

inline const char* state_name(State s) {
  return s == READY ? "running" : s == AT_BARRIER ? "__syncthreads" : s == AT_WARP ? "warp shuffle" : "exited";
}

inline void describe_stuck(const char* what) {
  Runtime& r = rt();
  char detail[512] = "";
  size_t used = 0;
  for (size_t i = 0; i < r.fibers.size() && used < sizeof(detail) - 80; ++i) {
    const Fiber& f = r.fibers[i];
    if (i > 0 && f.state == r.fibers[i - 1].state && f.line == r.fibers[i - 1].line) continue;
    used += snprintf(detail + used, sizeof(detail) - used, " thread %zu: %s %s:%d;", i, state_name(f.state),
                     f.file, f.line);
  }
  fail("%s in block (%u,%u,%u):%s", what, r.block_idx.x, r.block_idx.y, r.block_idx.z, detail);
}

// Releases the warp barriers and the block barrier that every live thread has reached.
// Returns false when nothing can run any more (deadlock or divergence, already reported).
inline bool release_barriers() {
  Runtime& r = rt();
  const int n = (int)r.fibers.size();
  int done = 0, at_bar = 0, ready = 0;
  for (const Fiber& f : r.fibers) {
    done += f.state == DONE;
    at_bar += f.state == AT_BARRIER;
    ready += f.state == READY;
  }
  if (done == n || ready > 0) return true;
  bool released = false;
  for (int w = 0; w * 32 < n; ++w) {
    const int end = std::min(n, (w + 1) * 32);
    int waiting = 0, live = 0;
    for (int i = w * 32; i < end; ++i) {
      live += r.fibers[i].state != DONE;
      waiting += r.fibers[i].state == AT_WARP;
    }
    if (waiting == 0) continue;
    if (waiting != end - w * 32) {
      if (waiting == live) describe_stuck("warp shuffle with exited lanes");
      continue;
    }
    for (int i = w * 32; i < end; ++i) r.fibers[i].state = READY;
    released = true;
  }
  if (released || r.failed) return !r.failed;
  if (at_bar == n - done && at_bar > 0) {
    if (done > 0) {
      describe_stuck("divergent barrier: threads exited while others wait at __syncthreads");
      return false;
    }
    for (const Fiber& f : r.fibers) {
      if (f.line != r.fibers[0].line || std::strcmp(f.file, r.fibers[0].file) != 0) {
        describe_stuck("divergent barrier: threads wait at different __syncthreads");
        return false;
      }
    }
    for (Fiber& f : r.fibers) f.state = READY;
    return true;
  }
  describe_stuck("deadlock");
  return false;
}

inline void run_block() {
  Runtime& r = rt();
  const int n = (int)r.fibers.size();
  std::fill(r.smem.begin(), r.smem.end(), std::nanf(""));
  for (int i = 0; i < n; ++i) {
    Fiber& f = r.fibers[i];
    f.state = READY;
    f.linear = i;
    f.idx.x = i % r.block.x;
    f.idx.y = (i / r.block.x) % r.block.y;
    f.idx.z = i / (r.block.x * r.block.y);
    f.shuffles = 0;
    char* stack = r.stacks.data() + (size_t)i * r.stack_size;
#ifdef EMU_FAST_SWITCH
    // The frame emu_switch pops: control words, six registers, then "returns" into fiber_main
    // with the stack aligned as after a call.
    uintptr_t top = ((uintptr_t)(stack + r.stack_size)) & ~(uintptr_t)15;
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                                    // fiber_main's (never used) return address
    *--sp = reinterpret_cast<void*>(&fiber_main);
    for (int k = 0; k < 6; ++k) *--sp = nullptr;        // rbp rbx r12 r13 r14 r15
    *--sp = reinterpret_cast<void*>((uintptr_t)0x037F00001F80ull);  // MXCSR default, x87 CW default
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = r.stack_size;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
  }
  while (!r.failed) {
    for (int i = 0; i < n && !r.failed; ++i) {
      if (r.fibers[i].state != READY) continue;
      r.current = i;
#ifdef EMU_FAST_SWITCH
      emu_switch(&r.sched_sp, r.fibers[i].sp);
#else
      swapcontext(&r.sched, &r.fibers[i].ctx);
#endif
    }
    bool all_done = true;
    for (const Fiber& f : r.fibers) all_done &= f.state == DONE;
    if (all_done || !release_barriers()) return;
  }
}

#ifdef EMU_THREADS
inline void* thread_main(void* arg) {
  tl_thread = (int)(intptr_t)arg;
  rt().body();
  return nullptr;
}

inline void run_block_threads() {
  Runtime& r = rt();
  const int n = (int)r.fibers.size();
  std::fill(r.smem.begin(), r.smem.end(), std::nanf(""));
  for (auto& b : r.block_barriers) pthread_barrier_init(&b, nullptr, (unsigned)n);
  r.warp_barriers.resize(2 * ((size_t)(n + 31) / 32));
  for (size_t w = 0; w < r.warp_barriers.size(); ++w)
    pthread_barrier_init(&r.warp_barriers[w], nullptr, (unsigned)std::min(32, n - (int)(w / 2) * 32));
  std::vector<pthread_t> threads((size_t)n);
  for (int i = 0; i < n; ++i) {
    Fiber& f = r.fibers[i];
    f.linear = i;
    f.syncs = f.warp_syncs = f.shuffles = 0;
    f.idx.x = i % r.block.x;
    f.idx.y = (i / r.block.x) % r.block.y;
    f.idx.z = i / (r.block.x * r.block.y);
  }
  for (int i = 0; i < n; ++i) pthread_create(&threads[i], nullptr, thread_main, (void*)(intptr_t)i);
  for (int i = 0; i < n; ++i) pthread_join(threads[i], nullptr);
  for (auto& b : r.block_barriers) pthread_barrier_destroy(&b);
  for (auto& b : r.warp_barriers) pthread_barrier_destroy(&b);
}
#endif

inline Region* region_of(const char* addr) {
  for (Region& g : rt().regions)
    if (addr >= g.map && addr < g.map + g.map_len) return &g;
  return nullptr;
}

inline void on_fault(int, siginfo_t* info, void*) {
  Runtime& r = rt();
  const char* addr = static_cast<const char*>(info->si_addr);
  r.failed = false;
  if (const Region* g = region_of(addr)) {
    const long long off = (long long)(addr - g->data);
    fail("out-of-bounds access in block (%u,%u,%u) thread %d: byte %lld of a %zu-byte buffer at %p",
         r.block_idx.x, r.block_idx.y, r.block_idx.z, r.current, off, g->nbytes, (void*)g->data);
  } else {
    fail("segmentation fault at %p in block (%u,%u,%u) thread %d (not next to any launch buffer)", (void*)addr,
         r.block_idx.x, r.block_idx.y, r.block_idx.z, r.current);
  }
  siglongjmp(r.fault_jmp, 1);
}

struct LaunchArgs {
  unsigned grid[3];
  unsigned block[3];
  long long smem_bytes;
  int nargs;
  const int* codes;
  const uint64_t* values;
  char* error;
  long long error_len;
};

template <typename... Args, size_t... I>
void bind(void (*kernel)(Args...), const LaunchArgs* a, std::index_sequence<I...>) {
  static std::tuple<Args...> args;  // fibers read it through body(); one launch at a time
  static void (*fn)(Args...);
  args = std::tuple<Args...>(unpack<Args>(a->values[I])...);
  fn = kernel;
  rt().body = [] { std::apply(fn, args); };
}

template <typename... Args>
int launch(void (*kernel)(Args...), const LaunchArgs* a) {
  Runtime& r = rt();
  r.error = a->error;
  r.error_len = (size_t)a->error_len;
  r.failed = false;
  constexpr int expected[] = {code_of<Args>::value..., 0};
  if (a->nargs != (int)sizeof...(Args)) {
    fail("kernel takes %zu arguments, launch passed %d", sizeof...(Args), a->nargs);
    return 1;
  }
  for (int i = 0; i < a->nargs; ++i) {
    if (a->codes[i] != expected[i]) {
      fail("argument %d: kernel takes %s, launch passed %s", i, code_name(expected[i]), code_name(a->codes[i]));
      return 1;
    }
  }
  bind(kernel, a, std::index_sequence_for<Args...>{});
  r.grid = dim3{a->grid[0], a->grid[1], a->grid[2]};
  r.block = dim3{a->block[0], a->block[1], a->block[2]};
  const size_t threads = (size_t)r.block.x * r.block.y * r.block.z;
  if (threads == 0 || threads > 1024) {
    fail("block of %zu threads", threads);
    return 1;
  }
  r.fibers.assign(threads, Fiber{});
  if (r.stacks.size() < threads * r.stack_size) r.stacks.resize(threads * r.stack_size);
  r.smem.assign((size_t)(a->smem_bytes + 3) / 4, 0.f);
  r.shfl.assign(2 * ((threads + 31) / 32 * 32), 0);  // two alternating exchange buffers

#ifdef EMU_THREADS
  for (unsigned z = 0; z < r.grid.z; ++z)
    for (unsigned y = 0; y < r.grid.y; ++y)
      for (unsigned x = 0; x < r.grid.x; ++x) {
        r.block_idx = dim3{x, y, z};
        run_block_threads();
      }
  return r.failed ? 1 : 0;
#endif
  struct sigaction act {}, old_segv {}, old_bus {};
  act.sa_sigaction = on_fault;
  act.sa_flags = SA_SIGINFO | SA_ONSTACK;
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  sigaltstack(&ss, nullptr);
  sigaction(SIGSEGV, &act, &old_segv);
  sigaction(SIGBUS, &act, &old_bus);
  if (sigsetjmp(r.fault_jmp, 1) == 0) {
    for (unsigned z = 0; z < r.grid.z && !r.failed; ++z)
      for (unsigned y = 0; y < r.grid.y && !r.failed; ++y)
        for (unsigned x = 0; x < r.grid.x && !r.failed; ++x) {
          r.block_idx = dim3{x, y, z};
          run_block();
        }
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  return r.failed ? 1 : 0;
}

}  // namespace emu

// Guarded buffers: the data ends exactly at a PROT_NONE page, and another one precedes its first
// page, so reads past the end (and just before the start) fault instead of reading a neighbour.
extern "C" void* emu_alloc(long long nbytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t body = ((size_t)nbytes + page - 1) / page * page;
  const size_t len = body + 2 * page;
  char* map = static_cast<char*>(mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (map == MAP_FAILED) return nullptr;
  mprotect(map, page, PROT_NONE);
  mprotect(map + page + body, page, PROT_NONE);
  char* data = map + page + body - (size_t)nbytes;
  emu::rt().regions.push_back(emu::Region{data, (size_t)nbytes, map, len});
  return data;
}

extern "C" void emu_free(void* data) {
  auto& regions = emu::rt().regions;
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].data == data) {
      munmap(regions[i].map, regions[i].map_len);
      regions.erase(regions.begin() + (long)i);
      return;
    }
  }
}

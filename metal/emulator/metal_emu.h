// metal_emu.h: runs Metal compute-kernel source on the CPU, for tests on machines without Metal.
//
// The kernel text is compiled unchanged by a C++20 compiler: the address-space words
// (device, constant, thread, threadgroup) become storage hints, Metal's scalar and vector
// types and math functions are supplied here, and `run_grid` executes a dispatch:
//
// - Threadgroups run one after another; the threads of one threadgroup run concurrently as
//   fibers (ucontext), switched only at `threadgroup_barrier` and at simdgroup operations,
//   so a barrier really waits for every thread of the threadgroup and a simd_* call really
//   exchanges values between the 32 lanes of a simdgroup (lane = linear index % 32).
// - `threadgroup` variables are function-static: shared by the fibers of the threadgroup
//   that is running (threadgroups never overlap). They are not cleared between threadgroups.
// - Device buffers live in their own mappings with inaccessible guard pages around them;
//   an access past either end faults, and the fault handler names the buffer and exits
//   with status 86. With METAL_EMU_ALIGN=end (default) a buffer ends at its guard page
//   (exactly when its size is a multiple of 4 bytes, else within 3 bytes: buffers stay
//   4-byte aligned), so a read one element past the end faults; with METAL_EMU_ALIGN=start
//   it begins exactly after the front guard page, so a read before the start faults.
// - Unwritten output bytes are 0xFF (NaN for floats) unless the launch gives an init value.
// - Errors in the kernel's use of barriers or simd ops (a barrier some threads never reach,
//   simd ops where lanes of one simdgroup diverge) stop the run with status 87.
//
// Not modelled: memory ordering between threadgroups and device atomics, fast-math
// precision, the float16 rounding of intermediate `half` arithmetic beyond IEEE binary16,
// threadgroup memory limits (32 KiB on Apple GPUs), and out-of-bounds threadgroup-array
// indexing (not guarded).
#pragma once

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <signal.h>
#include <string>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

// ---------------------------------------------------------------- scalar and vector types
using uint = unsigned int;
using ushort = unsigned short;
using half = _Float16;
using float16_t = _Float16;

struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  bfloat16_t(float f) {  // round to nearest even, as MLX converts
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40);
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
};

template <typename T, int N>
struct vec;

#define METAL_EMU_VEC_COMMON(N)                                                    \
  T& operator[](int i) { return (&x)[i]; }                                         \
  const T& operator[](int i) const { return (&x)[i]; }                             \
  template <typename U>                                                            \
  explicit vec(const vec<U, N>& o) {                                               \
    for (int i = 0; i < N; i++) (*this)[i] = T(float(o[i]));                       \
  }

template <typename T>
struct vec<T, 2> {
  T x{}, y{};
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  METAL_EMU_VEC_COMMON(2)
};
template <typename T>
struct vec<T, 3> {
  T x{}, y{}, z{};
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  METAL_EMU_VEC_COMMON(3)
};
template <typename T>
struct vec<T, 4> {
  T x{}, y{}, z{}, w{};
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  METAL_EMU_VEC_COMMON(4)
};

#define METAL_EMU_VEC_OP(op)                                                       \
  template <typename T, int N>                                                     \
  vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {                  \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; i++) r[i] = a[i] op b[i];                               \
    return r;                                                                      \
  }                                                                                \
  template <typename T, int N>                                                     \
  vec<T, N> operator op(const vec<T, N>& a, T b) {                                 \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; i++) r[i] = a[i] op b;                                  \
    return r;                                                                      \
  }                                                                                \
  template <typename T, int N>                                                     \
  vec<T, N> operator op(T a, const vec<T, N>& b) {                                 \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; i++) r[i] = a op b[i];                                  \
    return r;                                                                      \
  }                                                                                \
  template <typename T, int N>                                                     \
  vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) {                    \
    return a = a op b;                                                             \
  }                                                                                \
  template <typename T, int N>                                                     \
  vec<T, N>& operator op##=(vec<T, N>& a, T b) {                                   \
    return a = a op b;                                                             \
  }
METAL_EMU_VEC_OP(+)
METAL_EMU_VEC_OP(-)
METAL_EMU_VEC_OP(*)
METAL_EMU_VEC_OP(/)

using float2 = vec<float, 2>;
using float3 = vec<float, 3>;
using float4 = vec<float, 4>;
using half2 = vec<half, 2>;
using half4 = vec<half, 4>;
using int2 = vec<int, 2>;
using int4 = vec<int, 4>;
using uint2 = vec<uint, 2>;
using uint3 = vec<uint, 3>;
using uint4 = vec<uint, 4>;

// ---------------------------------------------------------------- math (namespace metal)
namespace metal {
using std::abs;
using std::ceil;
using std::exp;
using std::exp2;
using std::floor;
using std::isinf;
using std::isnan;
using std::log;
using std::rint;
using std::round;
using std::sqrt;
using std::tanh;
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline float clamp(float x, float lo, float hi) { return min(max(x, lo), hi); }
inline int clamp(int x, int lo, int hi) { return min(max(x, lo), hi); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <typename T, int N>
T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; i++) s += a[i] * b[i];
  return s;
}
template <typename To, typename From>
To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To r;
  std::memcpy(&r, &x, sizeof(To));
  return r;
}
namespace fast {
using std::exp;
using std::tanh;
}  // namespace fast
namespace precise {
using std::exp;
using std::tanh;
}  // namespace precise

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
}  // namespace metal

// ---------------------------------------------------------------- threads as fibers
namespace metal_emu {

enum State { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };

struct Thread {
  ucontext_t ctx;
  State state = RUNNABLE;
  long simd_ops = 0;  // simd calls made: lanes of one simdgroup must agree at each rendezvous
  const void* slot = nullptr;  // this lane's operand while a simd op is in flight
};

struct Attrs {
  uint3 thread_position_in_grid, threadgroup_position_in_grid, thread_position_in_threadgroup;
  uint3 threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size;
  uint thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup;
  uint simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
};

constexpr int kSimdWidth = 32;
constexpr size_t kStackBytes = 256 * 1024;

struct Threadgroup {
  std::vector<Thread> threads;
  char* stacks = nullptr;  // kStackBytes per thread, mapped once, committed lazily
  size_t num_stacks = 0;
  ucontext_t scheduler;
  int current = 0;
  int size = 0;
  std::function<void(int)> body;
};

inline Threadgroup*& active() {
  static Threadgroup* tg = nullptr;
  return tg;
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "metal_emu: %s\n", what);
  std::fflush(stderr);
  _exit(87);
}

inline void block(State state) {
  Threadgroup* tg = active();
  Thread& t = tg->threads[tg->current];
  t.state = state;
  swapcontext(&t.ctx, &tg->scheduler);
}

inline void fiber_entry() {
  Threadgroup* tg = active();
  int me = tg->current;
  tg->body(me);
  tg->threads[me].state = DONE;  // uc_link returns to the scheduler
}

// Releases the lanes of every simdgroup whose live lanes all wait at a simd op.
inline bool release_simdgroups(Threadgroup& tg) {
  bool released = false;
  for (int base = 0; base < tg.size; base += kSimdWidth) {
    int end = std::min(base + kSimdWidth, tg.size);
    int waiting = 0, live = 0;
    long ops = -1;
    for (int i = base; i < end; i++) {
      if (tg.threads[i].state == DONE) continue;
      live++;
      if (tg.threads[i].state != AT_SIMD) continue;
      waiting++;
      if (ops >= 0 && tg.threads[i].simd_ops != ops) fail("lanes of one simdgroup reached different simd ops");
      ops = tg.threads[i].simd_ops;
    }
    if (live > 0 && waiting == live) {
      for (int i = base; i < end; i++)
        if (tg.threads[i].state == AT_SIMD) tg.threads[i].state = RUNNABLE;
      released = true;
    }
  }
  return released;
}

inline bool release_barrier(Threadgroup& tg) {
  int done = 0, waiting = 0;
  for (auto& t : tg.threads) {
    done += t.state == DONE;
    waiting += t.state == AT_BARRIER;
  }
  if (waiting == 0) return false;
  if (done > 0) fail("threadgroup_barrier: some threads of the threadgroup returned without reaching it");
  if (waiting != tg.size) fail("threadgroup_barrier reached while other threads wait at a simd op (divergence)");
  for (auto& t : tg.threads) t.state = RUNNABLE;
  return true;
}

inline void schedule(Threadgroup& tg) {
  for (;;) {
    bool ran = false;
    for (int i = 0; i < tg.size; i++) {
      if (tg.threads[i].state != RUNNABLE) continue;
      tg.current = i;
      swapcontext(&tg.scheduler, &tg.threads[i].ctx);
      ran = true;
    }
    if (ran) continue;
    bool all_done = true;
    for (auto& t : tg.threads) all_done &= t.state == DONE;
    if (all_done) return;
    if (release_simdgroups(tg)) continue;
    if (release_barrier(tg)) continue;
    fail("deadlock: threads wait on each other at mismatched barriers or simd ops");
  }
}

inline void run_threadgroup(Threadgroup& tg, int size, std::function<void(int)> body) {
  tg.size = size;
  tg.body = std::move(body);
  tg.threads.assign(size, Thread{});
  if (tg.num_stacks < size_t(size)) {
    if (tg.stacks) munmap(tg.stacks, tg.num_stacks * kStackBytes);
    void* m = mmap(nullptr, size * kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) fail("cannot map fiber stacks");
    tg.stacks = static_cast<char*>(m);
    tg.num_stacks = size;
  }
  active() = &tg;
  for (int i = 0; i < size; i++) {
    Thread& t = tg.threads[i];
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = tg.stacks + i * kStackBytes;
    t.ctx.uc_stack.ss_size = kStackBytes;
    t.ctx.uc_link = &tg.scheduler;
    makecontext(&t.ctx, fiber_entry, 0);
  }
  schedule(tg);
}

// One simd rendezvous: every live lane deposits `value`; `combine` reads the others' values.
template <typename T, typename F>
T simd_exchange(T value, F combine) {
  Threadgroup* tg = active();
  int me = tg->current;
  tg->threads[me].slot = &value;
  tg->threads[me].simd_ops++;
  block(AT_SIMD);  // wait until every live lane has deposited
  int base = me / kSimdWidth * kSimdWidth;
  int end = std::min(base + kSimdWidth, tg->size);
  auto lane_value = [&](int lane, bool* ok) -> T {
    int i = base + lane;
    *ok = i < end && tg->threads[i].state != DONE;
    return *ok ? *static_cast<const T*>(tg->threads[i].slot) : T{};
  };
  T result = combine(me - base, end - base, lane_value);
  tg->threads[me].simd_ops++;
  block(AT_SIMD);  // wait until every lane has read before the deposited values go away
  return result;
}

// ---------------------------------------------------------------- guarded buffers
struct Buffer {
  std::string name;
  char* map = nullptr;
  size_t map_bytes = 0;
  char* data = nullptr;
  size_t bytes = 0;
};

inline std::vector<Buffer>& buffers() {
  static std::vector<Buffer> all;
  return all;
}

inline void on_fault(int, siginfo_t* info, void*) {
  char* addr = static_cast<char*>(info->si_addr);
  char msg[512];
  int n = std::snprintf(msg, sizeof msg, "metal_emu: out-of-bounds access at %p\n", (void*)addr);
  for (auto& b : buffers()) {
    if (addr >= b.map && addr < b.map + b.map_bytes) {
      n = std::snprintf(msg, sizeof msg, "metal_emu: out-of-bounds access to buffer '%s' at byte offset %ld (size %zu)\n",
                        b.name.c_str(), long(addr - b.data), b.bytes);
    }
  }
  ssize_t ignored = write(2, msg, n);
  (void)ignored;
  _exit(86);
}

inline void install_fault_handler() {
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  sigaltstack(&ss, nullptr);
  struct sigaction sa{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
}

// A buffer of `bytes` between two guard regions of 64 KiB.
inline Buffer allocate(const std::string& name, size_t bytes) {
  const size_t page = sysconf(_SC_PAGESIZE), guard = 64 * 1024;
  size_t data_pages = (bytes + page - 1) / page * page;
  if (data_pages == 0) data_pages = page;
  Buffer b;
  b.name = name;
  b.bytes = bytes;
  b.map_bytes = data_pages + 2 * guard;
  b.map = static_cast<char*>(mmap(nullptr, b.map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (b.map == MAP_FAILED) fail("mmap failed");
  mprotect(b.map + guard, data_pages, PROT_READ | PROT_WRITE);
  const char* align = std::getenv("METAL_EMU_ALIGN");
  bool at_start = align && std::string(align) == "start";
  b.data = at_start ? b.map + guard : b.map + guard + ((data_pages - bytes) & ~size_t(3));
  buffers().push_back(b);
  return b;
}

inline void read_file(const std::string& path, const Buffer& b) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open an input file");
  in.read(b.data, b.bytes);
  if (size_t(in.gcount()) != b.bytes) fail("an input file is shorter than its buffer");
}

inline void write_file(const std::string& path, const Buffer& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(b.data, b.bytes);
}

// Runs `kernel(attrs)` for every thread of a dispatchThreads(grid, threadgroup) launch.
template <typename K>
void run_grid(uint3 grid, uint3 group, K kernel) {
  if (group.x * group.y * group.z > 1024) fail("threadgroup larger than 1024 threads (Apple GPU limit)");
  if (group.x * group.y * group.z == 0 || grid.x * grid.y * grid.z == 0) fail("empty grid or threadgroup");
  uint3 groups((grid.x + group.x - 1) / group.x, (grid.y + group.y - 1) / group.y, (grid.z + group.z - 1) / group.z);
  Threadgroup tg;
  for (uint gz = 0; gz < groups.z; gz++)
    for (uint gy = 0; gy < groups.y; gy++)
      for (uint gx = 0; gx < groups.x; gx++) {
        // the last threadgroup of a dimension is partial (non-uniform dispatch)
        uint3 size(std::min(group.x, grid.x - gx * group.x), std::min(group.y, grid.y - gy * group.y),
                   std::min(group.z, grid.z - gz * group.z));
        int count = int(size.x * size.y * size.z);
        run_threadgroup(tg, count, [&](int linear) {
          Attrs a{};
          uint3 local(linear % size.x, linear / size.x % size.y, linear / (size.x * size.y));
          a.threadgroup_position_in_grid = uint3(gx, gy, gz);
          a.thread_position_in_threadgroup = local;
          a.thread_position_in_grid =
              uint3(gx * group.x + local.x, gy * group.y + local.y, gz * group.z + local.z);
          a.threads_per_threadgroup = size;
          a.threadgroups_per_grid = groups;
          a.threads_per_grid = grid;
          a.grid_size = grid;
          a.thread_index_in_threadgroup = uint(linear);
          a.simdgroup_index_in_threadgroup = uint(linear / kSimdWidth);
          a.thread_index_in_simdgroup = uint(linear % kSimdWidth);
          a.simdgroups_per_threadgroup = uint((count + kSimdWidth - 1) / kSimdWidth);
          a.threads_per_simdgroup = kSimdWidth;
          a.thread_execution_width = kSimdWidth;
          kernel(a);
        });
      }
}

}  // namespace metal_emu

// ---------------------------------------------------------------- barriers and simd ops
namespace metal {
inline void threadgroup_barrier(mem_flags) { metal_emu::block(metal_emu::AT_BARRIER); }
inline void simdgroup_barrier(mem_flags) {
  metal_emu::simd_exchange(0, [](int, int, auto) { return 0; });
}

template <typename T, typename Op>
T simd_reduce(T x, Op op) {
  return metal_emu::simd_exchange(x, [&](int, int width, auto lane_value) {
    bool ok, any = false;
    T acc{};
    for (int l = 0; l < width; l++) {
      T v = lane_value(l, &ok);
      if (!ok) continue;
      acc = any ? op(acc, v) : v;
      any = true;
    }
    return acc;
  });
}
template <typename T>
T simd_sum(T x) {
  return simd_reduce(x, [](T a, T b) { return T(a + b); });
}
template <typename T>
T simd_max(T x) {
  return simd_reduce(x, [](T a, T b) { return max(a, b); });
}
template <typename T>
T simd_min(T x) {
  return simd_reduce(x, [](T a, T b) { return min(a, b); });
}
// Reads lane `src(me)`; a lane outside the simdgroup or inactive yields the caller's own value.
template <typename T, typename Src>
T simd_read(T x, Src src) {
  return metal_emu::simd_exchange(x, [&](int me, int width, auto lane_value) {
    int from = src(me);
    bool ok = false;
    T v = (from >= 0 && from < width) ? lane_value(from, &ok) : T{};
    return ok ? v : x;
  });
}
template <typename T>
T simd_shuffle(T x, ushort lane) {
  return simd_read(x, [&](int) { return int(lane); });
}
template <typename T>
T simd_broadcast(T x, ushort lane) {
  return simd_read(x, [&](int) { return int(lane); });
}
template <typename T>
T simd_shuffle_xor(T x, ushort mask) {
  return simd_read(x, [&](int me) { return me ^ int(mask); });
}
template <typename T>
T simd_shuffle_down(T x, ushort delta) {
  return simd_read(x, [&](int me) { return me + int(delta); });
}
template <typename T>
T simd_shuffle_up(T x, ushort delta) {
  return simd_read(x, [&](int me) { return me - int(delta); });
}
}  // namespace metal

using namespace metal;

// ---------------------------------------------------------------- address spaces
// Declared last so the definitions above keep their ordinary meaning.
#define device
#define constant
#define thread
#define threadgroup static

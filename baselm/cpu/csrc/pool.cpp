#include "pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BASE_PAUSE() _mm_pause()
#else
#define BASE_PAUSE() std::this_thread::yield()
#endif

// How long an idle worker spins before sleeping (BASE_CPU_SPIN_US, else 20 us). Claiming is
// dynamic, so a sleeping worker's wake-up is not on the caller's path; a long spin only takes a
// core from MLX's own thread, which on a busy machine costs more than it saves.
constexpr int kDefaultSpinUs = 20;

namespace nb = nanobind;

namespace base_cpu {

namespace {

std::vector<std::string> supported_isas() {
  std::vector<std::string> isas;
#if defined(BASE_HAVE_X86_PATHS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    isas.push_back("avx512");
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    isas.push_back("avx2");
  }
#endif
  isas.push_back("generic");
  return isas;
}

std::string initial_isa() {
  auto isas = supported_isas();
  const char* wanted = std::getenv("BASE_CPU_ISA");
  if (wanted != nullptr) {
    for (auto& isa : isas) {
      if (isa == wanted) return isa;
    }
  }
  return isas.front();
}

std::string& isa_slot() {
  static std::string isa = initial_isa();
  return isa;
}

// A positive integer from the environment variable `name`, else `fallback`.
long env_count(const char* name, long fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr) return fallback;
  const long n = std::atol(env);
  return n > 0 ? n : fallback;
}

std::atomic<long>& spin_us() {
  static std::atomic<long> us{env_count("BASE_CPU_SPIN_US", kDefaultSpinUs)};
  return us;
}

std::atomic<size_t>& parallel_bytes() {
  static std::atomic<size_t> bytes{static_cast<size_t>(env_count("BASE_CPU_PARALLEL_BYTES", 512 * 1024))};
  return bytes;
}

int initial_threads() {
  if (const char* env = std::getenv("BASE_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Workers wait for a new job: spinning for a short while (the next matmul of a decode step is
// usually microseconds away), then sleeping on a condition variable. Chunks are claimed from
// one atomic word holding (job, next chunk), so a worker that wakes late cannot take part in
// a finished job, and the caller waits for chunks done, not for every worker to show up (on a
// busy machine a worker may not get a core in time; the caller then does all the chunks).
class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t); });
  }

  int threads() const { return threads_; }

  void run(int num_chunks, const std::function<void(int, int, int)>& fn) {
    std::lock_guard<std::mutex> serial(run_mutex_);
    if (threads_ == 1 || num_chunks <= 1) {
      fn(0, num_chunks, 0);
      return;
    }
    fn_ = &fn;
    num_chunks_ = num_chunks;
    grain_ = num_chunks >= 8 * threads_ ? 2 : 1;
    done_.store(0, std::memory_order_relaxed);
    uint64_t job = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    claim_.store(job << 32, std::memory_order_release);
    if (sleeping_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    drain(job, 0);
    // The last chunks may be on a worker the OS has preempted: after a short spin, yield the core.
    for (int spins = 0; done_.load(std::memory_order_acquire) < num_chunks; ++spins) {
      if (spins < 2000) {
        BASE_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  // Claims and runs chunks of `job` until none are left (or the job is no longer current).
  void drain(uint64_t job, int thread) {
    for (;;) {
      uint64_t state = claim_.load(std::memory_order_acquire);
      int begin;
      do {
        begin = static_cast<int>(state & 0xffffffffu);
        if ((state >> 32) != job || begin >= num_chunks_) return;
      } while (!claim_.compare_exchange_weak(state, state + static_cast<uint64_t>(grain_), std::memory_order_acq_rel));
      int end = begin + grain_ < num_chunks_ ? begin + grain_ : num_chunks_;
      (*fn_)(begin, end, thread);
      done_.fetch_add(end - begin, std::memory_order_release);
    }
  }

  void work(int thread) {
    uint64_t seen = 0;
    for (;;) {
      auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us().load(std::memory_order_relaxed));
      while ((claim_.load(std::memory_order_acquire) >> 32) == seen) {
        if (std::chrono::steady_clock::now() >= spin_until) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return (claim_.load() >> 32) != seen; });
          sleeping_.fetch_sub(1);
          break;
        }
        for (int i = 0; i < 32; ++i) BASE_PAUSE();
      }
      seen = claim_.load(std::memory_order_acquire) >> 32;
      drain(seen, thread);
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::mutex run_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> claim_{0};  // (job << 32) | next chunk
  std::atomic<int> done_{0};
  std::atomic<int> sleeping_{0};
  const std::function<void(int, int, int)>* fn_ = nullptr;
  int num_chunks_ = 0;
  int grain_ = 1;
};

std::vector<std::vector<float>>& scratch_slots() {
  static std::vector<std::vector<float>> slots;
  return slots;
}

Pool*& pool_slot() {
  static Pool* pool = nullptr;
  return pool;
}

Pool& pool() {
  Pool*& p = pool_slot();
  if (p == nullptr) {
    p = new Pool(initial_threads());  // NOTE: never freed: its workers must outlive interpreter teardown
    scratch_slots().resize(p->threads());
  }
  return *p;
}

}  // namespace

const std::string& active_isa() { return isa_slot(); }

int num_threads() { return pool().threads(); }

size_t min_parallel_bytes() { return parallel_bytes().load(std::memory_order_relaxed); }

void parallel_for(int num_chunks, size_t bytes, const std::function<void(int, int, int)>& fn) {
  if (num_chunks <= 0) return;
  if (bytes < min_parallel_bytes()) {
    fn(0, num_chunks, 0);
    return;
  }
  pool().run(num_chunks, fn);
}

void parallel_for(int num_chunks, const std::function<void(int, int, int)>& fn) {
  if (num_chunks > 0) pool().run(num_chunks, fn);
}

float* thread_scratch(int thread, size_t count) {
  // NOTE: thread 0 is the caller, and callers may be several at once (each MLX stream runs its own
  // thread, and a process may run several engines): its buffer is the calling thread's own. The
  // workers' slots are used only inside `Pool::run`, one job at a time.
  thread_local std::vector<float> caller;
  pool();  // the slots are sized for every pool thread when the pool starts
  auto& buffer = thread == 0 ? caller : scratch_slots()[thread];
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

void register_runtime(nb::module_& m) {
  m.def("isa", [] { return active_isa(); }, "The instruction set the kernels run with.");
  m.def("supported_isas", &supported_isas, "Instruction sets this CPU runs, widest first.");
  m.def(
      "set_isa",
      [](const std::string& isa) {
        for (auto& s : supported_isas()) {
          if (s == isa) {
            isa_slot() = isa;
            return;
          }
        }
        throw std::invalid_argument("instruction set " + isa + " is not supported on this CPU");
      },
      nb::arg("isa"), "Runs the kernels with `isa` (one of supported_isas()).");
  m.def(
      "set_parallel_bytes", [](size_t bytes) { parallel_bytes().store(bytes); }, nb::arg("bytes"),
      "Weight bytes per activation row from which a matmul is shared out among the threads (BASE_CPU_PARALLEL_BYTES).");
  m.def(
      "set_spin_us", [](long us) { spin_us().store(us); }, nb::arg("us"),
      "How long an idle worker spins before it sleeps, in microseconds (BASE_CPU_SPIN_US).");
  m.def("num_threads", &num_threads, "Threads a kernel call uses (BASE_CPU_THREADS, else all cores).");
}

}  // namespace base_cpu

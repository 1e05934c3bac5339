// The shared runtime of the CPU kernels: instruction-set choice and a small persistent thread
// pool (MLX evaluates its CPU graph on one thread; a decode-sized matmul is too short for
// OpenMP's fork/join to pay off on every call, so the workers spin briefly between calls).
#pragma once

#include <functional>
#include <string>

#include <nanobind/nanobind.h>

namespace base_cpu {

// "avx512", "avx2" or "generic": the widest this CPU supports, unless BASE_CPU_ISA or set_isa
// narrowed it.
const std::string& active_isa();

// Runs fn(begin, end, thread) over [0, num_chunks) split into dynamically claimed runs of
// chunks, on up to num_threads() threads; returns when all chunks are done. A call reading
// fewer than min_parallel_bytes() runs on the calling thread alone: waking a worker costs more
// than it saves there, and on a busy machine a worker the OS has preempted stalls the call.
// 512 KiB, or BASE_CPU_PARALLEL_BYTES.
size_t min_parallel_bytes();
void parallel_for(int num_chunks, size_t bytes, const std::function<void(int, int, int)>& fn);
// The same with no size: always shared out among the threads.
void parallel_for(int num_chunks, const std::function<void(int, int, int)>& fn);
int num_threads();

// A float buffer of at least `count` floats owned by pool thread `thread` (reused across calls);
// thread 0's is the calling thread's own, so callers on several threads never share one.
float* thread_scratch(int thread, size_t count);

void register_runtime(nanobind::module_& m);

}  // namespace base_cpu

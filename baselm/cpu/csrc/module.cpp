// The CPU kernels module. Each kernel family lives in its own <family>.cpp (the MLX primitives
// and their Python functions, registered by register_<family>) with its inner loops in
// <family>_impl.h, built per instruction set by <family>_<isa>.cpp (see CMakeLists.txt).
// Adding a family: its files, one line in BASE_KERNEL_SOURCES / BASE_ISA_FAMILIES, and one
// register call below. Shared pieces: pool.h (thread pool, ISA choice), primitive.h (queueing
// work on MLX's stream, row-major input views).
#include <nanobind/nanobind.h>

#include "pool.h"

namespace base_cpu {
void register_linear(nanobind::module_& m);
void register_attention(nanobind::module_& m);
void register_dense_attention(nanobind::module_& m);
void register_fused(nanobind::module_& m);
void register_layer(nanobind::module_& m);
}

NB_MODULE(_kernels, m) {
  m.doc() = "CPU kernels that MLX runs inside its graph (see baselm/cpu).";
  base_cpu::register_runtime(m);
  base_cpu::register_linear(m);
  base_cpu::register_attention(m);
  base_cpu::register_dense_attention(m);
  base_cpu::register_fused(m);
  base_cpu::register_layer(m);
}

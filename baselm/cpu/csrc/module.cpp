// The CPU kernels module: each kernel family registers its own functions here.
#include <nanobind/nanobind.h>

#include "pool.h"

namespace base_cpu {
void register_linear(nanobind::module_& m);
}

NB_MODULE(_kernels, m) {
  m.doc() = "CPU kernels that MLX runs inside its graph (see baselm/cpu).";
  base_cpu::register_runtime(m);
  base_cpu::register_linear(m);
}

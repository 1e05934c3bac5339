// The fused per-token loops built for one instruction set (flags from CMakeLists.txt).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fused.h"

namespace base_cpu::generic {

#include "fused_impl.h"

const FusedKernels& fused_kernels() {
  static const FusedKernels kernels{"generic", rms_norm, rope, gated, layer_norm, activate};
  return kernels;
}

}  // namespace base_cpu::generic

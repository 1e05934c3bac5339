// The attention inner loops built for one instruction set (flags from CMakeLists.txt).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"

namespace base_cpu::avx512 {

#include "attention_impl.h"

const AttentionKernels& attention_kernels() {
  static const AttentionKernels kernels{"avx512", attend, attend_dense};
  return kernels;
}

}  // namespace base_cpu::avx512

// One linear layer's weights as raw pointers, and the threaded few-row product over them: what
// the linear primitives (linear.cpp) and the fused decoder layer (layer.cpp) both run.
#pragma once

#include <cstdint>

namespace base_cpu {

// W (N, K): float32 (bits 0) or affine-quantized in MLX's layout (bits 1..8, see kernels.h).
struct LinearWeights {
  int bits;  // 0: float32 in `w`
  int group_size;
  int scale_type;  // kScaleF32 / kScaleF16 / kScaleBF16
  const void* w;  // float32 (N, K), uint32 codes (N, ld_codes), or GGUF blocks (bits a BlockType: ld_codes bytes)
  const void* scales;  // (N, ld_scales), quantized only
  const void* biases;
  int64_t ld_codes, ld_scales;
  int N, K;
  const float* bias;  // (N,) or nullptr
  int64_t bytes;  // weight bytes read per call (for the thread-pool rule)
};

// y (M, N) = x (M, K) @ W.T (+ bias), rows of W spread over the pool when W is large.
void linear_forward(const LinearWeights& w, const float* x, int M, float* y);

}  // namespace base_cpu

// The small per-token ops of a decoder layer, each one MLX graph node on the CPU instead of
// the several MLX's CPU backend runs for it: RMSNorm, RoPE and the gated activation of the MLP,
// and a vision tower's LayerNorm and plain activation.
// The interface between the primitives (fused.cpp) and the loops built per instruction set
// (fused_<isa>.cpp). No MLX types.
#pragma once

#include <cstdint>

namespace base_cpu {

enum GatedActivation : int { kSilu = 0, kGeluTanh = 1, kGeluErf = 2 };

struct FusedKernels {
  const char* isa;
  // y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (w + weight_offset), rows [r0, r1) of width d.
  void (*rms_norm)(const float* x, const float* w, float weight_offset, float eps, int d, float* y, int r0, int r1);
  // Rotates the first `dims` features of each head of tokens [t0, t1) (x: (tokens, heads, head_dim))
  // by position * inv_freqs[i], rotate-half layout or interleaved pairs (`traditional`), the
  // rotated part scaled by mscale; the rest is copied.
  void (*rope)(const float* x, const int32_t* positions, const float* inv_freqs, int heads, int head_dim, int dims,
               bool traditional, float mscale, float* y, int t0, int t1);
  // y[r, :] = act(gate_up[r, :n]) * gate_up[r, n:], rows [r0, r1).
  void (*gated)(const float* gate_up, int n, int act, float* y, int r0, int r1);
  // y[r] = (x[r] - mean) * rsqrt(var + eps) * w + b (w, b may be null: 1 and 0), rows [r0, r1) of width d.
  void (*layer_norm)(const float* x, const float* w, const float* b, float eps, int d, float* y, int r0, int r1);
  // y[i] = act(x[i]) for i in [i0, i1).
  void (*activate)(const float* x, int act, float* y, int64_t i0, int64_t i1);
};

// The loops for the active instruction set (fused.cpp).
const FusedKernels& active_fused_kernels();

namespace generic {
const FusedKernels& fused_kernels();
}
namespace avx2 {
const FusedKernels& fused_kernels();
}
namespace avx512 {
const FusedKernels& fused_kernels();
}

}  // namespace base_cpu

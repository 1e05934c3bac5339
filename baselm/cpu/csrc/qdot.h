// Quantized linear layers with 8-bit activations: each activation row is quantized once per
// call to blocks of 32 int8 values with one float scale, and every weight block's codes meet
// them in integer multiply-adds (AVX2 maddubs, AVX-512 VNNI dpbusd), so a weight code is
// expanded to a byte, never to a float. The float-activation kernels (linear_impl.h) stay as
// the exact path (BASE_CPU_EXACT=1).
//
// Per block b of 32 values, with x ~ dx_b * xq (xq integers in [-127, 127]) and the weight
// w = s * q + c of its group:
//   sum_k x_k w_k ~ s * dx_b * sum_k q_k xq_k + c * sum_k x_k
// The integer sum is exact; the sums of x are kept in float from the unquantized row.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace base_cpu {

constexpr int kQBlock = 32;  // activation values per int8 block

// One call's quantized activations, as quantize() writes them for a weight of `bits`.
struct QActivations {
  const void* q;  // (M, K) int8 or int16 (`width`): each block's 32 codes in the ISA's lane order for `bits`
  int width;  // 8 or 16 bits per activation code
  const float* d;  // (M, K / 32): block scales
  const float* sum;  // (M, K / gs): float sums of each weight group's unquantized values
  const float* qsum;  // (M, K / gs): sums over the group's blocks of d times the block's codes
  const float* half_sum;  // (M, K / 16): float sums of each 16 unquantized values (Q2_K's minimums), or nullptr
};

struct QdotArgs {
  QActivations x;
  int M, K;
  const uint8_t* codes;  // (N, K * bits / 8) bytes, row stride ld_bytes: MLX's affine layout (or GGUF blocks)
  int64_t ld_bytes;
  const void* scales;  // (N, K / gs) of scale_type, row stride ld_scales
  const void* biases;
  int64_t ld_scales;
  int scale_type;
  int bits, group_size;
  const float* bias;  // (N,) or nullptr
  float* y;  // (M, N), row stride ldy
  int64_t ldy;
};

// Many activation rows (a prefill) as the integer GEMM takes them (qgemm_impl.h): 16- or 8-bit codes in
// blocks of 32 values, `rows` (M rounded up to 16, plus 16 where that is an even number of 16s: see
// linear.cpp's gemm_buffers; the rows past M zero) a column, transposed so that
// the codes of values 2k, 2k + 1 (8 bits: 4k..4k+3) of 16 consecutive rows are 64 contiguous bytes.
struct GemmActivations {
  const void* q;  // (K / 2, rows, 2) int16 or (K / 4, rows, 4) int8
  int width;  // 16 or 8 bits a code
  int top;  // the largest |code|: 127, 32767, or 16383 against Q6_K (its codes carry their scale: 4096)
  const float* d;  // (K / 32, rows): block scales
  const float* sum16;  // (K / 16, rows): d times the sum of each 16 values' codes
  const float* sum32;  // (K / 32, rows): the same over each 32
  int rows;
  // VNNI, 16-bit codes, up to 8 rows (a decode batch): each row's codes of values 4k..4k+3 as one
  // 64-bit element, so that a 512-bit vector holds 8 rows (row i in lanes 2i and 2i + 1) and a
  // 16-lane tile does no work on missing rows. `rows` is then 16 (lanes), and d and the sums are
  // repeated in both of a row's lanes.
  bool pairs = false;
};

struct GemmArgs {
  GemmActivations x;
  int M, K;
  const uint8_t* codes;  // (N, bytes) GGUF blocks of `type`, row stride ld_bytes
  int64_t ld_bytes;
  int type;
  const float* bias;  // (N,) or nullptr
  float* y;  // (M, N), row stride ldy
  int64_t ldy;
};

struct QdotKernels {
  const char* name;
  // Quantizes M rows of x (row stride ldx) to `width`-bit codes in q (int8 or int16), for a
  // weight of `bits` in groups of `group_size`.
  void (*quantize)(const float* x, int64_t ldx, int M, int K, int bits, int group_size, int width, void* q,
                   float* d, float* sum, float* qsum);
  // y[:, n0:n1]; scratch holds at least qdot_scratch_floats(K) floats, owned by the caller.
  void (*matmul)(const QdotArgs&, int n0, int n1, float* scratch);
  // The integer GEMM over GGUF blocks for many rows (VNNI, AVX2), or nullptr where this ISA has
  // none: rows m0..m1 (a multiple of 16 apart) of x quantized into `out`'s buffers, then
  // y[:, n0:n1] (scratch: at least gemm_scratch_floats(K, x.rows) floats).
  void (*gemm_quantize)(const float* x, int64_t ldx, int M, int m0, int m1, int K, const GemmActivations& out);
  void (*gemm)(const GemmArgs&, int n0, int n1, float* scratch);
  bool gemm_bytes;  // whether the GEMM also takes 8-bit codes (VNNI's dpbusd); else 16-bit ones only
  // Activation rows from which GGUF block matmuls take the GEMM rather than the few-row loops (where
  // the GEMM exists): one weight row decoded once into 16-bit codes meets the rows in tiles without
  // a float step per block and row. On an AVX-512 EPYC (Zen 4, one thread, 8960 x 1536 weights) VNNI's
  // 8-row tile (pairs) ran 1.0x (Q4_K) to 1.5x (Q6_K) the few-row loops' speed at 6 rows, 1.2-1.7x at
  // 8 (0.6-0.95x at 4); AVX2's tiles won from 16 rows (1.15-1.5x there, 0.86-1.12x at 8).
  int gemm_min_rows;
};

// The largest activation code the GEMM takes against weights of `type` at `width` bits: 16-bit codes
// stop at 16383 against Q6_K, whose codes carry their scale (up to 4096), so that 32 products fit an
// int32 lane (qgemm_impl.h).
inline int gemm_code_top(int width, int type) { return width == 8 ? 127 : type == kQ6K ? 16383 : 32767; }

// The GEMM's decoded weight rows (16 rows of K 16-bit or byte codes and two floats per 16 values)
// and their sums against `rows` (M rounded up to 16) activation rows.
inline int64_t gemm_scratch_floats(int K, int rows) { return 16 * (K / 2 + 2 * (K / 16)) + 16 * static_cast<int64_t>(rows) + 16; }

// Bit widths and group sizes the integer path decodes (MLX affine layout), and GGUF blocks
// (kernels.h's BlockType: 16-bit activations, group sums over blocks of 32).
inline bool qdot_supports(int bits, int group_size, int K) {
  if (is_block(bits)) return group_size == 32 && K % block_values(bits) == 0;
  bool width = bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
  bool groups = group_size == 32 || group_size == 64 || group_size == 128;  // MLX's
  return width && groups && K % group_size == 0;
}

// A weight row's group scales and biases as float32 (the generic loops widen them there), and a
// Q2_K row's offsets per 16 values.
inline int64_t qdot_scratch_floats(int K) { return 4 * (K / kQBlock) + 16; }

namespace generic {
const QdotKernels& qdot_kernels();
}
namespace avx2 {
const QdotKernels& qdot_kernels();
}
namespace avx512 {
const QdotKernels& qdot_kernels();
}

}  // namespace base_cpu

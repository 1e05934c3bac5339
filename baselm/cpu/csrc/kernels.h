// The plain inner loops: no MLX types, so each instruction-set build (linear_<isa>.cpp) holds
// nothing but these loops, compiled with its own flags.
#pragma once

#include <cstdint>

namespace base_cpu {

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for rows n in [n0, n1) of a float32 weight.
struct DenseArgs {
  const float* x;  // (M, K), row stride ldx
  int64_t ldx;
  int M;
  const float* w;  // (N, K), row stride ldw
  int64_t ldw;
  int K;
  const float* bias;  // (N,) or nullptr
  float* y;  // (M, N), row stride ldy
  int64_t ldy;
};

enum ScaleType : int { kScaleF32 = 0, kScaleF16 = 1, kScaleBF16 = 2 };

// GGUF blocks kept as the file holds them, named by a weight's `bits` (above every affine width),
// in llama.cpp's layouts (ggml-common.h): the super-blocks of 256 values (block_q2_K, block_q3_K,
// block_q4_K, block_q5_K, block_q6_K, block_iq4_xs) and the blocks of 32 (block_q4_0, block_q4_1,
// block_q5_0, block_q5_1, block_q8_0, block_iq4_nl; the "legacy" family, IQ4_NL being Q4_0's layout
// with its codes looked up in a table). A row of K values is K / block_values blocks, back to back.
enum BlockType : int {
  kQ2K = 102,
  kQ3K = 103,
  kQ4K = 104,
  kQ5K = 105,
  kQ6K = 106,
  kIQ4XS = 107,
  kQ4_0 = 110,
  kQ4_1 = 111,
  kQ5_0 = 112,
  kQ5_1 = 113,
  kIQ4NL = 114,
  kQ8_0 = 118,
  // The legacy types with each full run of 8 blocks stored field by field (block_runs): the 8 d,
  // the 8 m, the 8 qh, then the 8 qs, the same bytes in the same place as the run's 8 blocks; a
  // row's last blocks (K / 32 % 8 of them) as the file holds them. A run's fields then load as
  // vectors, not gathered from 8 blocks.
  kQ4_0Runs = 120,
  kQ4_1Runs = 121,
  kQ5_0Runs = 122,
  kQ5_1Runs = 123,
  kIQ4NLRuns = 124,
  kQ8_0Runs = 128,
};
constexpr int kRunsOffset = kQ4_0Runs - kQ4_0;
constexpr int kSuperBlock = 256;
constexpr int kLegacyBlock = 32;
// The super-block types (named K-quants here for the most of them; IQ4_XS is one too).
constexpr bool is_kquant(int bits) {
  return bits == kQ2K || bits == kQ3K || bits == kQ4K || bits == kQ5K || bits == kQ6K || bits == kIQ4XS;
}
constexpr bool is_legacy_file_block(int bits) {
  return bits == kQ4_0 || bits == kQ4_1 || bits == kQ5_0 || bits == kQ5_1 || bits == kQ8_0 || bits == kIQ4NL;
}
constexpr bool is_legacy_runs(int bits) { return is_legacy_file_block(bits - kRunsOffset); }
constexpr bool is_legacy_block(int bits) { return is_legacy_file_block(bits) || is_legacy_runs(bits); }
// The file's type of a legacy type in either layout (the fields' meaning).
constexpr int legacy_file_type(int bits) { return is_legacy_runs(bits) ? bits - kRunsOffset : bits; }
constexpr bool is_block(int bits) { return is_kquant(bits) || is_legacy_block(bits); }
// Values a block of `type` holds, and its bytes.
constexpr int block_values(int type) { return is_kquant(type) ? kSuperBlock : kLegacyBlock; }
constexpr int block_bytes(int type) {
  switch (legacy_file_type(type)) {
    case kQ2K: return 84;
    case kQ3K: return 110;
    case kQ4K: return 144;
    case kQ5K: return 176;
    case kQ6K: return 210;
    case kIQ4XS: return 136;
    case kQ4_0: return 18;
    case kIQ4NL: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    default: return 34;  // kQ8_0
  }
}

// A legacy block's fields (Each takes a type in either layout, kernels.h's kQ*_0 or kQ*Runs.)
constexpr bool legacy_has_min(int type) {
  return legacy_file_type(type) == kQ4_1 || legacy_file_type(type) == kQ5_1;
}
constexpr bool legacy_has_high_bits(int type) {
  return legacy_file_type(type) == kQ5_0 || legacy_file_type(type) == kQ5_1;
}
constexpr bool legacy_is_q8(int type) { return legacy_file_type(type) == kQ8_0; }
// IQ4_NL: Q4_0's nibbles, each an index into the 16 values of kIQ4Values (value = d * kIQ4Values[q]).
constexpr bool legacy_is_iq4(int type) { return legacy_file_type(type) == kIQ4NL; }
// llama.cpp's kvalues_iq4nl: the 16 int8 levels IQ4_NL's and IQ4_XS's 4-bit codes index.
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// Where qs starts in a block (qh, where there is one, is the 4 bytes before it): the bytes of its
// d, m and qh fields.
constexpr int legacy_qs_at(int type) { return 2 + (legacy_has_min(type) ? 2 : 0) + (legacy_has_high_bits(type) ? 4 : 0); }
// The zero point of the types without a minimum: value = d * (q - zero).
constexpr int legacy_zero(int type) {
  return legacy_file_type(type) == kQ4_0 ? 8 : legacy_file_type(type) == kQ5_0 ? 16 : 0;
}

// The same product over an affine-quantized weight in MLX's layout: value k of row n is
// scales[n, k / gs] * q + biases[n, k / gs], q the `bits`-bit field at bit k * bits of the
// row's little-endian uint32 stream.
struct AffineArgs {
  const float* x;  // (M, K), row stride ldx
  int64_t ldx;
  int M;
  const uint32_t* codes;  // (N, K * bits / 32), row stride ld_codes (GGUF blocks: bytes, ld_codes bytes)
  int64_t ld_codes;
  const void* scales;  // (N, K / gs) of scale_type, row stride ld_scales
  const void* biases;  // (N, K / gs) of scale_type, row stride ld_scales
  int64_t ld_scales;
  int scale_type;
  int bits;
  int group_size;
  int K;
  const float* bias;  // (N,) or nullptr
  float* y;  // (M, N), row stride ldy
  int64_t ldy;
  // Set by affine_prepare when the ISA's fused few-row path applies, else nullptr:
  const float* xp;  // (M, K) x reordered to the decoder's lane order, then (M, K / gs) group sums of x
};

// Rows of weights decoded per block of the affine kernel (the scratch holds this many rows of K).
constexpr int kAffineBlockRows = 4;
// Activation rows from which the float32 kernels run as a GEMM over panels of decoded weight rows
// (gemm_impl.h): one past the integer path's rows (linear.cpp's kQdotMaxRows), so that up to there
// a row's result is the same in any batch on either path.
constexpr int kGemmMinRows = 33;
// Scratch rows of K floats per thread: the few-row block's rows and their scales and biases as
// float32, or a GEMM panel of 16 rows and 8 decoded rows.
constexpr int kAffineScratchRows = 24;

struct LinearKernels {
  const char* isa;
  // scratch: kAffineScratchRows * K floats, owned by the calling thread.
  void (*dense)(const DenseArgs&, int n0, int n1, float* scratch);
  // Floats affine_prepare writes for these args: 0 when the fused path does not apply.
  int64_t (*affine_prepared_size)(const AffineArgs&);
  void (*affine_prepare)(const AffineArgs&, float* xp);
  // scratch: kAffineScratchRows * K floats, owned by the calling thread.
  void (*affine)(const AffineArgs&, int n0, int n1, float* scratch);
  // out (R, K) float32: R rows of GGUF blocks of `type` (row stride ld bytes) decoded.
  void (*block_rows)(int type, const uint8_t* rows, int64_t ld, int R, int K, float* out);
};

namespace generic {
const LinearKernels& linear_kernels();
}
namespace avx2 {
const LinearKernels& linear_kernels();
}
namespace avx512 {
const LinearKernels& linear_kernels();
}

}  // namespace base_cpu

// Every GGUF block type (kernels.h's BlockType) as blocks of 32 values, each 32 integer codes and
// an affine pair (s, c), value = s * code + c: the K-quants' sub-blocks (kquants_impl.h) and the
// legacy blocks (legacy_blocks_impl.h) behind one interface, for the integer and float kernels.
// Q2_K adds an offset per 16 values (has_half_offsets, q2k_half_offsets): its two minimums a block of 32.
// Included inside each instruction set's anonymous namespace, after those two.

// The (s, c) of blocks b .. b + count of a row of `blocks` blocks (count <= 8; a K-quant row's
// runs are its super-blocks, so b % 8 == 0 and count == 8 there).
template <int TYPE>
inline void run_affine(const uint8_t* row, int b, int count, int blocks, float* s, float* c) {
  if constexpr (is_kquant(TYPE)) {
    kquant_affine<TYPE>(row + (b / 8) * block_bytes(TYPE), s, c);
  } else {
    for (int j = 0; j < count; ++j) legacy_affine<TYPE>(legacy_block<TYPE>(row, b + j, blocks), s[j], c[j]);
  }
}

// The 32 codes of block b of a row of `blocks` blocks.
template <int TYPE>
inline void block_codes(const uint8_t* row, int b, int blocks, int16_t* out) {
  if constexpr (is_kquant(TYPE)) {
    kquant_codes<TYPE>(row + (b / 8) * block_bytes(TYPE), b % 8, out);
  } else {
    legacy_codes<TYPE>(legacy_block<TYPE>(row, b, blocks), out);
  }
}

#if defined(__AVX2__)
// 32 codes as 16-bit lanes (values 0-15, 16-31) to float32 s * code + c at out.
inline void decode_code_lanes(__m256i lo, __m256i hi, float s, float c, float* out) {
  const __m256 vs = _mm256_set1_ps(s), vc = _mm256_set1_ps(c);
  const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1), _mm256_castsi256_si128(hi),
                            _mm256_extracti128_si256(hi, 1)};
  for (int i = 0; i < 4; ++i)
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(parts[i])), vs, vc));
}
#endif

template <int TYPE>
inline void block_decode_row_as(const uint8_t* row, int K, float* dst) {
#if defined(__AVX2__)
  if constexpr (is_legacy_block(TYPE)) {  // codes decoded in registers (the prefill GEMM decodes every row)
    for (int b = 0; b < K / 32; ++b) {
      const LegacyBlock block = legacy_block<TYPE>(row, b, K / 32);
      float s, c;
      legacy_affine<TYPE>(block, s, c);
      __m256i lo, hi;
      legacy_code_lanes<TYPE>(block, lo, hi);
      decode_code_lanes(lo, hi, s, c, dst + 32 * b);
    }
    return;
  }
#endif
  alignas(64) int16_t codes[32];
  float s[8], c[8], c16[16];
  const int blocks = K / 32;
  for (int b = 0; b < blocks; b += 8) {
    const int count = blocks - b < 8 ? blocks - b : 8;
    run_affine<TYPE>(row, b, count, blocks, s, c);
    if constexpr (has_half_offsets(TYPE)) q2k_half_offsets(row + (b / 8) * block_bytes(TYPE), c16);
    for (int j = 0; j < count; ++j) {
      block_codes<TYPE>(row, b + j, blocks, codes);
      float* out = dst + 32 * (b + j);
      for (int l = 0; l < 32; ++l) {  // s * code is exact, so each value is one rounding, llama.cpp's
        out[l] = s[j] * static_cast<float>(codes[l]) + (has_half_offsets(TYPE) ? c16[2 * j + l / 16] : c[j]);
      }
    }
  }
}

// The K float32 values of one row of blocks of `type`.
inline void block_decode_row(int type, const uint8_t* row, int K, float* dst) {
  switch (type) {
    case kQ2K: return block_decode_row_as<kQ2K>(row, K, dst);
    case kQ3K: return block_decode_row_as<kQ3K>(row, K, dst);
    case kIQ4XS: return block_decode_row_as<kIQ4XS>(row, K, dst);
    case kIQ4NL: return block_decode_row_as<kIQ4NL>(row, K, dst);
    case kIQ4NLRuns: return block_decode_row_as<kIQ4NLRuns>(row, K, dst);
    case kQ4K: return block_decode_row_as<kQ4K>(row, K, dst);
    case kQ5K: return block_decode_row_as<kQ5K>(row, K, dst);
    case kQ6K: return block_decode_row_as<kQ6K>(row, K, dst);
    case kQ4_0: return block_decode_row_as<kQ4_0>(row, K, dst);
    case kQ4_1: return block_decode_row_as<kQ4_1>(row, K, dst);
    case kQ5_0: return block_decode_row_as<kQ5_0>(row, K, dst);
    case kQ5_1: return block_decode_row_as<kQ5_1>(row, K, dst);
    case kQ8_0: return block_decode_row_as<kQ8_0>(row, K, dst);
    case kQ4_0Runs: return block_decode_row_as<kQ4_0Runs>(row, K, dst);
    case kQ4_1Runs: return block_decode_row_as<kQ4_1Runs>(row, K, dst);
    case kQ5_0Runs: return block_decode_row_as<kQ5_0Runs>(row, K, dst);
    case kQ5_1Runs: return block_decode_row_as<kQ5_1Runs>(row, K, dst);
    default: return block_decode_row_as<kQ8_0Runs>(row, K, dst);
  }
}

// GGUF's legacy blocks (kernels.h's kQ4_0 ... kQ8_0) block by block, for the integer and float
// kernels. Included inside each instruction set's anonymous namespace, after kquants_impl.h (half_at).
//
// A block holds 32 values: a float16 scale d, for Q4_1/Q5_1 a float16 minimum m, for Q5_0/Q5_1
// 4 bytes qh of fifth bits, then the low bits qs (llama.cpp's block_q4_0 ... block_q8_0):
//   type  bytes  fields                    value
//   Q4_0  18     d | qs[16]                d * (q - 8)
//   Q4_1  20     d | m | qs[16]            d * q + m
//   Q5_0  22     d | qh[4] | qs[16]        d * (q - 16)
//   Q5_1  24     d | m | qh[4] | qs[16]    d * q + m
//   Q8_0  34     d | qs[32] (int8)         d * q
//   IQ4_NL 18    d | qs[16]                d * kIQ4Values[q]
// Nibble byte l of qs holds value l (low half) and value l + 16 (high half); bit l of the
// little-endian u32 qh is bit 4 of value l. A block comes out as 32 integer codes in natural order
// (q, signed for Q8_0, kIQ4Values[q] for IQ4_NL) and one affine pair (s, c), value = s * code + c:
// s = d, and c = m (Q4_1, Q5_1), -8d (Q4_0), -16d (Q5_0) or 0 (Q8_0, IQ4_NL). d * code, -8d and -16d
// are exact in float32 (at most 11 + 8 significant bits), so each value is llama.cpp's own: exact for
// Q4_0, Q5_0, Q8_0 and IQ4_NL, one rounding of d * q + m for Q4_1 and Q5_1, as llama.cpp rounds it.

// Where one block's fields are: together in the block (the file's layout), or in its run's field
// arrays (kQ*Runs: a run's 8 d at its start, then 8 m, 8 qh and 8 qs; 8 times the fields' bytes
// before the qs).
struct LegacyBlock {
  const uint8_t* d;
  const uint8_t* m;
  const uint8_t* qh;
  const uint8_t* qs;
};

template <int TYPE>
inline LegacyBlock legacy_block_in_file(const uint8_t* block) {
  const uint8_t* qs = block + legacy_qs_at(TYPE);
  return LegacyBlock{block, block + 2, qs - 4, qs};
}

// Block j of a full run in the runs layout.
template <int TYPE>
inline LegacyBlock legacy_block_in_run(const uint8_t* run, int j) {
  constexpr int fields = legacy_qs_at(TYPE);
  constexpr int qs_bytes = block_bytes(TYPE) - fields;
  return LegacyBlock{run + 2 * j, run + 16 + 2 * j, run + 8 * (fields - 4) + 4 * j, run + 8 * fields + qs_bytes * j};
}

// Block b of a row of `blocks` blocks of TYPE, in either layout.
template <int TYPE>
inline LegacyBlock legacy_block(const uint8_t* row, int b, int blocks) {
  if constexpr (is_legacy_runs(TYPE)) {
    if (b < blocks / 8 * 8) return legacy_block_in_run<TYPE>(row + static_cast<int64_t>(b / 8) * 8 * block_bytes(TYPE), b % 8);
  }
  return legacy_block_in_file<TYPE>(row + static_cast<int64_t>(b) * block_bytes(TYPE));
}

// The block's s and c.
template <int TYPE>
inline void legacy_affine(const LegacyBlock& block, float& s, float& c) {
  s = half_at(block.d);
  if constexpr (legacy_has_min(TYPE)) {
    c = half_at(block.m);
  } else if constexpr (legacy_zero(TYPE) != 0) {
    c = -static_cast<float>(legacy_zero(TYPE)) * s;
  } else {
    c = 0.0f;
  }
}

// The block's fifth bits (bit l: value l's), read as little-endian bytes on any host.
inline uint32_t legacy_high_bits(const uint8_t* qh) {
  return static_cast<uint32_t>(qh[0]) | static_cast<uint32_t>(qh[1]) << 8 | static_cast<uint32_t>(qh[2]) << 16 |
         static_cast<uint32_t>(qh[3]) << 24;
}

// The block's 32 codes.
template <int TYPE>
inline void legacy_codes(const LegacyBlock& block, int16_t* out) {
  const uint8_t* qs = block.qs;
  if constexpr (legacy_is_q8(TYPE)) {
    for (int l = 0; l < 32; ++l) out[l] = static_cast<int8_t>(qs[l]);
  } else if constexpr (legacy_is_iq4(TYPE)) {
    for (int l = 0; l < 16; ++l) out[l] = kIQ4Values[qs[l] & 15], out[l + 16] = kIQ4Values[qs[l] >> 4];
  } else {
    const uint32_t qh = legacy_has_high_bits(TYPE) ? legacy_high_bits(block.qh) : 0;
    for (int l = 0; l < 16; ++l) {
      out[l] = static_cast<int16_t>((qs[l] & 15) | ((qh >> l) & 1) << 4);
      out[l + 16] = static_cast<int16_t>((qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4);
    }
  }
}

#if defined(__AVX2__)
// 16 bytes of nibbles (value l low in byte l, value l + 16 high) looked up in kIQ4Values in
// registers (pshufb), widened to 16-bit codes: values 0-15 in lo, 16-31 in hi.
inline void iq4_code_lanes(const uint8_t* qs, __m256i& lo, __m256i& hi) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
  const __m128i low4 = _mm_set1_epi8(0x0f), bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(bytes, low4)));
  hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
}

// legacy_codes in registers, two vectors of 16-bit codes (values 0-15, 16-31): the 16 nibble bytes
// widened to 16 bits give the low nibbles (values 0-15) and the high ones (16-31); a Q5 block's fifth
// bits come from qh, each lane testing its own bit; Q8_0's bytes are widened with their sign.
template <int TYPE>
inline void legacy_code_lanes(const LegacyBlock& block, __m256i& lo, __m256i& hi) {
  const uint8_t* qs = block.qs;
  auto bytes16 = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  if constexpr (legacy_is_q8(TYPE)) {
    lo = _mm256_cvtepi8_epi16(bytes16(qs));
    hi = _mm256_cvtepi8_epi16(bytes16(qs + 16));
  } else if constexpr (legacy_is_iq4(TYPE)) {
    iq4_code_lanes(qs, lo, hi);
  } else {
    const __m256i v = _mm256_cvtepu8_epi16(bytes16(qs));
    lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
    hi = _mm256_srli_epi16(v, 4);
    if constexpr (legacy_has_high_bits(TYPE)) {
      uint32_t qh;
      __builtin_memcpy(&qh, block.qh, sizeof qh);  // x86: little-endian
      const __m256i lane_bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                 16384, static_cast<int16_t>(0x8000));
      const __m256i fifth = _mm256_set1_epi16(0x10);
      auto high = [&](uint32_t bits) {
        const __m256i set = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), lane_bit);
        return _mm256_and_si256(_mm256_cmpeq_epi16(set, lane_bit), fifth);
      };
      lo = _mm256_or_si256(lo, high(qh & 0xffff));
      hi = _mm256_or_si256(hi, high(qh >> 16));
    }
  }
}
#endif

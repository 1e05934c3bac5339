// The AVX2 / AVX-512 integer loops over GGUF blocks (kquants_impl.h and legacy_blocks_impl.h give
// the layouts; Q2_K's minimums, one per 16 values, meet the activations' sums over those values),
// included by qdot_impl.h inside its AVX2 section. A row is taken in runs of 8 blocks of 32 values
// (a super-block; 8 legacy blocks, the row's last run maybe fewer): the run's 8 (s, c) pairs widened
// once into registers, each block decoded in registers into two vectors of 16-bit codes (natural
// order) that meet the 16-bit activation codes in multiply-adds as the affine blocks do. For a
// batch of rows, Q6_K's codes carry their 8-bit scale (mullo), and Q2_K's and Q3_K's their 4- or
// 6-bit one, so every block is one integer sum and one FMA, and their blocks are decoded a
// super-block at a time into a small buffer (q6k_decode, low_bits_decode); a row alone (one decode
// stream) takes them in registers (q6k_row_alone, low_bits_row_alone).

template <int TYPE>
inline WeightBlock<int16_t> kquant_block(const uint8_t* sb, int j) {
  // Each half (16 values) loaded as bytes widened to 16 bits: the nibble a block takes is then one
  // AND or one shift, and two blocks sharing bytes (Q4_K/Q5_K j, j + 1) read the same 32 bytes.
  const __m256i low4 = _mm256_set1_epi16(0x0f);
  auto widened = [](const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  auto nibble = [&](__m256i v, bool high) { return high ? _mm256_srli_epi16(v, 4) : _mm256_and_si256(v, low4); };
  static_assert(TYPE != kQ6K && TYPE != kQ3K && TYPE != kQ2K,
                "Q6_K, Q3_K and Q2_K blocks are decoded a super-block at a time (q6k_decode, low_bits_decode)");
  if constexpr (TYPE == kIQ4XS) {
    WeightBlock<int16_t> w;
    iq4_code_lanes(sb + 8 + 16 * j, w.lo, w.hi);
    return w;
  }
  const uint8_t* qs = sb + (TYPE == kQ4K ? 16 : 48) + 32 * (j / 2);
  __m256i lo = nibble(widened(qs), j & 1), hi = nibble(widened(qs + 16), j & 1);
  if constexpr (TYPE == kQ5K) {  // bit j of byte i of qh: value i's fifth bit, moved to bit 4
    const __m128i shift = _mm_cvtsi32_si128(j);
    const __m256i fifth = _mm256_set1_epi16(0x10);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srl_epi16(_mm256_slli_epi16(widened(sb + 16), 4), shift), fifth));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srl_epi16(_mm256_slli_epi16(widened(sb + 32), 4), shift), fifth));
  }
  return WeightBlock<int16_t>{lo, hi};
}

// Blocks 4g..4g + 3 of a Q6_K super-block as centred codes (-32..31), a block's 32 bytes a vector.
// Each 128 values share 64 bytes of low nibbles and 32 of high bit pairs: block 4g + i takes the
// low nibbles of l0, l1, then the high nibbles, with bit pair i of h as bits 4-5.
inline void q6k_centred(const uint8_t* sb, int g, __m256i* q) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * g));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * g + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * g));
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(h, bits45));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                         _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45));
  for (int i = 0; i < 4; ++i) q[i] = _mm256_sub_epi8(q[i], offset);
}

// A Q6_K super-block's 8 blocks as 16-bit codes times their 16-value scales, into w (256 values):
// decoded as bytes (32 values an operation, q6k_centred), then widened and scaled.
inline void q6k_decode(const uint8_t* sb, int16_t* w) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192);
  for (int g = 0; g < 2; ++g) {
    __m256i q[4];
    q6k_centred(sb, g, q);
    for (int i = 0; i < 4; ++i) {
      const int j = 4 * g + i;
      const __m256i centred = q[i];
      const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(centred));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(centred, 1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 32 * j), _mm256_mullo_epi16(lo, _mm256_set1_epi16(sc[2 * j])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 32 * j + 16),
                         _mm256_mullo_epi16(hi, _mm256_set1_epi16(sc[2 * j + 1])));
    }
  }
}

// The d (and m) fields of the 8 blocks at p, p + stride, ... p + 7 stride as float32 lanes: each
// block's first 4 bytes (d | m for Q4_1/Q5_1) read as one word, the words' halves packed and widened
// (8 word inserts, against 16 of the halves one at a time; AVX2's gather was slower on Zen).
template <bool WITH_MIN>
inline void first_halves(const uint8_t* p, int64_t stride, __m256& d, __m256& m) {
  auto at = [&](int j) {
    uint32_t w;
    __builtin_memcpy(&w, p + j * stride, sizeof w);
    return static_cast<int>(w);
  };
  const __m256i words = _mm256_setr_epi32(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
  const __m256i low = _mm256_and_si256(words, _mm256_set1_epi32(0xffff));
  const __m256i high = WITH_MIN ? _mm256_srli_epi32(words, 16) : low;
  // packus interleaves per 128-bit lane (low 0-3, high 0-3 | low 4-7, high 4-7); the permute puts
  // the lows first.
  const __m256i halves = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xD8);
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  if constexpr (WITH_MIN) m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

// kquant_affine in registers: the 8 blocks' s and c of super-block sb.
template <int TYPE>
inline void kquant_affine_lanes(const uint8_t* sb, __m256& s, __m256& c) {
  if constexpr (TYPE == kQ6K || TYPE == kQ3K || TYPE == kQ2K) {
    s = _mm256_set1_ps(half_at(sb + kquant_d_at(TYPE)));
    c = _mm256_setzero_ps();
  } else if constexpr (TYPE == kIQ4XS) {  // s = d * (ls - 32): low nibbles of scales_l, 2 bits of scales_h
    uint32_t scales_l;
    __builtin_memcpy(&scales_l, sb + 4, sizeof scales_l);
    const __m128i each_twice = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(scales_l)),
                                                _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i low = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(each_twice), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    const __m256i high =
        _mm256_srlv_epi32(_mm256_set1_epi32(sb[2] | sb[3] << 8), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i ls = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4));
    s = _mm256_mul_ps(_mm256_set1_ps(half_at(sb)), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
    c = _mm256_setzero_ps();
  } else {
    uint64_t scales, mins;
    kquant_scales_mins(sb + 4, scales, mins);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(scales))));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mins))));
    s = _mm256_mul_ps(_mm256_set1_ps(half_at(sb)), sc);
    c = _mm256_mul_ps(_mm256_set1_ps(-half_at(sb + 2)), m);
  }
}

// run_affine in registers: the s and c of blocks b .. b + 7 of a row.
template <int TYPE>
inline void run_affine_lanes(const uint8_t* row, int b, __m256& s, __m256& c) {
  if constexpr (is_kquant(TYPE)) {
    kquant_affine_lanes<TYPE>(row + (b / 8) * block_bytes(TYPE), s, c);
  } else {
    const uint8_t* first = row + static_cast<int64_t>(b) * block_bytes(TYPE);
    if constexpr (is_legacy_runs(TYPE)) {  // the run's 8 d, then its 8 m
      s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first)));
      if constexpr (legacy_has_min(TYPE)) c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first + 16)));
    } else {
      first_halves<legacy_has_min(TYPE)>(first, block_bytes(TYPE), s, c);
    }
    if constexpr (!legacy_has_min(TYPE)) {
      c = _mm256_mul_ps(s, _mm256_set1_ps(-static_cast<float>(legacy_zero(TYPE))));
    }
  }
}

// Whether blocks of TYPE have an offset c that meets the activations' block sums (Q4_K, Q5_K and the
// legacy types with a zero point or minimum; Q2_K's offsets are per 16 values, add_half_offsets).
constexpr bool has_offsets(int type) {
  return type == kQ4K || type == kQ5K || (is_legacy_block(type) && !legacy_is_q8(type) && !legacy_is_iq4(type));
}

// Q2_K's offsets per 16 values (q2k_half_offsets) of the super-block at sb (blocks b .. b + 7)
// against the MR rows' sums of those values, into each row's last accumulator.
template <int MR, int ACCS>
inline void add_half_offsets(const QdotArgs& a, const uint8_t* sb, int m0, int b, __m256 (*acc)[ACCS]) {
  const __m128i mins = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)), 4),
                                     _mm_set1_epi8(0x0f));
  const __m256 minus_dmin = _mm256_set1_ps(-half_at(sb + 82));
  const __m256 c0 = _mm256_mul_ps(minus_dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)));
  const __m256 c1 = _mm256_mul_ps(minus_dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8))));
  for (int m = 0; m < MR; ++m) {
    const float* sums = a.x.half_sum + static_cast<int64_t>(m0 + m) * (a.K / 16) + 2 * b;
    acc[m][ACCS - 1] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(sums), acc[m][ACCS - 1]);
    acc[m][ACCS - 1] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(sums + 8), acc[m][ACCS - 1]);
  }
}

// Block j of the run from block b (K-quants: the super-block's sub-block j); IN_RUN: of a full
// run (a legacy row's last blocks are not, and keep the file's layout in either).
template <int TYPE, bool IN_RUN>
inline WeightBlock<int16_t> run_block(const uint8_t* row, int b, int j) {
  if constexpr (is_kquant(TYPE)) {
    return kquant_block<TYPE>(row + (b / 8) * block_bytes(TYPE), j);
  } else {
    const uint8_t* at = row + static_cast<int64_t>(b) * block_bytes(TYPE);
    WeightBlock<int16_t> w;
    if constexpr (IN_RUN && is_legacy_runs(TYPE)) {
      legacy_code_lanes<TYPE>(legacy_block_in_run<TYPE>(at, j), w.lo, w.hi);
    } else {
      legacy_code_lanes<TYPE>(legacy_block_in_file<TYPE>(at + j * block_bytes(TYPE)), w.lo, w.hi);
    }
    return w;
  }
}

// A Q6_K weight row against one activation row alone, its blocks decoded in registers: each
// 128 values' 64 bytes of low nibbles and 32 of high bit pairs give 4 blocks of centred codes as
// bytes (32 values an operation), widened once and taken in one dpwssd (AVX-512) or two maddwd
// (AVX2). The 16-value scales stay out of the integer sums and go into the float ones: the lanes
// of the first 16 values' pairs times d sc[2j] dx_j, the second's times d sc[2j + 1] dx_j (a batch
// of rows takes q6k_decode's scaled codes instead, decoded once for all its rows).
inline __m256 q6k_row_alone(const QdotArgs& a, int n, int m0) {
  constexpr int kBytes = block_bytes(kQ6K);
  constexpr int64_t ahead = 2048;
  const int blocks = a.K / B;
  const uint8_t* row = a.codes + static_cast<int64_t>(n) * a.ld_bytes;
  const int16_t* xq = static_cast<const int16_t*>(a.x.q) + static_cast<int64_t>(m0) * a.K;
  const float* d = a.x.d + static_cast<int64_t>(m0) * blocks;
#if defined(__AVX512VNNI__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#else
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  alignas(32) float scale[16];
#endif
  for (int b = 0; b < blocks; b += 8) {
    const uint8_t* sb = row + (b / 8) * kBytes;
    for (int line = 0; line < kBytes; line += 64) __builtin_prefetch(sb + ahead + line, 0, 3);
    const int16_t* x = xq + b * B;
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192));
    const __m256 dx = _mm256_mul_ps(_mm256_loadu_ps(d + b), _mm256_set1_ps(half_at(sb + 208)));
#if defined(__AVX512VNNI__)
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)),
                                        _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(dx)));
#else
    _mm256_store_ps(scale, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)),
                                         _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3))));
    _mm256_store_ps(scale + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))),
                                             _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))));
#endif
    for (int g = 0; g < 2; ++g) {
      __m256i q[4];
      q6k_centred(sb, g, q);
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * g + i;
        const __m256i centred = q[i];
#if defined(__AVX512VNNI__)
        const __m512i dot =
            _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(centred), _mm512_loadu_si512(x + j * B));
        const __m512i halves = _mm512_add_epi32(_mm512_set1_epi32(2 * j),
                                                _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
        acc[j % 4] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(halves, scales), acc[j % 4]);
#else
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j * B));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j * B + 16));
        const __m256i p0 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(centred)), x0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(centred, 1)), x1);
        acc[j % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(scale[2 * j]), acc[j % 2]);
        acc[2 + j % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(scale[2 * j + 1]), acc[2 + j % 2]);
#endif
      }
    }
  }
#if defined(__AVX512VNNI__)
  const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  return _mm256_add_ps(_mm512_castps512_ps256(total), _mm512_extractf32x8_ps(total, 1));
#else
  return _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
#endif
}
// Q3_K's 16 scales less 32 (q3k_scale) as int8 lanes, from its 12 packed bytes q (at 96, d after
// them): the low nibbles of bytes 0-7, then their high nibbles, with bit pairs 0-1, 2-3, 4-5, 6-7 of
// bytes 8-11 above each four.
inline __m128i q3k_scale_lanes(const uint8_t* q) {
  // The 16 bytes ending with d (all within the super-block), moved down to start at q.
  const __m128i packed = _mm_srli_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q - 2)), 2);
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(packed, low4), _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
  const __m128i pairs = _mm_shuffle_epi32(packed, _MM_SHUFFLE(2, 2, 2, 2));  // bytes 8-11, four times
  __m128i high = _mm_blend_epi32(pairs, _mm_srli_epi16(pairs, 2), 0x2);
  high = _mm_blend_epi32(high, _mm_srli_epi16(pairs, 4), 0x4);
  high = _mm_blend_epi32(high, _mm_srli_epi16(pairs, 6), 0x8);
  high = _mm_slli_epi16(_mm_and_si128(high, _mm_set1_epi8(3)), 4);
  return _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));
}

// A Q2_K/Q3_K super-block's bytes as the blocks' codes take them: per 128 values its 32 bytes of 2-bit
// fields widened to 16 bits (bits[2 g], bits[2 g + 1]: values 0-15 and 16-31 of blocks 4g .. 4g + 3),
// and Q3_K's 32 hmask bytes widened and inverted (set where a code is less 4). A block's codes are
// then shifts and masks in these lanes, with no shuffles (low_bits_block).
template <int TYPE>
struct LowBits {
  __m256i bits[4], cleared[2];
  explicit LowBits(const uint8_t* sb) {
    auto widened = [](const uint8_t* p) {
      return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    };
    for (int h = 0; h < 4; ++h) bits[h] = widened(sb + (TYPE == kQ3K ? 32 : 16) + 16 * h);
    if constexpr (TYPE == kQ3K) {
      for (int h = 0; h < 2; ++h) cleared[h] = _mm256_xor_si256(widened(sb + 16 * h), _mm256_set1_epi16(0xff));
    }
  }
  // Block j's codes, values 0-15 in q[0] and 16-31 in q[1] (Q2_K: q; Q3_K: q - 4 where its bit is clear).
  void block(int j, __m256i* q) const {
    for (int h = 0; h < 2; ++h) {
      q[h] = _mm256_and_si256(_mm256_srli_epi16(bits[2 * (j / 4) + h], 2 * (j % 4)), _mm256_set1_epi16(3));
      if constexpr (TYPE == kQ3K) {  // bit j of the inverted hmask moved to bit 2: 4 or 0
        const __m256i at2 = j >= 2 ? _mm256_srli_epi16(cleared[h], j - 2) : _mm256_slli_epi16(cleared[h], 2 - j);
        q[h] = _mm256_sub_epi16(q[h], _mm256_and_si256(at2, _mm256_set1_epi16(4)));
      }
    }
  }
};

// The 16 scales of a Q2_K/Q3_K super-block (one per 16 values) as int8 lanes: Q2_K's low nibbles of
// scales[16], Q3_K's 6-bit scales less 32.
template <int TYPE>
inline __m128i low_bits_scales(const uint8_t* sb) {
  if constexpr (TYPE == kQ3K) return q3k_scale_lanes(sb + 96);
  return _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)), _mm_set1_epi8(15));
}

// A Q2_K/Q3_K super-block's 8 blocks as 16-bit codes times their 16-value scales, into w (256 values),
// as q6k_decode does for Q6_K: a batch of rows takes each block decoded once.
template <int TYPE>
inline void low_bits_decode(const uint8_t* sb, int16_t* w) {
  alignas(16) int8_t sc[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(sc), low_bits_scales<TYPE>(sb));
  const LowBits<TYPE> fields(sb);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    __m256i q[2];
    fields.block(j, q);
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 32 * j + 16 * h),
                         _mm256_mullo_epi16(q[h], _mm256_set1_epi16(sc[2 * j + h])));
  }
}

// A Q2_K or Q3_K weight row against one activation row alone, its blocks decoded in registers
// (LowBits): each block's two halves meet the row in a maddwd each and take their 16-value scale in
// the float FMAs (the half's scale times d dx_j), as q6k_row_alone does; Q2_K's minimums meet the
// row's sums of 16 values.
template <int TYPE>
inline __m256 low_bits_row_alone(const QdotArgs& a, int n, int m0) {
  constexpr int kBytes = block_bytes(TYPE);
  constexpr int64_t ahead = 2048;
  const int blocks = a.K / B;
  const uint8_t* row = a.codes + static_cast<int64_t>(n) * a.ld_bytes;
  const int16_t* xq = static_cast<const int16_t*>(a.x.q) + static_cast<int64_t>(m0) * a.K;
  const float* d = a.x.d + static_cast<int64_t>(m0) * blocks;
  __m256 acc[1][4] = {{_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}};
  alignas(32) float scale[16];
  for (int b = 0; b < blocks; b += 8) {
    const uint8_t* sb = row + (b / 8) * kBytes;
    for (int line = 0; line < kBytes; line += 64) __builtin_prefetch(sb + ahead + line, 0, 3);
    const int16_t* x = xq + b * B;
    const __m128i sc8 = low_bits_scales<TYPE>(sb);
    const __m256 dx = _mm256_mul_ps(_mm256_loadu_ps(d + b), _mm256_set1_ps(half_at(sb + kquant_d_at(TYPE))));
    _mm256_store_ps(scale, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)),
                                         _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3))));
    _mm256_store_ps(scale + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))),
                                             _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))));
    const LowBits<TYPE> fields(sb);
    __asm__ volatile("" ::: "memory");  // the scales' FMAs then broadcast from memory, not by shuffles
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i q[2];
      fields.block(j, q);
      const __m256i p0 = _mm256_madd_epi16(q[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j * B)));
      const __m256i p1 = _mm256_madd_epi16(q[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j * B + 16)));
      acc[0][j % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(scale + 2 * j), acc[0][j % 2]);
      acc[0][2 + j % 2] =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(scale + 2 * j + 1), acc[0][2 + j % 2]);
    }
    if constexpr (has_half_offsets(TYPE)) add_half_offsets<1, 4>(a, sb, m0, b, acc);
  }
  return _mm256_add_ps(_mm256_add_ps(acc[0][0], acc[0][1]), _mm256_add_ps(acc[0][2], acc[0][3]));
}

// weight_row_lanes for a row of GGUF blocks (activation group sums over blocks of 32).
template <int TYPE, int MR, int ACCS>
inline void block_row_lanes(const QdotArgs& a, int n, int m0, __m256* lanes) {
  if constexpr (TYPE == kQ6K && MR == 1 && ACCS == 4) {  // a row alone (a batch's rows sum as one another)
    lanes[0] = q6k_row_alone(a, n, m0);
    return;
  }
  if constexpr ((TYPE == kQ3K || TYPE == kQ2K) && MR == 1 && ACCS == 4) {
    lanes[0] = low_bits_row_alone<TYPE>(a, n, m0);
    return;
  }
  constexpr int kBytes = block_bytes(TYPE);
  constexpr int64_t ahead = 2048;
  const int blocks = a.K / B;
  const uint8_t* row = a.codes + static_cast<int64_t>(n) * a.ld_bytes;
  const int16_t* xq[MR];
  const float* d[MR];
  const float* sums[MR];
  for (int m = 0; m < MR; ++m) {
    xq[m] = static_cast<const int16_t*>(a.x.q) + static_cast<int64_t>(m0 + m) * a.K;
    d[m] = a.x.d + static_cast<int64_t>(m0 + m) * blocks;
    sums[m] = a.x.sum + static_cast<int64_t>(m0 + m) * blocks;
  }
  __m256 acc[MR][ACCS];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < ACCS; ++i) acc[m][i] = _mm256_setzero_ps();
  // The run's 8 block scales times each row's, in lanes: kept in registers, a lane picked by a
  // permute (broadcasts from memory went through spilled pointers: 8 activation rows 9-20% faster
  // on Q4_0 and Q8_0); for the types decoded a super-block at a time into q6 (Q6_K, Q3_K, Q2_K),
  // beside those blocks, from memory (5% faster on Q6_K).
  constexpr bool kDecoded = TYPE == kQ6K || TYPE == kQ3K || TYPE == kQ2K;
  __m256 sd[MR];
  alignas(32) float sd_kept[kDecoded ? MR : 1][8];
  alignas(32) int16_t q6[kDecoded ? kSuperBlock : 1];
  auto scale_of = [&](int m, int j) {
    if constexpr (kDecoded) return _mm256_broadcast_ss(&sd_kept[m][j]);
    return _mm256_permutevar8x32_ps(sd[m], _mm256_set1_epi32(j));
  };
  auto set_scales = [&](int m, __m256 v) {
    if constexpr (kDecoded) _mm256_store_ps(sd_kept[m], v);
    sd[m] = v;
  };
  // Block b + j against the rows, its scale times theirs (scale_of), into accumulator `into`.
  auto add_block = [&](auto in_run, int b, int j, int into) {  // in_run: std::true_type in a full run
    WeightBlock<int16_t> w;
    if constexpr (kDecoded) {
      w = WeightBlock<int16_t>{_mm256_load_si256(reinterpret_cast<const __m256i*>(q6 + 32 * j)),
                               _mm256_load_si256(reinterpret_cast<const __m256i*>(q6 + 32 * j + 16))};
    } else {
      w = run_block<TYPE, decltype(in_run)::value>(row, b, j);
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 prod = _mm256_cvtepi32_ps(block_dot<16>(w, xq[m] + (b + j) * B));
      acc[m][into] = _mm256_fmadd_ps(prod, scale_of(m, j), acc[m][into]);
    }
  };
  int b = 0;
  for (; b + 8 <= blocks; b += 8) {
    // The run's bytes `ahead` further on, a line at a time (a legacy run's last line, where it starts
    // a line of its own, is the next run's first).
    const uint8_t* run = row + (is_kquant(TYPE) ? (b / 8) * kBytes : static_cast<int64_t>(b) * kBytes);
    constexpr int kRunBytes = is_kquant(TYPE) ? kBytes : 8 * kBytes;
    for (int line = 0; line < kRunBytes; line += 64) __builtin_prefetch(run + ahead + line, 0, 3);
    __m256 sv, cv;
    run_affine_lanes<TYPE>(row, b, sv, cv);
    for (int m = 0; m < MR; ++m) {
      if constexpr (has_offsets(TYPE))
        acc[m][ACCS - 1] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(sums[m] + b), acc[m][ACCS - 1]);
      set_scales(m, _mm256_mul_ps(sv, _mm256_loadu_ps(d[m] + b)));
    }
    if constexpr (has_half_offsets(TYPE)) add_half_offsets<MR, ACCS>(a, run, m0, b, acc);
    if constexpr (TYPE == kQ6K) q6k_decode(run, q6);
    if constexpr (TYPE == kQ3K || TYPE == kQ2K) low_bits_decode<TYPE>(run, q6);
    // Unrolled, so that the accumulators stay in registers (a loop indexing them kept them in memory).
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) add_block(std::true_type{}, b, j, j % ACCS);
  }
  float tail[MR] = {};  // the last blocks of a legacy row whose blocks are not a multiple of 8
  if constexpr (!is_kquant(TYPE)) {
    for (; b < blocks; ++b) {
      float s, c;
      legacy_affine<TYPE>(legacy_block_in_file<TYPE>(row + static_cast<int64_t>(b) * kBytes), s, c);
      for (int m = 0; m < MR; ++m) {
        tail[m] += c * sums[m][b];
        set_scales(m, _mm256_set1_ps(s * d[m][b]));
      }
      add_block(std::false_type{}, b, 0, 0);
    }
  }
  for (int m = 0; m < MR; ++m) {
    __m256 total = acc[m][0];
    for (int i = 1; i < ACCS; ++i) total = _mm256_add_ps(total, acc[m][i]);
    lanes[m * 8] = _mm256_add_ps(total, _mm256_setr_ps(tail[m], 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f));
  }
}

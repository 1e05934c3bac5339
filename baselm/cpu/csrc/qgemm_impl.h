// The many-row product over GGUF blocks with integer activations (prefill, and decode steps from
// QdotKernels::gemm_min_rows rows: 6 on VNNI, 16 on AVX2), on AVX-512 VNNI or AVX2, included by
// qdot_impl.h inside the AVX2 section of the avx512 and avx2 builds (kquant_block, q6k_centred,
// LowBits, legacy_code_lanes and the rest come from there). AVX2 takes 16-bit codes only, 8 rows a
// vector, in tiles of 8 or 16 rows (vpmaddwd and vpaddd where VNNI has one dpwssd).
//
// With many activation rows a product is compute-bound. Here the activations are quantized
// once per call to codes in blocks of 32 with one float scale dx: 16-bit codes by default (dpwssd: 32
// products a 512-bit instruction, twice a float FMA's 16; near-exact, as the few-row path) or 8-bit
// ones with activation_bits() 8 (dpbusd: 64 products; llama.cpp's Q8_0 precision). They are stored
// transposed, 16 rows a vector: the codes of values 2k, 2k + 1 (8 bits: 4k..4k+3) of rows m..m+15
// are one 64-byte vector (gemm_quantize). Each weight row is decoded once per call (GemmLayout):
//   16 bits (gemm_row_wide): signed 16-bit codes q with one float scale s per 32 values, value
//     s * q (+ c where the type has a minimum: Q4_1, Q5_1, Q4_K, Q5_K per 32 values, Q2_K per 16):
//     zero points are taken off the codes, and Q6_K's, Q3_K's and Q2_K's carry their 16-value
//     scales (Q6_K's up to 4096, so its activations take codes to 16383: 32 products fit an int32);
//   8 bits (gemm_row): unsigned byte codes u (dpbusd's unsigned side) with (s, c) per sub-block of 32
//     values (16 for Q6_K, Q3_K and Q2_K, whose 16-value scales differ within a block), value
//     s * u + c: a signed code (Q8_0, IQ4_*, Q6_K, Q3_K) is moved up and its offset goes into c.
// A tile of MV x 16 activation rows and NB weight rows then takes, per lane word, MV vector loads of
// activations and NB broadcasts of weight codes into MV x NB dot instructions, an exact integer sum
// per sub-block (at most 32 x 4096 x 16383 in a lane); per sub-block each sum meets dx * s in one
// FMA, and an offset c the rows' sums of quantized values (dx times the sum of codes, as llama.cpp's
// bsums) in another. So a result is
//   sum over sub-blocks of s * dx * sum(q * xq) + c * dx * sum(xq),
// the exact value of the weight against the quantized activations, but for float32 rounding. A
// row's codes and its sums' order do not depend on the other rows of the call.

#if defined(__AVX512VNNI__)
constexpr int kGemmLanes = 16;  // activation rows a vector: one int32 lane each
constexpr int kGemmMaxMV = 3;  // activation vectors a tile takes (MV): 12 sums in 32 registers
#else
constexpr int kGemmLanes = 8;
constexpr int kGemmMaxMV = 2;  // 8 sums, 2 activation vectors and a broadcast in 16 registers
#endif
constexpr int kGemmStrip = 4;  // weight rows a tile takes at once (NB)
constexpr int kGemmGroup = 16;  // weight rows decoded at once: 4 strips
constexpr int kGemmSliceK = 2048;  // values of K a pass takes: 48 rows' 16-bit codes, 192 KiB

// A K-quant super-block's 8 (s, c) at s and c, converted in registers and stored once (a scalar loop
// over the 8 cost a decode batch's GEMM as much as the codes).
template <int TYPE>
inline void store_kquant_affine(const uint8_t* sb, float* s, float* c) {
  __m256 sv, cv;
  kquant_affine_lanes<TYPE>(sb, sv, cv);
  _mm256_storeu_ps(s, sv);
  _mm256_storeu_ps(c, cv);
}

template <int TYPE>
constexpr int gemm_sub_block() {
  return TYPE == kQ6K || TYPE == kQ3K || TYPE == kQ2K ? 16 : 32;
}

// Two vectors of 16-bit codes (values 0-15, 16-31) as 32 codes of T in natural order: as they are, or
// packed to bytes (codes 0..255).
template <class T>
inline void store_codes(__m256i lo, __m256i hi, T* out) {
  if constexpr (sizeof(T) == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), hi);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xD8));
  }
}

#if defined(__AVX512VNNI__)
// One weight row of GGUF blocks of TYPE (K values) as unsigned byte codes and (s, c) per sub-block
// (the 8-bit GEMM's).
template <int TYPE>
void gemm_row(const uint8_t* row, int K, uint8_t* codes, float* s, float* c) {
  const __m256i up128 = _mm256_set1_epi16(128);
  if constexpr (is_legacy_block(TYPE)) {
    const int blocks = K / kLegacyBlock;
    for (int b = 0; b < blocks; ++b) {
      const LegacyBlock block = legacy_block<TYPE>(row, b, blocks);
      legacy_affine<TYPE>(block, s[b], c[b]);
      __m256i lo, hi;
      legacy_code_lanes<TYPE>(block, lo, hi);
      if constexpr (legacy_is_q8(TYPE) || legacy_is_iq4(TYPE)) {  // signed codes, moved up by 128
        lo = _mm256_add_epi16(lo, up128), hi = _mm256_add_epi16(hi, up128);
        c[b] -= 128.0f * s[b];
      }
      store_codes(lo, hi, codes + 32 * b);
    }
  } else if constexpr (TYPE == kQ4K || TYPE == kQ5K || TYPE == kIQ4XS) {
    for (int i = 0; i < K / kSuperBlock; ++i) {
      const uint8_t* sb = row + static_cast<int64_t>(i) * block_bytes(TYPE);
      store_kquant_affine<TYPE>(sb, s + 8 * i, c + 8 * i);
      for (int j = 0; j < 8; ++j) {
        WeightBlock<int16_t> w = kquant_block<TYPE>(sb, j);
        if constexpr (TYPE == kIQ4XS) {
          w.lo = _mm256_add_epi16(w.lo, up128), w.hi = _mm256_add_epi16(w.hi, up128);
          c[8 * i + j] = -128.0f * s[8 * i + j];
        }
        store_codes(w.lo, w.hi, codes + kSuperBlock * i + 32 * j);
      }
    }
  } else if constexpr (TYPE == kQ6K) {  // q in 0..63, value d * sc * (q - 32) per 16 values
    for (int i = 0; i < K / kSuperBlock; ++i) {
      const uint8_t* sb = row + static_cast<int64_t>(i) * block_bytes(TYPE);
      const float d = half_at(sb + kquant_d_at(TYPE));
      const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192);
      for (int g = 0; g < 2; ++g) {
        __m256i q[4];
        q6k_centred(sb, g, q);
        for (int j = 0; j < 4; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + kSuperBlock * i + 128 * g + 32 * j),
                              _mm256_add_epi8(q[j], _mm256_set1_epi8(32)));
      }
      for (int h = 0; h < 16; ++h) {
        s[16 * i + h] = d * static_cast<float>(sc[h]);
        c[16 * i + h] = -32.0f * s[16 * i + h];
      }
    }
  } else {  // Q3_K: q - 4 in -4..3, value d * (sc - 32) * (q - 4); Q2_K: q in 0..3, d * sc * q - dmin * m
    for (int i = 0; i < K / kSuperBlock; ++i) {
      const uint8_t* sb = row + static_cast<int64_t>(i) * block_bytes(TYPE);
      const float d = half_at(sb + kquant_d_at(TYPE));
      alignas(16) int8_t sc[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(sc), low_bits_scales<TYPE>(sb));
      const LowBits<TYPE> fields(sb);
      for (int j = 0; j < 8; ++j) {
        __m256i q[2];
        fields.block(j, q);
        if constexpr (TYPE == kQ3K) {
          q[0] = _mm256_add_epi16(q[0], _mm256_set1_epi16(4)), q[1] = _mm256_add_epi16(q[1], _mm256_set1_epi16(4));
        }
        store_codes(q[0], q[1], codes + kSuperBlock * i + 32 * j);
      }
      const float dmin = TYPE == kQ2K ? half_at(sb + 82) : 0.0f;
      for (int h = 0; h < 16; ++h) {
        s[16 * i + h] = d * static_cast<float>(sc[h]);
        c[16 * i + h] = TYPE == kQ3K ? -4.0f * s[16 * i + h] : -(dmin * static_cast<float>(sb[h] >> 4));
      }
    }
  }
}
#endif  // __AVX512VNNI__

// One weight row as the 16-bit GEMM takes it: signed 16-bit codes, each 32 values' s, and an offset c
// only where the type has a minimum (Q4_1, Q5_1, Q4_K, Q5_K per 32 values, Q2_K per 16): a zero point
// (Q4_0's 8, Q5_0's 16) is taken off the codes. Q6_K's, Q3_K's and Q2_K's codes carry their 16-value
// scales (as the few-row path decodes them: q6k_decode, low_bits_decode), so s is d for all 32.
template <int TYPE>
void gemm_row_wide(const uint8_t* row, int K, int16_t* codes, float* s, float* c) {
  if constexpr (is_legacy_block(TYPE)) {
    const int blocks = K / kLegacyBlock;
    const __m256i zero = _mm256_set1_epi16(static_cast<int16_t>(legacy_zero(TYPE)));
    for (int b = 0; b < blocks; ++b) {
      const LegacyBlock block = legacy_block<TYPE>(row, b, blocks);
      legacy_affine<TYPE>(block, s[b], c[b]);
      __m256i lo, hi;
      legacy_code_lanes<TYPE>(block, lo, hi);
      store_codes(_mm256_sub_epi16(lo, zero), _mm256_sub_epi16(hi, zero), codes + 32 * b);
    }
  } else if constexpr (TYPE == kQ4K || TYPE == kQ5K || TYPE == kIQ4XS) {
    for (int i = 0; i < K / kSuperBlock; ++i) {
      const uint8_t* sb = row + static_cast<int64_t>(i) * block_bytes(TYPE);
      store_kquant_affine<TYPE>(sb, s + 8 * i, c + 8 * i);
      for (int j = 0; j < 8; ++j) {
        const WeightBlock<int16_t> w = kquant_block<TYPE>(sb, j);
        store_codes(w.lo, w.hi, codes + kSuperBlock * i + 32 * j);
      }
    }
  } else {
    for (int i = 0; i < K / kSuperBlock; ++i) {
      const uint8_t* sb = row + static_cast<int64_t>(i) * block_bytes(TYPE);
      if constexpr (TYPE == kQ6K) {
        q6k_decode(sb, codes + kSuperBlock * i);
      } else {
        low_bits_decode<TYPE>(sb, codes + kSuperBlock * i);
      }
      const float d = half_at(sb + kquant_d_at(TYPE));
      for (int j = 0; j < 8; ++j) s[8 * i + j] = d;
      if constexpr (TYPE == kQ2K) {
        const float dmin = half_at(sb + 82);
        for (int h = 0; h < 16; ++h) c[16 * i + h] = -(dmin * static_cast<float>(sb[h] >> 4));
      }
    }
  }
}

// How a row of TYPE meets codes of T: values an integer sum covers (SUB), values an offset c covers
// (OFFSET_VALUES), and whether there are offsets at all.
template <int TYPE, class T>
struct GemmLayout {
  static constexpr bool kWide = sizeof(T) == 2;
  static constexpr int SUB = kWide ? 32 : gemm_sub_block<TYPE>();
  static constexpr int OFFSET_VALUES = kWide && TYPE == kQ2K ? 16 : SUB;
  static constexpr bool OFFSETS = !kWide || TYPE == kQ2K || TYPE == kQ4K || TYPE == kQ5K || legacy_has_min(TYPE);
};

// The 4 byte codes or 2 16-bit codes at p, as one int32 lane.
template <class T>
inline int32_t word_at(const T* p) {
  int32_t w;
  __builtin_memcpy(&w, p, sizeof w);
  return w;
}

#if defined(__AVX512VNNI__)
// The VNNI tile's vectors: LANES activation rows each, 16 on 512-bit vectors, or 8 on 256-bit ones
// (a call's last 8 rows or fewer: 8 decode streams take one such tile, not half of a 16-row one).
template <int LANES>
struct GemmVec;
template <>
struct GemmVec<16> {
  using I = __m512i;
  using F = __m512;
  static I load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I set1(int32_t w) { return _mm512_set1_epi32(w); }
  static I dpwssd(I acc, I w, I x) { return _mm512_dpwssd_epi32(acc, w, x); }
  static I dpbusd(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F floats(I v) { return _mm512_cvtepi32_ps(v); }
};
template <>
struct GemmVec<8> {
  using I = __m256i;
  using F = __m256;
  static I load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I set1(int32_t w) { return _mm256_set1_epi32(w); }
  static I dpwssd(I acc, I w, I x) { return _mm256_dpwssd_epi32(acc, w, x); }
  static I dpbusd(I acc, I w, I x) { return _mm256_dpbusd_epi32(acc, w, x); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F floats(I v) { return _mm256_cvtepi32_ps(v); }
};

// part[r * ld + i] (+)= row r of the strip against activation row m0 + i, over sub-blocks t0..t1
// (from zero where t0 is 0): MV vectors of LANES rows. PAIRS: the layout of up to 8 rows
// (GemmActivations::pairs): lanes 2i and 2i + 1 take a share of row i's products each (two lane
// words of the row a 64-bit element, against one 64-bit broadcast of the weight's), their integer
// sums are added before the float steps, and both lanes then hold row i's result, the same bits as
// a 16-row tile gives it.
template <int TYPE, class T, int MV, int LANES = kGemmLanes, bool PAIRS = false>
inline void gemm_tile(const GemmActivations& x, int K, const T* codes, const float* s, const float* c, int m0, int t0,
                      int t1, float* part, int64_t ld) {
  using L = GemmLayout<TYPE, T>;
  using V = GemmVec<LANES>;
  constexpr int SB = L::SUB, CV = L::OFFSET_VALUES;
  constexpr int P = (PAIRS ? 8 : 4) / sizeof(T);  // values a lane (a pair of lanes) takes per instruction
  const int offsets = K / CV;
  constexpr int NB = kGemmStrip;
  const int subs = K / SB;
  const int64_t mp = x.rows;
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q) + m0;
  const float* sums = (CV == 16 ? x.sum16 : x.sum32) + m0;
  auto weight = [&](int r, int kp) {
    const T* at = codes + static_cast<int64_t>(r) * K + P * kp;
    if constexpr (PAIRS) {
      int64_t w;
      __builtin_memcpy(&w, at, sizeof w);
      return _mm512_set1_epi64(w);
    } else {
      return V::set1(word_at(at));
    }
  };
  typename V::F acc[MV][NB];
  for (int v = 0; v < MV; ++v)
    for (int r = 0; r < NB; ++r) acc[v][r] = t0 == 0 ? V::zerof() : V::loadf(part + r * ld + v * LANES);
  for (int t = t0; t < t1; ++t) {
    typename V::I dots[MV][NB];
    for (int v = 0; v < MV; ++v)
      for (int r = 0; r < NB; ++r) dots[v][r] = V::zero();
#pragma GCC unroll 16
    for (int kp = t * SB / P; kp < (t + 1) * SB / P; ++kp) {
      typename V::I xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = V::load(xq + kp * mp + v * LANES);
      for (int r = 0; r < NB; ++r) {
        const typename V::I w = weight(r, kp);
        for (int v = 0; v < MV; ++v) {
          if constexpr (sizeof(T) == 1) {
            dots[v][r] = V::dpbusd(dots[v][r], w, xv[v]);
          } else {
            dots[v][r] = V::dpwssd(dots[v][r], w, xv[v]);
          }
        }
      }
    }
    if constexpr (PAIRS) {  // each lane of a pair gets the row's whole sum, as a 16-row tile has it
      for (int r = 0; r < NB; ++r) dots[0][r] = _mm512_add_epi32(dots[0][r], _mm512_shuffle_epi32(dots[0][r], _MM_PERM_CDAB));
    }
    const float* dx = x.d + (t * SB / 32) * mp + m0;
    for (int v = 0; v < MV; ++v) {
      const typename V::F d = V::loadf(dx + v * LANES);
      for (int r = 0; r < NB; ++r) {
        const typename V::F ds = V::mul(d, V::set1f(s[r * subs + t]));
        acc[v][r] = V::fmadd(V::floats(dots[v][r]), ds, acc[v][r]);
      }
      if constexpr (L::OFFSETS) {
        for (int o = t * SB / CV; o < (t + 1) * SB / CV; ++o) {
          const typename V::F q = V::loadf(sums + o * mp + v * LANES);
          for (int r = 0; r < NB; ++r) acc[v][r] = V::fmadd(q, V::set1f(c[r * offsets + o]), acc[v][r]);
        }
      }
    }
  }
  for (int v = 0; v < MV; ++v)
    for (int r = 0; r < NB; ++r) V::storef(part + r * ld + v * LANES, acc[v][r]);
}
#else
// AVX2 (16-bit codes only): a vpmaddwd multiplies a lane's two codes and adds the pair (at most
// 2 x 32767 x 32767, within an int32), a vpaddd takes it into the sub-block's sum: 16 products in
// two instructions, against a float FMA's 8 in one, and the FMA's port stays free for the adds.
template <int TYPE, class T, int MV>
inline void gemm_tile(const GemmActivations& x, int K, const T* codes, const float* s, const float* c, int m0, int t0,
                      int t1, float* part, int64_t ld) {
  static_assert(sizeof(T) == 2, "the AVX2 GEMM takes 16-bit codes");
  using L = GemmLayout<TYPE, T>;
  constexpr int SB = L::SUB, CV = L::OFFSET_VALUES;
  const int offsets = K / CV;
  constexpr int NB = kGemmStrip;
  const int subs = K / SB;
  const int64_t mp = x.rows;
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q) + m0;
  const float* sums = (CV == 16 ? x.sum16 : x.sum32) + m0;
  if (t0 == 0)
    for (int v = 0; v < MV; ++v)
      for (int r = 0; r < NB; ++r) _mm256_storeu_ps(part + r * ld + v * kGemmLanes, _mm256_setzero_ps());
  for (int t = t0; t < t1; ++t) {
    __m256i dots[MV][NB];
    for (int v = 0; v < MV; ++v)
      for (int r = 0; r < NB; ++r) dots[v][r] = _mm256_setzero_si256();
    const int32_t* xt = xq + static_cast<int64_t>(t) * (SB / 2) * mp;
    const T* wt = codes + t * SB;
#pragma GCC unroll 2
    for (int i = 0; i < SB / 2; ++i) {  // a lane word (two codes) at a time
      __m256i xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + i * mp + v * kGemmLanes));
      for (int r = 0; r < NB; ++r) {
        const __m256i w = _mm256_set1_epi32(word_at(wt + static_cast<int64_t>(r) * K + 2 * i));
        for (int v = 0; v < MV; ++v) dots[v][r] = _mm256_add_epi32(dots[v][r], _mm256_madd_epi16(w, xv[v]));
      }
    }
    // The float sums live in `part` (16 registers hold the integer ones): a load and a store each
    // per 32 values.
    const float* dx = x.d + (t * SB / 32) * mp + m0;
    for (int v = 0; v < MV; ++v) {
      const __m256 d = _mm256_loadu_ps(dx + v * kGemmLanes);
      for (int r = 0; r < NB; ++r) {
        float* at = part + r * ld + v * kGemmLanes;
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(s[r * subs + t]));
        __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[v][r]), ds, _mm256_loadu_ps(at));
        if constexpr (L::OFFSETS) {
          for (int o = t * SB / CV; o < (t + 1) * SB / CV; ++o)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(sums + o * mp + v * kGemmLanes), _mm256_set1_ps(c[r * offsets + o]), acc);
        }
        _mm256_storeu_ps(at, acc);
      }
    }
  }
}
#endif

// Weight rows n0..n1 of GGUF blocks of TYPE, kGemmGroup rows at a time: decoded (the last strip
// padded with zero rows), then, a slice of kGemmSliceK values at a time, each tile of activation rows
// meets the group's strips in turn, so that the tile's activations are read from memory once for 16
// weight rows and stay in L2 with the group's codes; the sums wait in `part` between slices.
template <int TYPE, class T>
void gemm_blocks(const GemmArgs& a, int n0, int n1, float* scratch) {
  using L = GemmLayout<TYPE, T>;
  constexpr int SB = L::SUB, NB = kGemmStrip;
  const int K = a.K, subs = K / SB, offsets = K / L::OFFSET_VALUES;
  const int64_t mp = a.x.rows, row_bytes = static_cast<int64_t>(K) / block_values(TYPE) * block_bytes(TYPE);
  float* part = scratch;  // (kGemmGroup, mp)
  float* s = part + kGemmGroup * mp;
  float* c = s + kGemmGroup * (K / 16);
  T* codes = reinterpret_cast<T*>(c + kGemmGroup * (K / 16));
  for (int n = n0; n < n1; n += kGemmGroup) {
    const int rows = n1 - n < kGemmGroup ? n1 - n : kGemmGroup;
    const int strips = (rows + NB - 1) / NB;
    for (int r = 0; r < strips * NB; ++r) {
      const uint8_t* weights = a.codes + static_cast<int64_t>(n + r) * a.ld_bytes;
      // The next group's row r, a group (16 rows' decode and tiles) ahead: from memory, a decode batch's
      // few tiles are too short for the hardware's prefetchers to keep a read in flight.
      if (n + kGemmGroup + r < n1) {
        for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(weights + kGemmGroup * a.ld_bytes + line, 0, 3);
      }
      T* row_codes = codes + static_cast<int64_t>(r) * K;
      if (r >= rows) {
        __builtin_memset(row_codes, 0, sizeof(T) * K);
        for (int t = 0; t < subs; ++t) s[r * subs + t] = 0.0f;
        for (int o = 0; o < offsets; ++o) c[r * offsets + o] = 0.0f;
      } else if constexpr (L::kWide) {
        gemm_row_wide<TYPE>(weights, K, row_codes, s + r * subs, c + r * offsets);
      } else {
#if defined(__AVX512VNNI__)
        gemm_row<TYPE>(weights, K, row_codes, s + r * subs, c + r * offsets);
#endif
      }
    }
    for (int t0 = 0; t0 < subs; t0 += kGemmSliceK / SB) {
      const int t1 = t0 + kGemmSliceK / SB < subs ? t0 + kGemmSliceK / SB : subs;
      for (int m0 = 0; m0 < a.M;) {
        // The rows left, rounded up to the vectors' 8 (AVX2) or 16 (VNNI) lanes: up to kGemmMaxMV vectors
        // a tile; VNNI's last 8 rows or fewer take 256-bit vectors of 8 lanes.
        const int left = (a.M - m0 + kGemmLanes - 1) / kGemmLanes * kGemmLanes;
        const int mv = left >= 3 * kGemmLanes && kGemmMaxMV >= 3 ? 3 : left >= 2 * kGemmLanes ? 2 : 1;
        const bool half = kGemmLanes == 16 && a.M - m0 <= 8;
        for (int strip = 0; strip < strips; ++strip) {
          const int r0 = strip * NB;
          const T* strip_codes = codes + static_cast<int64_t>(r0) * K;
          float* at = part + r0 * mp + m0;
          const float* strip_s = s + r0 * subs;
          const float* strip_c = c + r0 * offsets;
#if defined(__AVX512VNNI__)
          if constexpr (sizeof(T) == 2) {
            if (a.x.pairs) {
              gemm_tile<TYPE, T, 1, 16, true>(a.x, K, strip_codes, strip_s, strip_c, 0, t0, t1, at, mp);
              continue;
            }
          }
          if (half) {
            gemm_tile<TYPE, T, 1, 8>(a.x, K, strip_codes, strip_s, strip_c, m0, t0, t1, at, mp);
            continue;
          }
          if (mv == 3) {
            gemm_tile<TYPE, T, 3>(a.x, K, strip_codes, strip_s, strip_c, m0, t0, t1, at, mp);
            continue;
          }
#endif
          if (mv == 2) {
            gemm_tile<TYPE, T, 2>(a.x, K, strip_codes, strip_s, strip_c, m0, t0, t1, at, mp);
          } else {
            gemm_tile<TYPE, T, 1>(a.x, K, strip_codes, strip_s, strip_c, m0, t0, t1, at, mp);
          }
        }
        m0 += a.x.pairs ? a.M : half ? 8 : mv * kGemmLanes;
      }
    }
    for (int m = 0; m < a.M; ++m) {
      float* y = a.y + static_cast<int64_t>(m) * a.ldy + n;
      for (int r = 0; r < rows; ++r) {
        const float* at = part + r * mp;
        y[r] = at[a.x.pairs ? 2 * m : m] + (a.bias != nullptr ? a.bias[n + r] : 0.0f);
      }
    }
  }
}

template <class T>
void gemm_as(const GemmArgs& a, int n0, int n1, float* scratch) {
  switch (a.type) {
    case kQ2K: return gemm_blocks<kQ2K, T>(a, n0, n1, scratch);
    case kQ3K: return gemm_blocks<kQ3K, T>(a, n0, n1, scratch);
    case kIQ4XS: return gemm_blocks<kIQ4XS, T>(a, n0, n1, scratch);
    case kIQ4NL: return gemm_blocks<kIQ4NL, T>(a, n0, n1, scratch);
    case kIQ4NLRuns: return gemm_blocks<kIQ4NLRuns, T>(a, n0, n1, scratch);
    case kQ4K: return gemm_blocks<kQ4K, T>(a, n0, n1, scratch);
    case kQ5K: return gemm_blocks<kQ5K, T>(a, n0, n1, scratch);
    case kQ6K: return gemm_blocks<kQ6K, T>(a, n0, n1, scratch);
    case kQ4_0: return gemm_blocks<kQ4_0, T>(a, n0, n1, scratch);
    case kQ4_1: return gemm_blocks<kQ4_1, T>(a, n0, n1, scratch);
    case kQ5_0: return gemm_blocks<kQ5_0, T>(a, n0, n1, scratch);
    case kQ5_1: return gemm_blocks<kQ5_1, T>(a, n0, n1, scratch);
    case kQ8_0: return gemm_blocks<kQ8_0, T>(a, n0, n1, scratch);
    case kQ4_0Runs: return gemm_blocks<kQ4_0Runs, T>(a, n0, n1, scratch);
    case kQ4_1Runs: return gemm_blocks<kQ4_1Runs, T>(a, n0, n1, scratch);
    case kQ5_0Runs: return gemm_blocks<kQ5_0Runs, T>(a, n0, n1, scratch);
    case kQ5_1Runs: return gemm_blocks<kQ5_1Runs, T>(a, n0, n1, scratch);
    case kQ8_0Runs: return gemm_blocks<kQ8_0Runs, T>(a, n0, n1, scratch);
    default: break;
  }
}

void gemm(const GemmArgs& a, int n0, int n1, float* scratch) {
#if defined(__AVX512VNNI__)
  if (a.x.width == 16) return gemm_as<int16_t>(a, n0, n1, scratch);
  gemm_as<uint8_t>(a, n0, n1, scratch);
#else
  gemm_as<int16_t>(a, n0, n1, scratch);  // QdotKernels::gemm_bytes false: always 16-bit codes
#endif
}

// gemm_quantize's outputs, writable (GemmActivations hands them to the GEMM as const).
struct GemmOut {
  int32_t* q;  // lane words of two 16-bit (or four 8-bit) codes
  float *d, *sum16, *sum32;
  int64_t mp;  // the row stride
};

inline GemmOut gemm_out(const GemmActivations& out) {
  return GemmOut{reinterpret_cast<int32_t*>(const_cast<void*>(out.q)), const_cast<float*>(out.d),
                 const_cast<float*>(out.sum16), const_cast<float*>(out.sum32), out.rows};
}

#if defined(__AVX512VNNI__)

// r[c] = column c of the 16 x 16 matrix of 32-bit lanes whose rows were r[0..15]: 128-bit lanes of
// 4 x 4 blocks transposed (two unpack stages), then the blocks moved into place.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + e]: rows i..i+3 of column 4j + e in 128-bit lane j
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i p0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), p1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i q0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), q1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(p0, q0, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(p0, q0, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(p1, q1, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(p1, q1, 0xDD);
  }
}

// The codes of 32 values v as int32 lanes (values 0-15, 16-31), scale max|v| / top, codes round(v /
// scale) to nearest even; and the sums of the first and second 16 codes.
inline void gemm_block_codes(const float* v, float top, __m512i& i0, __m512i& i1, float& scale, float& low,
                             float& high) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, magnitude), _mm512_and_ps(v1, magnitude)));
  scale = most / top;
  const __m512 inverse = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  const __m512 hi = _mm512_set1_ps(top), lo = _mm512_set1_ps(-top);
  i0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, inverse), lo), hi));
  i1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, inverse), lo), hi));
  low = static_cast<float>(_mm512_reduce_add_epi32(i0));
  high = static_cast<float>(_mm512_reduce_add_epi32(i1));
}

// Up to 8 rows of x in GemmActivations::pairs' layout: row m's codes of values 4k..4k+3 (one 64-bit
// element) at lanes 2m, 2m + 1 of vector k; its block scale and sums in both lanes.
void gemm_quantize_pairs(const float* x, int64_t ldx, int M, int K, const GemmOut& o, float top) {
  for (int m = 0; m < 8; ++m) {
    for (int b = 0; b < K / 32; ++b) {
      alignas(64) int16_t codes[32] = {};
      float scale = 0.0f, low = 0.0f, high = 0.0f;
      if (m < M) {
        __m512i i0, i1;
        gemm_block_codes(x + m * ldx + 32 * b, top, i0, i1, scale, low, high);
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes), _mm512_cvtepi32_epi16(i0));
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 16), _mm512_cvtepi32_epi16(i1));
      }
      for (int j = 0; j < 8; ++j) __builtin_memcpy(o.q + (8 * b + j) * o.mp + 2 * m, codes + 4 * j, 8);
      for (int lane = 2 * m; lane < 2 * m + 2; ++lane) {
        o.d[b * o.mp + lane] = scale;
        o.sum16[2 * b * o.mp + lane] = scale * low;
        o.sum16[(2 * b + 1) * o.mp + lane] = scale * high;
        o.sum32[b * o.mp + lane] = scale * (low + high);
      }
    }
  }
}

// Rows m0..m1 (a multiple of 16 apart) of x as gemm_quantize's layout, 16 rows at a time: each
// block's 16 rows of codes, a vector a row, transposed into the 16 (8-bit: 8) vectors of 16 rows'
// lanes; rows from M on are zero.
void gemm_quantize(const float* x, int64_t ldx, int M, int m0, int m1, int K, const GemmActivations& out) {
  const GemmOut o = gemm_out(out);
  if (out.pairs) return gemm_quantize_pairs(x, ldx, M, K, o, static_cast<float>(out.top));
  const int words = out.width == 16 ? 16 : 8;  // lanes of 32 bits a block of 32 codes fills
  const float top = static_cast<float>(out.top);
  for (int g = m0; g < m1; g += kGemmLanes) {
    for (int b = 0; b < K / 32; ++b) {
      alignas(64) float scale[kGemmLanes], low[kGemmLanes], high[kGemmLanes];
      __m512i rows[kGemmLanes];
      for (int i = 0; i < kGemmLanes; ++i) {
        const int m = g + i;
        scale[i] = low[i] = high[i] = 0.0f;
        rows[i] = _mm512_setzero_si512();
        if (m >= M) continue;
        __m512i i0, i1;
        gemm_block_codes(x + m * ldx + 32 * b, top, i0, i1, scale[i], low[i], high[i]);
        if (words == 16) {
          rows[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(i0)), _mm512_cvtepi32_epi16(i1), 1);
        } else {
          rows[i] = _mm512_castsi256_si512(
              _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(i0)), _mm512_cvtepi32_epi8(i1), 1));
        }
      }
      transpose16(rows);
      for (int c = 0; c < words; ++c) _mm512_storeu_si512(o.q + (words * b + c) * o.mp + g, rows[c]);
      const __m512 sv = _mm512_load_ps(scale), lv = _mm512_load_ps(low), hv = _mm512_load_ps(high);
      _mm512_storeu_ps(o.d + b * o.mp + g, sv);
      _mm512_storeu_ps(o.sum16 + 2 * b * o.mp + g, _mm512_mul_ps(sv, lv));
      _mm512_storeu_ps(o.sum16 + (2 * b + 1) * o.mp + g, _mm512_mul_ps(sv, hv));
      _mm512_storeu_ps(o.sum32 + b * o.mp + g, _mm512_mul_ps(sv, _mm512_add_ps(lv, hv)));
    }
  }
}
#else
inline int32_t gemm_hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Rows m0..m1 of x as gemm_quantize's layout, a row at a time: each block's codes as the few-row
// path makes them (quantize_block, natural order: the AVX-512 build's rounding too), each lane
// word of two codes stored into its row's place in the word's column; rows from M on are zero.
void gemm_quantize(const float* x, int64_t ldx, int M, int m0, int m1, int K, const GemmActivations& out) {
  const GemmOut o = gemm_out(out);
  for (int m = m0; m < m1; ++m) {
    for (int b = 0; b < K / 32; ++b) {
      alignas(32) int16_t codes[32] = {};
      float scale = 0.0f, total = 0.0f, low = 0.0f, high = 0.0f;
      if (m < M) {
        int sum = 0;
        quantize_block(x + m * ldx + 32 * b, 8, static_cast<float>(out.top), codes, scale, total, sum);
        const __m256i first = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes));
        low = static_cast<float>(gemm_hsum(_mm256_madd_epi16(first, _mm256_set1_epi16(1))));
        high = static_cast<float>(sum) - low;
      }
      for (int w = 0; w < 16; ++w) o.q[(16 * b + w) * o.mp + m] = word_at(codes + 2 * w);
      o.d[b * o.mp + m] = scale;
      o.sum16[2 * b * o.mp + m] = scale * low;
      o.sum16[(2 * b + 1) * o.mp + m] = scale * high;
      o.sum32[b * o.mp + m] = scale * (low + high);
    }
  }
}
#endif  // __AVX512VNNI__

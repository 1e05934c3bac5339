// Expanding one block of 32 affine codes (4 * bits bytes of MLX's little-endian bit stream)
// into a vector of 32 bytes, for the qdot kernels and the float decode of linear_impl.h.
// Included inside each instruction set's anonymous namespace, after <immintrin.h>, in AVX2
// builds only. The bytes come out in an order that depends on the width:
//   8 bits: natural;  4 bits: the even values then the odd ones (low nibbles, then high);
//   2, 3, 5, 6 bits: values 0-7, 16-23, 8-15, 24-31 (two 16-bit lanes of codes packed to bytes).

struct Decoder {
  __m256i shuffle_lo, shuffle_hi, multiply, mask;
};

// Per width: bytes of the block feed the 16-bit lane of each value; its code
// sits at bit `shift` of that lane and is moved to bit 8 by a multiply by 2^(8 - shift).
template <int BITS>
Decoder make_decoder() {
  constexpr int kSource = BITS <= 3 ? 8 : 16;  // bytes per source load
  constexpr int kBytes = 4 * BITS;
  alignas(32) int8_t lo[32], hi[32];
  alignas(32) int16_t mul[16];
  for (int half = 0; half < 2; ++half) {
    int8_t* table = half == 0 ? lo : hi;
    const int source = half == 0 ? 0 : kBytes - kSource;
    for (int lane = 0; lane < 2; ++lane) {
      for (int i = 0; i < 8; ++i) {
        int value = half * 16 + lane * 8 + i;
        int bit = value * BITS;
        int byte = bit / 8 - source;
        int shift = bit % 8;
        table[lane * 16 + 2 * i] = static_cast<int8_t>(byte);
        table[lane * 16 + 2 * i + 1] = static_cast<int8_t>(shift + BITS > 8 ? byte + 1 : -128);
        mul[lane * 8 + i] = static_cast<int16_t>(1 << (8 - shift));
      }
    }
  }
  Decoder dec;
  dec.shuffle_lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
  dec.shuffle_hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
  dec.multiply = _mm256_load_si256(reinterpret_cast<const __m256i*>(mul));
  dec.mask = _mm256_set1_epi8(static_cast<char>((1 << BITS) - 1));
  return dec;
}

inline __m256i source(const uint8_t* p, int bytes) {
  if (bytes == 8) return _mm256_set1_epi64x(*reinterpret_cast<const long long*>(p));
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Values 0-15 (a) and 16-31 (b) of a 2/3/5/6-bit block, each in the low byte of its 16-bit lane
// with the next value's low bits above it (masked by the caller).
template <int BITS>
inline void shifted_lanes(const uint8_t* p, const Decoder& dec, __m256i& a, __m256i& b) {
  constexpr int kSource = BITS <= 3 ? 8 : 16;
  a = _mm256_shuffle_epi8(source(p, kSource), dec.shuffle_lo);
  b = _mm256_shuffle_epi8(source(p + 4 * BITS - kSource, kSource), dec.shuffle_hi);
  a = _mm256_srli_epi16(_mm256_mullo_epi16(a, dec.multiply), 8);
  b = _mm256_srli_epi16(_mm256_mullo_epi16(b, dec.multiply), 8);
}

// The 32 codes of the block at p, in the width's lane order.
template <int BITS, int OFFSET>
inline __m256i decode(const uint8_t* p, const Decoder& dec) {
  if constexpr (BITS == 8) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return OFFSET == 0 ? v : _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (BITS == 4) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
  } else {
    __m256i a, b;
    shifted_lanes<BITS>(p, dec, a, b);
    return _mm256_and_si256(_mm256_packus_epi16(a, b), dec.mask);
  }
}


// The same 32 codes as two vectors of 16-bit integers in natural order (values 0-15, then 16-31),
// for 2, 3, 5 and 6 bits: the decoder's 16-bit lanes before they are packed to bytes.
template <int BITS>
inline void decode_wide(const uint8_t* p, const Decoder& dec, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi16((1 << BITS) - 1);
  shifted_lanes<BITS>(p, dec, lo, hi);
  lo = _mm256_and_si256(lo, mask);
  hi = _mm256_and_si256(hi, mask);
}

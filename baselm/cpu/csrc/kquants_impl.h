// GGUF super-blocks (kernels.h's kQ2K, kQ3K, kQ4K, kQ5K, kQ6K, kIQ4XS) block by block, for the
// integer and float kernels. Included inside each instruction set's anonymous namespace, after
// scales_impl.h.
//
// A super-block of 256 values is 8 blocks of 32, and each block comes out as 32 integer codes
// in natural order and one affine pair (s, c), value = s * code + c:
//   Q4_K, Q5_K: code q (4 or 5 bits), s = d * sc_j, c = -dmin * m_j, with sc_j and m_j the 6-bit
//     scale and minimum of block j (llama.cpp: d1 * q - m1, d1 = d * sc, m1 = dmin * m);
//   Q6_K: code (q - 32) * sc, the 8-bit scale of each 16-value half folded in (|code| <= 4096), s = d,
//     c = 0 (llama.cpp: d * sc * (q - 32));
//   Q3_K: code (sc - 32) * (q - 4), the 6-bit scale of each half folded in (|code| <= 128), s = d,
//     c = 0 (llama.cpp: d * (sc - 32) * (q - 4), q the 3-bit code);
//   IQ4_XS: code kIQ4Values[q] (q 4-bit), s = d * (ls_j - 32), c = 0, ls_j block j's 6-bit scale;
//   Q2_K: code sc * q, the 4-bit scale of each half folded in (code <= 45), s = d, c = 0, and an
//     offset per half, -dmin * m (q2k_half_offsets) with m its 4-bit minimum (llama.cpp: d * sc * q -
//     dmin * m per 16 values, two minimums a block of 32).
// d and dmin are float16, so d * sc and dmin * m are exact in float32 (at most 17 significant bits),
// and so is s * code (IQ4_XS: 11 + 6 + 7 bits): each value is one rounding of the block's own
// formula, as in llama.cpp (for Q6_K, llama.cpp's d * sc * q can round twice; this form is the
// exact value).

// The 8 six-bit scales and minimums of a Q4_K/Q5_K super-block's 12 packed bytes q, one a byte
// (block j in byte j). Blocks 0-3: the low 6 bits of q[j] (scale) and q[j + 4] (minimum); blocks
// 4-7: the low and high nibbles of q[j + 4] with the top 2 bits of q[j - 4] and q[j] above them.
inline void kquant_scales_mins(const uint8_t* q, uint64_t& scales, uint64_t& mins) {
  // Three words loaded one by one, not as an array: an array went through the stack.
  uint32_t u0, u1, u2;
  __builtin_memcpy(&u0, q, 4);
  __builtin_memcpy(&u1, q + 4, 4);
  __builtin_memcpy(&u2, q + 8, 4);
  constexpr uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  const uint32_t high_scales = (u2 & four) | (((u0 >> 6) & two) << 4);
  const uint32_t high_mins = ((u2 >> 4) & four) | (((u1 >> 6) & two) << 4);
  scales = (u0 & six) | static_cast<uint64_t>(high_scales) << 32;
  mins = (u1 & six) | static_cast<uint64_t>(high_mins) << 32;
}

// A block's float16 field at p (block fields sit on even offsets of 2-byte aligned rows).
inline float half_at(const uint8_t* p) { return scale_at(p, kScaleF16, 0); }

// Where a super-block type's float16 d is.
constexpr int kquant_d_at(int type) { return type == kQ6K ? 208 : type == kQ3K ? 108 : type == kQ2K ? 80 : 0; }

// Q3_K's 16 six-bit scales (one per 16 values) less 32, from its 12 packed bytes q: scale i's low
// 4 bits are the low (i < 8) or high nibble of q[i % 8], its top 2 bits bits 2 (i / 4) of q[8 + i % 4].
inline int q3k_scale(const uint8_t* q, int i) {
  return (((q[i % 8] >> (4 * (i / 8))) & 15) | (((q[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
}

// IQ4_XS block j's 6-bit scale: the nibble j % 2 of scales_l[j / 2] (4 bytes at 4), bits 2j, 2j + 1 of
// the little-endian scales_h (2 bytes at 2) above it.
inline int iq4xs_scale(const uint8_t* sb, int j) {
  const int high = ((sb[2] | sb[3] << 8) >> (2 * j)) & 3;
  return ((sb[4 + j / 2] >> (4 * (j % 2))) & 15) | high << 4;
}

// The 8 blocks' (s, c) of super-block sb.
template <int TYPE>
inline void kquant_affine(const uint8_t* sb, float* s, float* c) {
  if constexpr (TYPE == kQ6K || TYPE == kQ3K || TYPE == kQ2K) {
    const float d = half_at(sb + kquant_d_at(TYPE));
    for (int j = 0; j < 8; ++j) s[j] = d, c[j] = 0.0f;
  } else if constexpr (TYPE == kIQ4XS) {
    const float d = half_at(sb);
    for (int j = 0; j < 8; ++j) s[j] = d * static_cast<float>(iq4xs_scale(sb, j) - 32), c[j] = 0.0f;
  } else {
    const float d = half_at(sb), dmin = half_at(sb + 2);
    uint64_t scales, mins;
    kquant_scales_mins(sb + 4, scales, mins);
    for (int j = 0; j < 8; ++j) {
      s[j] = d * static_cast<float>((scales >> (8 * j)) & 63);
      c[j] = -(dmin * static_cast<float>((mins >> (8 * j)) & 63));
    }
  }
}

// Block j's 32 codes. Q4_K: qs (128 bytes at 16), each 32 bytes holding blocks 2i (low nibbles)
// and 2i + 1 (high); Q5_K: the same at 48, bit j of qh[l] (32 bytes at 16) the fifth bit of value
// l; Q6_K: low 4 bits in ql (128 bytes at 0), high 2 in qh (64 at 128), per 128 values 4 blocks:
// ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high nibbles with qh's bits 0-1, 2-3, 4-5, 6-7.
// Q3_K: the low 2 bits of value l of block j in bits 2 (j % 4) of qs[32 (j / 4) + l] (64 bytes at 32),
// the third in bit j of hmask[l] (32 bytes at 0); Q2_K: its 2 bits in bits 2 (j % 4) of qs[32 (j / 4) +
// l] (64 bytes at 16), the half's scale and minimum the low and high nibbles of scales[2j + half]
// (16 bytes at 0); IQ4_XS: block j's 16 bytes at 8 + 16j, nibbles as Q4_0's.
template <int TYPE>
inline void kquant_codes(const uint8_t* sb, int j, int16_t* out) {
  if constexpr (TYPE == kQ3K || TYPE == kQ2K) {
    const uint8_t* qs = sb + (TYPE == kQ3K ? 32 : 16) + 32 * (j / 4);
    const int shift = 2 * (j % 4);
    for (int half = 0; half < 2; ++half) {
      const int scale = TYPE == kQ3K ? q3k_scale(sb + 96, 2 * j + half) : sb[2 * j + half] & 15;
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        const int q = (qs[l] >> shift) & 3;
        out[l] = static_cast<int16_t>(TYPE == kQ3K ? (q + (((sb[l] >> j) & 1) << 2) - 4) * scale : q * scale);
      }
    }
  } else if constexpr (TYPE == kIQ4XS) {
    const uint8_t* qs = sb + 8 + 16 * j;
    for (int l = 0; l < 16; ++l) {
      out[l] = kIQ4Values[qs[l] & 15];
      out[l + 16] = kIQ4Values[qs[l] >> 4];
    }
  } else if constexpr (TYPE == kQ6K) {
    const uint8_t* ql = sb + 64 * (j / 4) + 32 * (j & 1);
    const uint8_t* qh = sb + 128 + 32 * (j / 4);
    const int low_shift = j & 2 ? 4 : 0, high_shift = 2 * (j % 4);
    const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192) + 2 * j;
    for (int half = 0; half < 2; ++half) {
      const int scale = sc[half];
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        const int q = ((ql[l] >> low_shift) & 15) | (((qh[l] >> high_shift) & 3) << 4);
        out[l] = static_cast<int16_t>((q - 32) * scale);
      }
    }
  } else {
    const uint8_t* qs = sb + (TYPE == kQ4K ? 16 : 48) + 32 * (j / 2);
    const int shift = j & 1 ? 4 : 0;
    for (int l = 0; l < 32; ++l) {
      int q = (qs[l] >> shift) & 15;
      if constexpr (TYPE == kQ5K) q |= ((sb[16 + l] >> j) & 1) << 4;
      out[l] = static_cast<int16_t>(q);
    }
  }
}

// Whether blocks of TYPE have offsets per 16 values besides (s, c): value = s * code + c16[l / 16]
// (Q2_K's minimums, two a block of 32, which meet the activations' sums over their 16 values).
constexpr bool has_half_offsets(int type) { return type == kQ2K; }

// A Q2_K super-block's 16 offsets, -dmin * m for each 16 values, m the high nibble of scales[h] and
// dmin the float16 at 82 (exact in float32: 11 + 4 significant bits).
inline void q2k_half_offsets(const uint8_t* sb, float* out) {
  const float dmin = half_at(sb + 82);
  for (int h = 0; h < 16; ++h) out[h] = -(dmin * static_cast<float>(sb[h] >> 4));
}

// GGUF K-quant super-blocks (kernels.h's kQ4K, kQ5K, kQ6K) block by block, for the integer and float
// kernels. Included inside each instruction set's anonymous namespace, after scales_impl.h.
//
// A super-block of 256 values is 8 blocks of 32, and each block comes out as 32 integer codes
// in natural order and one affine pair (s, c), value = s * code + c:
//   Q4_K, Q5_K: code q (4 or 5 bits), s = d * sc_j, c = -dmin * m_j, with sc_j and m_j the 6-bit
//     scale and minimum of block j (llama.cpp: d1 * q - m1, d1 = d * sc, m1 = dmin * m);
//   Q6_K: code (q - 32) * sc, the 8-bit scale of each 16-value half folded in (|code| <= 4096), s = d,
//     c = 0 (llama.cpp: d * sc * (q - 32)).
// d and dmin are float16, so d * sc and dmin * m are exact in float32 (at most 17 significant bits),
// and so is s * code: each value is one rounding of the block's own formula, as in llama.cpp (for
// Q6_K, llama.cpp's d * sc * q can round twice; this form is the exact value).

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

// The 8 blocks' (s, c) of super-block sb.
template <int TYPE>
inline void kquant_affine(const uint8_t* sb, float* s, float* c) {
  if constexpr (TYPE == kQ6K) {
    const float d = half_at(sb + 208);
    for (int j = 0; j < 8; ++j) s[j] = d, c[j] = 0.0f;
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
template <int TYPE>
inline void kquant_codes(const uint8_t* sb, int j, int16_t* out) {
  if constexpr (TYPE == kQ6K) {
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

// Reading one affine group's scale or bias (float32, float16 or bfloat16), shared by the
// linear and qdot inner loops. Included inside each instruction set's anonymous namespace
// (after <cstdint>, kernels.h and, for F16C, <immintrin.h>), so every build keeps its own copy
// (see the NOTE in linear_impl.h).

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int shift = 0;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

inline float scale_at(const void* base, int type, int64_t i) {
  if (type == kScaleF32) return static_cast<const float*>(base)[i];
  uint16_t h = static_cast<const uint16_t*>(base)[i];
  if (type == kScaleF16) return half_to_float(h);
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}


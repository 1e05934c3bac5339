// The integer-activation inner loops (see qdot.h), compiled once per instruction set: qdot_<isa>.cpp
// defines BASE_ISA (the namespace) and BASE_ISA_NAME, then includes this file. The avx512 build
// has AVX-512 VNNI (dpbusd on 256-bit vectors, 32 registers); the avx2 build multiplies with
// maddubs; the generic build is plain C++.
//
// A weight block (32 codes, 4 * bits bytes of MLX's little-endian bit stream) is expanded into
// one vector of 32 unsigned bytes, in an order that depends on the width, and the activations
// are quantized into that same order once per call (a permutation inside each block leaves the
// block's integer sum as it is):
//   8 bits: natural;  4 bits: the even values then the odd ones (low nibbles, then high);
//   2, 3, 5, 6 bits: values 0-7, 16-23, 8-15, 24-31 (two 16-bit lanes of codes packed to bytes)
//   against 8-bit activations, natural against 16-bit ones (the two 16-bit lanes as they are).
// NOTE: as in linear_impl.h, nothing here may instantiate a std:: template.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels.h"
#include "qdot.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace base_cpu {
namespace BASE_ISA {
namespace {

#include "scales_impl.h"
#include "kquants_impl.h"
#include "legacy_blocks_impl.h"
#include "blocks_impl.h"

constexpr int B = kQBlock;

#if !defined(__AVX2__)
// Position p of a block holds value lane_value(bits, p) of the block (generic: natural order but
// for 4 bits; the AVX2 builds order each block as quantize_block writes it).
inline int lane_value(int bits, int p) { return bits == 4 ? (p < 16 ? 2 * p : 2 * (p - 16) + 1) : p; }
#endif

// Block scales, then the codes round(x / d) with d = max|x| / 127 (ties to even, as the
// reference in the tests does it), and the group sums of each row the products take.
#if defined(__AVX2__)
inline __m256 evens(__m256 a, __m256 b) {
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  return _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), order);
}
inline __m256 odds(__m256 a, __m256 b) {
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  return _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)), order);
}

// One block of 32 values: its codes in the lane order of `bits`, with (as the scalar loop below)
// scale = max|v| / kMax and codes round(v / scale) to nearest even (the default rounding mode).
template <class T>
inline void quantize_block(const float* v, int bits, float top, T* out, float& scale, float& total, int& codes) {
  __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8), a2 = _mm256_loadu_ps(v + 16),
         a3 = _mm256_loadu_ps(v + 24);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  __m256 t = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 ts = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  ts = _mm_add_ps(ts, _mm_movehl_ps(ts, ts));
  total = _mm_cvtss_f32(_mm_add_ss(ts, _mm_movehdup_ps(ts)));
  scale = _mm_cvtss_f32(h) / top;
  const __m256 inverse = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  __m256 p0 = a0, p1 = a1, p2 = a2, p3 = a3;
  if (bits == 4) {
    p0 = evens(a0, a1), p1 = evens(a2, a3), p2 = odds(a0, a1), p3 = odds(a2, a3);
  } else if (bits != 8 && sizeof(T) == 1) {
    p1 = a2, p2 = a1;  // values 0-7, 16-23, 8-15, 24-31 (16-bit codes keep the natural order)
  }
  const __m256 hi = _mm256_set1_ps(top), lo = _mm256_set1_ps(-top);
  __m256i i0 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(p0, inverse), lo), hi));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(p1, inverse), lo), hi));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(p2, inverse), lo), hi));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(p3, inverse), lo), hi));
  __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  codes = _mm_cvtsi128_si32(s4);
  __m256i w01 = _mm256_packs_epi32(i0, i1), w23 = _mm256_packs_epi32(i2, i3);  // lanes interleaved
  if constexpr (sizeof(T) == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(w01, 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm256_permute4x64_epi64(w23, 0xD8));
  } else {
    __m256i b = _mm256_packs_epi16(w01, w23);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b);
  }
}
#endif

template <class T>
void quantize_as(const float* x, int64_t ldx, int M, int K, int bits, int group_size, T* q, float* d, float* sum,
                 float* qsum) {
  constexpr float kMax = sizeof(T) == 1 ? 127.0f : 32767.0f;
  const int blocks = K / B, groups = K / group_size, per_group = group_size / B;
#if !defined(__AVX2__)
  int order[B];
  for (int p = 0; p < B; ++p) order[p] = lane_value(bits, p);
#endif
  for (int m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    for (int g = 0; g < groups; ++g) {
      float total = 0.0f, quantized = 0.0f;
      for (int j = 0; j < per_group; ++j) {
        const int b = g * per_group + j;
        const float* v = row + b * B;
        T* out = q + static_cast<int64_t>(m) * K + b * B;
#if defined(__AVX2__)
        float scale, block_total;
        int codes;
        quantize_block(v, bits, kMax, out, scale, block_total, codes);
        total += block_total;
#else
        float amax = 0.0f;
        for (int i = 0; i < B; ++i) {
          float a = std::fabs(v[i]);
          amax = a > amax ? a : amax;
          total += v[i];
        }
        float scale = amax / kMax;
        float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        int codes = 0;
        for (int p = 0; p < B; ++p) {
          float r = std::nearbyint(v[order[p]] * inverse);
          r = r > kMax ? kMax : (r < -kMax ? -kMax : r);
          out[p] = static_cast<T>(r);
          codes += out[p];
        }
#endif
        d[static_cast<int64_t>(m) * blocks + b] = scale;
        quantized += scale * static_cast<float>(codes);
      }
      sum[static_cast<int64_t>(m) * groups + g] = total;
      qsum[static_cast<int64_t>(m) * groups + g] = quantized;
    }
  }
}

void quantize(const float* x, int64_t ldx, int M, int K, int bits, int group_size, int width, void* q, float* d,
              float* sum, float* qsum) {
  if (width == 16) return quantize_as(x, ldx, M, K, bits, group_size, static_cast<int16_t*>(q), d, sum, qsum);
  quantize_as(x, ldx, M, K, bits, group_size, static_cast<int8_t*>(q), d, sum, qsum);
}

#if defined(__AVX2__)

// The value added to codes before the multiply: against 8-bit activations maddubs takes
// unsigned bytes times signed ones and saturates pairs at 16 bits, so 8-bit codes go in as
// signed (q - 128) with the sign moved onto the activations; dpbusd has no pair saturation, and
// 16-bit activations meet codes widened to 16 bits, so both take them as they are.
template <int BITS, class T>
constexpr int code_offset() {
#if defined(__AVX512VNNI__)
  return 0;
#else
  return BITS == 8 && sizeof(T) == 1 ? -128 : 0;
#endif
}

#include "codes_impl.h"

// A decoded weight block as the dot product takes it: 32 bytes against 8-bit activations, two
// vectors of 16-bit codes against 16-bit ones.
template <class T>
struct WeightBlock;
template <>
struct WeightBlock<int8_t> {
  __m256i v;
};
template <>
struct WeightBlock<int16_t> {
  __m256i lo, hi;
};

template <int BITS, class T>
inline WeightBlock<T> weight_block(const uint8_t* p, const Decoder& dec) {
  if constexpr (sizeof(T) == 2 && BITS == 4) {  // bytes widened to 16 bits hold two codes each
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return WeightBlock<int16_t>{_mm256_and_si256(v, _mm256_set1_epi16(0x0f)), _mm256_srli_epi16(v, 4)};
  } else if constexpr (sizeof(T) == 2 && BITS == 8) {
    return WeightBlock<int16_t>{_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  if constexpr (sizeof(T) == 2) {  // 2, 3, 5, 6 bits: the decoder's 16-bit lanes, unpacked
    WeightBlock<int16_t> w;
    decode_wide<BITS>(p, dec, w.lo, w.hi);
    return w;
  }
  __m256i v = decode<BITS, code_offset<BITS, T>()>(p, dec);
  if constexpr (sizeof(T) == 1) {
    return WeightBlock<int8_t>{v};
  } else {
    return WeightBlock<int16_t>{_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)),
                                _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1))};
  }
}

// Eight int32 partial sums of codes * activations over one block (x: its 32 codes).
template <int BITS>
inline __m256i block_dot(const WeightBlock<int8_t>& w, const int8_t* x) {
  __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w.v, xv);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 8) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w.v, w.v), _mm256_sign_epi8(xv, w.v)), ones);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.v, xv), ones);
  }
#endif
}

template <int BITS>
inline __m256i block_dot(const WeightBlock<int16_t>& w, const int16_t* x) {
  __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if defined(__AVX512VNNI__)
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w.lo, x0), w.hi, x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, x0), _mm256_madd_epi16(w.hi, x1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Every line of weight row n's scales and biases: two streams beside the codes', each a few lines
// a row (float32 groups of 32: K / 8 bytes), too short for the hardware's stream prefetchers.
inline void prefetch_row_scales(const QdotArgs& a, int n) {
  const int64_t scale_bytes = a.scale_type == kScaleF32 ? 4 : 2;
  const int64_t at = static_cast<int64_t>(n) * a.ld_scales * scale_bytes;
  for (int64_t line = 0; line < static_cast<int64_t>(a.K / a.group_size) * scale_bytes; line += 64) {
    __builtin_prefetch(static_cast<const char*>(a.scales) + at + line, 0, 3);
    __builtin_prefetch(static_cast<const char*>(a.biases) + at + line, 0, 3);
  }
}

// Eight of a weight row's group scales (or biases) from element i, as float32.
inline __m256 load8_scales(const void* base, int type, int64_t i) {
  if (type == kScaleF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  if (type == kScaleF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bfloat16
}

// The 8 blocks' values of a per-group array whose low 8 / PER lanes hold the groups (PER blocks a
// group: 1, 2 or 4), each repeated over its blocks; with `first_only`, the repeats are zero
// (for the terms taken once a group).
template <int PER>
inline __m256 per_block(__m256 groups, bool first_only) {
  if constexpr (PER == 1) {
    return groups;
  } else {
    const __m256i order = _mm256_setr_epi32(0, 1 / PER, 2 / PER, 3 / PER, 4 / PER, 5 / PER, 6 / PER, 7 / PER);
    __m256 v = _mm256_permutevar8x32_ps(groups, order);
    if (!first_only) return v;
    constexpr int kFirsts = PER == 2 ? 0x55 : 0x11;
    return _mm256_blend_ps(_mm256_setzero_ps(), v, kFirsts);
  }
}

// The 8 / PER group scales (or biases, or floats) from element i in the low lanes, the rest zero.
template <int PER>
inline __m256 load_groups(const void* base, int type, int64_t i) {
  if constexpr (PER == 1) {
    return load8_scales(base, type, i);
  } else if constexpr (PER == 2) {
    __m128 v;
    if (type == kScaleF32) {
      v = _mm_loadu_ps(static_cast<const float*>(base) + i);
    } else {
      __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      v = type == kScaleF16 ? _mm_cvtph_ps(h) : _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    }
    return _mm256_zextps128_ps256(v);
  } else {
    return _mm256_setr_ps(scale_at(base, type, i), scale_at(base, type, i + 1), 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// A weight row against MR activation rows from m0, in one pass: lanes[m] gets 8
// lanes whose sum is the product with row m0 + m (the layer's bias aside). Every 8 blocks, their
// 8 group scales and biases are read and widened in registers, the scales times each row's block
// scales feed the blocks' FMAs and the biases meet the rows' group sums of x (with an offset, the
// scales the quantized sums); each weight block is decoded once for the MR rows. No per-row or
// per-tile tables and no reduction here (the caller sums 8 weight rows' lanes at once): a small
// model's rows are short (SmolLM2: 18 blocks), and those fixed costs were most of a row. ACCS
// accumulators per row: 4 alone (so the FMA's latency does not chain block to block), 2 in a
// batch (MR x 2 of them beside a decoded block and an activation block fill AVX2's 16
// registers); every row of a batch sums in the same order, whatever MR its chunk has.
template <int BITS, class T, int MR, int ACCS, int PER>
inline void weight_row_lanes(const QdotArgs& a, int n, int m0, const Decoder& dec, __m256* lanes) {
  constexpr int offset = code_offset<BITS, T>();
  const int blocks = a.K / B;
  const uint8_t* row = a.codes + static_cast<int64_t>(n) * a.ld_bytes;
  const T* xq[MR];
  const float* d[MR];
  const float* sums[MR];
  const float* qsums[MR];
  const int groups = blocks / PER;
  const int64_t at = static_cast<int64_t>(n) * a.ld_scales;
  for (int m = 0; m < MR; ++m) {
    xq[m] = static_cast<const T*>(a.x.q) + static_cast<int64_t>(m0 + m) * a.K;
    d[m] = a.x.d + static_cast<int64_t>(m0 + m) * blocks;
    sums[m] = a.x.sum + static_cast<int64_t>(m0 + m) * groups;
    qsums[m] = a.x.qsum + static_cast<int64_t>(m0 + m) * groups;
  }
  // Every line of the row 2 KiB ahead: the loop is long enough (about 10 operations a block) that the
  // out-of-order window alone keeps few lines in flight (8 GB/s on one core from DRAM without it,
  // 14 with it, against 20 for a plain read).
  constexpr int64_t ahead = 2048;
  __m256 acc[MR][ACCS];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < ACCS; ++i) acc[m][i] = _mm256_setzero_ps();
  alignas(32) float sd[MR][8];
  auto add_block = [&](int b, const float* scale, int into) {
    WeightBlock<T> w = weight_block<BITS, T>(row + b * 4 * BITS, dec);
    for (int m = 0; m < MR; ++m) {
      __m256 prod = _mm256_cvtepi32_ps(block_dot<BITS>(w, xq[m] + b * B));
      acc[m][into] = _mm256_fmadd_ps(prod, _mm256_set1_ps(scale[m * 8]), acc[m][into]);
    }
  };
  int b = 0;
  for (; b + 8 <= blocks; b += 8) {
    for (int line = 0; line < 32 * BITS; line += 64) __builtin_prefetch(row + ahead + b * 4 * BITS + line, 0, 3);
    const int g = b / PER;
    const __m256 s_groups = load_groups<PER>(a.scales, a.scale_type, at + g);
    const __m256 s = per_block<PER>(s_groups, false);
    const __m256 c = per_block<PER>(load_groups<PER>(a.biases, a.scale_type, at + g), true);
    for (int m = 0; m < MR; ++m) {
      __m256 x_sums = per_block<PER>(load_groups<PER>(sums[m] + g, kScaleF32, 0), false);
      acc[m][ACCS - 1] = _mm256_fmadd_ps(c, x_sums, acc[m][ACCS - 1]);
      if constexpr (offset != 0) {
        __m256 x_qsums = per_block<PER>(load_groups<PER>(qsums[m] + g, kScaleF32, 0), false);
        acc[m][ACCS - 1] = _mm256_fmadd_ps(
            _mm256_mul_ps(per_block<PER>(s_groups, true), _mm256_set1_ps(static_cast<float>(-offset))), x_qsums,
            acc[m][ACCS - 1]);
      }
      _mm256_store_ps(sd[m], _mm256_mul_ps(s, _mm256_loadu_ps(d[m] + b)));
    }
    for (int j = 0; j < 8; ++j) add_block(b + j, &sd[0][j], j % ACCS);
  }
  float tail[MR] = {};  // the last blocks of a row whose blocks are not a multiple of 8
  for (; b < blocks; ++b) {
    const int g = b / PER;
    const float scale = scale_at(a.scales, a.scale_type, at + g), bias = scale_at(a.biases, a.scale_type, at + g);
    for (int m = 0; m < MR; ++m) {
      if (b % PER == 0) tail[m] += bias * sums[m][g] - static_cast<float>(offset) * scale * qsums[m][g];
      sd[m][0] = scale * d[m][b];
    }
    add_block(b, &sd[0][0], 0);
  }
  for (int m = 0; m < MR; ++m) {
    __m256 total = acc[m][0];
    for (int i = 1; i < ACCS; ++i) total = _mm256_add_ps(total, acc[m][i]);
    lanes[m * 8] = _mm256_add_ps(total, _mm256_setr_ps(tail[m], 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f));
  }
}

// The sums of 8 vectors' lanes, as one vector (lane i: the sum of v[i]).
inline __m256 sum_lanes_of_8(const __m256* v) {
  __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#include "qdot_blocks_impl.h"

// Activation rows m0..m0+MR against weight rows n0..n1: 8 weight rows at a time, their lanes
// summed together (lanes[m][r] of weight row n + r).
template <int BITS, class T, int MR, int ACCS, int PER>
void weight_rows(const QdotArgs& a, int n0, int n1, int m0, const Decoder& dec) {
  __m256 lanes[MR][8];
  auto y_at = [&](int m, int n) { return a.y + static_cast<int64_t>(m0 + m) * a.ldy + n; };
  int n = n0;
  for (; n + 8 <= n1; n += 8) {
    for (int r = 0; r < 8; ++r) {
      if constexpr (is_block(BITS)) {
        block_row_lanes<BITS, MR, ACCS>(a, n + r, m0, &lanes[0][r]);
      } else {
        prefetch_row_scales(a, n + r + 8);
        weight_row_lanes<BITS, T, MR, ACCS, PER>(a, n + r, m0, dec, &lanes[0][r]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      __m256 y = sum_lanes_of_8(lanes[m]);
      if (a.bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(a.bias + n));
      _mm256_storeu_ps(y_at(m, n), y);
    }
  }
  for (; n < n1; ++n) {
    if constexpr (is_block(BITS)) {
      block_row_lanes<BITS, MR, ACCS>(a, n, m0, &lanes[0][0]);
    } else {
      prefetch_row_scales(a, n + 8);
      weight_row_lanes<BITS, T, MR, ACCS, PER>(a, n, m0, dec, &lanes[0][0]);
    }
    for (int m = 0; m < MR; ++m) *y_at(m, n) = hsum(lanes[m][0]) + (a.bias != nullptr ? a.bias[n] : 0.0f);
  }
}

// Every activation row against weight rows n0..n1 in groups of 32 * PER: one row alone, or chunks
// of up to 4 rows over runs of 64 weight rows (a run stays in L1 or L2 while the chunks take it,
// so the weight is read from memory once).
template <int BITS, class T, int PER>
void activations_in_groups(const QdotArgs& a, int n0, int n1, const Decoder& dec) {
  if (a.M == 1) return weight_rows<BITS, T, 1, 4, PER>(a, n0, n1, 0, dec);
  constexpr int kRun = 64;
  for (int n = n0; n < n1; n += kRun) {
    const int end = n + kRun < n1 ? n + kRun : n1;
    for (int m0 = 0; m0 < a.M;) {
      const int left = a.M - m0;
      if (left >= 4) {
        weight_rows<BITS, T, 4, 2, PER>(a, n, end, m0, dec), m0 += 4;
      } else if (left == 3) {
        weight_rows<BITS, T, 3, 2, PER>(a, n, end, m0, dec), m0 += 3;
      } else if (left == 2) {
        weight_rows<BITS, T, 2, 2, PER>(a, n, end, m0, dec), m0 += 2;
      } else {
        weight_rows<BITS, T, 1, 2, PER>(a, n, end, m0, dec), m0 += 1;
      }
    }
  }
}

template <int BITS, class T>
void matmul_bits(const QdotArgs& a, int n0, int n1, float*) {
  static const Decoder dec = BITS == 4 || BITS == 8 ? Decoder{} : make_decoder<BITS>();  // built once
  // One activation row (decode) takes one weight row at a time: a single forward stream through
  // the weight, which the prefetchers keep fed (four interleaved rows read the LM head from DRAM
  // 20-30% slower); more take each weight row in chunks of up to 4 activation rows.
  if (a.group_size == B) return activations_in_groups<BITS, T, 1>(a, n0, n1, dec);
  if (a.group_size == 2 * B) return activations_in_groups<BITS, T, 2>(a, n0, n1, dec);
  return activations_in_groups<BITS, T, 4>(a, n0, n1, dec);  // qdot_supports: groups of 32, 64 or 128
}

// GGUF blocks (16-bit activations only): the same runs and chunks, 8 blocks of 32 values a run.
template <int TYPE>
void matmul_blocks(const QdotArgs& a, int n0, int n1, float*) {
  activations_in_groups<TYPE, int16_t, 1>(a, n0, n1, Decoder{});
}

#if defined(__AVX2__)
#include "qgemm_impl.h"
#endif

#else  // generic: plain C++ loops the compiler vectorizes (SSE2 on x86-64, NEON on ARM)

// The tile's weight rows' scales and biases per group, as float32 (rows x K / gs each).
void widen_rows(const QdotArgs& a, int n, int rows, float* s, float* c) {
  const int groups = a.K / a.group_size;
  for (int r = 0; r < rows; ++r) {
    const int64_t at = static_cast<int64_t>(n + r) * a.ld_scales;
    float* sr = s + r * groups;
    float* cr = c + r * groups;
    int g = 0;
    for (; g < groups; ++g) {
      sr[g] = scale_at(a.scales, a.scale_type, at + g);
      cr[g] = scale_at(a.biases, a.scale_type, at + g);
    }
  }
}

inline float dot_floats(const float* a, const float* b, int n) {
  float total = 0.0f;
  for (int i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

// What a weight row adds to an activation row besides the integer dots: its biases against the
// group sums, minus the code offset's share (the dot took the codes as q + offset, against the
// quantized values, so the same quantized sums take it back out), plus the layer's bias.
inline float row_terms(const QdotArgs& a, int n, int m, const float* s, const float* c, int offset) {
  const int groups = a.K / a.group_size;
  const int64_t at = static_cast<int64_t>(m) * groups;
  float total = dot_floats(c, a.x.sum + at, groups);
  if (offset != 0) total -= static_cast<float>(offset) * dot_floats(s, a.x.qsum + at, groups);
  return total + (a.bias != nullptr ? a.bias[n] : 0.0f);
}

// The 32 codes of the block at p (4 * BITS bytes of MLX's little-endian bit stream) as 16-bit
// integers, in the order quantize() gave the activations (natural; 4 bits: low nibbles, then high).
template <int BITS>
inline void unpack_block(const uint8_t* p, int16_t* out) {
  if constexpr (BITS == 8) {
    for (int i = 0; i < B; ++i) out[i] = p[i];
  } else if constexpr (BITS == 4) {
    for (int i = 0; i < B / 2; ++i) out[i] = static_cast<int16_t>(p[i] & 15);
    for (int i = 0; i < B / 2; ++i) out[B / 2 + i] = static_cast<int16_t>(p[i] >> 4);
  } else {  // 8 codes in every BITS bytes
    for (int c = 0; c < B / 8; ++c) {
      uint64_t v = 0;
      for (int j = 0; j < BITS; ++j) v |= static_cast<uint64_t>(p[c * BITS + j]) << (8 * j);
      for (int i = 0; i < 8; ++i) out[8 * c + i] = static_cast<int16_t>((v >> (BITS * i)) & ((1u << BITS) - 1));
    }
  }
}

template <class T>
inline int32_t block_dot(const int16_t* w, const T* x) {
  int32_t dot = 0;
  for (int i = 0; i < B; ++i) dot += static_cast<int32_t>(w[i]) * static_cast<int32_t>(x[i]);
  return dot;
}

// A GGUF block's dot: Q6_K's codes carry their scale (up to 4096), so 32 products against 16-bit
// activation codes can pass 2^31; each half of 16 stays within it (the SIMD paths' lanes hold 4).
inline int64_t wide_block_dot(const int16_t* w, const int16_t* x) {
  int32_t low = 0, high = 0;
  for (int i = 0; i < B / 2; ++i) low += static_cast<int32_t>(w[i]) * static_cast<int32_t>(x[i]);
  for (int i = B / 2; i < B; ++i) high += static_cast<int32_t>(w[i]) * static_cast<int32_t>(x[i]);
  return static_cast<int64_t>(low) + high;
}

constexpr int kUnpackBlocks = 32;  // blocks of a weight row unpacked at a time (2 KiB, in L1)
constexpr int kRowsAtOnce = 32;  // activation rows whose sums a weight row keeps at once

// One weight row at a time: a run of its blocks unpacked to 16 bits, then met by every
// activation row. Each row sums its blocks in one order, so a row's result is the same in any batch.
template <int BITS, class T>
void matmul_bits(const QdotArgs& a, int n0, int n1, float* scratch) {
  const int blocks = a.K / B, per_group = a.group_size / B;
  float* s = scratch;
  float* c = scratch + a.K / a.group_size;
  alignas(64) int16_t w[kUnpackBlocks * B];
  float total[kRowsAtOnce];
  for (int n = n0; n < n1; ++n) {
    widen_rows(a, n, 1, s, c);
    const uint8_t* row = a.codes + static_cast<int64_t>(n) * a.ld_bytes;
    for (int m0 = 0; m0 < a.M; m0 += kRowsAtOnce) {
      const int rows = a.M - m0 < kRowsAtOnce ? a.M - m0 : kRowsAtOnce;
      for (int m = 0; m < rows; ++m) total[m] = 0.0f;
      for (int b0 = 0; b0 < blocks; b0 += kUnpackBlocks) {
        const int count = blocks - b0 < kUnpackBlocks ? blocks - b0 : kUnpackBlocks;
        for (int j = 0; j < count; ++j) unpack_block<BITS>(row + (b0 + j) * 4 * BITS, w + j * B);
        for (int m = 0; m < rows; ++m) {
          const T* xq = static_cast<const T*>(a.x.q) + static_cast<int64_t>(m0 + m) * a.K + b0 * B;
          const float* xd = a.x.d + static_cast<int64_t>(m0 + m) * blocks + b0;
          float t = total[m];
          for (int j = 0; j < count; ++j)
            t += s[(b0 + j) / per_group] * xd[j] * static_cast<float>(block_dot(w + j * B, xq + j * B));
          total[m] = t;
        }
      }
      for (int m = 0; m < rows; ++m)
        a.y[static_cast<int64_t>(m0 + m) * a.ldy + n] = total[m] + row_terms(a, n, m0 + m, s, c, 0);
    }
  }
}

// GGUF blocks: as above, each block's (s, c) and codes from blocks_impl.h.
template <int TYPE>
void matmul_blocks(const QdotArgs& a, int n0, int n1, float* scratch) {
  const int blocks = a.K / B;
  float* s = scratch;
  float* c = scratch + blocks;
  float* c16 = scratch + 2 * blocks;  // Q2_K: the offsets per 16 values
  alignas(64) int16_t w[kUnpackBlocks * B];
  float total[kRowsAtOnce];
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = a.codes + static_cast<int64_t>(n) * a.ld_bytes;
    for (int b = 0; b < blocks; b += 8) {
      run_affine<TYPE>(row, b, blocks - b < 8 ? blocks - b : 8, blocks, s + b, c + b);
      if constexpr (has_half_offsets(TYPE)) q2k_half_offsets(row + b / 8 * block_bytes(TYPE), c16 + 2 * b);
    }
    for (int m0 = 0; m0 < a.M; m0 += kRowsAtOnce) {
      const int rows = a.M - m0 < kRowsAtOnce ? a.M - m0 : kRowsAtOnce;
      for (int m = 0; m < rows; ++m) total[m] = 0.0f;
      for (int b0 = 0; b0 < blocks; b0 += kUnpackBlocks) {
        const int count = blocks - b0 < kUnpackBlocks ? blocks - b0 : kUnpackBlocks;
        for (int j = 0; j < count; ++j) block_codes<TYPE>(row, b0 + j, blocks, w + j * B);
        for (int m = 0; m < rows; ++m) {
          const int16_t* xq = static_cast<const int16_t*>(a.x.q) + static_cast<int64_t>(m0 + m) * a.K + b0 * B;
          const float* xd = a.x.d + static_cast<int64_t>(m0 + m) * blocks + b0;
          float t = total[m];
          for (int j = 0; j < count; ++j)
            t += s[b0 + j] * xd[j] * static_cast<float>(wide_block_dot(w + j * B, xq + j * B));
          total[m] = t;
        }
      }
      if constexpr (has_half_offsets(TYPE)) {
        for (int m = 0; m < rows; ++m)
          total[m] += dot_floats(c16, a.x.half_sum + static_cast<int64_t>(m0 + m) * (a.K / 16), a.K / 16);
      }
      for (int m = 0; m < rows; ++m)
        a.y[static_cast<int64_t>(m0 + m) * a.ldy + n] = total[m] + row_terms(a, n, m0 + m, s, c, 0);
    }
  }
}

#endif

template <class T>
void matmul_as(const QdotArgs& a, int n0, int n1, float* scratch) {
  switch (a.bits) {
    case 2: return matmul_bits<2, T>(a, n0, n1, scratch);
    case 3: return matmul_bits<3, T>(a, n0, n1, scratch);
    case 4: return matmul_bits<4, T>(a, n0, n1, scratch);
    case 5: return matmul_bits<5, T>(a, n0, n1, scratch);
    case 6: return matmul_bits<6, T>(a, n0, n1, scratch);
    default: return matmul_bits<8, T>(a, n0, n1, scratch);
  }
}

void matmul(const QdotArgs& a, int n0, int n1, float* scratch) {
  switch (a.bits) {
    case kQ2K: return matmul_blocks<kQ2K>(a, n0, n1, scratch);
    case kQ3K: return matmul_blocks<kQ3K>(a, n0, n1, scratch);
    case kIQ4XS: return matmul_blocks<kIQ4XS>(a, n0, n1, scratch);
    case kIQ4NL: return matmul_blocks<kIQ4NL>(a, n0, n1, scratch);
    case kIQ4NLRuns: return matmul_blocks<kIQ4NLRuns>(a, n0, n1, scratch);
    case kQ4K: return matmul_blocks<kQ4K>(a, n0, n1, scratch);
    case kQ5K: return matmul_blocks<kQ5K>(a, n0, n1, scratch);
    case kQ6K: return matmul_blocks<kQ6K>(a, n0, n1, scratch);
    case kQ4_0: return matmul_blocks<kQ4_0>(a, n0, n1, scratch);
    case kQ4_1: return matmul_blocks<kQ4_1>(a, n0, n1, scratch);
    case kQ5_0: return matmul_blocks<kQ5_0>(a, n0, n1, scratch);
    case kQ5_1: return matmul_blocks<kQ5_1>(a, n0, n1, scratch);
    case kQ8_0: return matmul_blocks<kQ8_0>(a, n0, n1, scratch);
    case kQ4_0Runs: return matmul_blocks<kQ4_0Runs>(a, n0, n1, scratch);
    case kQ4_1Runs: return matmul_blocks<kQ4_1Runs>(a, n0, n1, scratch);
    case kQ5_0Runs: return matmul_blocks<kQ5_0Runs>(a, n0, n1, scratch);
    case kQ5_1Runs: return matmul_blocks<kQ5_1Runs>(a, n0, n1, scratch);
    case kQ8_0Runs: return matmul_blocks<kQ8_0Runs>(a, n0, n1, scratch);
    default: break;
  }
  if (a.x.width == 16) return matmul_as<int16_t>(a, n0, n1, scratch);
  matmul_as<int8_t>(a, n0, n1, scratch);
}

}  // namespace

const QdotKernels& qdot_kernels() {
#if defined(__AVX512VNNI__)
  static const QdotKernels kernels{BASE_ISA_NAME, &quantize, &matmul, &gemm_quantize, &gemm, true, 6};
#elif defined(__AVX2__)
  static const QdotKernels kernels{BASE_ISA_NAME, &quantize, &matmul, &gemm_quantize, &gemm, false, 16};
#else
  static const QdotKernels kernels{BASE_ISA_NAME, &quantize, &matmul, nullptr, nullptr, false, 0};
#endif
  return kernels;
}

}  // namespace BASE_ISA
}  // namespace base_cpu

// The linear kernels' inner loops, written once over GCC vector types and compiled once per
// instruction set: linear_<isa>.cpp defines BASE_ISA (the namespace), BASE_VEC_FLOATS (lanes)
// and BASE_MAX_MR (activation rows per register tile), then includes this file.
// NOTE: nothing here may instantiate a std:: template: an inline function compiled with AVX-512
// flags could be the copy the linker keeps for every caller.
#include <cstdint>

#include "kernels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace base_cpu {
namespace BASE_ISA {
namespace {

constexpr int V = BASE_VEC_FLOATS;
constexpr int NR = 4;  // weight rows per register tile
constexpr int MR = BASE_MAX_MR;  // activation rows per register tile
typedef float vf __attribute__((vector_size(V * sizeof(float))));

inline int min_int(int a, int b) { return a < b ? a : b; }

#include "scales_impl.h"
#include "kquants_impl.h"
#include "legacy_blocks_impl.h"
#include "blocks_impl.h"

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// Weight rows are read once, straight from DRAM: a row's loads ask for the bytes this far ahead
// (for rows stored back to back, the next rows' at the end of one), so the misses are in flight
// before the loop needs them, across the tile's hsums and stores where the loads pause.
constexpr int kPrefetchFloats = 512;
inline void prefetch(const float* p) { __builtin_prefetch(p, 0, 3); }

inline vf load_tail(const float* p, int n) {
  vf v = {};
  for (int i = 0; i < n; ++i) v[i] = p[i];
  return v;
}

// A tree of halvings, not a serial chain: the M=1 tile ends in NR of these per NR weight rows,
// which for short rows (K of a few hundred) costs as much as the loads.
inline float hsum(vf v) {
#if defined(__AVX512F__)
  if constexpr (V == 16) return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#endif
  float t[V];
  __builtin_memcpy(t, &v, sizeof t);
  for (int width = V / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) t[i] += t[i + width];
  return t[0];
}

// out[m][r] = x[m, :K] . w[r][:K] over an NRxMR tile, one pass over K.
// Inlined into block(): a call per tile costs the M=1 case a tenth of its bandwidth on short rows.
template <int R, int M>
__attribute__((always_inline)) inline void tile(const float* const* w, const float* x, int64_t ldx, int K,
                                                float (*out)[NR]) {
  vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vf{};
  int k = 0;
  for (; k + V <= K; k += V) {
    vf wv[R];
    for (int r = 0; r < R; ++r) {
      prefetch(w[r] + k + kPrefetchFloats);
      wv[r] = load(w[r] + k);
    }
    for (int m = 0; m < M; ++m) {
      vf xv = load(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  if (k < K) {
    int rest = K - k;
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_tail(w[r] + k, rest);
    for (int m = 0; m < M; ++m) {
      vf xv = load_tail(x + m * ldx + k, rest);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum(acc[m][r]);
}

template <int R>
inline void tile_rows(const float* const* w, const float* x, int64_t ldx, int mr, int K, float (*out)[NR]) {
  static_assert(MR <= 4, "tile_rows covers up to 4 activation rows");
  switch (mr) {
    case 1: tile<R, 1>(w, x, ldx, K, out); break;
    case 2: tile<R, (MR >= 2 ? 2 : 1)>(w, x, ldx, K, out); break;
    case 3: tile<R, (MR >= 3 ? 3 : 1)>(w, x, ldx, K, out); break;
    default: tile<R, MR>(w, x, ldx, K, out); break;
  }
}

// y[:, n : n + rows] for `rows` (<= NR) weight rows held at w[0..rows).
inline void block(const float* const* w, int rows, int n, const float* x, int64_t ldx, int M, int K,
                  const float* bias, float* y, int64_t ldy) {
  float out[MR][NR];
  for (int m = 0; m < M; m += MR) {
    int mr = min_int(MR, M - m);
    const float* xm = x + m * ldx;
    switch (rows) {
      case 1: tile_rows<1>(w, xm, ldx, mr, K, out); break;
      case 2: tile_rows<2>(w, xm, ldx, mr, K, out); break;
      case 3: tile_rows<3>(w, xm, ldx, mr, K, out); break;
      default: tile_rows<4>(w, xm, ldx, mr, K, out); break;
    }
    for (int i = 0; i < mr; ++i) {
      float* ym = y + (m + i) * ldy + n;
      for (int r = 0; r < rows; ++r) ym[r] = out[i][r] + (bias != nullptr ? bias[n + r] : 0.0f);
    }
  }
}

void dense_few(const DenseArgs& a, int n0, int n1) {
  for (int n = n0; n < n1; n += NR) {
    int rows = min_int(NR, n1 - n);
    const float* w[NR];
    for (int r = 0; r < NR; ++r) w[r] = a.w + (n + min_int(r, rows - 1)) * a.ldw;
    block(w, rows, n, a.x, a.ldx, a.M, a.K, a.bias, a.y, a.ldy);
  }
}

// dst[0..gs) = s * q + b for 4-bit codes (two per byte, low nibble first).
inline void decode4(const uint8_t* bytes, int gs, float s, float b, float* dst) {
  int i = 0;
#if defined(__AVX512BW__)
  __m512 vs = _mm512_set1_ps(s), vb = _mm512_set1_ps(b);
  const __m256i low = _mm256_set1_epi16(0x000f);
  for (; i + 32 <= gs; i += 32) {
    __m256i w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + i / 2)));
    __m256i pair = _mm256_or_si256(_mm256_and_si256(w16, low), _mm256_slli_epi16(_mm256_srli_epi16(w16, 4), 8));
    __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(pair)));
    __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(pair, 1)));
    _mm512_storeu_ps(dst + i, _mm512_fmadd_ps(f0, vs, vb));
    _mm512_storeu_ps(dst + i + 16, _mm512_fmadd_ps(f1, vs, vb));
  }
#elif defined(__AVX2__)
  __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
  const __m128i low = _mm_set1_epi16(0x000f);
  for (; i + 16 <= gs; i += 16) {
    __m128i w16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i / 2)));
    __m128i pair = _mm_or_si128(_mm_and_si128(w16, low), _mm_slli_epi16(_mm_srli_epi16(w16, 4), 8));
    __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(pair));
    __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(pair, 8)));
    _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(f0, vs, vb));
    _mm256_storeu_ps(dst + i + 8, _mm256_fmadd_ps(f1, vs, vb));
  }
#endif
  for (; i < gs; i += 2) {
    uint8_t byte = bytes[i / 2];
    dst[i] = s * static_cast<float>(byte & 0x0f) + b;
    dst[i + 1] = s * static_cast<float>(byte >> 4) + b;
  }
}

// dst[0..gs) = s * q + b for 8-bit codes.
inline void decode8(const uint8_t* bytes, int gs, float s, float b, float* dst) {
  int i = 0;
#if defined(__AVX512F__)
  __m512 vs = _mm512_set1_ps(s), vb = _mm512_set1_ps(b);
  for (; i + 16 <= gs; i += 16) {
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + i))));
    _mm512_storeu_ps(dst + i, _mm512_fmadd_ps(f, vs, vb));
  }
#elif defined(__AVX2__)
  __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
  for (; i + 8 <= gs; i += 8) {
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i))));
    _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(f, vs, vb));
  }
#endif
  for (; i < gs; ++i) dst[i] = s * static_cast<float>(bytes[i]) + b;
}

#if defined(__AVX2__)
#include "codes_impl.h"

// dst[0..gs) = s * q + b for 2-, 3-, 5- or 6-bit codes, 32 at a time (gs a multiple of 32).
template <int BITS>
inline void decode_blocks(const uint8_t* bytes, int gs, float s, float b, float* dst) {
  static const Decoder dec = make_decoder<BITS>();
  const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
  for (int i = 0; i < gs; i += 32) {
    __m256i v = decode<BITS, 0>(bytes + i * BITS / 8, dec);  // values 0-7, 16-23, 8-15, 24-31
    __m128i first = _mm256_castsi256_si128(v), second = _mm256_extracti128_si256(v, 1);
    const int at[4] = {0, 16, 8, 24};
    const __m128i parts[4] = {first, _mm_srli_si128(first, 8), second, _mm_srli_si128(second, 8)};
    for (int j = 0; j < 4; ++j) {
      __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
      _mm256_storeu_ps(dst + i + at[j], _mm256_fmadd_ps(f, vs, vb));
    }
  }
}
#endif

// dst[0..gs) = s * q + b for any width: value j of the row sits at bit `first_bit + j * bits`.
inline void decode_bits(const uint32_t* row, int64_t first_bit, int bits, int gs, float s, float b, float* dst) {
  const uint32_t mask = (1u << bits) - 1u;
  for (int j = 0; j < gs; ++j) {
    int64_t bit = first_bit + static_cast<int64_t>(j) * bits;
    int64_t word = bit >> 5;
    int shift = static_cast<int>(bit & 31);
    uint32_t v = row[word] >> shift;
    if (shift + bits > 32) v |= row[word + 1] << (32 - shift);
    dst[j] = s * static_cast<float>(v & mask) + b;
  }
}

void decode_row(const AffineArgs& a, int n, float* dst) {
  if (is_block(a.bits))  // ld_codes counts bytes
    return block_decode_row(a.bits, reinterpret_cast<const uint8_t*>(a.codes) + n * a.ld_codes, a.K, dst);
  const uint32_t* row = a.codes + n * a.ld_codes;
  const int64_t scale_row = n * a.ld_scales;
  const int groups = a.K / a.group_size;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  for (int g = 0; g < groups; ++g) {
    float s = scale_at(a.scales, a.scale_type, scale_row + g);
    float b = scale_at(a.biases, a.scale_type, scale_row + g);
    float* out = dst + static_cast<int64_t>(g) * a.group_size;
    if (a.bits == 4) {
      decode4(bytes + static_cast<int64_t>(g) * a.group_size / 2, a.group_size, s, b, out);
    } else if (a.bits == 8) {
      decode8(bytes + static_cast<int64_t>(g) * a.group_size, a.group_size, s, b, out);
#if defined(__AVX2__)
    } else if (a.group_size % 32 == 0 && (a.bits == 2 || a.bits == 3 || a.bits == 5 || a.bits == 6)) {
      const uint8_t* group = bytes + static_cast<int64_t>(g) * a.group_size * a.bits / 8;
      if (a.bits == 2) decode_blocks<2>(group, a.group_size, s, b, out);
      if (a.bits == 3) decode_blocks<3>(group, a.group_size, s, b, out);
      if (a.bits == 5) decode_blocks<5>(group, a.group_size, s, b, out);
      if (a.bits == 6) decode_blocks<6>(group, a.group_size, s, b, out);
#endif
    } else {
      decode_bits(row, static_cast<int64_t>(g) * a.group_size * a.bits, a.bits, a.group_size, s, b, out);
    }
  }
}

// Scales or biases of `rows` weight rows, (rows, G) at `row0`, as float32 into dst (rows * G).
inline void widen_scales(const void* base, int type, int64_t ld, int n, int rows, int groups, float* dst) {
  for (int r = 0; r < rows; ++r) {
    int64_t at = (n + r) * ld;
    float* out = dst + static_cast<int64_t>(r) * groups;
    int g = 0;
#if defined(__F16C__)
    if (type == kScaleF16) {
      const uint16_t* h = static_cast<const uint16_t*>(base) + at;
      for (; g + 8 <= groups; g += 8)
        _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g))));
    }
#endif
    for (; g < groups; ++g) out[g] = scale_at(base, type, at + g);
  }
}

// Decodes NR weight rows at a time into the thread's scratch (it stays in L1/L2 while every
// activation row passes over it), then runs the float tile on them.
void affine_decoded(const AffineArgs& a, int n0, int n1, float* scratch) {
  for (int n = n0; n < n1; n += NR) {
    int rows = min_int(NR, n1 - n);
    const float* w[NR];
    for (int r = 0; r < NR; ++r) {
      float* dst = scratch + static_cast<int64_t>(r) * a.K;
      if (r < rows) decode_row(a, n + r, dst);
      w[r] = scratch + static_cast<int64_t>(min_int(r, rows - 1)) * a.K;
    }
    block(w, rows, n, a.x, a.ldx, a.M, a.K, a.bias, a.y, a.ldy);
  }
}

#include "gemm_impl.h"
static_assert(kAffineScratchRows >= kPanelRows + 8, "the scratch holds a panel and 8 decoded rows");

void dense(const DenseArgs& a, int n0, int n1, float* scratch) {
  if (a.M >= kGemmMinRows) return dense_gemm(a, n0, n1, scratch);
  dense_few(a, n0, n1);
}

#if defined(__AVX512BW__) || defined(__AVX2__)
// The fused few-row path: codes are decoded into registers and multiplied straight away, no
// scratch. Per group, sum_k x_k (s q_k + b) = s * sum_k x_k q_k + b * sum_k x_k, so the inner
// loop is two FMAs per code vector; the b terms are one dot product per row over the group
// sums of x. For 4-bit codes, one vector of bytes holds value pairs (low nibble first), so x
// is reordered once per call: within each chunk of 2L values, the even ones then the odd ones.
#if defined(__AVX512BW__)
typedef __m512 VF;
typedef __m512i VI;
constexpr int L = 16;
inline VI bytes_to_lanes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF cvt(VI v) { return _mm512_cvtepi32_ps(v); }
inline VI low_nibble(VI v) { return _mm512_and_si512(v, _mm512_set1_epi32(0x0f)); }
inline VI high_nibble(VI v) { return _mm512_srli_epi32(v, 4); }
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vset1(float f) { return _mm512_set1_ps(f); }
inline VF vzero() { return _mm512_setzero_ps(); }
inline float vsum(VF v) { return _mm512_reduce_add_ps(v); }
constexpr int kFusedMaxRows = 4;  // activation rows
#else
typedef __m256 VF;
typedef __m256i VI;
constexpr int L = 8;
inline VI bytes_to_lanes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VF cvt(VI v) { return _mm256_cvtepi32_ps(v); }
inline VI low_nibble(VI v) { return _mm256_and_si256(v, _mm256_set1_epi32(0x0f)); }
inline VI high_nibble(VI v) { return _mm256_srli_epi32(v, 4); }
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vset1(float f) { return _mm256_set1_ps(f); }
inline VF vzero() { return _mm256_setzero_ps(); }
inline float vsum(VF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int kFusedMaxRows = 4;
#endif

bool fused_applies(const AffineArgs& a) {
  return a.M <= kFusedMaxRows && (a.bits == 4 || a.bits == 8) && a.group_size % (2 * L) == 0;
}

int64_t affine_prepared_size(const AffineArgs& a) {
  return fused_applies(a) ? static_cast<int64_t>(a.M) * (a.K + a.K / a.group_size) : 0;
}

void affine_prepare(const AffineArgs& a, float* xp) {
  const int groups = a.K / a.group_size;
  float* sums = xp + static_cast<int64_t>(a.M) * a.K;
  for (int m = 0; m < a.M; ++m) {
    const float* x = a.x + m * a.ldx;
    float* dst = xp + static_cast<int64_t>(m) * a.K;
    if (a.bits == 4) {
      for (int c = 0; c < a.K; c += 2 * L) {
        for (int i = 0; i < L; ++i) {
          dst[c + i] = x[c + 2 * i];
          dst[c + L + i] = x[c + 2 * i + 1];
        }
      }
    } else {
      for (int k = 0; k < a.K; ++k) dst[k] = x[k];
    }
    for (int g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int i = 0; i < a.group_size; ++i) s += x[g * a.group_size + i];
      sums[m * groups + g] = s;
    }
  }
}

// R weight rows from n against M activation rows; scales/biases widened into sb/bb (R * G each).
template <int R, int M, int BITS>
void fused_rows(const AffineArgs& a, int n, float* sb, float* bb) {
  const int groups = a.K / a.group_size;
  widen_scales(a.scales, a.scale_type, a.ld_scales, n, R, groups, sb);
  widen_scales(a.biases, a.scale_type, a.ld_scales, n, R, groups, bb);
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const uint8_t*>(a.codes + (n + r) * a.ld_codes);
  VF acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  constexpr int kChunk = BITS == 4 ? 2 * L : L;  // values per code vector load
  for (int g = 0; g < groups; ++g) {
    VF p[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) p[r][m] = vzero();
    const int base = g * a.group_size;
    for (int c = base; c < base + a.group_size; c += kChunk) {
      for (int r = 0; r < R; ++r) {
        VI v = bytes_to_lanes(rows[r] + c * BITS / 8);
        if (BITS == 4) {
          VF lo = cvt(low_nibble(v)), hi = cvt(high_nibble(v));
          for (int m = 0; m < M; ++m) {
            const float* xm = a.xp + static_cast<int64_t>(m) * a.K + c;
            p[r][m] = vfma(lo, vload(xm), p[r][m]);
            p[r][m] = vfma(hi, vload(xm + L), p[r][m]);
          }
        } else {
          VF q = cvt(v);
          for (int m = 0; m < M; ++m) p[r][m] = vfma(q, vload(a.xp + static_cast<int64_t>(m) * a.K + c), p[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      VF s = vset1(sb[r * groups + g]);
      for (int m = 0; m < M; ++m) acc[r][m] = vfma(p[r][m], s, acc[r][m]);
    }
  }
  const float* sums = a.xp + static_cast<int64_t>(a.M) * a.K;
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float offset = 0.0f;
      for (int g = 0; g < groups; ++g) offset += bb[r * groups + g] * sums[m * groups + g];
      float bias = a.bias != nullptr ? a.bias[n + r] : 0.0f;
      a.y[m * a.ldy + n + r] = vsum(acc[r][m]) + offset + bias;
    }
  }
}

template <int M, int BITS>
void fused_range(const AffineArgs& a, int n0, int n1, float* scratch) {
  // Four weight rows at a time keep four independent accumulator chains in flight for one or
  // two activation rows; more activation rows take two weight rows (registers run out).
  constexpr int R = (M <= 2 && L == 16) || M == 1 ? 4 : 2;
  const int groups = a.K / a.group_size;
  float* sb = scratch;
  float* bb = scratch + 4 * groups;
  int n = n0;
  for (; n + R <= n1; n += R) fused_rows<R, M, BITS>(a, n, sb, bb);
  for (; n < n1; ++n) fused_rows<1, M, BITS>(a, n, sb, bb);
}

template <int BITS>
void fused(const AffineArgs& a, int n0, int n1, float* scratch) {
  switch (a.M) {
    case 1: fused_range<1, BITS>(a, n0, n1, scratch); break;
    case 2: fused_range<2, BITS>(a, n0, n1, scratch); break;
    case 3: fused_range<3, BITS>(a, n0, n1, scratch); break;
    default: fused_range<4, BITS>(a, n0, n1, scratch); break;
  }
}

void affine(const AffineArgs& a, int n0, int n1, float* scratch) {
  if (a.M >= kGemmMinRows) return affine_gemm(a, n0, n1, scratch);
  if (a.xp == nullptr) return affine_decoded(a, n0, n1, scratch);
  if (a.bits == 4) return fused<4>(a, n0, n1, scratch);
  return fused<8>(a, n0, n1, scratch);
}
#else
int64_t affine_prepared_size(const AffineArgs&) { return 0; }
void affine_prepare(const AffineArgs&, float*) {}
void affine(const AffineArgs& a, int n0, int n1, float* scratch) {
  if (a.M >= kGemmMinRows) return affine_gemm(a, n0, n1, scratch);
  affine_decoded(a, n0, n1, scratch);
}
#endif

void block_rows(int type, const uint8_t* rows, int64_t ld, int R, int K, float* out) {
  for (int r = 0; r < R; ++r) block_decode_row(type, rows + r * ld, K, out + static_cast<int64_t>(r) * K);
}

}  // namespace

const LinearKernels& linear_kernels() {
  static const LinearKernels kernels{BASE_ISA_NAME, &dense, &affine_prepared_size, &affine_prepare, &affine,
                                     &block_rows};
  return kernels;
}

}  // namespace BASE_ISA
}  // namespace base_cpu

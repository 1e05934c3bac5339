// The many-row (prefill) float32 product, included by linear_impl.h inside its ISA namespace
// (V, vf, load, min_int and decode_row come from there).
//
// Past kGemmMinRows activation rows the product is compute-bound, and the few-row tile (dot
// products along K, one horizontal sum per output) spends its loads on weight rows as much as on
// multiply-adds. Here kPanelRows weight rows are decoded once into a panel in K-major order
// (panel[k][j] = w[n + j][k]), and each micro tile keeps MB activation rows x kPanelRows outputs
// in 12 vector accumulators: per k, NV panel loads and MB broadcasts feed 12 FMAs, no horizontal
// sums. K runs in slices of kGemmSliceK so that the slice of the panel in use stays in L2 while
// every activation row passes over it; the partial sums wait in y between slices. On one Zen 3
// core the tile runs at 88-90 GFLOP/s on an M=128 product, the same loop alone in L1 at 94 and
// a register-only FMA loop at 137; the decode and transposes add a tenth.

constexpr int kPanelRows = 16;  // weight rows per panel: a claim (linear.cpp's kChunkRows) holds whole panels
constexpr int NV = kPanelRows / V;  // vectors per panel row: 2 on AVX2, 1 on AVX-512, 4 generic
constexpr int MB = 12 / NV;  // activation rows per micro tile: 12 accumulators in all
constexpr int kGemmSliceK = 1024;  // 64 KiB of the panel, in L2 (256: 10% slower on Zen 3)
static_assert(kPanelRows % V == 0 && 12 % NV == 0, "a panel row is whole vectors");

// Every lane = *p: one broadcast load (a vector of zeros plus *p adds a scalar add, for -0.0's
// sake, and lane by lane stores build it of inserts).
typedef int vi __attribute__((vector_size(V * sizeof(int))));
inline vf splat(const float* p) {
  const vf first = {*p};
  return __builtin_shuffle(first, vi{});
}

// acc[m][j] (+)= x[m, k0:k1] . panel[k0:k1][j V : (j + 1) V] for `M_` rows of x.
template <int M_>
__attribute__((always_inline)) inline void panel_tile(const float* panel, const float* x, int64_t ldx, int k0,
                                                      int k1, vf (&acc)[MB][NV]) {
  for (int k = k0; k < k1; ++k) {
    vf w[NV];
    for (int j = 0; j < NV; ++j) w[j] = load(panel + static_cast<int64_t>(k) * kPanelRows + j * V);
    for (int m = 0; m < M_; ++m) {
      const vf xb = splat(x + m * ldx + k);
      for (int j = 0; j < NV; ++j) acc[m][j] += xb * w[j];
    }
  }
}

// y[m0 : m0 + M_, n : n + rows] over K slice [k0, k1): the first slice starts from zero, the
// later ones from y, and the last adds the bias.
template <int M_>
inline void panel_rows(const float* panel, int rows, int n, const float* x, int64_t ldx, int k0, int k1, int K,
                       const float* bias, float* y, int64_t ldy) {
  vf acc[MB][NV];
  float tmp[kPanelRows];
  for (int m = 0; m < M_; ++m) {
    if (k0 == 0) {
      for (int j = 0; j < NV; ++j) acc[m][j] = vf{};
    } else {
      for (int j = 0; j < kPanelRows; ++j) tmp[j] = j < rows ? y[m * ldy + n + j] : 0.0f;
      for (int j = 0; j < NV; ++j) acc[m][j] = load(tmp + j * V);
    }
  }
  panel_tile<M_>(panel, x, ldx, k0, k1, acc);
  for (int m = 0; m < M_; ++m) {
    for (int j = 0; j < NV; ++j) __builtin_memcpy(tmp + j * V, &acc[m][j], sizeof(vf));
    float* ym = y + m * ldy + n;
    const bool last = k1 == K && bias != nullptr;
    for (int j = 0; j < rows; ++j) ym[j] = tmp[j] + (last ? bias[n + j] : 0.0f);
  }
}

inline void panel_block(const float* panel, int rows, int n, const float* x, int64_t ldx, int M, int K,
                        const float* bias, float* y, int64_t ldy) {
  for (int k0 = 0; k0 < K; k0 += kGemmSliceK) {
    const int k1 = min_int(K, k0 + kGemmSliceK);
    int m = 0;
    for (; m + MB <= M; m += MB) panel_rows<MB>(panel, rows, n, x + m * ldx, ldx, k0, k1, K, bias, y + m * ldy, ldy);
    // The rest (fewer than MB rows: up to 5 on AVX2, 11 on AVX-512, 2 generic) in tiles of at most 6.
    while (m < M) {
      const int r = min_int(M - m, 6);
      const float* xm = x + m * ldx;
      float* ym = y + m * ldy;
      switch (r) {
        case 1: panel_rows<1>(panel, rows, n, xm, ldx, k0, k1, K, bias, ym, ldy); break;
        case 2: panel_rows<(MB >= 2 ? 2 : 1)>(panel, rows, n, xm, ldx, k0, k1, K, bias, ym, ldy); break;
        case 3: panel_rows<(MB >= 3 ? 3 : 1)>(panel, rows, n, xm, ldx, k0, k1, K, bias, ym, ldy); break;
        case 4: panel_rows<(MB >= 4 ? 4 : 1)>(panel, rows, n, xm, ldx, k0, k1, K, bias, ym, ldy); break;
        case 5: panel_rows<(MB >= 5 ? 5 : 1)>(panel, rows, n, xm, ldx, k0, k1, K, bias, ym, ldy); break;
        default: panel_rows<(MB >= 6 ? 6 : 1)>(panel, rows, n, xm, ldx, k0, k1, K, bias, ym, ldy); break;
      }
      m += r;
    }
  }
}

// `count` (<= 8) rows of K floats (row stride ld) into panel columns [c0, c0 + count); the rest of
// the 8 columns zero (a short last panel: their lanes are never stored). Eight rows go in 8x8
// transposes, 24 shuffles for 64 values where scalar stores would take 64.
inline void rows_to_panel(const float* rows, int64_t ld, int count, int K, int c0, float* panel) {
  int k = 0;
#if defined(__AVX2__)
  if (count == 8) {
    for (; k + 8 <= K; k += 8) {
      __m256 r[8], t[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + i * ld + k);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(panel + static_cast<int64_t>(k + i) * kPanelRows + c0, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(panel + static_cast<int64_t>(k + i + 4) * kPanelRows + c0,
                         _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
      }
    }
  }
#endif
  for (; k < K; ++k) {
    float* dst = panel + static_cast<int64_t>(k) * kPanelRows + c0;
    for (int r = 0; r < 8; ++r) dst[r] = r < count ? rows[r * ld + k] : 0.0f;
  }
}

// Weight rows [n0, n1) of `a`, decoded a panel at a time, 8 rows at once; scratch holds
// kAffineScratchRows * K floats (the panel's 16 rows, then 8 decoded rows).
void affine_gemm(const AffineArgs& a, int n0, int n1, float* scratch) {
  float* panel = scratch;
  float* rows = scratch + static_cast<int64_t>(kPanelRows) * a.K;
  for (int n = n0; n < n1; n += kPanelRows) {
    const int num_rows = min_int(kPanelRows, n1 - n);
    for (int c0 = 0; c0 < kPanelRows; c0 += 8) {
      const int count = num_rows - c0 < 0 ? 0 : min_int(8, num_rows - c0);
      for (int r = 0; r < count; ++r) decode_row(a, n + c0 + r, rows + static_cast<int64_t>(r) * a.K);
      rows_to_panel(rows, a.K, count, a.K, c0, panel);
    }
    panel_block(panel, num_rows, n, a.x, a.ldx, a.M, a.K, a.bias, a.y, a.ldy);
  }
}

// The same over float32 weight rows, moved into the panel (scratch: kPanelRows * K floats).
void dense_gemm(const DenseArgs& a, int n0, int n1, float* scratch) {
  for (int n = n0; n < n1; n += kPanelRows) {
    const int num_rows = min_int(kPanelRows, n1 - n);
    for (int c0 = 0; c0 < kPanelRows; c0 += 8) {
      const int count = num_rows - c0 < 0 ? 0 : min_int(8, num_rows - c0);
      rows_to_panel(a.w + (n + c0) * a.ldw, a.ldw, count, a.K, c0, scratch);
    }
    panel_block(scratch, num_rows, n, a.x, a.ldx, a.M, a.K, a.bias, a.y, a.ldy);
  }
}

// The loops of fused.h, compiled once per instruction set by fused_<isa>.cpp (inside its
// namespace; the standard headers come from there).

#include "vec_math.h"

static void rms_norm(const float* x, const float* w, float weight_offset, float eps, int d, float* y, int r0,
                     int r1) {
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + int64_t(r) * d;
    float* yr = y + int64_t(r) * d;
    int i = 0;
    vf acc{};
    for (; i + kLanes <= d; i += kLanes) {
      const vf v = vload(xr + i);
      acc += v * v;
    }
    float sum = hsum(acc);
    for (; i < d; ++i) sum += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(sum / float(d) + eps);
    i = 0;
    for (; i + kLanes <= d; i += kLanes) vstore(yr + i, vload(xr + i) * inv * (vload(w + i) + weight_offset));
    for (; i < d; ++i) yr[i] = xr[i] * inv * (w[i] + weight_offset);
  }
}

static void rope(const float* x, const int32_t* positions, const float* inv_freqs, int heads, int head_dim, int dims,
                 bool traditional, float mscale, float* y, int t0, int t1) {
  const int half = dims / 2;
  std::vector<float> cs(half), sn(half);
  for (int t = t0; t < t1; ++t) {
    const float pos = float(positions[t]);
    for (int i = 0; i < half; ++i) {
      const float theta = pos * inv_freqs[i];
      cs[i] = std::cos(theta) * mscale;
      sn[i] = std::sin(theta) * mscale;
    }
    for (int h = 0; h < heads; ++h) {
      const float* xh = x + (int64_t(t) * heads + h) * head_dim;
      float* yh = y + (int64_t(t) * heads + h) * head_dim;
      if (traditional) {
        for (int i = 0; i < half; ++i) {
          const float a = xh[2 * i], b = xh[2 * i + 1];
          yh[2 * i] = a * cs[i] - b * sn[i];
          yh[2 * i + 1] = a * sn[i] + b * cs[i];
        }
      } else {
        for (int i = 0; i < half; ++i) {
          const float a = xh[i], b = xh[i + half];
          yh[i] = a * cs[i] - b * sn[i];
          yh[i + half] = a * sn[i] + b * cs[i];
        }
      }
      for (int i = dims; i < head_dim; ++i) yh[i] = xh[i];
    }
  }
}

static inline vf silu(vf g) {
  return g / (1.0f + vexp(-g));
}

static inline vf gelu_tanh(vf g) {  // 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
  return 0.5f * g * (1.0f + vtanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

static inline float gelu_scalar(float g, int act) {
  if (act == kGeluErf) return 0.5f * g * (1.0f + std::erf(g * 0.7071067811865476f));
  if (act == kGeluTanh) return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  return g / (1.0f + std::exp(-g));
}

static void gated(const float* gate_up, int n, int act, float* y, int r0, int r1) {
  for (int r = r0; r < r1; ++r) {
    const float* g = gate_up + int64_t(r) * 2 * n;
    const float* u = g + n;
    float* yr = y + int64_t(r) * n;
    int i = 0;
    if (act != kGeluErf) {
      for (; i + kLanes <= n; i += kLanes) {
        const vf gv = vload(g + i);
        vstore(yr + i, (act == kSilu ? silu(gv) : gelu_tanh(gv)) * vload(u + i));
      }
    }
    for (; i < n; ++i) yr[i] = gelu_scalar(g[i], act) * u[i];
  }
}

// LayerNorm and the plain activation run over whole images (thousands of rows), so their loops use
// the build's own register width (vn): 16-float `vf` values compile to stack traffic without AVX-512.
static void layer_norm(const float* x, const float* w, const float* b, float eps, int d, float* y, int r0, int r1) {
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + int64_t(r) * d;
    float* yr = y + int64_t(r) * d;
    int i = 0;
    vn acc{};
    for (; i + kNative <= d; i += kNative) acc += nload(xr + i);
    float sum = nhsum(acc);
    for (; i < d; ++i) sum += xr[i];
    const float mean = sum / float(d);
    acc = vn{};
    for (i = 0; i + kNative <= d; i += kNative) {
      const vn c = nload(xr + i) - mean;
      acc += c * c;
    }
    float squares = nhsum(acc);
    for (; i < d; ++i) squares += (xr[i] - mean) * (xr[i] - mean);
    const float inv = 1.0f / std::sqrt(squares / float(d) + eps);
    for (i = 0; i + kNative <= d; i += kNative) {
      vn v = (nload(xr + i) - mean) * inv;
      if (w != nullptr) v *= nload(w + i);
      if (b != nullptr) v += nload(b + i);
      nstore(yr + i, v);
    }
    for (; i < d; ++i) yr[i] = (xr[i] - mean) * inv * (w != nullptr ? w[i] : 1.0f) + (b != nullptr ? b[i] : 0.0f);
  }
}

static inline vn gelu_tanh_native(vn g) {  // as gelu_tanh, with tanh(u) = 1 - 2 / (exp(2u) + 1) on -|u|
  const vn u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const vn e = nexp(-2.0f * (u < 0.0f ? -u : u));
  const vn t = (1.0f - e) / (1.0f + e);
  return 0.5f * g * (1.0f + (u < 0.0f ? -t : t));
}

static void activate(const float* x, int act, float* y, int64_t i0, int64_t i1) {
  int64_t i = i0;
  if (act != kGeluErf) {
    for (; i + kNative <= i1; i += kNative) {
      const vn v = nload(x + i);
      nstore(y + i, act == kSilu ? v / (1.0f + nexp(-v)) : gelu_tanh_native(v));
    }
  }
  for (; i < i1; ++i) y[i] = gelu_scalar(x[i], act);
}

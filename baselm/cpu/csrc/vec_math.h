// Vector maths shared by the kernels' inner loops, with GCC/Clang vector types: one AVX-512
// register per `vf` where the build has it, two AVX2 or four SSE/NEON registers elsewhere.
// Included inside each instruction set's namespace by a <family>_impl.h (so: no include guard,
// and the standard headers come from the including .cpp).

typedef float vf __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int kLanes = 16;

static inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline void vstore(float* p, vf v) {
  std::memcpy(p, &v, sizeof(v));
}

static inline vf vsplat(float x) {
  return vf{} + x;
}

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

// The build's own register width. Without AVX-512, GCC keeps a `vf` that a loop carries (an
// accumulator) in memory, moving it through the stack 8 bytes at a time on every iteration, so
// the inner loops carry their sums in `vn` instead: 16 lanes as kParts native vectors, each lane
// summed in the same order, so the results are the same bit for bit.
#if defined(__AVX512F__)
typedef float vn __attribute__((vector_size(64)));
#elif defined(__AVX__)
typedef vf8 vn;
#else
typedef vf4 vn;
#endif
constexpr int kNative = static_cast<int>(sizeof(vn) / sizeof(float));
constexpr int kParts = kLanes / kNative;

static inline vn nload(const float* p) {
  vn v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline void nstore(float* p, vn v) {
  std::memcpy(p, &v, sizeof(v));
}

static inline vf4 fold(vf v, bool take_max) {  // 16 lanes -> 4, by halves
  vf8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  vf8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf8 a = take_max ? (lo > hi ? lo : hi) : lo + hi;
  vf4 l = __builtin_shufflevector(a, a, 0, 1, 2, 3);
  vf4 h = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return take_max ? (l > h ? l : h) : l + h;
}

static inline float hsum(vf v) {
  vf4 a = fold(v, false);
  return (a[0] + a[2]) + (a[1] + a[3]);
}

static inline float hmax(vf v) {
  vf4 a = fold(v, true);
  float x = a[0] > a[1] ? a[0] : a[1];
  float y = a[2] > a[3] ? a[2] : a[3];
  return x > y ? x : y;
}


// exp(x) (Cephes' expf: 2^n * p(r), |error| ~ 2 ulp) on any float vector V with int vector I of
// its lanes; lanes below -87 (or -inf) give 0, as exp's true value is below float's normal range
// there, and lanes above 88 give exp(88).
template <class V, class I>
static inline V pick(I mask, V a, V b) {  // mask lanes are all ones or all zeros: bit operations, not blends
  I ai, bi;
  std::memcpy(&ai, &a, sizeof(a));
  std::memcpy(&bi, &b, sizeof(b));
  const I r = (ai & mask) | (bi & ~mask);
  V out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

static inline vf vselect(vi mask, vf a, vf b) {
  return pick<vf, vi>(mask, a, b);
}

template <class V, class I>
static inline V exp_lanes(V x) {
  const I tiny = x < -87.0f;
  x = pick<V, I>(tiny, V{} - 87.0f, x);
  x = pick<V, I>(x > 88.0f, V{} + 88.0f, x);
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const V r2 = r * r;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  I bits;
  std::memcpy(&bits, &p, sizeof(p));
  bits = bits + (__builtin_convertvector(n, I) << 23);
  V out;
  std::memcpy(&out, &bits, sizeof(out));
  return pick<V, I>(tiny, V{}, out);
}

static inline vf vexp(vf x) {
  return exp_lanes<vf, vi>(x);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1), evaluated on -|x| so exp never overflows.
static inline vf vtanh(vf x) {
  vi neg = x < vf{};
  vf a = vselect(neg, -x, x);
  vf e = vexp(-2.0f * a);
  vf t = (1.0f - e) / (1.0f + e);
  return vselect(neg, -t, t);
}

// Helpers on the build's own register width (see vn): loops over whole images use these.
typedef int32_t vni __attribute__((vector_size(sizeof(vn))));

static inline vn nmax(vn a, vn b) {
  return a > b ? a : b;
}

static inline float nhmax(vn v) {
  float m = v[0];
  for (int i = 1; i < kNative; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

static inline float nhsum(vn v) {
  float s = 0.0f;
  for (int i = 0; i < kNative; ++i) s += v[i];
  return s;
}

static inline vn nexp(vn x) {
  return exp_lanes<vn, vni>(x);
}

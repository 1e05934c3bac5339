// Paged attention on the CPU: the maths of one work item (one sequence, one KV head, a tile of
// its query rows), written once with GCC/Clang vector types and compiled by
// attention_<isa>.cpp once per instruction set.
//
// The maths is the reference's (metal/reference.py): scores = (q * scale) . k, optional
// tanh soft-capping, a causal mask (keys at positions <= the query's and, with a window,
// > position - window), softmax in float32, then the weighted sum of the values. Here the
// softmax is online (flash attention): keys are taken 16 at a time, each row keeps its
// running max and sum, and the accumulated output is rescaled when the max grows. So no
// score matrix of the whole context is ever held, and every K/V row is read once per tile.
//
// Included inside a namespace by attention_<isa>.cpp, which includes the standard headers.

#include "vec_math.h"

#define BASE_IDX(...) __VA_ARGS__

static inline float bf16_round(float x) {  // to the nearest bfloat16, ties to even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

static inline float to_float(const void* p, int dtype, int64_t i) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (dtype == 2) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}

// Row `row` (slot * kv_heads + head) of the pool as head_dim floats in `out`.
static inline void load_row(const PoolView& pool, int64_t row, int head_dim, float* out) {
  if (pool.bits == 0) {
    if (pool.dtype == 0) {
      std::memcpy(out, static_cast<const float*>(pool.data) + row * head_dim, head_dim * sizeof(float));
    } else {
      for (int d = 0; d < head_dim; ++d) out[d] = to_float(pool.data, pool.dtype, row * head_dim + d);
    }
    return;
  }
  const int per_word = 32 / pool.bits;
  const uint32_t mask = (1u << pool.bits) - 1;
  const uint32_t* codes = static_cast<const uint32_t*>(pool.data) + row * (head_dim / per_word);
  const int num_groups = head_dim / pool.group_size;
  for (int g = 0; g < num_groups; ++g) {
    const float s = to_float(pool.scales, pool.dtype, row * num_groups + g);
    const float b = to_float(pool.biases, pool.dtype, row * num_groups + g);
    for (int d = g * pool.group_size; d < (g + 1) * pool.group_size; ++d) {
      const uint32_t q = (codes[d / per_word] >> ((d % per_word) * pool.bits)) & mask;
      const float x = s * float(q) + b;
      // the reference dequantizes to the scales' dtype before attending
      out[d] = pool.dtype == 0 ? x : pool.dtype == 2 ? bf16_round(x) : float(_Float16(x));
    }
  }
}

// Scratch of one work item: `rows` = query rows x heads per KV head.
struct Scratch {
  std::vector<float> q, acc, p, kt, v, row_max, row_sum;
  std::vector<vf> s;  // (rows,) scores of one chunk
  std::vector<vf> sums;  // (rows,) running softmax denominators, lane-wise
  std::vector<int> pos;
  void size(int rows, int head_dim) {
    q.resize(size_t(rows) * head_dim);
    acc.assign(size_t(rows) * head_dim, 0.0f);
    p.resize(size_t(rows) * kLanes);
    kt.resize(size_t(head_dim) * kLanes);
    v.resize(size_t(kLanes) * head_dim);
    row_max.assign(rows, -INFINITY);
    row_sum.assign(rows, 0.0f);
    pos.resize(rows);
    s.resize(rows);
    sums.assign(rows, vf{});
  }
};

// kt (head_dim, 16) = the 16 key rows of v (16, head_dim) transposed, 16x16 blocks at a time by
// four butterfly rounds (each swaps the off-diagonal sub-blocks of size 8, 4, 2, 1).
static inline void transpose_keys(const float* v, int head_dim, float* kt) {
  for (int b = 0; b < head_dim; b += kLanes) {
    vf r[kLanes];
    for (int j = 0; j < kLanes; ++j) r[j] = vload(v + size_t(j) * head_dim + b);
#define BASE_BUTTERFLY(S, LO, HI)                                  \
  for (int i = 0; i < kLanes; ++i) {                               \
    if (i & S) continue;                                           \
    const vf a = r[i], c = r[i + S];                               \
    r[i] = __builtin_shufflevector(a, c, LO);                      \
    r[i + S] = __builtin_shufflevector(a, c, HI);                  \
  }
    BASE_BUTTERFLY(8, BASE_IDX(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                   BASE_IDX(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
    BASE_BUTTERFLY(4, BASE_IDX(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                   BASE_IDX(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
    BASE_BUTTERFLY(2, BASE_IDX(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                   BASE_IDX(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
    BASE_BUTTERFLY(1, BASE_IDX(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                   BASE_IDX(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef BASE_BUTTERFLY
    for (int d = 0; d < kLanes; ++d) vstore(kt + size_t(b + d) * kLanes, r[d]);
  }
}

// Query rows a tile of the score and accumulate loops takes at once: their sums (R x 16 lanes)
// must stay in registers (32 with AVX-512, 16 otherwise).
constexpr int kRowTile = kNative == 16 ? 8 : (kNative == 8 ? 4 : 2);

// scores (rows, 16) of the query rows against 16 keys held transposed in kt (head_dim, 16), row m
// at s + m * stride. R rows at a time: R independent multiply-add chains keep both FMA pipes busy.
template <int R>
static inline void scores_rows(const Scratch& w, const float* kt, int m, int head_dim, float* s, int stride) {
  vn acc[R][kParts] = {};
  const float* q = &w.q[size_t(m) * head_dim];
  for (int d = 0; d < head_dim; ++d) {
    vn k[kParts];
    for (int i = 0; i < kParts; ++i) k[i] = nload(&kt[size_t(d) * kLanes + i * kNative]);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kParts; ++i) acc[r][i] += q[size_t(r) * head_dim + d] * k[i];
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kParts; ++i) nstore(s + size_t(m + r) * stride + i * kNative, acc[r][i]);
}

static inline void scores_transposed(const Scratch& w, const float* kt, int rows, int head_dim, float* s,
                                     int stride) {
  int m = 0;
  for (; m + kRowTile <= rows; m += kRowTile) scores_rows<kRowTile>(w, kt, m, head_dim, s, stride);
  for (; m < rows; ++m) scores_rows<1>(w, kt, m, head_dim, s, stride);
}

// Row `row` of the pool as floats: in place for a float32 pool, else decoded into `scratch`.
static inline const float* pool_row(const PoolView& pool, int64_t row, int head_dim, float* scratch) {
  if (pool.bits == 0 && pool.dtype == 0) return static_cast<const float*>(pool.data) + row * head_dim;
  load_row(pool, row, head_dim, scratch);
  return scratch;
}

// The sum of a native vector's lanes, by halves.
static inline float nsum(vn v) {
#if defined(__AVX512F__)
  vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(__AVX__)
  vf8 h = v;
#endif
#if defined(__AVX__)
  vf4 a = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#else
  vf4 a = v;
#endif
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// The lane sums of four native vectors, as one vector of four: pairs of lanes added across the
// vectors by shuffles, so no sum leaves the registers one float at a time.
static inline vf4 nsum4(vn a, vn b, vn c, vn d) {
#if defined(__AVX__)
#if defined(__AVX512F__)
  auto half = [](vn v) -> vf8 {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  };
  const vf8 a8 = half(a), b8 = half(b), c8 = half(c), d8 = half(d);
#else
  const vf8 a8 = a, b8 = b, c8 = c, d8 = d;
#endif
  // [a01 b01 a23 b23 | a45 b45 a67 b67], the same of c and d, then [a b c d | a b c d] by quarters.
  const vf8 ab = __builtin_shufflevector(a8, b8, 0, 8, 2, 10, 4, 12, 6, 14) +
                 __builtin_shufflevector(a8, b8, 1, 9, 3, 11, 5, 13, 7, 15);
  const vf8 cd = __builtin_shufflevector(c8, d8, 0, 8, 2, 10, 4, 12, 6, 14) +
                 __builtin_shufflevector(c8, d8, 1, 9, 3, 11, 5, 13, 7, 15);
  const vf8 q = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
                __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(q, q, 0, 1, 2, 3) + __builtin_shufflevector(q, q, 4, 5, 6, 7);
#else
  const vf4 ab = __builtin_shufflevector(a, b, 0, 4, 2, 6) + __builtin_shufflevector(a, b, 1, 5, 3, 7);
  const vf4 cd = __builtin_shufflevector(c, d, 0, 4, 2, 6) + __builtin_shufflevector(c, d, 1, 5, 3, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
#endif
}

// Scores of R query rows from m against J keys from j0 (out[r][j0 + j]): the rows' query vectors
// meet each key's vector as it is loaded, R x J sums in registers (3 x 4 of them beside 3 query
// and one key vector fill AVX2's 16), the horizontal sums four keys at a time at the end.
template <int R, int J>
static inline void scores_tile(const Scratch& w, const float* const* keys, int m, int j0, int head_dim,
                               float (*out)[kLanes]) {
  vn acc[R][J] = {};
  const float* q = &w.q[size_t(m) * head_dim];
  for (int d = 0; d < head_dim; d += kNative) {
    vn qv[R];
    for (int r = 0; r < R; ++r) qv[r] = nload(q + size_t(r) * head_dim + d);
    for (int j = 0; j < J; ++j) {
      const vn k = nload(keys[j0 + j] + d);
      for (int r = 0; r < R; ++r) acc[r][j] += qv[r] * k;
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (J == 4) {
      const vf4 sums = nsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      std::memcpy(&out[r][j0], &sums, sizeof sums);
    } else {
      for (int j = 0; j < J; ++j) out[r][j0 + j] = nsum(acc[r][j]);
    }
  }
}

template <int R>
static inline void scores_rows_of_keys(const Scratch& w, const float* const* keys, int m, int head_dim, int num_keys,
                                       float (*out)[kLanes]) {
  int j = 0;
  for (; j + 4 <= num_keys; j += 4) scores_tile<R, 4>(w, keys, m, j, head_dim, out);
  for (; j < num_keys; ++j) scores_tile<R, 1>(w, keys, m, j, head_dim, out);
}

// The same scores from the key rows themselves (keys[j], head_dim floats each): for few query
// rows (decode), where transposing the keys would cost more than the dot products. Rows go three
// at a time, keys four at a time.
static inline void scores_dot(const Scratch& w, const float* const* keys, int rows, int head_dim, int num_keys,
                              vf* s) {
  alignas(64) float out[3][kLanes] = {};
  for (int m = 0; m < rows; m += 3) {
    const int tile = std::min(3, rows - m);
    if (tile == 3) scores_rows_of_keys<3>(w, keys, m, head_dim, num_keys, out);
    if (tile == 2) scores_rows_of_keys<2>(w, keys, m, head_dim, num_keys, out);
    if (tile == 1) scores_rows_of_keys<1>(w, keys, m, head_dim, num_keys, out);
    for (int r = 0; r < tile; ++r) s[m + r] = vload(out[r]);
  }
}

// Online softmax of one 16-key chunk starting at key position `first`: masks (unless every row
// sees every key of it), updates each row's max and sum, rescales its accumulator, and leaves
// the chunk's weights in w.p.
static inline void softmax_chunk(Scratch& w, vf* s, int rows, int head_dim, int first, int num_keys,
                                 const AttentionShape& a) {
  const bool all_visible = num_keys == kLanes && first + kLanes - 1 <= w.pos[0] &&
                           (a.window == 0 || first > w.pos[rows - 1] - a.window);
  vi key_pos;
  for (int j = 0; j < kLanes; ++j) key_pos[j] = first + j;
  const vi valid_key = key_pos < (first + num_keys);
  vi ok = valid_key;
  for (int m = 0; m < rows; ++m) {
    vf x = s[m];
    if (a.softcap > 0.0f) x = vtanh(x * (1.0f / a.softcap)) * a.softcap;
    if (!all_visible) {
      ok = valid_key & (key_pos <= w.pos[m]);
      if (a.window > 0) ok = ok & (key_pos > w.pos[m] - a.window);
      x = vselect(ok, x, vsplat(-INFINITY));
    }
    const float chunk_max = hmax(x);
    float* p = &w.p[size_t(m) * kLanes];
    if (chunk_max == -INFINITY) {  // nothing of this chunk is visible to this row
      vstore(p, vf{});
      continue;
    }
    const float old_max = w.row_max[m];
    if (chunk_max > old_max) {
      if (old_max != -INFINITY) {
        const float c = vexp(vsplat(old_max - chunk_max))[0];
        w.sums[m] *= c;
        float* acc = &w.acc[size_t(m) * head_dim];
        for (int d = 0; d < head_dim; d += kLanes) vstore(acc + d, vload(acc + d) * c);
      }
      w.row_max[m] = chunk_max;
    }
    vf e = vexp(x - w.row_max[m]);
    if (!all_visible) e = vselect(ok, e, vf{});
    w.sums[m] += e;
    vstore(p, e);
  }
}

// acc (rows, head_dim) += p (rows, num_keys; row stride p_stride) . v (num_keys rows values[j]),
// R rows of one 16-wide column at a time.
template <int R>
static inline void accumulate_rows(Scratch& w, const float* const* values, int m, int d, int head_dim,
                                   int num_keys, int p_stride) {
  float* acc = &w.acc[size_t(m) * head_dim + d];
  const float* p = &w.p[size_t(m) * p_stride];
  vn a[R][kParts];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kParts; ++i) a[r][i] = nload(acc + size_t(r) * head_dim + i * kNative);
  for (int j = 0; j < num_keys; ++j) {
    vn v[kParts];
    for (int i = 0; i < kParts; ++i) v[i] = nload(values[j] + d + i * kNative);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kParts; ++i) a[r][i] += p[r * p_stride + j] * v[i];
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kParts; ++i) nstore(acc + size_t(r) * head_dim + i * kNative, a[r][i]);
}

static inline void accumulate(Scratch& w, const float* const* values, int rows, int head_dim, int num_keys,
                              int p_stride = kLanes) {
  for (int d = 0; d < head_dim; d += kLanes) {
    int m = 0;
    for (; m + kRowTile <= rows; m += kRowTile)
      accumulate_rows<kRowTile>(w, values, m, d, head_dim, num_keys, p_stride);
    // The rest together: each value vector loaded once for up to three rows.
    for (; rows - m >= 3; m += 3) accumulate_rows<3>(w, values, m, d, head_dim, num_keys, p_stride);
    if (rows - m == 2) accumulate_rows<2>(w, values, m, d, head_dim, num_keys, p_stride);
    if (rows - m == 1) accumulate_rows<1>(w, values, m, d, head_dim, num_keys, p_stride);
  }
}

// One work item: query rows [i0, i1) of a sequence (its first query row at flattened token
// `q_start`, `q_len` rows, `ctx` cached keys, `table` its block ids), all query heads of KV head `h`.
static void attend_tile_impl(const AttentionShape& a, const float* queries, float* out, const PoolView& keys,
                        const PoolView& values, const int32_t* table, int ctx, int q_start, int q_len, int h,
                        int i0, int i1, Scratch& w) {
  const int group = a.num_heads / a.num_kv_heads, head_dim = a.head_dim;
  const int rows = (i1 - i0) * group;
  w.size(rows, head_dim);
  for (int i = i0; i < i1; ++i) {
    for (int g = 0; g < group; ++g) {
      const int m = (i - i0) * group + g;
      const float* q = queries + (q_start + i) * a.q_token_stride + (h * group + g) * a.q_head_stride;
      for (int d = 0; d < head_dim; ++d) w.q[size_t(m) * head_dim + d] = q[d] * a.scale;
      w.pos[m] = ctx - q_len + i;
    }
  }
  const int last = ctx - q_len + i1 - 1;  // newest position any row sees
  int first = 0;
  if (a.window > 0) first = std::max(0, ctx - q_len + i0 - a.window + 1);
  first -= first % kLanes;
  const bool transpose = rows >= 8;
  vf* s = w.s.data();
  const float* rows_of[kLanes];  // the chunk's key (then value) rows
  int64_t slots[kLanes];  // the chunk's pool slots
  for (int c = first; c <= last; c += kLanes) {
    const int num_keys = std::min(kLanes, last + 1 - c);
    for (int j = 0, block = c / a.block_size, offset = c % a.block_size; j < num_keys; ++j) {
      slots[j] = int64_t(table[block]) * a.block_size + offset;
      if (++offset == a.block_size) offset = 0, ++block;
    }
    for (int j = 0; j < num_keys; ++j) {
      const int64_t slot = slots[j];
      float* into = &w.v[size_t(j) * head_dim];
      if (transpose) {
        load_row(keys, slot * a.num_kv_heads + h, head_dim, into);
      } else {
        rows_of[j] = pool_row(keys, slot * a.num_kv_heads + h, head_dim, into);
      }
    }
    if (transpose) {
      std::fill(w.v.begin() + size_t(num_keys) * head_dim, w.v.end(), 0.0f);
      transpose_keys(w.v.data(), head_dim, w.kt.data());
      scores_transposed(w, w.kt.data(), rows, head_dim, reinterpret_cast<float*>(s), kLanes);
    } else {
      scores_dot(w, rows_of, rows, head_dim, num_keys, s);
    }
    softmax_chunk(w, s, rows, head_dim, c, num_keys, a);
    for (int j = 0; j < num_keys; ++j)
      rows_of[j] = pool_row(values, slots[j] * a.num_kv_heads + h, head_dim, &w.v[size_t(j) * head_dim]);
    accumulate(w, rows_of, rows, head_dim, num_keys);
  }
  for (int i = i0; i < i1; ++i) {
    for (int g = 0; g < group; ++g) {
      const int m = (i - i0) * group + g;
      const float inv = 1.0f / hsum(w.sums[m]);
      float* o = out + (int64_t(q_start + i) * a.num_heads + h * group + g) * head_dim;
      for (int d = 0; d < head_dim; ++d) o[d] = w.acc[size_t(m) * head_dim + d] * inv;
    }
  }
}

static void attend(const AttentionArgs& args, const AttentionTile& tile) {
  static thread_local Scratch scratch;
  const AttentionShape& a = args.shape;
  const int q_start = args.query_starts[tile.seq];
  const int q_len = args.query_starts[tile.seq + 1] - q_start;
  const int32_t* table = args.block_tables + int64_t(tile.seq) * a.max_blocks;
  attend_tile_impl(a, args.queries, args.out, args.keys, args.values, table, args.context_lens[tile.seq], q_start,
                   q_len, tile.kv_head, tile.row_begin, tile.row_end, scratch);
}

// Keys a dense work item takes at once: each row's softmax update (its max, the rescale of its
// sums) is paid once per block rather than once per 16 keys.
constexpr int kDenseBlock = 64;

// The softmax step of one row over a block of scores (num_keys of kDenseBlock valid): raises the
// row's max (rescaling its output and sum), leaves the weights exp(score - max) in place.
static inline void dense_softmax_row(float* scores, int num_keys, float& row_max, float& row_sum, float* acc,
                                     int dim) {
  for (int j = num_keys; j < kDenseBlock; ++j) scores[j] = -INFINITY;
  vn top = nload(scores);
  for (int j = kNative; j < kDenseBlock; j += kNative) top = nmax(top, nload(scores + j));
  const float block_max = nhmax(top);
  if (block_max > row_max) {
    if (row_max != -INFINITY) {
      const float c = std::exp(row_max - block_max);
      row_sum *= c;
      for (int d = 0; d < dim; d += kNative) nstore(acc + d, nload(acc + d) * c);
    }
    row_max = block_max;
  }
  vn sum{};
  for (int j = 0; j < kDenseBlock; j += kNative) {
    const vn e = nexp(nload(scores + j) - row_max);
    sum += e;
    nstore(scores + j, e);
  }
  row_sum += nhsum(sum);
}

// One dense work item: query rows [row_begin, row_end) of a segment, one head, against all the
// segment's keys, kDenseBlock at a time from their packed panels.
static void attend_dense(const DenseAttentionArgs& a, const DenseTile& t) {
  static thread_local Scratch w;
  const int rows = t.row_end - t.row_begin, dim = a.padded_dim;
  w.size(rows, dim);
  w.p.resize(size_t(rows) * kDenseBlock);
  for (int m = 0; m < rows; ++m) {
    const float* q = a.queries + int64_t(t.row_begin + m) * a.q_seq_stride + int64_t(t.head) * a.q_head_stride;
    float* into = &w.q[size_t(m) * dim];
    for (int d = 0; d < a.head_dim; ++d) into[d] = q[d] * a.scale;
    std::fill(into + a.head_dim, into + dim, 0.0f);
  }
  const int first_row = a.segments[t.segment], num_keys_all = a.segments[t.segment + 1] - first_row;
  const float* panels = a.key_panels + (int64_t(t.head) * a.panels_per_head + a.first_panel[t.segment]) * dim * kLanes;
  const float* values = a.values + (int64_t(t.head) * a.seq_len + first_row) * dim;
  const float* rows_of[kDenseBlock];
  for (int c = 0; c < num_keys_all; c += kDenseBlock) {
    const int num_keys = std::min(kDenseBlock, num_keys_all - c);
    for (int k = 0; k < num_keys; k += kLanes)
      scores_transposed(w, panels + int64_t((c + k) / kLanes) * dim * kLanes, rows, dim, &w.p[k], kDenseBlock);
    for (int m = 0; m < rows; ++m)
      dense_softmax_row(&w.p[size_t(m) * kDenseBlock], num_keys, w.row_max[m], w.row_sum[m], &w.acc[size_t(m) * dim],
                        dim);
    for (int j = 0; j < num_keys; ++j) rows_of[j] = values + int64_t(c + j) * dim;
    accumulate(w, rows_of, rows, dim, num_keys, kDenseBlock);
  }
  for (int m = 0; m < rows; ++m) {
    const float inv = 1.0f / w.row_sum[m];
    float* o = a.out + (int64_t(t.row_begin + m) * a.num_heads + t.head) * a.head_dim;
    for (int d = 0; d < a.head_dim; ++d) o[d] = w.acc[size_t(m) * dim + d] * inv;
  }
}

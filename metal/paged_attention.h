// Helpers for the paged-attention and KV-write kernels (prepended to their bodies as
// `header`). Rows of a pool are addressed as `row = slot * KV_HEADS + kv_head`; a lane
// works on 4-value chunks of a row: chunk c holds values 4c .. 4c+3.

// 4 consecutive values of a float pool row as float4 (one vector load each).
inline float4 load4(const device float* p) { return *((const device float4*)p); }
inline float4 load4(const device half* p) { return float4(*((const device half4*)p)); }
inline float4 load4(const device bfloat16_t* p) {
  // bfloat16 is the upper half of a float32: widen the bits of two packed pairs.
  uint2 w = *((const device uint2*)p);
  return float4(as_type<float>(w.x << 16), as_type<float>(w.x & 0xffff0000u),
                as_type<float>(w.y << 16), as_type<float>(w.y & 0xffff0000u));
}

// Rows of a float pool (num_slots * KV_HEADS, D).
template <typename P, int D>
struct FloatRows {
  const device P* data;
  float4 chunk(int row, int c) const { return load4(data + row * D + 4 * c); }
};

// Rows of a quantized pool: codes (num_slots * KV_HEADS, D * BITS / 32) uint32, scales and
// biases (num_slots * KV_HEADS, D / GROUP). One chunk is one uint32 word (8-bit) or half
// a word (4-bit), and never crosses a group since GROUP is a multiple of 4.
template <typename P, int D, int BITS, int GROUP>
struct QuantRows {
  const device uint32_t* codes;
  const device P* scales;
  const device P* biases;
  float4 chunk(int row, int c) const {
    int group = row * (D / GROUP) + (4 * c) / GROUP;
    float s = float(scales[group]);
    float b = float(biases[group]);
    uint w;
    float4 q;
    if (BITS == 8) {
      w = codes[row * (D / 4) + c];
      q = float4(float(w & 0xffu), float((w >> 8) & 0xffu), float((w >> 16) & 0xffu), float(w >> 24));
    } else {
      w = codes[row * (D / 8) + c / 2] >> (16 * (c & 1));
      q = float4(float(w & 0xfu), float((w >> 4) & 0xfu), float((w >> 8) & 0xfu), float((w >> 12) & 0xfu));
    }
    return q * s + float4(b);
  }
};

// Chunks per lane: a simdgroup of 32 lanes covers D / 4 chunks.
constant constexpr int kLanes = 32;
// Simdgroups per attention threadgroup, at most (sizes its threadgroup memory).
constant constexpr int kMaxSimdgroups = 8;

template <int D>
struct LaneChunks {
  static constant constexpr const int N = (D / 4 + kLanes - 1) / kLanes;
};

// Online-softmax state of one simdgroup over its keys, for R query rows; every lane holds
// the same m and l and its own chunks of the unnormalized outputs.
template <int D, int R>
struct SoftmaxState {
  float m[R];
  float l[R];
  float4 o[R][LaneChunks<D>::N];
};

// The query rows of one threadgroup: `num_tokens` consecutive tokens of one sequence
// (positions first_pos, first_pos + 1, ...) times the GQ query heads from `first_head`,
// which share `kv_head`. Row r is token r / GQ, head first_head + r % GQ.
struct QueryTile {
  int first_token;
  int num_tokens;
  int first_pos;
  int window;  // 0: none
  int first_head;
  int kv_head;
};

// Unnormalized attention of a tile's query rows over keys [begin, end) of its sequence,
// taking every `stride`-th key from begin + offset (one simdgroup's share); each row sees
// the keys its position and the window allow. Each key and value chunk is loaded once for
// all rows. `Table` is the block table's pointer type: MLX passes inputs of fewer than 8
// elements in the constant address space, larger ones in device memory.
// NOTE: every lane of the simdgroup must call this with the same arguments (simd_sum).
template <typename T, int D, int GQ, int QT, int HEADS, int BS, int KV_HEADS, bool SOFTCAP, typename Rows,
          typename Table>
SoftmaxState<D, GQ * QT> attend_keys(
    const device T* queries, QueryTile tile, float scale, float softcap, Rows keys, Rows values, Table table,
    int begin, int end, int offset, int stride, uint lane) {
  constexpr int N = LaneChunks<D>::N;
  constexpr int R = GQ * QT;
  const int rows = tile.num_tokens * GQ;
  float4 q[R][N];
  SoftmaxState<D, R> st;
  for (int r = 0; r < R; r++) {
    st.m[r] = -1e30f;  // finite: fast math may not honour infinities
    st.l[r] = 0.0f;
    int token = tile.first_token + min(r / GQ, tile.num_tokens - 1);
    const device T* x = queries + (token * HEADS + tile.first_head + r % GQ) * D;
    for (int i = 0; i < N; i++) {
      int c = int(lane) + kLanes * i;
      q[r][i] = c < D / 4 ? float4(float(x[4 * c]), float(x[4 * c + 1]), float(x[4 * c + 2]), float(x[4 * c + 3])) * scale
                          : float4(0.0f);
      st.o[r][i] = float4(0.0f);
    }
  }
  for (int k = begin + offset; k < end; k += stride) {
    int row = (table[k / BS] * BS + k % BS) * KV_HEADS + tile.kv_head;
    float4 chunk[N];
    for (int i = 0; i < N; i++) {
      int c = int(lane) + kLanes * i;
      chunk[i] = c < D / 4 ? keys.chunk(row, c) : float4(0.0f);
    }
    float p[R];
    float rescale[R];
    for (int r = 0; r < R; r++) {
      int pos = tile.first_pos + r / GQ;
      bool visible = r < rows && k <= pos && (tile.window == 0 || k > pos - tile.window);
      p[r] = 0.0f;
      rescale[r] = 1.0f;
      if (visible) {  // the same for every lane: depends on k and r only
        float s = 0.0f;
        for (int i = 0; i < N; i++) {
          s += dot(q[r][i], chunk[i]);
        }
        s = simd_sum(s);
        if (SOFTCAP) {
          s = tanh(s / softcap) * softcap;
        }
        float m = max(st.m[r], s);
        rescale[r] = exp(st.m[r] - m);
        p[r] = exp(s - m);
        st.l[r] = st.l[r] * rescale[r] + p[r];
        st.m[r] = m;
      }
    }
    for (int i = 0; i < N; i++) {
      int c = int(lane) + kLanes * i;
      chunk[i] = c < D / 4 ? values.chunk(row, c) : float4(0.0f);
    }
    for (int r = 0; r < rows; r++) {
      for (int i = 0; i < N; i++) {
        st.o[r][i] = st.o[r][i] * rescale[r] + chunk[i] * p[r];
      }
    }
  }
  return st;
}

// Paged attention: one threadgroup of up to 8 simdgroups per (query tile, group of GQ query
// heads sharing a KV head, key split). A tile is up to QT consecutive query tokens of one
// sequence (`tiles`: first token, token count). The simdgroups share the tile's keys
// round-robin, each keeping an online softmax per query row (token x head); threadgroup
// memory merges them. Header defines: BASE_KV_QUANT (pools are codes/scales/biases) and
// BASE_SPLIT (write this split's partial result for the reduce kernel instead of the
// normalized output). Template SINKS: a per-head sink logit (`sinks`, float32) in every softmax.
const int split = int(threadgroup_position_in_grid.x);
const int num_splits = int(threadgroups_per_grid.x);
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const int tid = int(sg) * 32 + int(lane);
const int nsg = int(simdgroups_per_threadgroup);  // chosen at launch: no recompile per context length
QueryTile tile;
tile.first_token = tiles[2 * int(threadgroup_position_in_grid.z)];
tile.num_tokens = tiles[2 * int(threadgroup_position_in_grid.z) + 1];
tile.first_pos = positions[tile.first_token];
tile.window = WINDOW ? window[0] : 0;
tile.first_head = int(threadgroup_position_in_grid.y) * GQ;
tile.kv_head = tile.first_head / (HEADS / KV_HEADS);
const int seq = seq_ids[tile.first_token];

// Keys the tile sees (causal, within the window); this split's share of them.
const int first = WINDOW ? max(0, tile.first_pos - tile.window + 1) : 0;
const int last = tile.first_pos + tile.num_tokens;
const int per_split = (last - first + num_splits - 1) / num_splits;
const int begin = first + split * per_split;
const int end = min(last, begin + per_split);

#if BASE_KV_QUANT
QuantRows<P, D, BITS, GROUP> keys{k_codes, k_scales, k_biases};
QuantRows<P, D, BITS, GROUP> values{v_codes, v_scales, v_biases};
#else
FloatRows<P, D> keys{k_pool};
FloatRows<P, D> values{v_pool};
#endif
SoftmaxState<D, GQ * QT> st = attend_keys<T, D, GQ, QT, HEADS, BS, KV_HEADS, SOFTCAP>(
    queries, tile, params[0], params[1], keys, values, block_tables + seq * block_tables_shape[1],
    begin, end, int(sg), nsg, lane);

// Merge the simdgroups, one query row at a time: rescale each to the common maximum.
threadgroup float tg_m[kMaxSimdgroups];
threadgroup float tg_l[kMaxSimdgroups];
threadgroup float tg_o[kMaxSimdgroups * D];
for (int r = 0; r < tile.num_tokens * GQ; r++) {
  if (lane == 0) {
    tg_m[sg] = st.m[r];
    tg_l[sg] = st.l[r];
  }
  for (int i = 0; i < LaneChunks<D>::N; i++) {
    int c = int(lane) + 32 * i;
    if (c < D / 4) {
      for (int e = 0; e < 4; e++) {
        tg_o[int(sg) * D + 4 * c + e] = st.o[r][i][e];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float m = -1e30f;
  for (int g = 0; g < nsg; g++) {
    m = max(m, tg_m[g]);
  }
  // With SINKS the head's sink logit joins the softmax as one more key with no value; split 0
  // holds it, so the reduce kernel counts it once.
  const float sink = SINKS && split == 0 ? sinks[tile.first_head + r % GQ] : -1e30f;
  m = max(m, sink);
  float l = SINKS && split == 0 ? exp(sink - m) : 0.0f;
  for (int g = 0; g < nsg; g++) {
    l += tg_l[g] * exp(tg_m[g] - m);
  }
  const int out_row = (tile.first_token + r / GQ) * HEADS + tile.first_head + r % GQ;
  for (int d = tid; d < D; d += nsg * 32) {
    float acc = 0.0f;
    for (int g = 0; g < nsg; g++) {
      acc += tg_o[g * D + d] * exp(tg_m[g] - m);
    }
#if BASE_SPLIT
    part_o[(out_row * num_splits + split) * D + d] = acc;
#else
    out[out_row * D + d] = T(l > 0.0f ? acc / l : 0.0f);
#endif
  }
#if BASE_SPLIT
  if (tid == 0) {
    part_ml[(out_row * num_splits + split) * 2] = m;
    part_ml[(out_row * num_splits + split) * 2 + 1] = l;
  }
#endif
  threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next row overwrites tg_*
}

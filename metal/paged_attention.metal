// Paged attention: one threadgroup of NSG simdgroups per (query token, group of GQ query
// heads sharing a KV head, key split). The simdgroups share the token's keys round-robin,
// each keeping an online softmax per query head; threadgroup memory merges them. Header
// defines: BASE_KV_QUANT (pools are codes/scales/biases) and BASE_SPLIT (write this
// split's partial result for the reduce kernel instead of the normalized output).
const int token = int(threadgroup_position_in_grid.z);
const int first_head = int(threadgroup_position_in_grid.y) * GQ;
const int split = int(threadgroup_position_in_grid.x);
const int num_splits = int(threadgroups_per_grid.x);
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const int tid = int(sg) * 32 + int(lane);
const int kv_head = first_head / (HEADS / KV_HEADS);
const int seq = seq_ids[token];
const int qpos = positions[token];

// Keys this query sees: causal, within the sliding window; this split's share of them.
const int first = WINDOW ? max(0, qpos - window[0] + 1) : 0;
const int per_split = (qpos + 1 - first + num_splits - 1) / num_splits;
const int begin = first + split * per_split;
const int end = min(qpos + 1, begin + per_split);

#if BASE_KV_QUANT
QuantRows<P, D, BITS, GROUP> keys{k_codes, k_scales, k_biases};
QuantRows<P, D, BITS, GROUP> values{v_codes, v_scales, v_biases};
#else
FloatRows<P, D> keys{k_pool};
FloatRows<P, D> values{v_pool};
#endif
SoftmaxState<D, GQ> st = attend_keys<T, D, GQ, BS, KV_HEADS, SOFTCAP>(
    queries + (token * HEADS + first_head) * D, params[0], params[1], keys, values,
    block_tables + seq * block_tables_shape[1], kv_head, begin, end, int(sg), NSG, lane);

// Merge the simdgroups, one query head at a time: rescale each to the common maximum.
threadgroup float tg_m[NSG];
threadgroup float tg_l[NSG];
threadgroup float tg_o[NSG * D];
for (int j = 0; j < GQ; j++) {
  if (lane == 0) {
    tg_m[sg] = st.m[j];
    tg_l[sg] = st.l[j];
  }
  for (int i = 0; i < LaneChunks<D>::N; i++) {
    int c = int(lane) + 32 * i;
    if (c < D / 4) {
      for (int e = 0; e < 4; e++) {
        tg_o[int(sg) * D + 4 * c + e] = st.o[j][i][e];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float m = -1e30f;
  for (int g = 0; g < NSG; g++) {
    m = max(m, tg_m[g]);
  }
  float l = 0.0f;
  for (int g = 0; g < NSG; g++) {
    l += tg_l[g] * exp(tg_m[g] - m);
  }
  const int out_row = token * HEADS + first_head + j;
  for (int d = tid; d < D; d += NSG * 32) {
    float acc = 0.0f;
    for (int g = 0; g < NSG; g++) {
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
  threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next head overwrites tg_*
}

// Paged attention on the CPU: the work-item interface between the primitive (attention.cpp)
// and the inner loops, compiled once per instruction set (attention_<isa>.cpp). No MLX types.
#pragma once

#include <cstdint>

namespace base_cpu {

// The K and V rows one work item reads: a sequence's block table into one pool per side,
// each pool plain (float32/float16/bfloat16) or affine-quantized (kv_quant.py).
struct PoolView {
  const void* data;  // plain values, or uint32 codes
  const void* scales;  // quantized only: (slots, kv_heads, head_dim / group_size)
  const void* biases;
  int dtype;  // of the values, or of the scales when quantized: 0 float32, 1 float16, 2 bfloat16
  int bits;  // 0 plain, 8 or 4 quantized
  int group_size;
};

struct AttentionShape {
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale, softcap;  // softcap 0: none
  int window;  // 0: none
  int64_t q_token_stride, q_head_stride;  // in floats (heads * head_dim, head_dim)
};


// One step's attention inputs. Sequence s owns the flattened query rows
// [query_starts[s], query_starts[s + 1]); its i-th row sits at position
// context_lens[s] - query_len + i and sees the keys at positions <= its own.
struct AttentionArgs {
  AttentionShape shape;
  const float* queries;  // (num_tokens, heads, head_dim) row-major
  float* out;  // (num_tokens, heads, head_dim) contiguous
  PoolView keys, values;  // (num_blocks * block_size, kv_heads, head_dim) logical rows
  const int32_t* block_tables;  // (num_seqs, max_blocks)
  const int32_t* context_lens;  // (num_seqs,)
  const int32_t* query_starts;  // (num_seqs + 1,)
};

// Query rows [row_begin, row_end) of sequence `seq`, all query heads of KV head `kv_head`.
struct AttentionTile {
  int seq, kv_head, row_begin, row_end;
};

// Attention without a cache (a vision tower's): every query row of a segment sees every key row of
// that segment, and nothing else. The keys and values come packed (attention.cpp, pack_dense):
// head_dim zero-padded to a multiple of 16, the keys of each segment 16 at a time, transposed.
struct DenseAttentionArgs {
  int num_heads, head_dim, padded_dim, seq_len;
  float scale;
  const float* queries;  // (seq_len, heads, head_dim), rows at q_seq_stride, heads at q_head_stride (floats)
  int64_t q_seq_stride, q_head_stride;
  float* out;  // (seq_len, heads, head_dim) contiguous
  const float* key_panels;  // (heads, panels_per_head, padded_dim, 16): a segment's keys from its first panel
  const float* values;  // (heads, seq_len, padded_dim)
  const int32_t* segments;  // (num_segments + 1,): segment s is rows [segments[s], segments[s + 1])
  const int64_t* first_panel;  // (num_segments,): each segment's first panel within a head
  int64_t panels_per_head;
};

// Query rows [row_begin, row_end) of segment `segment` (absolute rows), head `head`.
struct DenseTile {
  int head, segment, row_begin, row_end;
};

struct AttentionKernels {
  const char* isa;
  void (*attend)(const AttentionArgs&, const AttentionTile&);
  void (*attend_dense)(const DenseAttentionArgs&, const DenseTile&);
};

// One step's attention over `num_seqs` sequences: split into tiles and run with the active
// instruction set, on the thread pool when the step is large (attention.cpp).
void attend_step(const AttentionArgs& args, int num_seqs);

// Throws std::invalid_argument unless every index attend_step follows stays inside its array:
// query_starts ascending within the `num_tokens` query rows, each sequence's query rows at most
// its context and its context within its block table, and each block it reads one of the pool's
// `num_blocks`. Call it in the dispatched task (only there do the contents exist), before
// attend_step; it reads what the kernel reads of the tables, a small part of one step's work.
void check_step_indices(const AttentionArgs& args, int num_seqs, int64_t num_tokens, int64_t num_blocks);

// The loops for the active instruction set (attention.cpp).
const AttentionKernels& active_attention_kernels();

namespace generic {
const AttentionKernels& attention_kernels();
}
namespace avx2 {
const AttentionKernels& attention_kernels();
}
namespace avx512 {
const AttentionKernels& attention_kernels();
}

}  // namespace base_cpu

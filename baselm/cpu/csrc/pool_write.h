// The KV write as an MLX graph node (attention.cpp), for the primitives that build on it.
#pragma once

#include "mlx/array.h"

namespace base_cpu {

// The pool (num_blocks, block_size, kv_heads, head_dim) with rows (num_tokens, kv_heads, head_dim)
// at the slots; in place when the graph holds the pool's only reference.
mlx::core::array write_pool(const mlx::core::array& pool, const mlx::core::array& rows, const mlx::core::array& slots);

}  // namespace base_cpu

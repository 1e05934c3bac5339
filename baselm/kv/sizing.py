"""How many KV blocks the pool gets: one rule, for every engine (`LLMEngine`, a prefill rank).

With `kv_memory` (--kv-memory) the pool is that many bytes; a request too long for it is refused
when it arrives (the scheduler's fit check). Without, it is sized from the context and the
sequences the command expects:

    ceiling = memory / MEMORY_FRACTION / bytes per token   (memory: the GPU's, else the system's)
    context = min(max_model_len, ceiling - lookahead)       (in whole blocks)
    per_seq = context + lookahead
    tokens  = min(max_num_seqs * per_seq, max(per_seq, min(SHARED_TOKENS, ceiling)))

`max_model_len` is the model's own context, --max-model-len, or for `base run` the prompt plus
--max-tokens; `lookahead` the speculative tokens a step verifies; `max_num_seqs` is 1 for `base
run` and `base chat`, --max-num-seqs for `base serve`. Sequences share one paged pool and hold
only the blocks they use, so past one whole context the pool stops at SHARED_TOKENS (16
sequences of 1,024 tokens): when running requests fill it, the newest is preempted and
recomputed later, as llama.cpp's server shares one total context among its slots. Like vLLM's
memory fraction, the ceiling keeps the pool to a share of memory: when one context alone would
take more, the context is shortened to what fits (the engine's max_model_len), so every request
the engine admits can finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from baselm.config import EngineConfig

SHARED_TOKENS = 16 * 1024  # the default pool past one context: --max-num-seqs 16 x 1,024 tokens
MEMORY_FRACTION = 5  # the default pool takes at most 1/5 of memory
UNKNOWN_MEMORY = 8 * 2**30  # assumed when the OS does not say


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    """The pool an engine makes, and the context every request it admits must fit in."""

    num_blocks: int
    max_model_len: int  # as asked, or shortened so that one context fits the default pool


def kv_pool_size(
    config: EngineConfig, max_model_len: int, bytes_per_token: int, memory_bytes: int | None
) -> KVPoolSize:
    """The pool for `config` over a model whose cached token takes `bytes_per_token` (every
    layer's K and V), given the context `max_model_len` and the memory the pool shares."""
    block_size = config.block_size
    if config.kv_memory is not None:
        return KVPoolSize(max(1, config.kv_memory // (bytes_per_token * block_size)), max_model_len)
    lookahead = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    ceiling = (memory_bytes or UNKNOWN_MEMORY) // MEMORY_FRACTION // bytes_per_token
    room = (ceiling - lookahead) // block_size * block_size  # whole blocks, the lookahead left over
    context = min(max_model_len, max(block_size, room))
    per_seq = context + lookahead
    tokens = min(config.max_num_seqs * per_seq, max(per_seq, min(SHARED_TOKENS, ceiling)))
    return KVPoolSize(-(-tokens // block_size), context)

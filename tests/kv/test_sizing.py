"""The default KV pool: config and model shapes in, blocks (and the context they admit) out.

Shapes are real models' (per cached token, every layer's K and V): SmolLM2-135M on the CPU
(float32 pools), Qwen2.5-0.5B on the CPU, Llama-3.1-8B on a GPU (float16 pools).
"""

from __future__ import annotations

import mlx.core as mx

from baselm.config import EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from baselm.kv import PagedKVCache
from baselm.kv.sizing import SHARED_TOKENS, KVPoolSize, kv_pool_size
from tests.tiny_model import loaded_fixture

MiB, GiB = 2**20, 2**30
SMOLLM2_CPU = PagedKVCache.bytes_per_token(30, 3, 64, mx.float32, 16)  # 45 KiB
QWEN05_CPU = PagedKVCache.bytes_per_token(24, 2, 64, mx.float32, 16)  # 24 KiB
LLAMA8B_GPU = PagedKVCache.bytes_per_token(32, 8, 128, mx.float16, 16)  # 128 KiB


def pool_bytes(size: KVPoolSize, bytes_per_token: int, block_size: int = 16) -> int:
    return size.num_blocks * block_size * bytes_per_token


def test_the_shapes_are_what_the_models_cache_per_token():
    assert (SMOLLM2_CPU, QWEN05_CPU, LLAMA8B_GPU) == (46080, 24576, 131072)


def test_kv_memory_is_the_pool_and_keeps_the_context():
    size = kv_pool_size(EngineConfig(kv_memory=90 * MiB), 8192, SMOLLM2_CPU, 16 * GiB)
    assert size == KVPoolSize(num_blocks=128, max_model_len=8192)  # 90 MiB / (16 x 45 KiB)


def test_kv_memory_smaller_than_a_block_still_gives_one():
    assert kv_pool_size(EngineConfig(kv_memory=1), 8192, SMOLLM2_CPU, 16 * GiB).num_blocks == 1


def test_run_holds_its_one_request():
    # `base run`: one sequence; its context is the prompt plus --max-tokens in whole blocks.
    size = kv_pool_size(EngineConfig(max_num_seqs=1, max_model_len=64), 64, QWEN05_CPU, 16 * GiB)
    assert size == KVPoolSize(num_blocks=4, max_model_len=64)
    assert pool_bytes(size, QWEN05_CPU) == 1536 * 1024


def test_speculative_tokens_get_room_past_the_context():
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    size = kv_pool_size(EngineConfig(max_num_seqs=1, speculative=spec), 64, QWEN05_CPU, 16 * GiB)
    assert size == KVPoolSize(num_blocks=5, max_model_len=64)  # 68 tokens


def test_chat_holds_one_whole_context():
    size = kv_pool_size(EngineConfig(max_num_seqs=1), 8192, SMOLLM2_CPU, 16 * GiB)
    assert size == KVPoolSize(num_blocks=512, max_model_len=8192)
    assert pool_bytes(size, SMOLLM2_CPU) == 360 * MiB


def test_serve_shares_the_pool_past_one_context():
    # 16 sequences of 8,192 tokens would be 5.6 GiB; they share SHARED_TOKENS instead.
    size = kv_pool_size(EngineConfig(max_num_seqs=16), 8192, SMOLLM2_CPU, 16 * GiB)
    assert size == KVPoolSize(num_blocks=SHARED_TOKENS // 16, max_model_len=8192)
    assert pool_bytes(size, SMOLLM2_CPU) == 720 * MiB


def test_serve_of_a_long_context_reserves_one_context_not_one_per_sequence():
    size = kv_pool_size(EngineConfig(max_num_seqs=8), 32768, QWEN05_CPU, 16 * GiB)
    assert size == KVPoolSize(num_blocks=2048, max_model_len=32768)
    assert pool_bytes(size, QWEN05_CPU) == 768 * MiB


def test_few_short_sequences_get_only_their_contexts():
    size = kv_pool_size(EngineConfig(max_num_seqs=2), 4096, SMOLLM2_CPU, 16 * GiB)
    assert size.num_blocks == 512  # 2 x 4,096 tokens, under SHARED_TOKENS


def test_a_context_larger_than_a_fifth_of_memory_is_shortened():
    # 128k tokens of Llama-3.1-8B are 16 GiB; a fifth of 16 GiB holds 26,214 tokens.
    size = kv_pool_size(EngineConfig(max_num_seqs=1), 131072, LLAMA8B_GPU, 16 * GiB)
    assert size == KVPoolSize(num_blocks=1638, max_model_len=26208)
    assert pool_bytes(size, LLAMA8B_GPU) <= 16 * GiB // 5


def test_the_memory_ceiling_bounds_the_shared_pool_too():
    # A fifth of 1 GiB holds 4,660 SmolLM2 tokens: the context is cut to 4,656 and 16 sequences share 4,660.
    size = kv_pool_size(EngineConfig(max_num_seqs=16), 8192, SMOLLM2_CPU, 1 * GiB)
    assert size == KVPoolSize(num_blocks=292, max_model_len=4656)


def test_unknown_memory_is_taken_as_8_gib():
    assert kv_pool_size(EngineConfig(max_num_seqs=1), 131072, LLAMA8B_GPU, None) == kv_pool_size(
        EngineConfig(max_num_seqs=1), 131072, LLAMA8B_GPU, 8 * GiB
    )


def test_the_engine_sizes_its_pool_by_the_rule():
    loaded = loaded_fixture()  # 512 positions
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1))
    assert (engine.cache.num_blocks, engine.max_model_len) == (32, 512)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_model_len=100))
    assert (engine.cache.num_blocks, engine.max_model_len) == (25, 100)  # 400 tokens

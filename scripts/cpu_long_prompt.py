"""CPU time of a long prompt's prefill beside decoding streams, step by step through the model.

The `base bench --long-prompt` scenario without the engine: 4 streams decode while an N-token
prompt is fed in chunks (the step's token budget minus the decode rows). It reports the
process's CPU seconds as well as wall seconds, because on a shared machine wall time swings
with the neighbours' load while the CPU time a step costs does not. Compare runs with and
without the CPU kernels (`BASE_CPU_KERNELS=0`); for a single-core figure set
`BASE_CPU_THREADS=1 OPENBLAS_NUM_THREADS=1` (idle pool workers spin, which CPU time counts).

    python scripts/cpu_long_prompt.py MODEL.gguf --prompt-tokens 2000 --budget 64
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from baselm import cpu
from baselm.backend import select_backend
from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.loader import load_model

BLOCK_SIZE = 16
NUM_STREAMS = 4
STREAM_CONTEXT = 300


def run(model_path: str, prompt_tokens: int, budget: int) -> dict:
    import mlx.core as mx  # after baselm, which loads the optimized BLAS before mlx.core

    model = load_model(model_path, select_backend("cpu")).model
    blocks_per_seq = -(-(prompt_tokens + STREAM_CONTEXT) // BLOCK_SIZE)
    cache = PagedKVCache.for_model(model, num_blocks=(NUM_STREAMS + 1) * blocks_per_seq + 1, block_size=BLOCK_SIZE)
    tables = [list(range(1 + s * blocks_per_seq, 1 + (s + 1) * blocks_per_seq)) for s in range(NUM_STREAMS + 1)]
    ids = np.random.default_rng(0).integers(100, 10000, prompt_tokens).tolist()
    chunk = budget - NUM_STREAMS
    streams = [STREAM_CONTEXT] * NUM_STREAMS
    wall, cpu_time, done = time.perf_counter(), time.process_time(), 0
    while done < prompt_tokens:
        n = min(chunk, prompt_tokens - done)
        streams = [c + 1 for c in streams]
        query_lens, context_lens = [1] * NUM_STREAMS + [n], [*streams, done + n]
        logits_rows = list(np.cumsum(query_lens) - 1)
        meta = AttentionMetadata.build(tables, query_lens, context_lens, BLOCK_SIZE, logits_rows)
        tokens = mx.array([5] * NUM_STREAMS + ids[done : done + n])
        mx.eval(model(tokens, meta.positions, meta, cache))
        done += n
    return {
        "kernels": cpu.describe(),
        "prompt_tokens": prompt_tokens,
        "budget": budget,
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(time.process_time() - cpu_time, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(run(args.model, args.prompt_tokens, args.budget)))


if __name__ == "__main__":
    main()

"""`python -m tests.distributed.tp_prefix_ranks FOLDER FILE N [SHIFT]`: one run of the model at FOLDER
over N ranks (1: this process alone) with `--prefix-cache-file FILE`, as a server's life: load
the files, answer PROMPT (each token id + SHIFT) greedily, save and stop. Prints one JSON line:
the tokens and the prefix cache counters of that first request; warnings go to stderr."""

from __future__ import annotations

import json
import logging
import sys

from baselm.backend import select_backend
from baselm.config import EngineConfig
from baselm.distributed.tp.launch import DistOptions, load
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.sampling.params import SamplingParams

PROMPT = list(range(1, 70))  # 69 tokens: 4 full blocks of 16 (64 tokens the cache can serve) and 5 more
CONFIG = {"kv_memory": 4_000_000, "max_num_batched_tokens": 48, "max_num_seqs": 8}


def main(folder: str, file: str, size: str, shift: str = "0") -> dict:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    dist = DistOptions(tensor_parallel=int(size), prefix_cache_file=file) if int(size) > 1 else None
    loaded = load_model(folder, select_backend("cpu")) if dist is None else load(folder, "cpu", False, dist)[0]
    engine = LLMEngine(loaded, EngineConfig(**CONFIG, prefix_cache_file=file))
    result = engine.generate([[t + int(shift) for t in PROMPT]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    stats = engine.stats()
    engine.save_prefix_cache()
    if dist is not None:
        loaded.model.stop()
    return {
        "tokens": result.completions[0].token_ids,
        "hits": stats.prefix_cache_hits,
        "queries": stats.prefix_cache_queries,
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])), flush=True)

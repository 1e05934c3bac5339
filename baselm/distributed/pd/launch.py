"""Forming a prefill/decode group and giving each rank its part.

`make_node` builds this process's rank once the group is formed: a `PrefillWorker` on ranks
0..P-1, a decode `LLMEngine` (with speculative decoding when configured) on ranks P..P+D-1,
and checks that every rank's KV pool has the same block layout. Rank 0 then wraps its node in
a `PDEngine` for the server; the other ranks run `pd_node.serve` until rank 0 says stop.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import replace

from baselm import blas
from baselm.config import ConfigError, EngineConfig
from baselm.distributed.pd.node import Layout, Node
from baselm.distributed.pd.prefill import PrefillWorker
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.toolcalls.forcing import model_processor_factory


def share_cores(num_local_ranks: int) -> int:
    """Gives this rank 1/num_local_ranks of the machine's cores for OpenBLAS, whose threads spin
    while they wait: ranks sharing a machine with all threads each starved each other (measured
    with SmolLM2 on 2 cores, 2 ranks: 62.5 s against 14.9 s for a batch). Our CPU kernels keep
    their threads: their workers give up spinning and the caller does the work alone, and halving
    them made the same batch slower (18.6 s against 8.3 s). Returns the OpenBLAS thread count."""
    threads = max(1, (os.cpu_count() or 1) // num_local_ranks)
    if blas.status["library"] is not None:
        ctypes.CDLL(blas.status["library"]).openblas_set_num_threads(threads)
    return threads


def make_node(loaded: LoadedModel, config: EngineConfig, layout: Layout, group) -> Node:
    """This process's rank of a formed group (`group`: an mx.distributed Group of layout.size ranks).
    The rank makes constrained requests' processors for its own copy of the model."""
    if group.size() != layout.size:
        raise ConfigError(f"--pd {layout} needs {layout.size} ranks, but the group has {group.size()}")
    rank = group.rank()
    constraints = model_processor_factory(loaded)
    if layout.role(rank) == "prefill":
        node = Node(group, layout, worker=PrefillWorker(loaded, config, rank), constraints=constraints)
    else:
        # NOTE: a decode rank's prefix cache holds what was shipped to it; the files belong to the prefill ranks.
        engine = LLMEngine(loaded, replace(config, prefix_cache_file=None))
        node = Node(group, layout, engine=engine, constraints=constraints)
    node.check_layouts()
    return node

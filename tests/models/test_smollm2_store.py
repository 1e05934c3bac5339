"""SmolLM2's GGUF pulled into the store: kept as it is, as q8 and as q4, against the GGUF loaded directly.

For each reference prompt the GGUF's own greedy continuation (16 tokens, through the engine) is
the target. A stored variant is then run once over prompt + continuation (teacher forcing): its
greedy tokens equal the GGUF's for exactly as many steps as its argmax agrees with the
continuation from the first step on, since up to the first disagreement both see the same
context. All runs are on the CPU backend (float32 compute), which is deterministic.

What happens, measured with this file (Q4_1 body, Q8_0 tied embeddings):
- kept (`q4_1`): the triplets are the GGUF's bit for bit, so the logits are identical at every
  step of every prompt and all 16 tokens match.
- `q8` and `q4` (default profile): requantizing a GGUF to at least its own bits in its own
  groups of 32 widens each block exactly (codes shifted left, scales divided by a power of two),
  so the Q4_1 body as q4 or q8 and the Q8_0 embedding as q8 hold the same values: the logits
  are identical to the GGUF's and all 16 tokens match. (Rounded afresh in groups of 64, q8
  flipped the France chat prompt at step 0, margin 0.082, and q4 kept all 16 tokens on only
  2 of 8 prompts.)
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from baselm.backend import select_backend
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.loader import LoadedModel, load_model
from baselm.sampling.params import SamplingParams
from baselm.store.import_local import import_local
from baselm.store.registry import Store

pytestmark = pytest.mark.slow

NUM_TOKENS = 16
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def backend():
    return select_backend("cpu")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """A store that `load_model` resolves names in."""
    root = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BASE_HOME", str(root))
        yield Store(root)


@pytest.fixture(scope="module")
def prompts(smollm2_reference) -> list[list[int]]:
    return [case["prompt_token_ids"] for case in smollm2_reference["cases"]]


@pytest.fixture(scope="module")
def gguf_run(smollm2_gguf: Path, backend, prompts) -> tuple[list[list[int]], list[np.ndarray]]:
    """The GGUF's greedy tokens (engine) and its teacher-forced logits over them, per prompt."""
    loaded = load_model(smollm2_gguf, backend)
    engine = LLMEngine(loaded, EngineConfig(kv_memory=64 * 2**20))
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    tokens = [r.completions[0].token_ids for r in engine.generate(prompts, params)]
    logits = [forced_logits(loaded, p, t) for p, t in zip(prompts, tokens)]
    # Teacher forcing reproduces the engine's greedy run (the premise of the counts below).
    assert [list(step_logits.argmax(axis=-1)) for step_logits in logits] == tokens
    return tokens, logits


def forced_logits(loaded: LoadedModel, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logits at each of the `len(tokens)` steps, from one pass over prompt + tokens[:-1]."""
    ids = prompt + tokens[:-1]
    num_blocks = len(ids) // BLOCK_SIZE + 1
    cache = PagedKVCache.for_model(loaded.model, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    steps = list(range(len(prompt) - 1, len(ids)))
    meta = AttentionMetadata.build([list(range(num_blocks))], [len(ids)], [len(ids)], BLOCK_SIZE, steps)
    return np.array(loaded.model(mx.array(ids), meta.positions, meta, cache))  # (len(tokens), vocab)


def matching_tokens(logits: np.ndarray, tokens: list[int]) -> int:
    agree = logits.argmax(axis=-1) == np.array(tokens)
    return len(tokens) if agree.all() else int(np.argmin(agree))


def test_the_kept_gguf_variant_gives_the_ggufs_logits_exactly(smollm2_gguf, store, backend, prompts, gguf_run) -> None:
    model = import_local(smollm2_gguf, supported={"llama"}, store=store)
    assert model.ref == "HuggingFaceTB/smollm2-135M-8k-lc100k-mix1-ep2:q4_1"  # named by its GGUF metadata
    loaded = load_model(model.ref, backend)
    tokens, expected = gguf_run
    for prompt, continuation, gguf_logits in zip(prompts, tokens, expected):
        assert np.array_equal(forced_logits(loaded, prompt, continuation), gguf_logits)


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_q8_and_q4_variants_carry_the_ggufs_weights_exactly(
    quant, smollm2_gguf, store, backend, prompts, gguf_run
) -> None:
    model = import_local(smollm2_gguf, quant=quant, supported={"llama"}, store=store)
    assert model.ref == f"HuggingFaceTB/smollm2-135M-8k-lc100k-mix1-ep2:{quant}"
    loaded = load_model(model.ref, backend)
    tokens, expected = gguf_run
    for prompt, continuation, gguf_logits in zip(prompts, tokens, expected):
        logits = forced_logits(loaded, prompt, continuation)
        assert matching_tokens(logits, continuation) == NUM_TOKENS
        assert np.array_equal(logits, gguf_logits)

"""`base doctor`'s self-benchmark: what decode speed to expect on this machine, measured in about
two seconds. Decoding a token reads every weight once, so the memory read bandwidth (measured as
`base bench --synthetic` measures its roofline, on a smaller buffer) bounds tok/s for a model of any
size; and when the default model is stored, a short decode of it says what a real model reaches."""

from __future__ import annotations

from typing import Any

from baselm.backend import Backend

READ_BYTES = 256 * 2**20  # the buffer read for the bandwidth: past every cache, quick to fill
PROMPT_TOKENS, GEN_TOKENS = 16, 32  # the measured decode, after a warm-up of 4 tokens
SIZES_GIB = (1, 4)  # model sizes the bandwidth's bound is said for


def measure_speed(backend: Backend) -> dict[str, Any]:
    """The read bandwidth, and a one-stream decode of the default model when the store holds it
    (None otherwise)."""
    from baselm.commands.bench_synthetic import stream_bandwidth

    bandwidth = stream_bandwidth(backend, READ_BYTES, repeats=3)
    return {"read_gb_s": round(bandwidth / 1e9, 1), "decode": _default_model_decode(backend)}


def _default_model_decode(backend: Backend) -> dict[str, Any] | None:
    from baselm.commands.bench import throughput
    from baselm.config import EngineConfig
    from baselm.engine import LLMEngine
    from baselm.loader import load_model
    from baselm.store.default_model import STORE_NAME
    from baselm.store.registry import Store

    stored = sorted((m for m in Store().list() if m.name == STORE_NAME), key=lambda m: m.size)
    if not stored:
        return None
    loaded = load_model(stored[0].path, backend)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, max_model_len=256, kv_memory=32 * 2**20))
    throughput(engine, 1, 8, 4, seed=0)  # warm-up: the first steps build kernels and caches
    result = throughput(engine, 1, PROMPT_TOKENS, GEN_TOKENS, seed=0)
    return {
        "model": stored[0].ref,
        "weight_bytes": stored[0].size,
        "prompt_tokens": PROMPT_TOKENS,
        "gen_tokens": GEN_TOKENS,
        "decode_tok_s": round(result["decode_tok_s_per_stream"], 1),
        "prefill_tok_s": round(result["prefill_tok_s"], 1),
    }


def describe(speed: dict[str, Any] | None) -> str:
    """The Speed row: what was measured, and what it bounds for larger models."""
    if speed is None:
        return "not measured (--no-speed)"
    bandwidth = speed["read_gb_s"]
    bounds = " and ".join(f"~{bandwidth * 1e9 / (gib * 2**30):.1f} tok/s for {gib} GiB" for gib in SIZES_GIB)
    text = f"memory reads {bandwidth} GB/s, which bounds decode at {bounds} of weights"
    decode = speed["decode"]
    if decode is None:
        return f"{text} (with the default model stored, `make model`, doctor also decodes it)"
    return (
        f"{decode['model']}: decode {decode['decode_tok_s']} tok/s, prefill {decode['prefill_tok_s']:.0f} tok/s "
        f"(1 stream, {decode['gen_tokens']} tokens, measured now: a busy machine measures less); {text}"
    )

"""The prefix cache file: blocks survive a restart with the same answers; anything that does not fit is
ignored with one warning; a kill during a save leaves the previous file whole."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from baselm.async_engine import AsyncEngine
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.kv.persist import MAGIC
from baselm.sampling.params import SamplingParams
from tests.paths import LLAMA_FIXTURE
from tests.tiny_model import loaded_widened_llama

PROMPT = [(11 * i) % 300 + 5 for i in range(70)]  # four full blocks of 16 and a partial one
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def engine_with(path: Path, loaded=None, **options) -> LLMEngine:
    options.setdefault("kv_memory", 2**20)
    return LLMEngine(loaded or loaded_widened_llama("tiny"), EngineConfig(prefix_cache_file=str(path), **options))


def answer(engine: LLMEngine, prompt=PROMPT) -> tuple[list[int], int]:
    (result,) = engine.generate([prompt], GREEDY)
    return result.completions[0].token_ids, result.num_cached_tokens


def test_cached_blocks_survive_a_restart_and_give_the_same_answer(tmp_path) -> None:
    path = tmp_path / "prefix.kvc"
    first = engine_with(path)
    cold, cached = answer(first)
    assert cached == 0
    assert first.save_prefix_cache() >= 4
    assert first.save_prefix_cache() is None  # unchanged since: nothing written
    second = engine_with(path)
    warm, cached = answer(second)
    assert warm == cold and cached == 64
    assert second.stats().num_used_blocks == 0


def test_quantized_kv_round_trips_too(tmp_path) -> None:
    path = tmp_path / "prefix.kvc"
    cold, _ = answer(first := engine_with(path, kv_bits=8))
    first.save_prefix_cache()
    warm, cached = answer(engine_with(path, kv_bits=8))
    assert (warm, cached) == (cold, 64)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"block_size": 32}, "block_size"),
        ({"kv_bits": 8}, "arrays"),
        ("weights", "weights"),
        ("truncate", "truncated"),
        ("corrupt", "corrupt"),
        ("garbage", "not a prefix cache file"),
    ],
)
def test_a_file_that_does_not_fit_is_ignored_with_one_warning(tmp_path, caplog, change, reason) -> None:
    path = tmp_path / "prefix.kvc"
    first = engine_with(path)
    cold, _ = answer(first)
    first.save_prefix_cache()
    options, loaded = {}, None
    if isinstance(change, dict):
        options = change
    elif change == "weights":
        other = tmp_path / "other"
        shutil.copytree(LLAMA_FIXTURE, other)
        (other / "config.json").write_text((other / "config.json").read_text() + "\n")
        loaded = dataclasses.replace(loaded_widened_llama("tiny"), path=other)
    elif change == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif change == "corrupt":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(b"not a cache at all")
    with caplog.at_level(logging.WARNING, logger="baselm.kv"):
        engine = engine_with(path, loaded, **options)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0] and "empty cache" in warnings[0]
    assert engine.kv_manager.pool.num_cached_blocks == 0
    tokens, cached = answer(engine)
    assert cached == 0 and (tokens == cold or options)


def test_the_file_keeps_the_most_recently_used_blocks_within_its_size(tmp_path) -> None:
    path = tmp_path / "prefix.kvc"
    probe = engine_with(path)
    per_block = probe.cache.nbytes // probe.cache.num_blocks
    engine = engine_with(path, prefix_cache_max_size=2 * per_block)
    answer(engine, [200 + i for i in range(40)])  # older: two full blocks
    answer(engine)  # newer: four full blocks
    assert engine.save_prefix_cache() == 2
    restarted = engine_with(path)
    assert restarted.kv_manager.pool.num_cached_blocks == 2
    _, cached = answer(restarted)
    assert cached == 32  # the newest prompt's head: a prefix's tail goes before its head, as in the pool
    _, cached = answer(restarted, [200 + i for i in range(40)])
    assert cached == 0  # the older prompt's blocks did not fit


def test_the_engine_thread_saves_at_shutdown(tmp_path) -> None:
    path = tmp_path / "prefix.kvc"
    client = AsyncEngine(engine_with(path)).start()
    future = client.call(lambda engine: engine.generate([PROMPT], GREEDY))
    cold = future.result(timeout=60)[0].completions[0].token_ids
    client.stop()
    assert path.read_bytes().startswith(MAGIC)
    tokens, cached = answer(engine_with(path))
    assert (tokens, cached) == (cold, 64)


def test_a_kill_during_a_save_leaves_the_previous_file_whole(tmp_path) -> None:
    path = tmp_path / "prefix.kvc"
    first = engine_with(path)
    cold, _ = answer(first)
    first.save_prefix_cache()
    before = path.read_bytes()
    script = textwrap.dedent(
        f"""
        import sys, time
        import baselm.kv.persist as persist
        from tests.kv.test_persist import engine_with, answer
        from pathlib import Path
        real = persist.xxhash.xxh3_64_hexdigest
        calls = []
        def slow(data):
            calls.append(1)
            if len(calls) == 3:  # in the middle of writing the arrays
                print("writing", flush=True)
                time.sleep(60)
            return real(data)
        engine = engine_with(Path({str(path)!r}))
        answer(engine, [300 + i for i in range(50)])
        persist.xxhash.xxh3_64_hexdigest = slow
        engine.save_prefix_cache()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert path.read_bytes() == before
    tokens, cached = answer(engine_with(path))
    assert (tokens, cached) == (cold, 64)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the next load cleaned up


def test_a_prefix_cache_file_needs_prefix_caching() -> None:
    from baselm.config import ConfigError

    with pytest.raises(ConfigError, match="prefix caching"):
        EngineConfig(prefix_cache_file="x", enable_prefix_caching=False)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_weights_file_fingerprint_follows_its_bytes_and_reads_only_samples(tmp_path) -> None:
    from baselm.kv import persist

    size = persist._HEAD + 64 * persist._SAMPLE * 3  # larger than what the fingerprint reads
    data = bytearray(os.urandom(size))
    first = persist.weights_fingerprint(_write(tmp_path / "m.gguf", bytes(data)))
    assert persist.weights_fingerprint(_write(tmp_path / "m.gguf", bytes(data))) == first
    retrained = bytearray(b ^ 1 for b in data[: persist._HEAD]) + data[persist._HEAD :]
    assert persist.weights_fingerprint(_write(tmp_path / "m.gguf", bytes(retrained))) != first
    offsets = persist._sample_offsets(size)
    assert len(offsets) == 64 and offsets[0] == persist._HEAD and offsets[-1] < size
    for where in (offsets[10], offsets[-1] + persist._SAMPLE - 1):  # a byte inside a window
        edited = bytearray(data)
        edited[where] ^= 0xFF
        assert persist.weights_fingerprint(_write(tmp_path / "m.gguf", bytes(edited))) != first
    assert persist.weights_fingerprint(_write(tmp_path / "m.gguf", bytes(data) + b"\0")) != first
    assert sum(persist._SAMPLE for _ in offsets) + persist._HEAD < size  # not every byte is read


def test_a_model_folder_fingerprint_covers_every_file(tmp_path) -> None:
    from baselm.kv import persist

    _write(tmp_path / "config.json", b"{}")
    _write(tmp_path / "model.safetensors", b"x" * 1000)
    first = persist.weights_fingerprint(tmp_path)
    _write(tmp_path / "config.json", b'{"a": 1}')
    assert persist.weights_fingerprint(tmp_path) != first


def peak_bytes_allocated(work) -> int:
    """The most bytes Python and NumPy held at once above the start while `work()` ran."""
    import tracemalloc

    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_file_of_another_model_is_refused_by_its_header_without_reading_its_blocks(tmp_path, caplog) -> None:
    path = tmp_path / "prefix.kvc"
    other = tmp_path / "other"
    shutil.copytree(LLAMA_FIXTURE, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")
    engine = engine_with(path, dataclasses.replace(loaded_widened_llama("tiny"), path=other))  # no file yet
    saver = engine_with(path)
    answer(saver)
    saver.save_prefix_cache()
    with path.open("r+b") as f:  # the other model's file, its data grown to 64 MiB (sparse: nothing is written)
        f.truncate(path.stat().st_size + 64 * 2**20)
    with caplog.at_level(logging.WARNING, logger="baselm.kv"):
        peak = peak_bytes_allocated(engine.prefix_file.load)
    assert peak < 2**20  # the header alone was read
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "another model" in warning and "weights" in warning
    assert engine.kv_manager.pool.num_cached_blocks == 0


def test_a_file_with_more_blocks_than_the_pool_loads_the_most_recent_that_fit_reading_no_more(tmp_path) -> None:
    from baselm.kv import persist

    path = tmp_path / "prefix.kvc"
    large, small = engine_with(path, kv_memory=8 * 2**20), engine_with(path, kv_memory=2**20)  # 1024 and 128 blocks
    cold, _ = answer(large)
    recent = persist._recent_cached_blocks(large.kv_manager)  # the prompt's four full blocks
    rest = [b for b in range(large.cache.num_blocks) if b not in {block.block_id for block in recent}]
    hashes = [b.block_hash for b in recent] + [2**100 + b for b in rest]  # every other block, as if cached
    persist.write_file(path, large.cache, large.prefix_file.stamp, hashes, [b.block_id for b in recent] + rest)
    assert path.stat().st_size > 8 * 2**20
    peak = peak_bytes_allocated(small.prefix_file.load)
    assert peak < 2 * 2**20  # about the 1 MiB of blocks kept, not the 8 MiB file
    assert small.kv_manager.pool.num_cached_blocks == small.cache.num_blocks == 128
    tokens, cached = answer(small)
    assert (tokens, cached) == (cold, 64)

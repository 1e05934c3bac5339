"""The prefix cache on disk: full cached blocks, their chained hashes and their K/V, across restarts.

File layout (little-endian):

    b"BASEKVC1" | u64 header_len | header JSON | data | footer JSON | u64 footer_len

The header holds the format version, the fingerprint (the model's weights: a `.base` file's
header checksum, else an xxh3 sampled over the model's files; the KV layout: layers, KV heads, head
dim, block size, dtype, kv bits) and the block hashes, most recently used first. The data is
array-major: for each layer, K then V, each pool array (one, or codes/scales/biases for a
quantized pool) holds the saved blocks' rows back to back. The footer holds an xxh3-64 of each
group of 64 rows of each array, so a pool smaller than the file reads only the groups it keeps;
the header is checked before any data is read. A file whose fingerprint differs, that is
truncated or whose bytes fail their checksums is ignored with one warning line: the engine
starts with an empty cache.

Writes go to a temporary file that is fsynced and renamed over the old one (store.fs), so a
kill at any point leaves the previous file whole. Loading puts the blocks back as free cached
blocks, in their LRU order, so the first request with the same prefix hits them.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np
import xxhash

from baselm.kv.cache import PagedKVCache, pool_arrays, set_pool_rows
from baselm.kv.manager import KVCacheManager
from baselm.store.fs import atomic_write

log = logging.getLogger("baselm.kv")

MAGIC = b"BASEKVC1"
VERSION = 2  # 2: a checksum for each group of _GROUP blocks of an array, not one for the whole array
_GROUP = 64  # blocks an array's checksum covers: a load reads whole groups, no more than the pool keeps
_LEN = struct.Struct("<Q")
GROUP_SUFFIX = ".tp"  # rank R of a tensor-parallel group keeps FILE.tpR (dist/tp_persist.py)


_HEAD = 4 * 2**20  # the first bytes of each file: a GGUF's metadata and tensor table, a config, a safetensors header
_SAMPLES, _SAMPLE = 64, 64 * 2**10  # then 64 evenly spaced 64 KiB windows of the rest


def weights_fingerprint(path: Path) -> str:
    """What identifies a model's weights: a `.base` file's header checksum, else an xxh3 of its
    file(s) sampled: names, sizes, the head of each file and 64 windows spread over the rest.

    Sampling reads ~8 MiB however large the model is, where hashing every byte read the whole
    file again at each start. Weights trained further change every tensor, so they change the
    windows; a file edited in one place between windows would keep its fingerprint (the cached
    K/V would then be stale), which is why a `.base` file uses its own checksummed header."""
    if path.suffix == ".base":
        from baselm.store.base_reader import BaseFile

        return "base:" + BaseFile.open(path).header["header_xxh64"]
    digest = xxhash.xxh3_64()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        size = file.stat().st_size
        digest.update(file.name.encode() + b"\0" + _LEN.pack(size))
        with open(file, "rb") as f:
            digest.update(f.read(_HEAD))
            for offset in _sample_offsets(size):
                f.seek(offset)
                digest.update(f.read(_SAMPLE))
    return "xxh3s:" + digest.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    """Where the windows after the head start: none for a file the head already covers."""
    rest = size - _HEAD
    if rest <= 0:
        return []
    return [_HEAD + rest * i // _SAMPLES for i in range(_SAMPLES)]


def fingerprint(weights: str, cache: PagedKVCache) -> dict[str, Any]:
    """The weights' fingerprint and the KV layout a saved block only fits into unchanged."""
    layer = cache[0]
    return {
        "version": VERSION,
        "weights": weights,
        "num_layers": len(cache),
        "block_size": cache.block_size,
        "kv_bits": cache.kv_bits,
        "arrays": [[str(a.dtype), list(a.shape[1:])] for a in pool_arrays(layer.keys)],
    }


def _pool_arrays(cache: PagedKVCache) -> list[tuple[int, str, int]]:
    """(layer, "keys" or "values", array index) of every pool array, in file order."""
    count = len(pool_arrays(cache[0].keys))
    return [(i, kv, j) for i in range(len(cache)) for kv in ("keys", "values") for j in range(count)]


def _recent_cached_blocks(kv: KVCacheManager) -> list[Any]:
    """Cached blocks, most recently used first: those in use, then the free ones from the LRU tail."""
    pool = kv.pool
    in_use = [b for b in pool.blocks if b.block_hash is not None and b.ref_cnt > 0]
    free = [b for b in reversed(pool.free_block_ids()) if pool.blocks[b].block_hash is not None]
    return in_use + [pool.blocks[b] for b in free]


def chosen_blocks(kv: KVCacheManager, cache: PagedKVCache, max_bytes: int) -> list[Any]:
    """The cached blocks a save keeps: the most recently used, at most `max_bytes` of K/V."""
    per_block = cache.nbytes // cache.num_blocks
    return _recent_cached_blocks(kv)[: max(max_bytes // max(per_block, 1), 0)]


def save(path: Path, kv: KVCacheManager, cache: PagedKVCache, stamp: dict[str, Any], max_bytes: int) -> int:
    """Writes the most recently used cached blocks (at most `max_bytes` of K/V) to `path`; returns how many."""
    blocks = chosen_blocks(kv, cache, max_bytes)
    write_file(path, cache, stamp, [b.block_hash for b in blocks], [b.block_id for b in blocks])
    return len(blocks)


def write_file(path: Path, cache: PagedKVCache, stamp: dict[str, Any], hashes: list[int], block_ids: list[int]) -> None:
    """Writes the K/V of the pool's blocks `block_ids`, named by `hashes`, to `path`."""
    cache.check_block_ids(block_ids)
    header = {**stamp, "hashes": [f"{h:032x}" for h in hashes]}
    ids = mx.array(block_ids, dtype=mx.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        raw_header = json.dumps(header, separators=(",", ":")).encode()
        f.write(MAGIC + _LEN.pack(len(raw_header)) + raw_header)
        checksums = []
        for layer, kind, index in _pool_arrays(cache) if block_ids else []:
            array = pool_arrays(getattr(cache[layer], kind))[index]
            data = np.array(mx.view(array[ids], mx.uint8)).tobytes()
            group = len(data) // len(block_ids) * _GROUP
            checksums.append([xxhash.xxh3_64_hexdigest(data[i : i + group]) for i in range(0, len(data), group)])
            f.write(data)
        footer = json.dumps({"checksums": checksums}).encode()
        f.write(footer + _LEN.pack(len(footer)))


class Unusable(Exception):
    """Why a prefix cache file cannot be used."""


def load(path: Path, kv: KVCacheManager, cache: PagedKVCache, stamp: dict[str, Any]) -> int:
    """Puts the blocks of `path` back into the pool as free cached blocks; returns how many.

    Anything wrong with the file (missing is fine and silent) is one warning and 0 blocks. Temporary
    files a killed save left beside it are removed (a cache file belongs to one engine at a time)."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    if not path.exists():
        group_file = path.with_name(path.name + GROUP_SUFFIX + "0")
        if group_file.exists():
            log.warning(
                "no prefix cache file %s, but %s is there: a --tensor-parallel group saved it (each rank keeps "
                "its own KV heads in FILE.tpR); starting with an empty cache",
                path,
                group_file,
            )
        return 0
    try:
        hashes, arrays = read_file(path, cache, stamp, kv.pool.num_free_blocks)
    except Unusable as exc:
        log.warning("ignoring the prefix cache file %s: %s; starting with an empty cache", path, exc)
        return 0
    num = min(len(hashes), kv.pool.num_free_blocks)
    if not num:
        return 0
    blocks = kv.pool.allocate(num)
    restore(kv, cache, blocks, hashes, arrays)
    return num


def restore(kv: KVCacheManager, cache: PagedKVCache, blocks: list[Any], hashes: list[int], arrays: list) -> None:
    """Puts the first len(`blocks`) saved blocks into the allocated `blocks`, as free cached blocks."""
    write_rows(cache, [b.block_id for b in blocks], arrays)
    for block, block_hash in zip(blocks, hashes):
        kv.pool.cache_block(block, block_hash)
    kv.pool.free(reversed(blocks))  # least recent first: it is evicted first


def write_rows(cache: PagedKVCache, block_ids: list[int], arrays: list[mx.array]) -> None:
    """The pool's blocks `block_ids` take the first len(`block_ids`) rows of each saved array."""
    cache.check_block_ids(block_ids)
    ids = mx.array(block_ids, dtype=mx.int32)
    for (layer, kind, index), data in zip(_pool_arrays(cache), arrays):
        set_pool_rows(cache[layer], kind, index, ids, data[: len(block_ids)])
    mx.eval([(layer.keys, layer.values) for layer in cache.layers])


def read_file(
    path: Path, cache: PagedKVCache, stamp: dict[str, Any], max_blocks: int | None = None
) -> tuple[list[int], list[mx.array]]:
    """The block hashes and pool arrays saved in `path`, the most recent `max_blocks` blocks at most
    (None: all); raises Unusable with the reason it cannot be used.

    NOTE: the header is checked before any data is read, and only the kept blocks' rows are read
    (with the rest of their checksum group): a file of another model, or one larger than the pool,
    costs no more memory than the blocks that fit."""
    try:
        with open(path, "rb") as f:
            return _read(f, os.fstat(f.fileno()).st_size, cache, stamp, max_blocks)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Unusable(str(exc)) from None


def _read(
    f: BinaryIO, size: int, cache: PagedKVCache, stamp: dict[str, Any], max_blocks: int | None
) -> tuple[list[int], list[mx.array]]:
    if f.read(len(MAGIC)) != MAGIC:
        raise Unusable("it is not a prefix cache file")
    try:
        header = _read_header(f, size, stamp)
        hashes = [int(h, 16) for h in header["hashes"]]
        data = _Data(f.tell(), *_read_footer(f, size), len(hashes))
        num = len(hashes) if max_blocks is None else min(len(hashes), max_blocks)
        return hashes[:num], _read_arrays(f, cache, stamp, data, num)
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise Unusable(f"it is truncated or corrupt ({type(exc).__name__})") from None


def _read_header(f: BinaryIO, size: int, stamp: dict[str, Any]) -> dict[str, Any]:
    """The header JSON, checked against `stamp`; the file is left at the start of the data."""
    (header_len,) = _LEN.unpack(f.read(_LEN.size))
    if header_len > size - f.tell() - _LEN.size:
        raise ValueError("the header runs past the end of the file")
    header = json.loads(f.read(header_len))
    mismatched = sorted(k for k in stamp if header.get(k) != stamp[k])
    if mismatched:
        raise Unusable(f"it was saved for another model or KV layout ({', '.join(mismatched)} differ)")
    return header


def _read_footer(f: BinaryIO, size: int) -> tuple[int, list[list[str]]]:
    """(where the data ends, the checksums of each array's groups); the file is left where it was."""
    data_start = f.tell()
    f.seek(size - _LEN.size)
    (footer_len,) = _LEN.unpack(f.read(_LEN.size))
    data_end = size - _LEN.size - footer_len
    if data_end < data_start:
        raise ValueError("the footer runs past the start of the data")
    f.seek(data_end)
    checksums = json.loads(f.read(footer_len))["checksums"]
    f.seek(data_start)
    return data_end, checksums


@dataclass(slots=True)
class _Data:
    """Where a file's arrays lie and what checks them."""

    start: int
    end: int
    checksums: list[list[str]]  # for each array, an xxh3-64 of each group of _GROUP rows
    num_blocks: int  # rows of each array


def _read_arrays(f: BinaryIO, cache: PagedKVCache, stamp: dict[str, Any], data: _Data, num: int) -> list[mx.array]:
    """The first `num` rows of every pool array."""
    specs = [stamp["arrays"][index] for _, _, index in _pool_arrays(cache)] if data.num_blocks else []
    dtypes = [getattr(mx, dtype.split(".")[-1]) for dtype, _ in specs]
    row_sizes = [int(np.prod(shape)) * dtype.size for (_, shape), dtype in zip(specs, dtypes)]
    if data.start + data.num_blocks * sum(row_sizes) != data.end:
        raise Unusable("its length does not match its contents")
    if len(data.checksums) != len(specs):
        raise Unusable("it holds fewer arrays than the layout needs")
    arrays, offset = [], data.start
    for (_, shape), dtype, row_size, groups in zip(specs, dtypes, row_sizes, data.checksums):
        f.seek(offset)
        rows = np.frombuffer(_read_rows(f, row_size, data.num_blocks, num, groups), dtype=np.uint8)
        arrays.append(mx.view(mx.array(rows), dtype).reshape(num, *shape))
        offset += data.num_blocks * row_size
    return arrays


def _read_rows(f: BinaryIO, row_size: int, num_saved: int, num: int, groups: list[str]) -> bytearray:
    """The first `num` of an array's `num_saved` rows, read in whole groups of _GROUP rows, each checked."""
    if len(groups) != -(-num_saved // _GROUP):
        raise Unusable("its checksums do not match its contents")
    kept = bytearray()
    for i in range(-(-num // _GROUP)):
        group = f.read(min(_GROUP, num_saved - i * _GROUP) * row_size)
        if xxhash.xxh3_64_hexdigest(group) != groups[i]:
            raise Unusable("its data is truncated or corrupt")
        kept += memoryview(group)[: (num - i * _GROUP) * row_size]
    return kept


class PersistentPrefixCache:
    """A prefix cache file bound to an engine's pool: loaded once, saved when due and at shutdown."""

    def __init__(self, path: Path, kv: KVCacheManager, cache: PagedKVCache, stamp: dict[str, Any], max_bytes: int):
        self.path, self.kv, self.cache, self.stamp, self.max_bytes = path, kv, cache, stamp, max_bytes
        self.saved_version = -1  # the pool's cache version last written

    @classmethod
    def open(
        cls,
        path: str,
        weights: Path,
        kv: KVCacheManager,
        cache: PagedKVCache,
        max_size: int | None,
        adapters: Sequence[tuple[Path, float]] = (),
    ) -> PersistentPrefixCache:
        """The file at `path` for the model at `weights` (with LoRA `adapters` at their scales in its
        weights, which change every K/V), its blocks loaded into the pool; it keeps at most `max_size`
        bytes of K/V (None: the pool's size)."""
        weights_id = weights_fingerprint(weights)
        weights_id += "".join(f"+{weights_fingerprint(p)}*{scale!r}" for p, scale in adapters)
        stamp = fingerprint(weights_id, cache)
        max_bytes = cache.nbytes if max_size is None else max_size
        persistent = cls(Path(path).expanduser(), kv, cache, stamp, max_bytes)
        persistent.load()
        return persistent

    def load(self) -> int:
        num = load(self.path, self.kv, self.cache, self.stamp)
        self.saved_version = self.kv.pool.version
        return num

    def save(self) -> int | None:
        """Writes the file when the cache changed since the last save; returns blocks written (None: unchanged)."""
        if self.kv.pool.version == self.saved_version:
            return None
        version = self.kv.pool.version
        num = save(self.path, self.kv, self.cache, self.stamp, self.max_bytes)
        self.saved_version = version
        return num

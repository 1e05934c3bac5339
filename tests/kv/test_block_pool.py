"""BlockPool and hash_block: exact block ids, LRU free-list order, lazy eviction, stable hashes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from baselm.kv.block_pool import BlockPool, hash_block


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# --- hash_block ---------------------------------------------------------------------------


def test_hash_is_the_same_in_another_process_with_another_hash_seed():
    code = (
        "from baselm.kv.block_pool import hash_block; "
        "print(hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8], ('salt',)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(other.stdout) == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8], ("salt",))


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == base
    assert hash_block(None, (1, 2, 3, 4)) == base  # any sequence of ints
    assert hash_block(None, [1, 2, 3, 5]) != base
    assert hash_block(None, [4, 3, 2, 1]) != base
    assert hash_block(base, [1, 2, 3, 4]) != base
    assert hash_block(None, [1, 2, 3, 4], ("a",)) != base
    assert hash_block(None, [1, 2, 3, 4], ("a",)) != hash_block(None, [1, 2, 3, 4], (b"a",))


def test_extra_keys_are_length_delimited():
    tokens = [7, 7]
    assert hash_block(None, tokens, ("ab",)) != hash_block(None, tokens, ("a", "b"))
    assert hash_block(None, tokens, (12,)) != hash_block(None, tokens, (1, 2))


def test_hash_is_a_128_bit_int():
    h = hash_block(None, [0] * 16)
    assert isinstance(h, int) and 0 <= h < 2**128


def test_unsupported_extra_key_is_refused():
    with pytest.raises(TypeError, match="extra key must be int, str or bytes, not float"):
        hash_block(None, [1], (1.5,))


# --- BlockPool ----------------------------------------------------------------------------


def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(4)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert pool.num_free_blocks == 1
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0]


def test_allocating_more_than_free_is_refused():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="cannot allocate 2 KV blocks: only 1 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_freed_blocks_without_hash_go_to_the_head_and_are_reused_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.free([c, b])
    assert pool.free_block_ids() == [b.block_id, c.block_id, 3]
    assert ids(pool.allocate(1)) == [1]


def test_freed_blocks_with_hash_go_to_the_tail_in_the_order_given():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks[:3]):
        assert pool.cache_block(block, 100 + i)
    pool.free(reversed(blocks))  # a sequence's blocks, last first
    # block 3 has no hash: head; then the untouched block 4; then the hashed tail 2, 1, 0
    assert pool.free_block_ids() == [3, 4, 2, 1, 0]


def test_freed_cached_block_stays_findable_until_reallocated():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache_block(block, 42)
    pool.free([block])
    assert pool.get_cached_block(42) is block
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 1
    assert ids(pool.allocate(2)) == [1, 2]  # the LRU head goes first; block 0 is still cached
    assert pool.get_cached_block(42) is block
    assert ids(pool.allocate(1)) == [0]  # now it is evicted
    assert pool.get_cached_block(42) is None and block.block_hash is None


def test_eviction_follows_lru_order_of_freeing():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block in blocks:
        pool.cache_block(block, 10 + block.block_id)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert ids(pool.allocate(1)) == [1]
    assert pool.get_cached_block(11) is None
    assert pool.get_cached_block(10) is blocks[0] and pool.get_cached_block(12) is blocks[2]


def test_touch_takes_a_free_cached_block_out_of_the_free_list():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], 7)
    pool.free(blocks)
    hit = pool.get_cached_block(7)
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2
    assert ids(pool.allocate(2)) == [2, 1]  # unhashed blocks went to the head; the hit is never evicted
    assert pool.num_free_blocks == 0 and pool.get_cached_block(7) is hit


def test_shared_block_returns_to_the_free_list_only_when_its_last_user_frees_it():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2


def test_freeing_a_free_block_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="KV block 0 was freed more often than it was taken"):
        pool.free([block])


def test_second_block_with_the_same_hash_stays_unnamed():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    assert pool.cache_block(first, 5)
    assert not pool.cache_block(second, 5)
    assert second.block_hash is None and pool.get_cached_block(5) is first
    assert not pool.cache_block(first, 6)  # a named block keeps its name
    assert first.block_hash == 5


def test_reset_prefix_cache_forgets_free_and_used_blocks():
    pool = BlockPool(3)
    used, freed, _ = pool.allocate(3)
    pool.cache_block(used, 1)
    pool.cache_block(freed, 2)
    pool.free([freed])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert used.block_hash is None and freed.block_hash is None
    assert used.ref_cnt == 1 and pool.num_free_blocks == 1


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)

"""KVCacheManager: prefix hits over hash-chained full blocks, allocation, forks, freeing order.

All cases use blocks of 4 tokens; a request's tokens are "computed" by advancing
num_computed_tokens, as the scheduler does after a step.
"""

from __future__ import annotations

import pytest

from baselm.kv.manager import KVCacheManager
from baselm.request import Request

BLOCK = 4


def computed(kv: KVCacheManager, request: Request, num_new_tokens: int) -> None:
    """Allocates for and 'computes' the next tokens of a request that already holds blocks (or has none)."""
    assert kv.allocate_slots(request, num_new_tokens, [] if not kv.block_table(request) else None)
    request.num_computed_tokens += num_new_tokens
    kv.cache_full_blocks(request)


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler does for a waiting request: look up, allocate the rest, advance. Returns hits."""
    blocks, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, blocks)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return num_hit


def test_first_request_gets_blocks_in_id_order():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = Request("a", list(range(10)))
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 10, [])
    assert kv.block_table(a) == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)


def test_allocation_grows_by_a_block_only_when_the_last_one_is_full():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = Request("a", list(range(3)))
    computed(kv, a, 3)
    assert kv.block_table(a) == [0]
    a.append_output_token_ids(50)
    computed(kv, a, 1)  # 4 tokens: still one block
    assert kv.block_table(a) == [0]
    a.append_output_token_ids(51)
    computed(kv, a, 1)  # the 5th token opens block 1
    assert kv.block_table(a) == [0, 1]


def test_second_request_hits_the_first_requests_full_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = Request("a", list(range(10)))
    assert admit(kv, a) == 0
    b = Request("b", list(range(8)) + [90, 91, 92])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit == 8
    assert kv.allocate_slots(b, 3, blocks)
    assert kv.block_table(b) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
    assert kv.prefix_cache_hit_rate == pytest.approx(8 / 21)


def test_a_hit_stops_at_the_first_block_that_differs():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(kv, Request("a", list(range(12)) + [99]))
    b = Request("b", [0, 1, 2, 3, 70, 5, 6, 7, 8, 9, 10, 11, 12])  # block 1 differs, block 2 equals a's
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0] and num_hit == 4


def test_equal_tokens_after_a_different_prefix_do_not_hit():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = Request("a", [1, 1, 1, 1, 5, 6, 7, 8, 0])
    b = Request("b", [2, 2, 2, 2, 5, 6, 7, 8, 0])
    admit(kv, a)
    admit(kv, b)
    assert a.block_hashes[1] != b.block_hashes[1]  # chained: the parent is part of the name
    assert kv.block_table(b) == [3, 4, 5]


def test_full_prompt_hit_of_exact_blocks_recomputes_the_whole_last_block():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(kv, Request("a", list(range(8))))
    b = Request("b", list(range(8)))
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0] and num_hit == 4  # the last token is recomputed
    assert kv.allocate_slots(b, 4, blocks)
    assert kv.block_table(b) == [0, 2]


def test_one_token_past_the_blocks_hits_them_all():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(kv, Request("a", list(range(9))))
    blocks, num_hit = kv.get_computed_blocks(Request("b", list(range(9))))
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit == 8


def test_partially_computed_blocks_are_not_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = Request("a", list(range(12)))
    computed(kv, a, 6)  # a chunk: block 0 full, block 1 half
    assert kv.pool.num_cached_blocks == 1
    _, num_hit = kv.get_computed_blocks(Request("b", list(range(12))))
    assert num_hit == 4
    computed(kv, a, 6)
    assert kv.pool.num_cached_blocks == 3


def test_free_returns_blocks_last_first_so_a_prefix_tail_is_evicted_first():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = Request("a", list(range(10)))
    admit(kv, a)  # blocks 0 and 1 full and cached, block 2 half full
    kv.free(a)
    assert kv.block_table(a) == []
    assert kv.num_free_blocks == 8
    assert kv.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    c = Request("c", [50] * 25)
    assert kv.allocate_slots(c, 25, [])  # 7 blocks: evicts block 1, keeps block 0
    assert kv.block_table(c) == [2, 3, 4, 5, 6, 7, 1]
    _, num_hit = kv.get_computed_blocks(Request("d", list(range(10))))
    assert num_hit == 4


def test_blocks_in_use_are_never_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = Request("a", list(range(9)))
    admit(kv, a)  # holds blocks 0, 1, 2
    assert not kv.allocate_slots(Request("big", [7] * 8), 8, [])
    _, num_hit = kv.get_computed_blocks(Request("b", list(range(9))))
    assert num_hit == 8


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = Request("a", list(range(8)))
    computed(kv, a, 8)
    b = Request("b", [9] * 9)
    assert not kv.allocate_slots(b, 9, [])
    assert kv.block_table(b) == [] and kv.num_free_blocks == 2
    assert not kv.allocate_slots(a, 9)  # a needs 17 tokens = 5 blocks
    assert kv.block_table(a) == [0, 1] and kv.num_free_blocks == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (8, 0)


def test_hits_in_the_free_list_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = Request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)  # free list: [2, 3, 1, 0], with 1 and 0 cached
    c = Request("c", [60])
    computed(kv, c, 1)  # takes block 2
    b = Request("b", list(range(8)) + [80, 81, 82, 83])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert not kv.allocate_slots(b, 4 + 4, blocks)  # 2 hits + 2 new > 3 free
    assert [blk.ref_cnt for blk in blocks] == [0, 0] and kv.num_free_blocks == 3
    assert kv.allocate_slots(b, 4, blocks)  # 2 hits + 1 new = 3 free
    assert kv.block_table(b) == [0, 1, 3] and kv.num_free_blocks == 0


def test_prefix_hits_need_a_fresh_request():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(kv, Request("a", list(range(9))))
    b = Request("b", list(range(9)))
    computed(kv, b, 1)
    blocks, _ = kv.get_computed_blocks(b)
    with pytest.raises(ValueError, match="already holds KV blocks"):
        kv.allocate_slots(b, 1, blocks)


def test_different_cache_salts_never_share():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(kv, Request("a", list(range(9)), cache_salt="alice"))
    assert kv.get_computed_blocks(Request("b", list(range(9)), cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(Request("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(Request("d", list(range(9)), cache_salt="alice"))[1] == 8


def test_prefix_caching_off_never_hits_or_names_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    admit(kv, Request("a", list(range(9))))
    assert kv.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)
    assert kv.pool.num_cached_blocks == 0


def test_reset_prefix_cache_drops_all_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = Request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)


def test_fork_shares_full_prompt_blocks_and_recomputes_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    parent = Request("p", list(range(10)))
    admit(kv, parent)  # blocks 0, 1 full; block 2 holds tokens 8, 9
    child = Request("p-1", list(range(10)))
    kv.fork(parent, child)
    assert kv.block_table(child) == [0, 1]
    assert child.num_computed_tokens == 8
    assert [kv.pool.blocks[i].ref_cnt for i in range(3)] == [2, 2, 1]
    assert kv.allocate_slots(child, 2)
    assert kv.block_table(child) == [0, 1, 3]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_fork_of_a_block_aligned_prompt_keeps_the_last_token_to_recompute():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    parent = Request("p", list(range(8)))
    admit(kv, parent)
    parent.append_output_token_ids(42)  # the parent already sampled; the child samples its own
    child = Request("p-1", list(range(8)))
    kv.fork(parent, child)
    assert kv.block_table(child) == [0] and child.num_computed_tokens == 4


def test_fork_works_without_prefix_caching():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    parent = Request("p", list(range(10)))
    admit(kv, parent)
    child = Request("p-1", list(range(10)))
    kv.fork(parent, child)
    assert kv.block_table(child) == [0, 1] and child.num_computed_tokens == 8


def test_fork_refuses_a_child_with_another_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    parent = Request("p", list(range(10)))
    admit(kv, parent)
    with pytest.raises(ValueError, match="does not start with the tokens of p"):
        kv.fork(parent, Request("x", [1, 2, 3]))
    assert kv.block_table(Request("x", [1])) == [] and kv.num_free_blocks == 5


def test_freeing_a_request_without_blocks_does_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK)
    kv.free(Request("a", [1]))
    assert kv.num_free_blocks == 2

"""The scheduler's catch-up rule, driven through many steps by a fake model (fake_model.py).

A wrong block table, a bad prefix hit, an early eviction or a lost token changes the fake
model's tokens, so every test can compare against plain greedy generation.
"""

from __future__ import annotations

import random

import pytest

from baselm.request import Request, RequestStatus
from baselm.scheduler import RequestTooLongError, effective_max_tokens
from tests.engine.fake_model import EOS, greedy, make, plan, request, run_to_end, step

# --- the catch-up rule --------------------------------------------------------------------


def test_a_long_prompt_is_chunked_while_a_running_request_keeps_decoding():
    scheduler, model = make(budget=8)
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=10))
    assert plan(step(scheduler, model)[0]) == [("a", 0, 3, True)]
    scheduler.add_request(request("b", list(range(100, 120))))
    plans = [plan(step(scheduler, model)[0]) for _ in range(4)]
    assert plans == [
        [("a", 3, 1, True), ("b", 0, 7, False)],
        [("a", 4, 1, True), ("b", 7, 7, False)],
        [("a", 5, 1, True), ("b", 14, 6, True)],
        [("a", 6, 1, True), ("b", 20, 1, True)],
    ]


def test_fed_tokens_block_tables_and_flags_of_one_step():
    scheduler, _ = make(budget=8)
    scheduler.add_request(request("a", list(range(10, 20))))
    output = scheduler.schedule()
    (scheduled,) = output.requests
    assert scheduled.token_ids == list(range(10, 18))
    assert scheduled.block_ids == [0, 1]
    assert (scheduled.context_len, scheduled.is_sampling, scheduled.is_new) == (8, False, True)
    assert output.num_scheduled_tokens == 8
    assert scheduler.update(output, {}) == []
    (scheduled,) = scheduler.schedule().requests
    assert scheduled.token_ids == [18, 19]
    assert (scheduled.num_computed_tokens, scheduled.block_ids, scheduled.is_sampling, scheduled.is_new) == (
        8, [0, 1, 2], True, False,
    )  # fmt: skip


def test_long_prefill_threshold_caps_each_chunk():
    scheduler, model = make(budget=64, long_prefill_token_threshold=4)
    scheduler.add_request(request("a", list(range(10)), max_tokens=2))
    plans = [plan(step(scheduler, model)[0]) for _ in range(4)]
    assert plans == [[("a", 0, 4, False)], [("a", 4, 4, False)], [("a", 8, 2, True)], [("a", 10, 1, True)]]
    assert not scheduler.has_unfinished


def test_max_num_seqs_caps_running_requests():
    scheduler, model = make(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(request(name, [1, 2], max_tokens=2))
    assert [p[0] for p in plan(step(scheduler, model)[0])] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    output, outputs = step(scheduler, model)
    assert [p[0] for p in plan(output)] == ["a", "b"]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "length"), ("b", "length")]
    assert plan(step(scheduler, model)[0]) == [("c", 0, 2, True)]


def test_waiting_requests_are_admitted_first_come_first_served():
    scheduler, model = make(num_blocks=4, block_size=4)
    scheduler.add_request(request("r", list(range(9)), max_tokens=3))
    step(scheduler, model)  # r holds 3 blocks
    scheduler.add_request(request("big", list(range(50, 58))))  # needs 2 blocks, 1 is free
    scheduler.add_request(request("small", [1, 2]))  # would fit, but waits its turn
    assert [p[0] for p in plan(step(scheduler, model)[0])] == ["r"]
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]


def test_second_request_with_the_same_prompt_starts_from_a_prefix_hit():
    scheduler, model = make()
    prompt = list(range(30, 40))
    scheduler.add_request(request("a", prompt, max_tokens=4))
    step(scheduler, model)
    scheduler.add_request(request("b", prompt, max_tokens=4, seed=5))
    output, outputs = step(scheduler, model)
    assert plan(output) == [("a", 10, 1, True), ("b", 8, 2, True)]
    assert output.requests[1].block_ids == [0, 1, 3]
    assert outputs[1].num_cached_tokens == 8
    tokens = run_to_end(scheduler, model)
    assert outputs[1].token_ids + tokens["b"] == greedy(prompt, 5, 4)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_hit_rate) == (20, 8, 0.4)
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.kv_usage) == (0, 16, 0.0)


def test_stats_count_blocks_in_use():
    scheduler, model = make()
    scheduler.add_request(request("a", list(range(10))))
    scheduler.add_request(request("b", [1]))
    step(scheduler, model)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks, stats.num_free_blocks) == (2, 0, 4, 12)
    assert stats.kv_usage == 0.25


# --- stops --------------------------------------------------------------------------------


def test_length_finish_after_max_tokens_and_all_blocks_freed():
    scheduler, model = make()
    prompt = [3, 1, 4, 1, 5]
    scheduler.add_request(request("a", prompt, max_tokens=6, seed=2))
    assert run_to_end(scheduler, model) == {"a": greedy(prompt, 2, 6)}
    assert scheduler.kv.num_free_blocks == 16


def test_a_stop_finishes_with_stop_also_on_the_last_allowed_token():
    prompt, seed = [9, 9], 0
    expected = greedy(prompt, seed, 30, eos=EOS)
    assert expected[-1] == EOS and len(expected) < 30  # the fixture really stops on EOS
    for max_tokens in (30, len(expected)):
        scheduler, model = make(eos_token_ids=[EOS])
        scheduler.add_request(request("a", prompt, max_tokens=max_tokens, seed=seed))
        finishes = []
        while scheduler.has_unfinished:
            finishes += [o.finish_reason for o in step(scheduler, model)[1] if o.finished]
        assert finishes == ["stop"]


def test_a_request_named_stopped_finishes_with_its_reason_and_frees_its_blocks():
    scheduler, _ = make()
    scheduler.add_request(request("a", [1, 2, 3]))
    output = scheduler.schedule()
    (out,) = scheduler.update(output, {"a": [5, EOS]}, {"a": "stop"})  # several ids, as speculative decoding gives
    assert (out.token_ids, out.finished, out.finish_reason) == ([5, EOS], True, "stop")
    assert scheduler.requests == {} and scheduler.kv.num_free_blocks == 16


def test_a_finish_reason_must_be_stop_or_length():
    scheduler, model = make()
    scheduler.add_request(request("a", [1]))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="request a got finish reason 'eos'; a step stops with 'stop' or 'length'"):
        scheduler.update(output, model.step(output), {"a": "eos"})


def test_a_request_at_its_max_tokens_must_be_stopped():
    scheduler, model = make()
    scheduler.add_request(request("a", [1], max_tokens=1))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match=r"request a reached its max_tokens \(1\) but was not stopped"):
        scheduler.update(output, model.step(output))


def test_a_sampling_request_without_sampled_ids_is_an_error():
    scheduler, _ = make()
    scheduler.add_request(request("a", [1, 2]))
    with pytest.raises(ValueError, match="request a sampled this step but no token ids came back for it"):
        scheduler.update(scheduler.schedule(), {})


# --- preemption ---------------------------------------------------------------------------


def test_a_request_that_cannot_grow_preempts_itself_and_resumes_from_its_cached_prefix():
    scheduler, model = make(num_blocks=5, block_size=2)
    scheduler.add_request(request("a", [1, 2, 3, 4], max_tokens=4, seed=1))
    scheduler.add_request(request("b", [5, 6, 7, 8], max_tokens=4, seed=2))
    output, _ = step(scheduler, model)
    assert plan(output) == [("a", 0, 4, True), ("b", 0, 4, True)]
    assert [s.block_ids for s in output.requests] == [[0, 1], [2, 3]]

    output, _ = step(scheduler, model)  # a takes the last free block; b, the newest, must go
    assert plan(output) == [("a", 4, 1, True)] and output.requests[0].block_ids == [0, 1, 4]
    assert output.preempted_request_ids == ["b"]
    b = scheduler.waiting[0]
    assert (b.request_id, b.status, b.num_computed_tokens) == ("b", RequestStatus.PREEMPTED, 0)
    assert scheduler.kv.pool.free_block_ids() == [3, 2]

    assert plan(step(scheduler, model)[0]) == [("a", 5, 1, True)]  # b's 2 hits + 1 new > 2 free
    output, outputs = step(scheduler, model)
    assert plan(output) == [("a", 6, 1, True)] and output.requests[0].block_ids == [0, 1, 4, 3]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "length")]

    output, _ = step(scheduler, model)  # b resumes: its first block is still cached, its second was evicted
    assert plan(output) == [("b", 2, 3, True)]
    assert output.requests[0].block_ids == [2, 3, 4] and output.requests[0].is_new
    tokens = run_to_end(scheduler, model)
    assert scheduler.requests == {} and scheduler.kv.num_free_blocks == 5
    assert len(tokens["b"]) == 2
    assert scheduler.stats().num_preemptions == 1


def test_resumed_request_generates_what_it_would_have_without_preemption():
    scheduler, model = make(num_blocks=5, block_size=2)
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    for seed, (name, prompt) in enumerate(prompts.items()):
        scheduler.add_request(request(name, prompt, max_tokens=4, seed=seed))
    tokens = run_to_end(scheduler, model)
    assert tokens == {name: greedy(prompt, seed, 4) for seed, (name, prompt) in enumerate(prompts.items())}
    assert scheduler.num_preemptions == 1


def test_the_newest_running_request_is_preempted_to_the_front_of_the_queue():
    scheduler, model = make(num_blocks=6, block_size=2)
    for seed, name in enumerate("abc"):
        scheduler.add_request(request(name, [10 * seed + i for i in range(4)], max_tokens=3, seed=seed))
    _, first = step(scheduler, model)  # a: [0, 1], b: [2, 3], c: [4, 5]
    scheduler.add_request(request("d", [90, 91], max_tokens=3, seed=3))
    output, _ = step(scheduler, model)
    assert plan(output) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert [s.block_ids for s in output.requests] == [[0, 1, 5], [2, 3, 4]]
    assert output.preempted_request_ids == ["c"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    tokens = run_to_end(scheduler, model)
    assert first[2].token_ids + tokens["c"] == greedy([20, 21, 22, 23], 2, 3)
    assert tokens["d"] == greedy([90, 91], 3, 3)
    assert scheduler.kv.num_free_blocks == 6


def test_several_victims_go_back_in_their_admission_order():
    scheduler, model = make(num_blocks=6, block_size=2, long_prefill_token_threshold=4)
    scheduler.add_request(request("a", list(range(8)), max_tokens=4))
    for name in "bcd":
        scheduler.add_request(request(name, [ord(name), 1]))
    step(scheduler, model)  # a: [0, 1] (a chunk), b: [2], c: [3], d: [4], free: [5]
    output, _ = step(scheduler, model)  # a needs 2 more blocks: d goes; then b needs one: c goes
    assert plan(output) == [("a", 4, 4, True), ("b", 2, 1, True)]
    assert [s.block_ids for s in output.requests] == [[0, 1, 5, 4], [2, 3]]
    assert output.preempted_request_ids == ["d", "c"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    run_to_end(scheduler, model)
    assert scheduler.kv.num_free_blocks == 6


def test_a_step_that_preempted_admits_no_waiting_request():
    scheduler, model = make(num_blocks=4, block_size=2, long_prefill_token_threshold=2, prefix_caching=False)
    scheduler.add_request(request("a", [1, 2], max_tokens=5))
    step(scheduler, model)
    scheduler.add_request(request("b", [5, 6, 7, 8], max_tokens=2))
    step(scheduler, model)
    assert [s.block_ids for s in step(scheduler, model)[0].requests] == [[0, 1], [2, 3]]
    output, _ = step(scheduler, model)  # a needs a 3rd block: b goes, and its first chunk would fit again
    assert plan(output) == [("a", 4, 1, True)] and output.preempted_request_ids == ["b"]
    assert scheduler.kv.num_free_blocks == 1
    output, _ = step(scheduler, model)
    assert plan(output) == [("a", 5, 1, True), ("b", 0, 2, False)]


def test_schedule_ahead_plans_the_next_decode_step_with_its_block_allocated():
    scheduler, model = make(block_size=4)
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=10))
    step(scheduler, model)
    now = scheduler.schedule()
    ahead = scheduler.schedule_ahead(now)
    assert plan(ahead) == [("a", 4, 1, True)] and ahead.requests[0].block_ids == [0, 1]
    scheduler.update(now, model.step(now))
    assert scheduler.is_ahead_plan(scheduler.schedule(), ahead)


def test_nothing_is_planned_ahead_while_a_request_waits_or_one_is_about_to_finish():
    scheduler, model = make(block_size=4)
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=2))
    step(scheduler, model)
    assert scheduler.schedule_ahead(scheduler.schedule()) is None  # its next token is its last
    scheduler, model = make(block_size=4, max_num_seqs=1)
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=10))
    scheduler.add_request(request("b", [4, 5]))
    step(scheduler, model)
    assert scheduler.schedule_ahead(scheduler.schedule()) is None


# --- admission, abort, fork ---------------------------------------------------------------


def test_too_long_requests_are_rejected_when_added():
    scheduler, _ = make(num_blocks=4, block_size=4, max_model_len=32)
    too_long = r"maximum context length is 32 tokens, but the request needs 33 \(30 prompt \+ 3 max_tokens\)"
    with pytest.raises(RequestTooLongError, match=too_long):
        scheduler.add_request(request("a", list(range(30)), max_tokens=3))
    with pytest.raises(RequestTooLongError, match="needs up to 5 KV blocks of 4 tokens but the cache has only 4"):
        scheduler.add_request(request("b", list(range(10)), max_tokens=8))
    with pytest.raises(RequestTooLongError, match="maximum context length is 32 tokens, but the prompt has 32,"):
        scheduler.add_request(Request("c", list(range(32))))
    assert not scheduler.has_unfinished


def test_effective_max_tokens_is_the_room_the_prompt_leaves_and_names_the_culprit():
    assert effective_max_tokens(30, None, 32) == 2
    assert effective_max_tokens(30, 2, 32) == 2
    with pytest.raises(RequestTooLongError) as too_long:
        effective_max_tokens(30, 3, 32)
    assert too_long.value.field == "max_tokens"
    with pytest.raises(RequestTooLongError) as no_room:
        effective_max_tokens(32, None, 32)
    assert no_room.value.field == "prompt"


def test_a_request_that_exactly_fills_the_pool_is_accepted_and_finishes():
    scheduler, model = make(num_blocks=4, block_size=4, max_model_len=32)
    scheduler.add_request(request("a", list(range(10)), max_tokens=7))  # 16 tokens stored, the 17th never fed
    assert run_to_end(scheduler, model) == {"a": greedy(list(range(10)), 0, 7)}


def test_missing_max_tokens_defaults_to_the_rest_of_the_model_length():
    scheduler, _ = make(max_model_len=20)
    r = Request("a", list(range(12)))
    scheduler.add_request(r)
    assert r.max_tokens == 8


def test_request_ids_must_be_unique():
    scheduler, _ = make()
    scheduler.add_request(request("a", [1]))
    with pytest.raises(ValueError, match="'a' is already queued or running"):
        scheduler.add_request(request("a", [2]))


def test_abort_frees_running_and_waiting_requests_at_once():
    scheduler, model = make(max_num_seqs=1)
    scheduler.add_request(request("a", list(range(9))))
    scheduler.add_request(request("b", [1, 2]))
    step(scheduler, model)
    outputs = scheduler.abort(["a", "b", "unknown"])
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [
        ("a", True, "abort"),
        ("b", True, "abort"),
    ]
    assert (scheduler.num_running, scheduler.num_waiting, scheduler.has_unfinished) == (0, 0, False)
    assert scheduler.kv.num_free_blocks == 16
    assert scheduler.schedule().finished_request_ids == ["a", "b"]


def test_abort_during_a_step_drops_that_steps_tokens():
    scheduler, model = make()
    scheduler.add_request(request("a", [1, 2, 3]))
    scheduler.add_request(request("b", [4, 5, 6]))
    output = scheduler.schedule()
    sampled = model.step(output)
    scheduler.abort(["a"])
    assert [o.request_id for o in scheduler.update(output, sampled)] == ["b"]
    assert [r.request_id for r in scheduler.running] == ["b"]
    assert scheduler.kv.block_table(output.requests[0].request) == []


def test_forked_child_shares_the_parents_full_blocks_and_recomputes_the_rest():
    scheduler, model = make()
    prompt = list(range(10))
    scheduler.add_request(request("p", prompt, max_tokens=3, seed=1))
    step(scheduler, model)  # p computed its prompt: blocks [0, 1, 2]
    child = request("p-1", prompt, max_tokens=3, seed=2)
    scheduler.fork_request("p", child)
    assert scheduler.kv.block_table(child) == [0, 1] and child.num_computed_tokens == 8
    output, outputs = step(scheduler, model)
    assert plan(output) == [("p", 10, 1, True), ("p-1", 8, 2, True)]
    assert output.requests[1].block_ids == [0, 1, 3]
    assert [s.is_new for s in output.requests] == [False, True]
    tokens = run_to_end(scheduler, model)
    assert outputs[1].token_ids + tokens["p-1"] == greedy(prompt, 2, 3)
    assert outputs[1].num_cached_tokens == 8
    assert scheduler.kv.num_free_blocks == 16


def test_forked_child_waits_at_the_front_when_no_sequence_slot_is_free():
    scheduler, model = make(max_num_seqs=1)
    prompt = list(range(10))
    scheduler.add_request(request("p", prompt, max_tokens=2, seed=1))
    scheduler.add_request(request("q", [1, 2], max_tokens=2))
    step(scheduler, model)
    scheduler.fork_request("p", request("p-1", prompt, max_tokens=2, seed=2))
    assert [r.request_id for r in scheduler.waiting] == ["p-1", "q"]
    step(scheduler, model)  # p finishes
    output, _ = step(scheduler, model)
    assert plan(output) == [("p-1", 8, 2, True)]  # picked up the parent's blocks as prefix hits
    tokens = run_to_end(scheduler, model)
    assert set(tokens) == {"p-1", "q"} and scheduler.kv.num_free_blocks == 16


def test_only_running_requests_can_be_forked():
    scheduler, _ = make()
    scheduler.add_request(request("p", [1, 2, 3]))
    with pytest.raises(ValueError, match="request 'p' is not running"):
        scheduler.fork_request("p", request("p-1", [1, 2, 3]))


# --- many steps, random arrivals -----------------------------------------------------------


def test_random_arrivals_aborts_and_forks_all_finish_correctly_and_free_every_block():
    rng = random.Random(1234)
    scheduler, model = make(
        num_blocks=14, block_size=4, max_num_seqs=5, budget=16, max_model_len=48,
        long_prefill_token_threshold=10, eos_token_ids=[EOS],
    )  # fmt: skip
    prefixes = [[], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25]]
    arrivals = sorted((rng.randrange(60), i) for i in range(40))
    expected, aborted, tokens = {}, set(), {}
    for step_index in range(1000):
        for _ in range(sum(1 for t, _ in arrivals if t == step_index)):
            _, i = arrivals.pop(0)
            prompt = rng.choice(prefixes) + [rng.randrange(1, 41) for _ in range(rng.randrange(1, 12))]
            r = request(f"r{i}", prompt, max_tokens=rng.randrange(1, 16), seed=i)
            scheduler.add_request(r)
            expected[r.request_id] = greedy(prompt, i, r.max_tokens, eos=EOS)
        running = [r for r in scheduler.running if r.output_token_ids and "c" not in r.request_id]
        if running and rng.random() < 0.1:
            parent = rng.choice(running)
            seed = 1000 + step_index
            child = request(f"{parent.request_id}c{step_index}", parent.prompt_token_ids, parent.max_tokens, seed)
            scheduler.fork_request(parent.request_id, child)
            expected[child.request_id] = greedy(child.prompt_token_ids, seed, child.max_tokens, eos=EOS)
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort([victim])
            aborted.add(victim)
        if not scheduler.has_unfinished and not arrivals:
            break
        output, outputs = step(scheduler, model)
        assert output.num_scheduled_tokens <= 16 and scheduler.num_running <= 5
        assert sum(b.ref_cnt for b in scheduler.kv.pool.blocks) == sum(
            len(scheduler.kv.block_table(r)) for r in scheduler.requests.values()
        )
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert not arrivals and not scheduler.has_unfinished
    assert scheduler.kv.num_free_blocks == 14
    for request_id, want in expected.items():
        got = tokens.get(request_id, [])
        assert got == (want[: len(got)] if request_id in aborted else want), request_id
    stats = scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the run exercised both
    assert len(expected) > 40 and aborted

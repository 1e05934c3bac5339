"""The output processor's stop decision: once per step, over the sampled ids, before the scheduler applies it."""

from __future__ import annotations

import logging

from baselm.kv.manager import KVCacheManager
from baselm.outputs import OutputProcessor, RunawayGuard, StopDecisions, copy_requests, quiet_runaway_log
from baselm.runner import RunnerOutput
from baselm.sampling.params import SamplingParams, TokenLogprobs
from baselm.scheduler import Scheduler, SchedulerOutput
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER

EOS = 2


def admitted(params: SamplingParams, runaway_guard: int = 0) -> tuple[OutputProcessor, Scheduler, SchedulerOutput]:
    """A processor and a scheduler holding request "a" (prompt [1, 2, 3]), and its first step's plan."""
    processor = OutputProcessor(Tokenizer.from_folder(BPE_TOKENIZER), eos_token_ids=[EOS], runaway_guard=runaway_guard)
    scheduler = Scheduler(KVCacheManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    requests = copy_requests("a", [1, 2, 3], params)
    scheduler.add_request(requests[0])
    processor.add(requests)
    return processor, scheduler, scheduler.schedule()


def logprobs_of(token_ids: list[int]) -> list[TokenLogprobs]:
    return [TokenLogprobs(t, -0.5, []) for t in token_ids]


def test_ids_after_a_stop_in_one_step_are_cut_with_their_logprobs():
    processor, scheduler, plan = admitted(SamplingParams(max_tokens=8, logprobs=0))
    sampled = [45, EOS, 46, 48]  # several ids, as speculative decoding gives
    stops = processor.process(plan, RunnerOutput({"a": sampled}, {"a": logprobs_of(sampled)}))
    assert stops == StopDecisions({"a": [45, EOS]}, {"a": "stop"})
    (out,) = [processor.complete(o) for o in scheduler.update(plan, stops.token_ids, stops.finish_reasons)]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([45, EOS], "stop", None)
    assert [e.token_id for e in out.logprobs] == [45, EOS]
    assert "a" not in processor and not scheduler.has_unfinished


def test_max_tokens_stops_with_length_and_the_whole_text_is_reported():
    processor, scheduler, plan = admitted(SamplingParams(max_tokens=2))
    stops = processor.process(plan, RunnerOutput({"a": [45, 46, 48]}))
    assert stops == StopDecisions({"a": [45, 46]}, {"a": "length"})
    (out,) = [processor.complete(o) for o in scheduler.update(plan, stops.token_ids, stops.finish_reasons)]
    assert (out.text, out.finish_reason) == (processor.tokenizer.decode([45, 46]), "length")


def test_a_request_aborted_while_its_step_ran_is_left_alone():
    processor, scheduler, plan = admitted(SamplingParams(max_tokens=1))
    scheduler.abort(processor.abort("a"))
    stops = processor.process(plan, RunnerOutput({"a": [45]}))
    assert stops == StopDecisions({"a": [45]}, {})
    assert scheduler.update(plan, stops.token_ids, stops.finish_reasons) == []
    (out,) = processor.collect_aborted(scheduler.schedule().finished_request_ids)
    assert (out.request_id, out.token_ids, out.text, out.finish_reason) == ("a", [], "", "abort")


# ---- the runaway guard --------------------------------------------------------------------


def guard_says(window: int, token_ids: list[int]) -> list[int | None]:
    guard = RunawayGuard(window)
    return [guard.add(t) for t in token_ids]


def test_the_guard_fires_once_a_bigram_has_repeated_for_the_window():
    # window 8: the 10th token is the 8th in a row equal to the one two before it
    assert guard_says(8, [5, 6] * 5) == [None] * 9 + [2]


def test_the_guard_names_the_shortest_period():
    assert guard_says(8, [7] * 9) == [None] * 8 + [1]  # one token over and over: period 1, not 2


def test_the_guard_keeps_saying_so_while_the_loop_goes_on():
    assert guard_says(8, [5, 6] * 6)[-3:] == [2, 2, 2]


def test_text_that_does_not_repeat_is_never_cut():
    assert set(guard_says(8, list(range(100)))) == {None}


def test_a_sequence_longer_than_a_quarter_of_the_window_is_not_a_runaway():
    assert set(guard_says(8, [1, 2, 3] * 10)) == {None}  # period 3 > 8 / 4


def test_one_token_out_of_the_loop_starts_the_count_again():
    assert set(guard_says(8, [5, 6] * 4 + [9] + [5, 6] * 4)) == {None}


def test_the_processor_cuts_a_runaway_answer_with_length_and_a_log_line(caplog):
    processor, scheduler, plan = admitted(SamplingParams(max_tokens=40), runaway_guard=8)
    sampled = [45, 46] * 10  # one step of many ids, as speculative decoding gives
    with caplog.at_level(logging.WARNING, logger="baselm.engine"):
        stops = processor.process(plan, RunnerOutput({"a": sampled}))
    assert stops == StopDecisions({"a": [45, 46] * 5}, {"a": "length"})
    (out,) = [processor.complete(o) for o in scheduler.update(plan, stops.token_ids, stops.finish_reasons)]
    assert (out.finish_reason, out.stop_reason, out.repeating) == ("length", None, True)
    assert out.text == processor.tokenizer.decode([45, 46] * 5)
    [record] = caplog.records
    assert record.getMessage().startswith("request a cut after 10 tokens: the last 8 repeat a 2-token sequence")


def test_a_command_that_streams_to_the_terminal_quiets_the_log_line_of_its_own_requests_only(caplog):
    with caplog.at_level(logging.WARNING, logger="baselm.engine"), quiet_runaway_log("repl-"):
        for request_id in ("repl-1", "a"):
            processor = OutputProcessor(Tokenizer.from_folder(BPE_TOKENIZER), eos_token_ids=[EOS], runaway_guard=8)
            scheduler = Scheduler(KVCacheManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
            requests = copy_requests(request_id, [1, 2, 3], SamplingParams(max_tokens=40))
            scheduler.add_request(requests[0])
            processor.add(requests)
            processor.process(scheduler.schedule(), RunnerOutput({request_id: [45, 46] * 10}))
        logging.getLogger("baselm.engine").warning("another warning")
    assert [r.getMessage().split(" cut")[0] for r in caplog.records] == ["request a", "another warning"]
    with caplog.at_level(logging.WARNING, logger="baselm.engine"):
        caplog.clear()
        processor, _, plan = admitted(SamplingParams(max_tokens=40), runaway_guard=8)
        processor.process(plan, RunnerOutput({"a": [45, 46] * 10}))
    assert len(caplog.records) == 1  # the filter went with the block


def test_a_request_that_ignores_eos_asked_for_its_length_and_is_not_cut():
    processor, _, plan = admitted(SamplingParams(max_tokens=40, ignore_eos=True), runaway_guard=8)
    assert processor.process(plan, RunnerOutput({"a": [45, 46] * 10})) == StopDecisions({"a": [45, 46] * 10}, {})


def test_the_first_min_tokens_are_never_cut():
    processor, _, plan = admitted(SamplingParams(max_tokens=40, min_tokens=15), runaway_guard=8)
    stops = processor.process(plan, RunnerOutput({"a": [45, 46] * 10}))
    assert stops == StopDecisions({"a": ([45, 46] * 10)[:16]}, {"a": "length"})


def test_with_the_guard_off_a_loop_runs_to_max_tokens():
    processor, _, plan = admitted(SamplingParams(max_tokens=20))
    assert processor.process(plan, RunnerOutput({"a": [45, 46] * 10})) == StopDecisions(
        {"a": [45, 46] * 10}, {"a": "length"}
    )

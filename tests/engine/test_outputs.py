"""The output processor's stop decision: once per step, over the sampled ids, before the scheduler applies it."""

from __future__ import annotations

from baselm.kv.manager import KVCacheManager
from baselm.outputs import OutputProcessor, StopDecisions, copy_requests
from baselm.runner import RunnerOutput
from baselm.sampling.params import SamplingParams, TokenLogprobs
from baselm.scheduler import Scheduler, SchedulerOutput
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER

EOS = 2


def admitted(params: SamplingParams) -> tuple[OutputProcessor, Scheduler, SchedulerOutput]:
    """A processor and a scheduler holding request "a" (prompt [1, 2, 3]), and its first step's plan."""
    processor = OutputProcessor(Tokenizer.from_folder(BPE_TOKENIZER), eos_token_ids=[EOS])
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

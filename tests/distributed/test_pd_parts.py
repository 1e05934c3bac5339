"""The parts of prefill/decode disaggregation that need no second process: layouts, assignment,
messages, KV block packing, routes, refusals."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from baselm.commands.doctor_pd import status
from baselm.commands.serve_pd import PDOptions
from baselm.config import ConfigError
from baselm.distributed.comm import MessageError
from baselm.distributed.pd import blocks as pd_blocks
from baselm.distributed.pd import codec as pd_codec
from baselm.distributed.pd.engine import check_handoff
from baselm.distributed.pd.node import Layout, Plan, RankStats, Report, assign, check_admissions, check_reports
from baselm.distributed.pd.prefill import Handoff
from baselm.distributed.pd.wire import route
from baselm.kv import PagedKVCache
from baselm.kv.cache import pool_arrays
from baselm.request import InvalidRequestError, RequestOutput
from baselm.sampling.params import Constraint, SamplingParams, SamplingParamsError, TokenLogprobs


def test_layout_parses_p_colon_d_and_names_roles() -> None:
    layout = Layout.parse("2:3")
    assert (layout.size, list(layout.decode_ranks)) == (5, [2, 3, 4])
    assert [layout.role(r) for r in range(5)] == ["prefill", "prefill", "decode", "decode", "decode"]
    for bad in ("1", "1:0", "a:b", "0:1", "1:2:3"):
        with pytest.raises(ConfigError, match="--pd"):
            Layout.parse(bad)


def test_rank_options_need_a_known_role_and_no_tensor_parallelism() -> None:
    from baselm.distributed.tp.launch import DistOptions

    with pytest.raises(ConfigError, match="prefill or decode"):
        PDOptions.parse("1:1", "both")
    with pytest.raises(ConfigError, match="cannot be combined"):
        PDOptions.parse("1:1", None, DistOptions(tensor_parallel=2))
    joined = PDOptions.parse("1:1", "decode", DistOptions(hostfile="hosts.json", rank=1))
    assert (joined.hostfile, joined.rank, joined.role) == ("hosts.json", 1, "decode")


def _report(rank: int, running: int, handoffs: list[str]) -> Report:
    stats = RankStats(rank, "decode" if rank >= 2 else "prefill", num_running=running)
    return Report(rank, [Handoff(h, [1], SamplingParams(), 2, None, 0, 1, rank) for h in handoffs], [], stats)


def test_finished_prompts_go_to_the_least_loaded_decode_rank_ties_to_the_lowest() -> None:
    reports = [_report(0, 0, ["a", "b"]), _report(1, 0, ["c"]), _report(2, 1, []), _report(3, 0, [])]
    moves = assign(reports, Layout(2, 2))
    assert [(h.request_id, dst) for h, dst in moves] == [("a", 3), ("b", 2), ("c", 3)]


def test_routes_go_up_the_ring_through_the_ranks_between() -> None:
    assert route(0, 1, 2) == [0, 1]
    assert route(0, 3, 4) == [0, 1, 2, 3]
    assert route(3, 1, 4) == [3, 0, 1]


def test_messages_round_trip_as_json_with_their_types() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={7: 1.5}, stop=["x"])
    plan = Plan(add=[(0, "r1", [1, 2], params)], abort=["r0"])
    out = RequestOutput("r1", token_ids=[3], logprobs=[TokenLogprobs(3, -0.5, [(3, -0.5)])], finished=True)
    back = pd_codec.decode(pd_codec.encode([plan, out]))
    assert back[0].add[0][3] == params and back[0].abort == ["r0"]
    assert back[1].logprobs[0].token_id == 3 and back[1].finished
    with pytest.raises(MessageError, match="unknown message type"):
        pd_codec.decode(b'{"__pd": "Popen", "args": "sh"}')
    with pytest.raises(TypeError, match="cannot be sent"):
        pd_codec.encode(object())


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xfe not json",
        b"[" * 100_000 + b"]" * 100_000,  # nested past Python's recursion limit
        b'{"__pd": "Plan", "add": [], "shell": "rm -rf /"}',  # a field Plan does not take
        b'{"__pd": ["Plan"]}',  # a tag that is not a name
        b'{"__items": [[["unhashable"], 1]]}',
        b'{"__pd": "SamplingParams", "temperature": -1}',  # refused by the class itself
    ],
    ids=["bytes", "deep", "field", "tag", "items", "refused"],
)
def test_bytes_that_are_not_a_message_are_one_message_error(data: bytes) -> None:
    with pytest.raises(MessageError, match="peer sent"):
        pd_codec.decode(data)


def _handoff(request_id: str, num_tokens: int, num_blocks: int, src: int = 0) -> Handoff:
    return Handoff(request_id, list(range(num_tokens)), SamplingParams(), 2, None, 0, num_blocks, src)


def _reports(*handoffs: Handoff) -> list[Report]:
    return [Report(0, list(handoffs), [], RankStats(0, "prefill")), Report(1, [], [], RankStats(1, "decode"))]


def test_reports_whose_handoffs_would_size_a_transfer_wrongly_are_refused() -> None:
    layout = Layout(1, 1)
    check_reports(_reports(_handoff("a", 17, 2), _handoff("b", 16, 1)), layout, 16, 100)
    from_decode = Report(1, [_handoff("a", 1, 1, src=1)], [], RankStats(1, "decode"))
    bad = {
        "more blocks than the prompt fills": _reports(_handoff("a", 17, 1 << 40)),
        "fewer blocks": _reports(_handoff("a", 17, 1)),
        "another rank's": _reports(_handoff("a", 17, 2, src=1)),
        "a token past the vocabulary": _reports(Handoff("a", [5, 100], SamplingParams(), 2, None, 0, 1, 0)),
        "a prompt that is not a list": _reports(Handoff("a", "abc", SamplingParams(), 2, None, 0, 1, 0)),
        "from a decode rank": [_reports()[0], from_decode],
        "out of rank order": list(reversed(_reports())),
    }
    for why, reports in bad.items():
        with pytest.raises(MessageError, match="rank"):
            check_reports(reports, layout, 16, 100)
            pytest.fail(why)


def test_an_admission_counts_only_from_the_rank_handed_the_request_and_inside_its_blocks() -> None:
    moves = [(_handoff("a", 40, 3), 1), (_handoff("b", 5, 1), 2)]
    assert check_admissions([{}, {"a": 3}, {"b": 0}], moves) == {"a": 3, "b": 0}
    for parts in (
        [{}, {"a": 4}, {}],
        [{}, {"a": -1}, {}],
        [{}, {"b": 0}, {}],
        [{}, {"z": 0}, {}],
        [{}, {"a": "0"}, {}],
        [{}, [], {}],
    ):
        with pytest.raises(MessageError, match="rank"):
            check_admissions(parts, moves)


def test_blocks_outside_the_cache_are_refused_before_a_row_is_read_or_written() -> None:
    cache = PagedKVCache(1, 4, 2, 1, 16)
    data = pd_blocks.pack(cache, [3])
    for ids in ([4], [-1], [1 << 20]):
        with pytest.raises(ValueError, match="outside this KV cache's 4 blocks"):
            pd_blocks.pack(cache, ids)
        with pytest.raises(ValueError, match="outside this KV cache's 4 blocks"):
            pd_blocks.unpack(cache, ids, data)
    with pytest.raises(ValueError, match="flat uint8"):
        pd_blocks.unpack(cache, [0], mx.view(data, mx.float32))


@pytest.mark.parametrize("kv_bits", [16, 8, 4])
def test_packed_blocks_land_bit_exact_in_other_block_ids(kv_bits: int) -> None:
    source = PagedKVCache(2, 6, 4, 2, 32, mx.float32, kv_bits)
    rng = np.random.default_rng(kv_bits)
    for layer in source.layers:
        for kind in ("keys", "values"):
            pool = getattr(layer, kind)
            arrays = pool_arrays(pool)
            filled = [mx.array(rng.integers(0, 2**16, a.shape).astype(np.float32)).astype(a.dtype) for a in arrays]
            setattr(
                layer,
                kind,
                filled[0]
                if isinstance(pool, mx.array)
                else pool._replace(**dict(zip(("codes", "scales", "biases"), filled))),
            )
    target = PagedKVCache(2, 6, 4, 2, 32, mx.float32, kv_bits)
    data = pd_blocks.pack(source, [1, 4])
    assert data.size == 2 * pd_blocks.block_nbytes(source)
    pd_blocks.unpack(target, [5, 0], data)
    assert np.array_equal(np.array(pd_blocks.pack(target, [5, 0])), np.array(data))
    assert pd_blocks.layout(source) == pd_blocks.layout(target)
    with pytest.raises(ValueError, match="cannot fill"):
        pd_blocks.unpack(target, [0], data)


def _counting_factory(made: list):
    def make(constraint: Constraint) -> list:
        processor = lambda ids, logits: logits  # noqa: E731
        made.append((constraint.grammar, processor))
        return [processor]

    return make


def test_a_constraint_travels_without_its_processors_and_is_remade_where_received() -> None:
    made: list = []
    make = _counting_factory(made)
    constraint = Constraint("start: /[0-9]+/", [2], "hermes")
    params = SamplingParams(n=2, seed=5, constraint=constraint, make_logits_processors=lambda: make(constraint))
    portable = params.without_processors()
    assert portable.logits_processors == [] and portable.make_logits_processors is None
    back = pd_codec.decode(pd_codec.encode(Plan(add=[(0, "r", [1], portable)]))).add[0][3]
    assert back.constraint == constraint and back == portable
    received = back.with_processors(make)
    assert received.logits_processors == [made[-1][1]]  # its own, made from the constraint
    assert received.for_copy(1).logits_processors == [made[-1][1]] and len(made) == 3  # a copy gets fresh ones
    with pytest.raises(SamplingParamsError, match="constraint"):
        back.with_processors(None)
    assert SamplingParams().with_processors(None).logits_processors == []


def test_only_processors_nothing_can_rebuild_are_refused_clearly() -> None:
    constraint = Constraint("start: /[0-9]+/", [2])
    check_handoff(SamplingParams(n=2, prompt_logprobs=1), None)
    check_handoff(SamplingParams(constraint=constraint), _counting_factory([]))
    with pytest.raises(InvalidRequestError, match="custom logits processors"):
        check_handoff(SamplingParams(logits_processors=[lambda ids, logits: logits]), _counting_factory([]))
    with pytest.raises(InvalidRequestError, match="cannot make constrained output"):
        check_handoff(SamplingParams(constraint=constraint), None)


def test_doctor_names_the_pd_mode() -> None:
    from baselm.commands.doctor import collect

    assert "--pd P:D" in status()
    assert collect()["distributed"]["prefill_decode"] == status()


def test_serve_reads_no_pd_options_without_pd() -> None:
    from baselm.commands.serve import pd_options
    from baselm.distributed.tp.launch import DistOptions

    assert pd_options(None, "both", None) is None  # --role is not looked at without --pd
    joined = pd_options("1:1", "decode", DistOptions(hostfile="hosts.json", rank=1))
    assert (joined.layout, joined.role, joined.hostfile, joined.rank) == (Layout(1, 1), "decode", "hosts.json", 1)


def test_bench_pd_refuses_tensor_parallel_options_beside_it() -> None:
    from baselm.commands.bench_pd import PDBenchArgs, PDBenchOptions
    from baselm.commands.model import ModelArgs
    from baselm.config import EngineConfig
    from baselm.distributed.group import DistError
    from baselm.distributed.tp.launch import DistOptions

    config, batch = EngineConfig(), PDBenchOptions(8, 4, 1, 0)
    with pytest.raises(DistError, match="--tensor-parallel"):
        PDBenchArgs(ModelArgs("m", "cpu", dist=DistOptions(tensor_parallel=2)), Layout(1, 1), config, batch)
    args = PDBenchArgs(ModelArgs("m", "cpu"), Layout(1, 1), config, batch)
    assert (args.model.ref, args.layout, args.options) == ("m", Layout(1, 1), PDBenchOptions(8, 4, 1, 0))

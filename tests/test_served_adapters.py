"""LoRA adapters served per request (baselm/served_adapters.py, baselm/models/lora.py): a request that
runs an adapter computes what the model with that adapter merged at load computes, its K/V are named
by the adapter, and adapters that cannot run per request are refused by name.

Models: the tiny llama (tests/fixtures/models/llama) on the CPU kernels' backend; adapters: the PEFT
fixture (made with transformers + PEFT) in its three layouts, and a seeded one on the other projections.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from baselm.adapters import AdapterError, apply_adapters, read_adapter
from baselm.backend import Backend, select_backend
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.kv import AdapterRows, AttentionMetadata, PagedKVCache, hash_block
from baselm.kv.manager import KVCacheManager
from baselm.kv.persist import weights_fingerprint
from baselm.loader import load_model
from baselm.models import build_model
from baselm.request import AdapterChoice, InvalidRequestError, Request
from baselm.sampling.params import SamplingParams
from baselm.served_adapters import AdapterSpec
from tests.lora_files import MLX, PEFT, gguf_lora, llama_folder, peft_adapter

CPU = select_backend("cpu")
NO_KERNELS = Backend("cpu", mx.float32, keep_quantized=False, cpu_kernels=False)  # dequantizes at load
PROMPT = list(range(3, 40))  # 37 tokens: two full blocks of 16 and a part
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OTHER_TARGETS = ("k_proj", "o_proj", "gate_proj", "up_proj")  # those the PEFT fixture leaves alone


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The model folder and the adapter files, by layout."""
    tmp = tmp_path_factory.mktemp("served")
    return {
        "model": llama_folder(tmp / "llama"),
        "peft": PEFT,
        "mlx": MLX,
        "gguf": gguf_lora(tmp / "lora.gguf"),
        "other": peft_adapter(tmp / "other", OTHER_TARGETS, seed=1),
    }


def all_rows(num_tokens: int, slot: int = 0, scale: float = 1.0) -> tuple[AdapterRows, ...]:
    return (AdapterRows(slot, mx.arange(num_tokens, dtype=mx.int32), mx.full((num_tokens, 1), scale)),)


def prefill(model, ids: list[int], adapter_rows: tuple[AdapterRows, ...] = ()) -> np.ndarray:
    """The logits at every position of `ids` through a fresh cache, (len(ids), vocab)."""
    num_blocks, size = -(-len(ids) // 4), 4
    cache = PagedKVCache.for_model(model, num_blocks=num_blocks, block_size=size)
    meta = AttentionMetadata.build([list(range(num_blocks))], [len(ids)], [len(ids)], size, adapter_rows=adapter_rows)
    return np.array(model(mx.array(ids), meta.positions, meta, cache))


def greedy(loaded, adapters: AdapterChoice | None = None, prompt: list[int] = PROMPT) -> list[int]:
    engine = LLMEngine(loaded, EngineConfig(kv_memory=2 * 2**20))
    return engine.generate([prompt], GREEDY, [adapters])[0].completions[0].token_ids


# ---- what a request with an adapter computes ----------------------------------------------


@pytest.mark.parametrize("layout", ["peft", "mlx", "gguf", "other"])
def test_an_adapter_served_per_request_computes_what_it_computes_merged(files, layout):
    served = load_model(str(files["model"]), CPU, served_adapters=[AdapterSpec.read(f"a={files[layout]}")])
    merged = load_model(str(files["model"]), CPU, adapters=[read_adapter(str(files[layout]))])
    expected = prefill(merged.model, PROMPT)
    np.testing.assert_allclose(prefill(served.model, PROMPT, all_rows(len(PROMPT))), expected, atol=1e-4, rtol=0)
    assert np.abs(prefill(served.model, PROMPT) - expected).max() > 1.0  # without its rows, the plain model
    choice = served.served_adapters.named("a")
    assert greedy(served, choice) == greedy(merged) != greedy(served)


def test_the_scale_multiplies_the_delta_and_two_adapters_on_one_row_add_up(files):
    specs = [AdapterSpec.read(f"a={files['peft']}"), AdapterSpec.read(f"b={files['other']}")]
    served = load_model(str(files["model"]), CPU, served_adapters=specs)
    halves = [read_adapter(f"{files['peft']}:0.5"), read_adapter(f"{files['other']}:-1")]
    merged = load_model(str(files["model"]), CPU, adapters=halves)
    n = len(PROMPT)
    both = (*all_rows(n, 0, 0.5), *all_rows(n, 1, -1.0))
    np.testing.assert_allclose(prefill(served.model, PROMPT, both), prefill(merged.model, PROMPT), atol=1e-4, rtol=0)
    assert served.served_adapters.listed([(0, 0.5), (1, -1.0)]).slots == ((0, 0.5), (1, -1.0))


def _dequantized_and_merged(path, adapter_path):
    """The reference of a quantized model with an adapter at run time: its own weights decoded to float32,
    the adapter's delta merged into them in float32 (no rounding step after it)."""
    plain = load_model(str(path), NO_KERNELS)
    weights = {("" if k.startswith("lm_head") else "model.") + k: v for k, v in tree_flatten(plain.model.parameters())}
    apply_adapters(weights, [read_adapter(str(adapter_path))], plain.config)
    return build_model(plain.config, weights, cpu_kernels=True)


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_an_adapter_on_a_quantized_model_adds_its_float_delta_to_the_quantized_weights(files, quant, tmp_path):
    """The quantized layers compute with their own (rounded) weights and the adapter adds its delta in float32,
    so the reference is those weights decoded with the delta merged in float32: agreement to 1e-4 (float32 sums
    in another order). Merged at load instead, the sum is rounded to the file's bits once more, which moves the
    logits by about what the quantization itself moves them (measured here: q8 0.06-0.08 against 0.09, q4 1.3-1.8
    against 1.1)."""
    from baselm.store.import_local import import_local
    from baselm.store.registry import Store

    stored = import_local(files["model"], quant=quant, supported={"llama"}, store=Store(tmp_path)).path
    float_logits = prefill(load_model(str(files["model"]), CPU).model, PROMPT)
    for adapter in (files["peft"], files["other"]):
        served = load_model(str(stored), CPU, served_adapters=[AdapterSpec.read(f"a={adapter}")])
        got = prefill(served.model, PROMPT, all_rows(len(PROMPT)))
        np.testing.assert_allclose(got, prefill(_dequantized_and_merged(stored, adapter), PROMPT), atol=1e-4, rtol=0)
        rounding = np.abs(prefill(served.model, PROMPT) - float_logits).max()  # the file's bits, no adapter
        merged = load_model(str(stored), CPU, adapters=[read_adapter(str(adapter))])
        assert np.abs(got - prefill(merged.model, PROMPT)).max() < 2.5 * rounding  # one rounding step apart
        assert np.abs(got - prefill(served.model, PROMPT)).max() > 4 * rounding  # and the adapter took


def test_an_adapter_on_k_quant_blocks_adds_its_float_delta_to_their_values(tmp_path, monkeypatch):
    """A GGUF's Q2_K ... Q6_K matrices kept as blocks on the CPU kernels (exact path): against the same
    file's values in float32 with the adapter merged, to float32 rounding (their test's bound, 1e-5 of the
    largest logit)."""
    from baselm import cpu
    from tests.cpu.test_kquant_models import FLOAT, IDS, KERNELS
    from tests.store.test_gguf_kquants import K_MODEL, k_quant_llama
    from tests.tiny_gguf import oracle

    if cpu.kernels is None:
        pytest.skip("the CPU kernels are not built here")
    monkeypatch.setenv("BASE_KQUANT_BLOCKS", "1")
    path = k_quant_llama(tmp_path / "k.gguf")
    values = {name: (v.astype(np.float32), "F32") for name, v in oracle(path).items()}
    values = k_quant_llama(tmp_path / "values.gguf", values)
    adapter = peft_adapter(
        tmp_path / "lora", ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 2, K_MODEL
    )
    before = cpu.kernels.exact_setting()
    cpu.kernels.set_exact(True)
    try:
        served = load_model(path, KERNELS, served_adapters=[AdapterSpec.read(f"a={adapter}")])
        assert type(served.model.layers[0].self_attn.q_proj).__name__ == "BlockLinear"
        got = prefill(served.model, IDS.tolist(), all_rows(len(IDS)))
    finally:
        cpu.kernels.set_exact(before)
    expected = prefill(load_model(values, FLOAT, adapters=[read_adapter(str(adapter))]).model, IDS.tolist())
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.abs(got - prefill(served.model, IDS.tolist())).max() > 1e-2 * np.abs(expected).max()


# ---- choosing adapters --------------------------------------------------------------------


def test_a_request_names_an_adapter_lists_ids_or_gets_the_default_scales(files):
    specs = [AdapterSpec.read(f"a={files['peft']}:0.5"), AdapterSpec.read(f"b={files['other']}")]
    served = load_model(str(files["model"]), CPU, served_adapters=specs).served_adapters
    peft, other = weights_fingerprint(files["peft"]), weights_fingerprint(files["other"])
    assert served.named("a") == AdapterChoice(((0, 0.5),), f"lora:{peft}*0.5")
    assert served.named("b") == AdapterChoice(((1, 1.0),), f"lora:{other}*1.0")
    assert served.listed([(1, 2.0), (0, 0.0)]) == AdapterChoice(((1, 2.0),), f"lora:{other}*2.0")
    assert served.listed([]) is None and served.defaults() is None  # every default scale starts at 0
    served.set_default_scales([(1, 0.25)])
    assert served.defaults() == AdapterChoice(((1, 0.25),), f"lora:{other}*0.25")
    assert served.describe() == [
        {"id": 0, "name": "a", "path": str(files["peft"]), "scale": 0.0},
        {"id": 1, "name": "b", "path": str(files["other"]), "scale": 0.25},
    ]
    listing = r"adapters 0 \(a\), 1 \(b\)"
    with pytest.raises(AdapterError, match=rf"adapter id 2 is not one of this model's; it serves {listing}"):
        served.listed([(2, 1.0)])
    with pytest.raises(AdapterError, match=rf"no adapter is named 'c'; this model serves {listing}"):
        served.named("c")


def test_an_engine_refuses_adapters_its_model_does_not_serve(files):
    plain = load_model(str(files["model"]), CPU)
    engine = LLMEngine(plain, EngineConfig(kv_memory=2**20))
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
        engine.add_request(PROMPT, GREEDY, adapters=AdapterChoice(((0, 1.0),), "lora:x"))
    served = load_model(str(files["model"]), CPU, served_adapters=[AdapterSpec.read(f"a={files['peft']}")])
    engine = LLMEngine(served, EngineConfig(kv_memory=2**20))
    refusal = r"adapter id 3 is not one of this model's; it serves adapters 0 \(a\)"
    with pytest.raises(InvalidRequestError, match=refusal):
        engine.add_request(PROMPT, GREEDY, adapters=AdapterChoice(((3, 1.0),), "lora:x"))


def test_adapters_that_cannot_run_per_request_are_refused_by_name(files, tmp_path):
    with pytest.raises(AdapterError, match="give NAME=PATH"):
        AdapterSpec.read(str(files["peft"]))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        AdapterSpec.read(f"a={tmp_path}")
    twice = [AdapterSpec.read(f"a={files['peft']}"), AdapterSpec.read(f"a={files['other']}")]
    with pytest.raises(AdapterError, match="--lora names 'a' twice"):
        load_model(str(files["model"]), CPU, served_adapters=twice)
    head = tmp_path / "head"
    head.mkdir()
    (head / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    down, up = mx.zeros((2, 64)), mx.zeros((256, 2))
    tensors = {"base_model.model.lm_head.lora_A.weight": down, "base_model.model.lm_head.lora_B.weight": up}
    mx.save_safetensors(str(head / "adapter_model.safetensors"), tensors)
    with pytest.raises(AdapterError, match="it adapts lm_head, and adapters served per request apply to the attention"):
        load_model(str(files["model"]), CPU, served_adapters=[AdapterSpec.read(f"a={head}")])


# ---- their K/V ----------------------------------------------------------------------------


def test_block_hashes_name_the_adapter_and_its_scale_on_the_first_block(files):
    specs = [AdapterSpec.read(f"a={files['peft']}"), AdapterSpec.read(f"b={files['other']}")]
    served = load_model(str(files["model"]), CPU, served_adapters=specs).served_adapters
    kv = KVCacheManager(num_blocks=8, block_size=16)
    first, second = PROMPT[:16], PROMPT[16:32]

    def hashes(adapters: AdapterChoice | None, salt: str | None = None) -> list[int]:
        return kv.block_hashes(Request("r", PROMPT, cache_salt=salt, adapters=adapters), 2)

    plain = hash_block(None, first)
    a_key = f"lora:{weights_fingerprint(files['peft'])}*1.0"
    with_a = hash_block(None, first, (a_key,))
    assert hashes(None) == [plain, hash_block(plain, second)]
    assert hashes(served.named("a")) == [with_a, hash_block(with_a, second)]
    with_b = hash_block(None, first, (f"lora:{weights_fingerprint(files['other'])}*1.0",))
    assert hashes(served.named("b")) == [with_b, hash_block(with_b, second)]
    assert hashes(served.listed([(0, 0.5)]))[0] == hash_block(None, first, (a_key.replace("*1.0", "*0.5"),))
    assert hashes(served.named("a"), salt="s")[0] == hash_block(None, first, ("s", a_key))
    assert len({plain, with_a, with_b, hashes(served.listed([(0, 0.5)]))[0]}) == 4


def test_a_shared_prefix_hits_under_the_same_adapter_only(files):
    specs = [AdapterSpec.read(f"a={files['peft']}"), AdapterSpec.read(f"b={files['other']}")]
    loaded = load_model(str(files["model"]), CPU, served_adapters=specs)
    served = loaded.served_adapters
    engine = LLMEngine(loaded, EngineConfig(kv_memory=2 * 2**20, block_size=16))
    one = SamplingParams(temperature=0, max_tokens=1)

    def cached(adapters: AdapterChoice | None, prompt: list[int] = PROMPT) -> int:
        return engine.generate([prompt], one, [adapters])[0].num_cached_tokens

    assert cached(served.named("a")) == 0
    assert cached(served.named("a"), PROMPT + [99, 98]) == 32  # the same adapter: both full blocks
    assert cached(None) == 0  # the plain model does not take the adapter's K/V
    assert cached(served.named("b")) == 0  # nor another adapter
    assert cached(served.listed([(0, 0.5)])) == 0  # nor the same at another scale
    assert cached(None, PROMPT + [7]) == 32  # the plain model's own


def test_a_prefix_cache_file_keeps_each_adapters_blocks_apart_across_restarts(files, tmp_path):
    cache_file = str(tmp_path / "prefix.kvc")
    one = SamplingParams(temperature=0, max_tokens=1)

    def cached_after_restart(adapter_file, use_adapter: bool) -> int:
        spec = AdapterSpec.read(f"a={adapter_file}")
        loaded = load_model(str(files["model"]), CPU, served_adapters=[spec])
        engine = LLMEngine(loaded, EngineConfig(prefix_cache_file=cache_file, block_size=16))
        choice = loaded.served_adapters.named("a") if use_adapter else None
        result = engine.generate([PROMPT], one, [choice])[0]
        engine.save_prefix_cache()
        return result.num_cached_tokens

    assert cached_after_restart(files["peft"], use_adapter=True) == 0  # a new file
    assert cached_after_restart(files["peft"], use_adapter=True) == 32  # its own K/V, two full blocks
    assert cached_after_restart(files["peft"], use_adapter=False) == 0  # the plain model's are not those
    assert cached_after_restart(files["other"], use_adapter=True) == 0  # another file under the same name
    assert cached_after_restart(files["peft"], use_adapter=False) == 32  # the plain model's, saved meanwhile

"""LoRA adapters applied as a model loads: PEFT's and mlx-lm's folders give transformers + PEFT's
logits on the tiny llama (tests/fixtures/adapters, from tests/tools/make_lora_fixtures.py)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from baselm.adapters import AdapterError, read_adapter
from baselm.backend import select_backend
from baselm.loader import load_model
from tests.forward import prefill_logits
from tests.lora_files import ADAPTERS, gguf_lora, llama_folder
from tests.paths import LLAMA_FIXTURE
from tests.tiny_gguf import tiny_llama_gguf

REFERENCE = np.load(ADAPTERS / "peft-llama-logits.npz")
LLAMA = LLAMA_FIXTURE  # with a tokenizer beside it: set by `llama_folder`


@pytest.fixture(scope="module", autouse=True)
def llama_folder_with_tokenizer(tmp_path_factory):
    """The tiny llama fixture with the fixture tokenizer beside it, as a folder `load_model` reads."""
    global LLAMA
    LLAMA = llama_folder(tmp_path_factory.mktemp("llama") / "llama")
    return LLAMA


def _logits(*adapters: str, model=None) -> np.ndarray:
    model = model or LLAMA
    loaded = load_model(str(model), select_backend("cpu"), adapters=[read_adapter(a) for a in adapters])
    return prefill_logits(loaded.model, REFERENCE["prompt"].tolist())


@pytest.mark.parametrize("layout", ["peft-llama", "mlx-llama", "gguf"])
def test_an_adapter_gives_transformers_and_peft_logits(layout, tmp_path):
    plain = _logits()
    assert np.abs(plain - REFERENCE["logits"]).max() > 1e-2  # the adapter changes the answer
    path = gguf_lora(tmp_path / "lora.gguf") if layout == "gguf" else ADAPTERS / layout
    np.testing.assert_allclose(_logits(str(path)), REFERENCE["logits"], atol=2e-4)


def test_a_scale_multiplies_the_delta_and_two_adapters_add_up():
    plain = _logits()
    full = _logits(str(ADAPTERS / "peft-llama"))
    half = _logits(f"{ADAPTERS / 'peft-llama'}:0.5")
    both = _logits(f"{ADAPTERS / 'peft-llama'}:0.5", f"{ADAPTERS / 'mlx-llama'}:0.5")
    np.testing.assert_allclose(both, full, atol=2e-4)
    assert np.abs(half - plain).max() > 1e-3 and np.abs(half - full).max() > 1e-3
    np.testing.assert_allclose(_logits(f"{ADAPTERS / 'peft-llama'}:0"), plain, atol=1e-5)


def test_an_adapter_on_a_quantized_model_is_merged_and_requantized(tmp_path):
    from baselm.store.import_local import import_local
    from baselm.store.registry import Store

    stored = import_local(LLAMA, quant="q8", supported={"llama"}, store=Store(tmp_path))
    got = _logits(str(ADAPTERS / "peft-llama"), model=stored.path)
    rounding = np.abs(_logits(model=stored.path) - _logits()).max()  # what q8 costs without an adapter
    error = np.abs(got - REFERENCE["logits"]).max()
    assert error < 2.5 * rounding, (error, rounding)  # q8's rounding, about once more
    assert np.abs(got - _logits(model=stored.path)).max() > 10 * rounding  # and the adapter took


def test_adapters_that_do_not_fit_are_refused_by_name(tmp_path):
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(str(tmp_path))
    with pytest.raises(AdapterError, match="no such GGUF file"):
        read_adapter(str(tmp_path / "lora.gguf"))
    base_model, _ = tiny_llama_gguf(tmp_path / "model.gguf", "F32")
    with pytest.raises(AdapterError, match="not a GGUF LoRA adapter"):
        read_adapter(str(base_model))
    other = tmp_path / "other"
    shutil.copytree(ADAPTERS / "peft-llama", other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "IA3"}))
    with pytest.raises(AdapterError, match="a IA3 adapter"):
        read_adapter(str(other))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ADAPTERS / "peft-llama", elsewhere)
    tensors = mx.load(str(elsewhere / "adapter_model.safetensors"))
    moved = {k.replace(".layers.1.", ".layers.7."): v for k, v in tensors.items()}
    mx.save_safetensors(str(elsewhere / "adapter_model.safetensors"), moved)
    with pytest.raises(AdapterError, match="adapts model.layers.7.*, which this model does not have"):
        _logits(str(elsewhere))


def test_base_run_takes_adapters_and_refuses_a_bad_one_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from tests.tiny_model import write_model_folder

    folder = write_model_folder(tmp_path / "model", eos=False)
    env = {**os.environ, "BASE_HOME": str(tmp_path / "home")}

    def run(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "baselm.cli", "run", str(folder), "hello", "--raw", "--max-tokens", "6"]
        command += ["--temperature", "0", "--json", *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    plain, adapted = run(), run("--adapter", str(ADAPTERS / "peft-llama"))
    assert plain.returncode == adapted.returncode == 0, adapted.stderr
    assert json.loads(plain.stdout)["token_ids"] != json.loads(adapted.stdout)["token_ids"]
    refused = run("--adapter", str(tmp_path / "nothing"))
    assert refused.returncode == 1 and refused.stderr.strip().endswith("an adapter is an mlx-lm or PEFT adapter folder")


def test_the_prefix_cache_file_of_an_adapted_model_is_its_own(tmp_path):
    """K/V saved for the model with an adapter are not loaded for it without (or at another scale)."""
    from baselm.config import EngineConfig
    from baselm.engine import LLMEngine
    from baselm.sampling.params import SamplingParams

    cache_file = str(tmp_path / "prefix.kvc")
    prompt = list(range(3, 40))

    def cached_after_restart(*adapters: str) -> int:
        loaded = load_model(str(LLAMA), select_backend("cpu"), adapters=[read_adapter(a) for a in adapters])
        engine = LLMEngine(loaded, EngineConfig(prefix_cache_file=cache_file, block_size=16))
        result = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
        engine.save_prefix_cache()
        return result.num_cached_tokens

    adapter = str(ADAPTERS / "peft-llama")
    assert cached_after_restart(adapter) == 0  # a new file
    assert cached_after_restart(adapter) == 32  # its own K/V, two full blocks
    assert cached_after_restart() == 0  # the plain model does not take the adapter's K/V
    assert cached_after_restart(f"{adapter}:0.5") == 0  # nor another scale

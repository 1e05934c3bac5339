"""`pull` end to end against a local hub server: download, convert to `.base`, store; and what
a killed, failed or concurrent pull leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hub_server import HubServer, tiny_gguf_files, tiny_llama_files
from safetensors.numpy import load, load_file, save

from baselm import gguf_blocks
from baselm.store import gguf
from baselm.store.base_reader import BaseFile, QuantizedArray, model_weights, read_base_file
from baselm.store.convert import convert
from baselm.store.errors import ModelFileError, UnsupportedModelError
from baselm.store.hub import HubClient, HubError, NoProgress
from baselm.store.pull import pull
from baselm.store.registry import Store
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import LLAMA_FIXTURE
from tests.tiny_gguf import tiny_llama_gguf

SUPPORTED = {"llama", "qwen2"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    gguf_dir = tmp_path_factory.mktemp("gguf")
    with HubServer() as server:
        server.add_repo("org/Tiny-Llama", tiny_llama_files(LLAMA_FIXTURE))
        server.add_repo("org/Tiny-Bert", tiny_llama_files(LLAMA_FIXTURE, model_type="bert"))
        server.add_repo("org/Tiny-Llama-GGUF", tiny_gguf_files(LLAMA_FIXTURE, gguf_dir))
        server.add_repo("org/Gated", tiny_llama_files(LLAMA_FIXTURE), gated=True)
        server.add_repo("org/Tiny-Sharded", sharded(tiny_llama_files(LLAMA_FIXTURE)))
        parts = split_gguf_files(gguf_dir / "split")
        server.add_repo("org/Tiny-Split-GGUF", parts)
        server.add_repo("org/Broken-Split-GGUF", {k: v for k, v in parts.items() if "-00002-of-" not in k})
        server.gguf_dir = gguf_dir
        yield server


def split_gguf_files(folder: Path) -> dict[str, bytes]:
    """A GGUF repo as large ones ship: a quant's split parts in a folder of its own (Q8_0/), 3 parts here."""
    folder.mkdir()
    first, _ = tiny_llama_gguf(folder / "tiny-llama.Q8_0.gguf", "Q8_0", split_max_tensors=8)
    return {"README.md": b"# split\n", **{f"Q8_0/{p.name}": p.read_bytes() for p in sorted(folder.iterdir())}}


def sharded(files: dict[str, bytes]) -> dict[str, bytes]:
    """The same repo with its weights in two safetensors shards and an index."""
    weights = load(files.pop("model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for shard, shard_names in shards.items():
        files[shard] = save({n: weights[n] for n in shard_names})
    index = {"metadata": {}, "weight_map": {n: shard for shard, ns in shards.items() for n in ns}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    return files


def run_pull(hub: HubServer, store: Store, ref: str, **options) -> object:
    client = HubClient(endpoint=hub.url, token="hf_none")
    return pull(ref, store=store, client=client, supported=SUPPORTED, progress=NoProgress(), **options)


def test_a_safetensors_repo_is_pulled_as_q4_by_default(hub: HubServer, tmp_path: Path) -> None:
    store = Store(tmp_path)
    model = run_pull(hub, store, "org/Tiny-Llama")
    assert store.list() == [model]
    assert (model.ref, model.arch, model.quant) == ("org/Tiny-Llama:q4", "llama", "q4")
    source = load_file(str(LLAMA_FIXTURE / "model.safetensors"))
    assert model.params == sum(v.size for v in source.values())
    assert model.source["commit"] == hub.repos["org/Tiny-Llama"].commit
    header, tensors = read_base_file(model.path, verify=True)
    assert (header["arch"], header["quant_scheme"], header["config"]["hidden_size"]) == ("llama", "q4", 64)
    stored = header["tokenizer"]
    tokenizer = Tokenizer.from_hf_files(
        stored["tokenizer.json"], stored["tokenizer_config.json"], stored["chat_template"]
    )
    assert tokenizer.encode("t5 t7 t100") == [5, 7, 100] and stored["chat_template"] == "{{ messages }}"
    assert sorted(tensors) == sorted(source)
    assert isinstance(tensors["model.layers.0.mlp.up_proj.weight"], QuantizedArray)
    assert tensors["model.layers.0.mlp.up_proj.weight"].bits == 4
    assert not (tmp_path / "downloads" / "org" / "Tiny-Llama").exists()  # sources are removed once stored


def test_only_the_files_a_model_needs_are_downloaded(hub: HubServer, tmp_path: Path) -> None:
    before = len(hub.requests)
    run_pull(hub, Store(tmp_path), "org/Tiny-Llama:q8")
    fetched = sorted(p.rsplit("/", 1)[1] for m, p, _ in hub.requests[before:] if m == "GET" and "/resolve/" in p)
    expected = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert fetched == expected


def test_an_f32_pull_stores_the_source_tensors_exactly(hub: HubServer, tmp_path: Path) -> None:
    model = run_pull(hub, Store(tmp_path), "org/Tiny-Llama:f32")
    _, tensors = read_base_file(model.path)
    for name, value in load_file(str(LLAMA_FIXTURE / "model.safetensors")).items():
        np.testing.assert_array_equal(np.array(tensors[name]), value)


def test_a_gguf_pull_picks_the_asked_file_and_keeps_its_quantization_bit_for_bit(
    hub: HubServer, tmp_path: Path
) -> None:
    before = len(hub.requests)
    model = run_pull(hub, Store(tmp_path), "org/Tiny-Llama-GGUF:Q8_0")
    fetched = [p.rsplit("/", 1)[1] for m, p, _ in hub.requests[before:] if m == "GET" and "/resolve/" in p]
    assert fetched == ["tiny-llama.Q8_0.gguf"]
    assert (model.ref, model.quant, model.source["format"]) == ("org/Tiny-Llama-GGUF:q8_0", "q8", "gguf")
    expected = _gguf_weights(hub.gguf_dir / "tiny-llama.Q8_0.gguf")
    _, tensors = read_base_file(model.path, verify=True)
    q = tensors["model.layers.1.self_attn.q_proj.weight"]  # its Q8_0 blocks, rows in HF order
    assert (q.dtype, q.shape) == ("gguf_q8_0", (64, 64))
    assert mx.array_equal(q.data, expected["model.layers.1.self_attn.q_proj.q8_0"])


def _gguf_weights(path: Path) -> dict[str, mx.array]:
    """A GGUF's weights as a pull stores them: every block type's matrices as their blocks."""
    return gguf.GGUFCheckpoint.open(path).mx_weights(keep_blocks=frozenset(gguf_blocks.BY_GGUF_TYPE))


def test_a_split_gguf_pull_fetches_every_part_and_keeps_the_weights_bit_for_bit(hub: HubServer, tmp_path: Path) -> None:
    before = len(hub.requests)
    model = run_pull(hub, Store(tmp_path), "org/Tiny-Split-GGUF:Q8_0")
    parts = [f"Q8_0/tiny-llama.Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    resolved = [p.split("/resolve/", 1)[1] for m, p, _ in hub.requests[before:] if m == "GET" and "/resolve/" in p]
    fetched = [p.split("/", 1)[1] for p in resolved]  # after the commit
    assert sorted(fetched) == parts and model.source["files"] == parts
    assert (model.ref, model.quant) == ("org/Tiny-Split-GGUF:q8_0", "q8")
    expected = _gguf_weights(hub.gguf_dir / "split" / "tiny-llama.Q8_0-00001-of-00003.gguf")
    _, tensors = read_base_file(model.path, verify=True)
    weights, _ = model_weights(tensors)
    assert len(tensors) == 21 and sorted(weights) == sorted(expected)
    for name, value in weights.items():
        assert mx.array_equal(value, expected[name]), name


def test_a_split_gguf_with_a_part_missing_on_the_hub_is_refused_naming_it(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"lacks part\(s\) Q8_0/tiny-llama.Q8_0-00002-of-00003.gguf"):
        run_pull(hub, Store(tmp_path), "org/Broken-Split-GGUF")


def test_a_gguf_repo_without_a_tag_gets_the_default_file(hub: HubServer, tmp_path: Path) -> None:
    model = run_pull(hub, Store(tmp_path), "org/Tiny-Llama-GGUF")
    assert (model.variant, model.source["files"]) == ("q4_0", ["tiny-llama.Q4_0.gguf"])


def test_an_unsupported_model_is_refused_before_any_weights_are_fetched(hub: HubServer, tmp_path: Path) -> None:
    before = len(hub.requests)
    with pytest.raises(UnsupportedModelError, match="org/Tiny-Bert is a 'bert' model, which base does not run"):
        run_pull(hub, Store(tmp_path), "org/Tiny-Bert")
    fetched = [p.rsplit("/", 1)[1] for m, p, _ in hub.requests[before:] if m == "GET" and "/resolve/" in p]
    assert fetched == ["config.json"]
    assert Store(tmp_path).list() == []


def test_a_gated_repo_fails_clearly_and_stores_nothing(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(HubError, match="org/Gated is gated or private: it needs a token"):
        run_pull(hub, Store(tmp_path), "org/Gated")
    assert Store(tmp_path).list() == []


def test_a_missing_repo_fails_clearly(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(HubError, match="no such repo 'org/Nothing'"):
        run_pull(hub, Store(tmp_path), "org/Nothing")


def test_pulling_a_stored_model_again_downloads_nothing(hub: HubServer, tmp_path: Path) -> None:
    store = Store(tmp_path)
    first = run_pull(hub, store, "org/Tiny-Llama")
    before = len(hub.requests)
    assert run_pull(hub, store, "org/Tiny-Llama") == first
    assert [m for m, p, _ in hub.requests[before:] if "/resolve/" in p] == []


def test_two_concurrent_pulls_of_one_model_both_finish_with_one_valid_model(hub: HubServer, tmp_path: Path) -> None:
    store = Store(tmp_path)
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda: results.append(run_pull(hub, store, "org/Tiny-Llama:q8"))) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 2 and results[0] == results[1]
    assert [m.ref for m in store.list()] == ["org/Tiny-Llama:q8"]
    read_base_file(results[0].path, verify=True)


def _wait_for(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


_PULLER = """
import sys
from baselm.store.hub import HubClient, NoProgress
from baselm.store.pull import pull
from baselm.store.registry import Store
pull("org/Tiny-Llama", store=Store(sys.argv[1]), client=HubClient(endpoint=sys.argv[2]), supported={"llama"},
     progress=NoProgress())
"""


def test_a_pull_killed_mid_download_leaves_nothing_listed_and_the_next_pull_resumes(
    hub: HubServer, tmp_path: Path
) -> None:
    store = Store(tmp_path)
    hub.stalled.clear()
    hub.release.clear()
    hub.stall_after["model.safetensors"] = 300_000
    partial = tmp_path / "downloads/org/Tiny-Llama" / hub.repos["org/Tiny-Llama"].commit / "model.safetensors.part"
    child = subprocess.Popen([sys.executable, "-c", _PULLER, str(tmp_path), hub.url])
    try:
        assert hub.stalled.wait(60), "the child never reached the weights"
        # Kill once the whole chunk is on disk: a size > 0 could be read mid-write, and a kill there cuts the chunk.
        assert _wait_for(lambda: partial.is_file() and partial.stat().st_size >= 262_144), "the child wrote no chunk"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
        hub.release.set()
    assert partial.stat().st_size == 262_144  # the whole chunks received before the kill
    assert store.list() == []
    before = len(hub.downloads_of("model.safetensors"))
    model = run_pull(hub, store, "org/Tiny-Llama")
    assert hub.downloads_of("model.safetensors")[before:] == ["bytes=262144-"]
    assert [m.ref for m in store.list()] == [model.ref]
    read_base_file(model.path, verify=True)


@pytest.mark.slow
def test_the_real_smollm2_gguf_converts_to_a_base_file_with_identical_weights(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    converted = convert(smollm2_gguf, tmp_path / "smollm2.base", None, None, "default")
    assert (converted.arch, converted.quant, converted.params) == ("llama", "q4", 134_515_008)
    header, tensors = read_base_file(tmp_path / "smollm2.base", verify=True)
    weights, group_sizes = model_weights(tensors)  # its Q4_1 matrices and Q8_0 embeddings as their blocks
    checkpoint = gguf.GGUFCheckpoint.open(smollm2_gguf)
    config, metadata = checkpoint.config, dict(checkpoint.metadata)
    expected = _gguf_weights(smollm2_gguf)
    assert header["config"] == config and header["quant_profile"] == "gguf-Q4_1"
    assert (
        sorted(weights) == sorted(expected)
        and group_sizes == {}
        and BaseFile.open(tmp_path / "smollm2.base").version == 3
    )
    assert all(mx.array_equal(weights[name], expected[name]) for name in expected)
    stored, original = Tokenizer.from_gguf_metadata(header["tokenizer"]["gguf"]), Tokenizer.from_gguf_metadata(metadata)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert stored.encode("Hello, world!") == original.encode("Hello, world!")
    assert stored.apply_chat_template(messages) == original.apply_chat_template(messages)


def test_a_sharded_repo_is_pulled_through_its_index(hub: HubServer, tmp_path: Path) -> None:
    model = run_pull(hub, Store(tmp_path), "org/Tiny-Sharded:f32", keep_download=True)
    assert sorted(model.source["files"]) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    _, tensors = read_base_file(model.path)
    for name, value in load_file(str(LLAMA_FIXTURE / "model.safetensors")).items():
        np.testing.assert_array_equal(np.array(tensors[name]), value)
    commit = hub.repos["org/Tiny-Sharded"].commit
    assert (tmp_path / "downloads/org/Tiny-Sharded" / commit / "model.safetensors.index.json").is_file()


def test_a_new_commit_on_the_hub_replaces_the_stored_variant(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with HubServer() as hub:
        files = tiny_llama_files(LLAMA_FIXTURE)
        first = hub.add_repo("org/Moving", files)
        assert run_pull(hub, store, "org/Moving").source["commit"] == first
        second = hub.add_repo("org/Moving", {**files, "tokenizer_config.json": b'{"eos_token": "t3"}'})
        model = run_pull(hub, store, "org/Moving")
    assert (model.source["commit"], second != first) == (second, True)
    assert store.list() == [model]
    header, _ = read_base_file(model.path)
    assert header["tokenizer"]["tokenizer_config.json"] == {"eos_token": "t3"}


def test_a_repo_named_in_another_case_is_stored_under_the_hubs_spelling(hub: HubServer, tmp_path: Path) -> None:
    store = Store(tmp_path)
    first = run_pull(hub, store, "ORG/tiny-llama")
    assert first.ref == "org/Tiny-Llama:q4"
    assert run_pull(hub, store, "org/Tiny-Llama") == first
    assert store.list() == [first]


def test_a_pull_can_pin_a_commit(hub: HubServer, tmp_path: Path) -> None:
    commit = hub.repos["org/Tiny-Llama"].commit
    model = run_pull(hub, Store(tmp_path), "org/Tiny-Llama", revision=commit)
    assert (model.source["revision"], model.source["commit"]) == (commit, commit)


def test_a_gguf_already_stored_from_a_local_import_is_not_downloaded_again(hub: HubServer, tmp_path: Path) -> None:
    from baselm.store.import_local import import_local

    store = Store(tmp_path)
    imported = import_local(hub.gguf_dir / "tiny-llama.Q8_0.gguf", supported=SUPPORTED, store=store)
    before = len(hub.requests)
    model = run_pull(hub, store, "org/Tiny-Llama-GGUF:Q8_0")
    assert hub.downloads_of("tiny-llama.Q8_0.gguf")[before:] == [] and not any(
        "/resolve/" in p for _, p, _ in hub.requests[before:]
    )
    assert (model.ref, model.path) == ("org/Tiny-Llama-GGUF:q8_0", imported.path)
    assert model.source["repo"] == "org/Tiny-Llama-GGUF" and len(list(store.blobs.root.glob("*.base"))) == 1

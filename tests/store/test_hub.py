"""The hub client against a local server speaking the hub's API: listing, choosing files,
resumable verified downloads, and the errors people see."""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

import pytest
from hub_server import HubServer, git_blob_id
from huggingface_hub import HfApi, hf_hub_download

from baselm.store import hub as hub_module
from baselm.store.errors import ModelFileError, StoreError, UnsupportedModelError
from baselm.store.hub import (
    DEFAULT_MMPROJ,
    HubClient,
    HubError,
    HubFile,
    MmprojChoice,
    RepoSnapshot,
    check_model_type,
    gguf_tag,
    quant_bits,
    select_files,
)
from baselm.store.progress import LineProgress

WEIGHTS = bytes(range(256)) * 4096  # 1 MiB, several download chunks
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"model": {}}',
    "model.safetensors": WEIGHTS,
    "README.md": b"# readme\n",
    "pytorch_model.bin": b"\0" * 100,
    "onnx/model.onnx": b"\0" * 100,
}
GGUFS = {f"Tiny-{tag}.gguf": tag.encode() * 10 for tag in ("Q4_K_M", "q8_0", "Q4_0", "F16")}


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        server.add_repo("org/tiny", FILES)
        server.add_repo("org/tiny-gguf", {**GGUFS, "mmproj-Tiny-F16.gguf": b"p", "README.md": b"r"})
        server.add_repo("org/gated", FILES, gated=True, granted_tokens=("hf_granted",))
        server.add_repo("org/private", FILES, private=True, granted_tokens=("hf_granted",))
        yield server


@pytest.fixture
def client(hub: HubServer) -> HubClient:
    return HubClient(endpoint=hub.url, token="hf_other")


def test_huggingface_hub_itself_downloads_from_the_test_server(hub: HubServer, tmp_path: Path) -> None:
    path = hf_hub_download("org/tiny", "model.safetensors", cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert Path(path).read_bytes() == WEIGHTS
    tree = HfApi(endpoint=hub.url, token=False).list_repo_tree("org/tiny", recursive=True)
    assert sorted(f.path for f in tree) == sorted(FILES)


def test_a_snapshot_lists_the_commit_sizes_and_hashes(hub: HubServer, client: HubClient) -> None:
    snapshot = client.snapshot("org/tiny")
    assert snapshot.commit == hub.repos["org/tiny"].commit
    weights = snapshot.file("model.safetensors")
    assert (weights.size, weights.sha256) == (len(WEIGHTS), hashlib.sha256(WEIGHTS).hexdigest())
    config = snapshot.file("config.json")
    assert (config.sha256, config.blob_id) == (None, git_blob_id(FILES["config.json"]))


def test_a_safetensors_repo_selects_only_what_a_model_needs(client: HubClient) -> None:
    selection = select_files(client.snapshot("org/tiny"), None)
    assert selection.kind == "safetensors"
    assert sorted(f.path for f in selection.files) == ["config.json", "model.safetensors", "tokenizer.json"]


@pytest.mark.parametrize(
    ("tag", "expected"),
    [("Q8_0", "Tiny-q8_0.gguf"), ("q4_k_m", "Tiny-Q4_K_M.gguf"), (None, "Tiny-Q4_0.gguf")],
)
def test_a_gguf_repo_selects_the_one_file_of_the_asked_quant(client: HubClient, tag: str | None, expected: str) -> None:
    selection = select_files(client.snapshot("org/tiny-gguf"), tag)
    assert (selection.kind, [f.path for f in selection.files]) == ("gguf", [expected])


def test_an_absent_gguf_quant_lists_the_ones_there_are(client: HubClient) -> None:
    with pytest.raises(ModelFileError, match="org/tiny-gguf has no Q2_K GGUF file; it has F16, Q4_0, Q4_K_M, Q8_0"):
        select_files(client.snapshot("org/tiny-gguf"), "Q2_K")


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("model-q8_0.gguf", "q8_0"),
        ("x-IQ4_XS.gguf", "IQ4_XS"),
        ("tiny.F16.gguf", "F16"),
        ("tiny.gguf", ""),
    ],
)
def test_the_quant_tag_of_a_gguf_file_name(name: str, tag: str) -> None:
    assert gguf_tag(name) == tag


def repo_of(*paths: str) -> RepoSnapshot:
    """A listing of `paths` as the hub gives it (sizes and hashes do not matter to the choice)."""
    return RepoSnapshot("org/vlm", "main", "0" * 40, tuple(HubFile(p, 1, None, None) for p in sorted(paths)))


def chosen(snapshot: RepoSnapshot, tag: str | None = None, mmproj: MmprojChoice = DEFAULT_MMPROJ) -> list[str]:
    """The model's files, then its projector, as `select_files` picks them."""
    selection = select_files(snapshot, tag, mmproj)
    return [f.path for f in selection.files] + ([selection.mmproj.path] if selection.mmproj else [])


@pytest.mark.parametrize(("name", "bits"), [("m-Q4_K_M.gguf", 4), ("mmproj-BF16.gguf", 16), ("mmproj.gguf", 0)])
def test_the_bits_of_a_quant_tag_are_its_first_number(name: str, bits: int) -> None:
    assert quant_bits(name) == bits


def test_a_gguf_repo_brings_the_projector_closest_in_bits_to_the_model_as_llama_cpp_does() -> None:
    unsloth = repo_of("M-Q4_K_M.gguf", "M-Q8_0.gguf", "mmproj-F32.gguf", "mmproj-F16.gguf", "mmproj-BF16.gguf")
    assert chosen(unsloth, "Q8_0") == ["M-Q8_0.gguf", "mmproj-BF16.gguf"]  # 16 bits of each: the first by name
    mixed = repo_of("M-Q4_0.gguf", "M-F32.gguf", "mmproj-M-f16.gguf", "mmproj-M-q8_0.gguf", "mmproj-M-f32.gguf")
    assert chosen(mixed) == ["M-Q4_0.gguf", "mmproj-M-q8_0.gguf"]  # the default Q4_0: 8 bits is closest
    assert chosen(mixed, "F32") == ["M-F32.gguf", "mmproj-M-f32.gguf"]


def test_the_projector_in_the_models_own_folder_wins_and_another_folders_is_never_taken() -> None:
    split = ("Q4_K_M/M-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/M-Q4_K_M-00002-of-00002.gguf")
    snapshot = repo_of(*split, "Q4_K_M/mmproj-F32.gguf", "mmproj-Q4_0.gguf", "BF16/mmproj-BF16.gguf", "M-F16.gguf")
    assert chosen(snapshot, "Q4_K_M") == [*split, "Q4_K_M/mmproj-F32.gguf"]
    assert chosen(snapshot, "F16") == ["M-F16.gguf", "mmproj-Q4_0.gguf"]  # BF16/ is not above the model's folder


def test_a_quant_tag_never_picks_a_projector_as_the_model() -> None:
    snapshot = repo_of("Model-F16.gguf", "Model-mmproj-F16.gguf", "mmproj-model-f16.gguf", "Model-Q4_K_M.gguf")
    assert chosen(snapshot, "F16") == ["Model-F16.gguf", "Model-mmproj-F16.gguf"]
    assert chosen(snapshot, "Q4_K_M", MmprojChoice(wanted=False)) == ["Model-Q4_K_M.gguf"]
    assert chosen(repo_of("Model-Q4_K_M.gguf", "README.md")) == ["Model-Q4_K_M.gguf"]  # no projector: as before


def test_a_named_projector_is_taken_by_its_path_or_its_file_name() -> None:
    snapshot = repo_of("M-Q4_0.gguf", "mmproj-F16.gguf", "extra/mmproj-F32.gguf")
    assert chosen(snapshot, None, MmprojChoice("extra/mmproj-F32.gguf"))[-1] == "extra/mmproj-F32.gguf"
    assert chosen(snapshot, None, MmprojChoice("mmproj-F32.gguf"))[-1] == "extra/mmproj-F32.gguf"


def test_a_named_projector_the_repo_lacks_is_an_error_naming_it_and_the_ones_there_are() -> None:
    snapshot = repo_of("M-Q4_0.gguf", "mmproj-F16.gguf", "mmproj-F32.gguf", "README.md")
    message = (
        "org/vlm has no GGUF file 'mmproj-Q8_0.gguf' to take as the vision projector; its projectors are "
        "mmproj-F16.gguf, mmproj-F32.gguf"
    )
    with pytest.raises(ModelFileError, match=re.escape(message)):
        select_files(snapshot, None, MmprojChoice("mmproj-Q8_0.gguf"))
    with pytest.raises(ModelFileError, match="no GGUF file 'README.md' to take as the vision projector"):
        select_files(snapshot, None, MmprojChoice("README.md"))
    with pytest.raises(ModelFileError, match="no GGUF file 'mmproj.gguf' .* it has no vision projector"):
        select_files(repo_of("M-Q4_0.gguf"), None, MmprojChoice("mmproj.gguf"))


def test_a_projector_for_a_safetensors_pull_or_with_no_mmproj_is_refused() -> None:
    snapshot = repo_of("config.json", "model.safetensors", "mmproj-F16.gguf")
    assert chosen(snapshot) == ["config.json", "model.safetensors"]
    with pytest.raises(ModelFileError, match="org/vlm is pulled from its safetensors weights; --mmproj picks a GGUF"):
        select_files(snapshot, None, MmprojChoice("mmproj-F16.gguf"))
    with pytest.raises(StoreError, match="--mmproj and --no-mmproj ask for opposite things; give one"):
        MmprojChoice("mmproj-F16.gguf", wanted=False)


def test_an_unsupported_model_type_is_refused_by_name() -> None:
    with pytest.raises(
        UnsupportedModelError, match="org/x is a 'bert' model, which base does not run; supported: llama, qwen2"
    ):
        check_model_type({"model_type": "bert"}, {"llama", "qwen2"}, "org/x")


def test_a_download_is_verified_and_byte_identical(hub: HubServer, client: HubClient, tmp_path: Path) -> None:
    snapshot = client.snapshot("org/tiny")
    path = client.download(snapshot, snapshot.file("model.safetensors"), tmp_path)
    assert path == tmp_path / "model.safetensors" and path.read_bytes() == WEIGHTS
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_download_cut_off_halfway_resumes_with_a_range_request(
    hub: HubServer, client: HubClient, tmp_path: Path
) -> None:
    snapshot = client.snapshot("org/tiny")
    hub.cut_after["model.safetensors"] = len(WEIGHTS) // 2 + 1000
    before = len(hub.downloads_of("model.safetensors"))
    path = client.download(snapshot, snapshot.file("model.safetensors"), tmp_path)
    assert path.read_bytes() == WEIGHTS
    # whole chunks (256 KiB) received before the cut are kept: the retry asks for the rest
    assert hub.downloads_of("model.safetensors")[before:] == [None, f"bytes={len(WEIGHTS) // 2}-"]


def test_a_partial_file_from_an_earlier_run_is_resumed(hub: HubServer, client: HubClient, tmp_path: Path) -> None:
    snapshot = client.snapshot("org/tiny")
    (tmp_path / "model.safetensors.part").write_bytes(WEIGHTS[:300_000])
    before = len(hub.downloads_of("model.safetensors"))
    path = client.download(snapshot, snapshot.file("model.safetensors"), tmp_path)
    assert path.read_bytes() == WEIGHTS
    assert hub.downloads_of("model.safetensors")[before:] == ["bytes=300000-"]


def test_a_download_that_does_not_match_its_hash_is_removed(hub: HubServer, client: HubClient, tmp_path: Path) -> None:
    snapshot = client.snapshot("org/tiny")
    hub.corrupt.add("model.safetensors")
    with pytest.raises(HubError, match="model.safetensors from org/tiny does not match the hash the hub lists"):
        client.download(snapshot, snapshot.file("model.safetensors"), tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert client.download(snapshot, snapshot.file("model.safetensors"), tmp_path).read_bytes() == WEIGHTS


def test_progress_lines_when_not_on_a_terminal(client: HubClient, tmp_path: Path) -> None:
    out = io.StringIO()
    snapshot = client.snapshot("org/tiny")
    client.download(snapshot, snapshot.file("model.safetensors"), tmp_path, LineProgress(out))
    lines = out.getvalue().splitlines()
    assert lines[:4] == [
        "downloading model.safetensors (1.0 MiB)",
        "  model.safetensors: 25%",
        "  model.safetensors: 50%",
        "  model.safetensors: 75%",
    ]
    assert re.fullmatch(r"  downloaded model\.safetensors: 1\.0 MiB in \d+\.\d s", lines[4]) and len(lines) == 5


@pytest.mark.parametrize("token", [None, "hf_other"])
def test_a_gated_repo_needs_a_token_with_access(
    hub: HubServer, tmp_path: Path, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored token either
    client = HubClient(endpoint=hub.url, token=token)
    snapshot = client.snapshot("org/gated")  # the listing is public, as on the hub
    with pytest.raises(HubError, match=r"org/gated is gated or private: it needs a token \(set HF_TOKEN\) with access"):
        client.download(snapshot, snapshot.file("config.json"), tmp_path)


def test_hf_token_grants_access(hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    client = HubClient(endpoint=hub.url)
    snapshot = client.snapshot("org/private")
    assert client.download(snapshot, snapshot.file("config.json"), tmp_path).read_bytes() == FILES["config.json"]


def test_a_private_repo_without_access_says_to_set_a_token(client: HubClient) -> None:
    with pytest.raises(HubError, match="no such repo 'org/private' .*set HF_TOKEN to a token with access"):
        client.snapshot("org/private")


def test_a_missing_repo_and_a_missing_revision_are_named(client: HubClient) -> None:
    with pytest.raises(HubError, match=r"no such repo 'org/nothing' on http://127\.0\.0\.1:\d+"):
        client.snapshot("org/nothing")
    with pytest.raises(HubError, match="org/tiny has no revision 'v2'"):
        client.snapshot("org/tiny", revision="v2")


def test_hf_endpoint_is_read_when_the_client_is_made(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    assert HubClient().snapshot("org/tiny").commit == hub.repos["org/tiny"].commit


def test_an_unreachable_hub_is_a_network_error() -> None:
    with pytest.raises(HubError, match=r"cannot reach http://127\.0\.0\.1:9 \(ConnectError\); check the network"):
        HubClient(endpoint="http://127.0.0.1:9").snapshot("org/tiny")


def test_a_connection_that_keeps_dropping_gives_up_with_a_resumable_error(
    hub: HubServer, client: HubClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hub_module, "RETRY_DELAY", 0.001)
    snapshot = client.snapshot("org/tiny")
    hub.cut_always["config.json"] = 5  # less than a chunk: no attempt brings new bytes
    try:
        with pytest.raises(
            HubError,
            match=r"the connection to http://127\.0\.0\.1:\d+ failed \(RemoteProtocolError\); pull again to resume",
        ):
            client.download(snapshot, snapshot.file("config.json"), tmp_path)
    finally:
        del hub.cut_always["config.json"]
    assert len(hub.downloads_of("config.json")) >= 5
    assert client.download(snapshot, snapshot.file("config.json"), tmp_path).read_bytes() == FILES["config.json"]


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../outside.json", "weights/../../outside.json", "dir\\file.json", "nul\0.json", "a//b"]
)
def test_a_listed_file_name_that_would_land_outside_the_folder_is_refused(
    hub: HubServer, client: HubClient, name: str
) -> None:
    hub.add_repo("org/hostile-names", {**FILES, name: b"x"})
    with pytest.raises(HubError) as refused:
        client.snapshot("org/hostile-names")
    assert str(refused.value) == (
        f"{hub.url} lists a file named {name!r} in org/hostile-names, which is not a path inside the repo; "
        "refused (is HF_ENDPOINT a hub you trust?)"
    )


@pytest.mark.parametrize("commit", ["../../elsewhere", "abc123", "A" * 40, "0" * 39 + "/"])
def test_a_commit_that_is_not_40_hex_digits_is_refused(hub: HubServer, client: HubClient, commit: str) -> None:
    hub.add_repo("org/hostile-commit", FILES)
    hub.repos["org/hostile-commit"].commit = commit
    with pytest.raises(HubError) as refused:
        client.snapshot("org/hostile-commit")
    assert str(refused.value) == (
        f"{hub.url} gave {commit!r} as the commit of org/hostile-commit@main, which is not a commit id "
        "(40 hex digits); is HF_ENDPOINT a hub?"
    )


def test_an_answer_for_another_repo_is_refused(hub: HubServer, client: HubClient) -> None:
    """The hub may change a repo id's letter case, never the id."""
    hub.add_repo("org/asked", FILES)
    hub.repos["org/asked"].name = "../../elsewhere"
    with pytest.raises(HubError) as refused:
        client.snapshot("org/asked")
    assert (
        str(refused.value)
        == f"{hub.url} answered for '../../elsewhere' when asked for 'org/asked'; is HF_ENDPOINT a hub?"
    )

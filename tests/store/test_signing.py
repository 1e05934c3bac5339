"""Signed `.base` files: keys, detached and embedded signatures, and every way a signature must fail."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from baselm.backend import Backend
from baselm.cli import app
from baselm.loader import load_model
from baselm.store.base_format import header_checksum
from baselm.store.base_reader import BaseFile
from baselm.store.convert import convert
from baselm.store.errors import BaseFileError, SignatureError, StoreError
from baselm.store.import_local import import_local
from baselm.store.registry import Store
from baselm.store.signed_file import keys_with, sign_file, verify_file
from baselm.store.signing import PublicKey, keygen, sidecar
from tests.forward import prefill_logits
from tests.paths import BPE_TOKENIZER, LLAMA_FIXTURE
from tests.store.base_helpers import entry, rewrite_header, write_small
from tests.tiny_gguf import tiny_llama_gguf

CPU = Backend("cpu", mx.float32, keep_quantized=False)
IDS = np.array([1, 17, 42, 99, 7, 200, 3, 64])


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BASE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return keygen(tmp_path / "keys", "alice")


def trust(home: Path, pub: Path) -> None:
    (home / "trusted_keys").mkdir(parents=True, exist_ok=True)
    shutil.copy(pub, home / "trusted_keys" / pub.name)


def flip_byte(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


def tensor_position(path: Path, name: str) -> int:
    base = BaseFile.open(path)
    return base.blob_start + base.tensors[name].offset + 3


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(keys) -> None:
    key, pub = keys
    assert (key.name, pub.name) == ("alice.key", "alice.pub")
    assert os.stat(key).st_mode & 0o777 == 0o600
    parsed = PublicKey.read(pub)
    assert parsed.name == "alice" and len(parsed.raw) == 32
    with pytest.raises(SignatureError, match="exists"):
        keygen(key.parent, "alice")


def test_a_detached_signature_verifies_with_a_trusted_key(tmp_path, home, keys) -> None:
    key, pub = keys
    path = write_small(tmp_path / "m.base")
    signer, where = sign_file(path, key)
    assert where == sidecar(path) and signer.name == "alice"
    with pytest.raises(SignatureError, match="not trusted"):
        verify_file(path)  # nothing trusted yet
    assert verify_file(path, keys_with(pub)).key_id == signer.key_id
    trust(home, pub)
    assert verify_file(path).key_id == signer.key_id


def test_an_embedded_signature_keeps_the_file_valid_and_verifiable(tmp_path, home, keys) -> None:
    key, pub = keys
    path = write_small(tmp_path / "m.base")
    before = BaseFile.open(path).load()
    sign_file(path, key, embed=True)
    assert not sidecar(path).exists()
    base = BaseFile.open(path)
    assert "signature" in base.header
    base.verify()  # its own xxh64 checksums still hold
    after = base.load()
    for name, value in before.items():
        a, b = (value, after[name]) if isinstance(value, mx.array) else (value.codes, after[name].codes)
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    trust(home, pub)
    verify_file(path)


def test_a_tampered_tensor_byte_is_caught_by_verify_and_while_loading(tmp_path, home, keys) -> None:
    key, pub = keys
    trust(home, pub)
    path = write_small(tmp_path / "m.base")
    sign_file(path, key)
    name = "model.layers.0.self_attn.q_proj.weight"
    flip_byte(path, tensor_position(path, name))
    with pytest.raises(BaseFileError, match="checksum"):
        verify_file(path)  # the xxh64 checksum already differs
    from baselm.store.signed_file import signed_statement

    base = BaseFile.open(path)
    digests = signed_statement(base)[0]["tensors_sha256"]
    with pytest.raises(SignatureError, match=f"tensor '{name}' differs"):
        base.load(digests=digests)


def test_a_forger_who_fixes_the_xxh64_checksums_still_fails_the_signature(tmp_path, home, keys) -> None:
    key, pub = keys
    trust(home, pub)
    path = write_small(tmp_path / "m.base")
    sign_file(path, key)
    name = "model.layers.0.input_layernorm.weight"
    flip_byte(path, tensor_position(path, name))
    import xxhash

    base = BaseFile.open(path)
    region = path.read_bytes()[base.blob_start + base.tensors[name].offset :][: base.tensors[name].length]

    def fix(header):
        entry(header, name)["checksum_xxh64"] = xxhash.xxh64(region).hexdigest()
        header["header_xxh64"] = header_checksum(header)

    rewrite_header(path, fix)
    BaseFile.open(path).verify()  # consistent for xxh64
    with pytest.raises(SignatureError, match="header differs"):
        verify_file(path)


def test_a_tampered_header_or_signature_is_refused(tmp_path, home, keys) -> None:
    key, pub = keys
    trust(home, pub)
    path = write_small(tmp_path / "m.base")
    sign_file(path, key)

    def edit(header):
        header["config"]["rms_norm_eps"] = 1e-3
        header["header_xxh64"] = header_checksum(header)

    rewrite_header(path, edit)
    with pytest.raises(SignatureError, match="header differs"):
        verify_file(path)
    path = write_small(tmp_path / "n.base")
    sign_file(path, key)
    signed = json.loads(sidecar(path).read_text())
    signed["signature"] = ("A" if signed["signature"][0] != "A" else "B") + signed["signature"][1:]
    sidecar(path).write_text(json.dumps(signed))
    with pytest.raises(SignatureError, match="does not verify"):
        verify_file(path)
    sign_file(path, key)
    good = json.loads(sidecar(path).read_text())
    good["statement"]["tensors_sha256"]["model.norm.weight"] = "0" * 64  # the statement edited, signature kept
    sidecar(path).write_text(json.dumps(good))
    with pytest.raises(SignatureError, match="does not verify"):
        verify_file(path)


def test_a_wrong_or_untrusted_key_is_refused(tmp_path, home, keys) -> None:
    key, _ = keys
    _, other_pub = keygen(tmp_path / "keys", "bob")
    trust(home, other_pub)
    path = write_small(tmp_path / "m.base")
    sign_file(path, key)
    with pytest.raises(SignatureError, match="alice.*not trusted"):
        verify_file(path)
    sidecar(path).unlink()
    with pytest.raises(SignatureError, match="not signed"):
        verify_file(path)


def test_a_signed_file_that_was_requantized_fails(tmp_path, home, keys) -> None:
    key, pub = keys
    trust(home, pub)
    folder = _hf_folder(tmp_path)
    path = tmp_path / "m.base"
    convert(folder, path, "q8", None, "mixed")
    sign_file(path, key)
    signature = sidecar(path).read_bytes()
    convert(folder, path, "q4", None, "mixed")  # the same model, quantized again, the old signature beside it
    sidecar(path).write_bytes(signature)
    with pytest.raises(SignatureError, match="re-quantized"):
        verify_file(path)


def _hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "src" / "Tiny-Llama"
    shutil.copytree(LLAMA_FIXTURE, folder, ignore=shutil.ignore_patterns("reference.npz", "config_linear.json"))
    for file in BPE_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def test_require_signature_loads_only_good_signed_base_files(tmp_path, home, keys) -> None:
    key, pub = keys
    trust(home, pub)
    folder = _hf_folder(tmp_path)
    path = tmp_path / "m.base"
    convert(folder, path, "q8", None, "mixed")
    with pytest.raises(SignatureError, match="not signed"):
        load_model(path, CPU, require_signature=True)
    with pytest.raises(SignatureError, match="only .base files"):
        load_model(folder, CPU, require_signature=True)
    sign_file(path, key, embed=True)
    signed = load_model(path, CPU, require_signature=True)
    assert np.array_equal(prefill_logits(signed.model, IDS), prefill_logits(load_model(path, CPU).model, IDS))
    flip_byte(path, tensor_position(path, "model.norm.weight"))
    with pytest.raises(SignatureError, match="model.norm.weight"):
        load_model(path, CPU, require_signature=True)


def test_require_signature_refuses_a_folder_named_like_a_base_file(tmp_path, home, keys) -> None:
    trust(home, keys[1])
    folder = _hf_folder(tmp_path).rename(tmp_path / "Tiny-Llama.base")
    with pytest.raises(SignatureError, match="only .base files"):
        load_model(folder, CPU, require_signature=True)
    result = CliRunner().invoke(app, ["run", str(folder), "hi", "--require-signature", "-n", "1"])
    assert result.exit_code == 1 and "only .base files" in result.output
    assert load_model(folder, CPU).path == folder  # without --require-signature it loads as the HF folder it is


def test_require_signature_refuses_a_gguf_file(tmp_path, home) -> None:
    path, _ = tiny_llama_gguf(tmp_path / "m.gguf", "F32")
    with pytest.raises(SignatureError, match=r"is not a \.base file; only \.base files carry signatures"):
        load_model(path, CPU, require_signature=True)


def test_pulling_a_signed_base_file_checks_and_keeps_its_signature(tmp_path, home, keys) -> None:
    key, pub = keys
    store = Store(home)
    path = write_small(tmp_path / "m.base", config={"model_type": "llama", "hidden_size": 64})
    sign_file(path, key)
    with pytest.raises(SignatureError, match="not trusted"):
        import_local(path, store=store, supported=None)
    assert store.list() == []
    trust(home, pub)
    stored = import_local(path, store=store, supported=None)
    assert sidecar(stored.path).read_bytes() == sidecar(path).read_bytes()
    verify_file(stored.path)
    store.remove(stored.ref)
    assert not sidecar(stored.path).exists()


def test_a_failed_embed_leaves_the_signed_file_as_it_was(tmp_path, home, keys, monkeypatch) -> None:
    key, pub = keys
    trust(home, pub)
    path = write_small(tmp_path / "m.base")
    sign_file(path, key)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr("baselm.store.base_writer.rewrite_header", crash)
    with pytest.raises(OSError):
        sign_file(path, key, embed=True)
    assert path.read_bytes() == before and sidecar(path).exists()
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []
    verify_file(path)


def test_the_commands_make_keys_sign_verify_and_refuse(tmp_path, home) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["keygen", "--out", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    path = write_small(tmp_path / "m.base")
    result = runner.invoke(app, ["sign", str(path), "--key", str(tmp_path / "k" / "base.key")])
    assert result.exit_code == 0 and "signed" in result.output
    result = runner.invoke(app, ["verify", str(path)])
    assert result.exit_code == 1 and "not trusted" in result.output
    result = runner.invoke(app, ["verify", str(path), "--pubkey", str(tmp_path / "k" / "base.pub")])
    assert result.exit_code == 0 and "good signature" in result.output
    folder = _hf_folder(tmp_path)
    result = runner.invoke(app, ["run", str(folder), "hi", "--require-signature", "-n", "1"])
    assert result.exit_code == 1 and "only .base files" in result.output


def test_store_errors_are_the_base_of_signature_errors() -> None:
    assert issubclass(SignatureError, StoreError)


def test_a_signature_check_reports_the_bytes_it_reads_and_closes_with_a_line(tmp_path, home, keys) -> None:
    import io
    import re

    from baselm.store.fs import human_size
    from baselm.store.progress import LineProgress

    key, pub = keys
    path = write_small(tmp_path / "m.base")
    sign_file(path, key)
    out = io.StringIO()
    verify_file(path, keys_with(pub), LineProgress(out, kind="check"))
    total = sum(e.length for e in BaseFile.open(path).tensors.values())
    lines = out.getvalue().splitlines()
    assert lines[0] == f"checking m.base ({human_size(total)})"
    assert re.fullmatch(r"  checked m\.base: .+ in \d+\.\d s", lines[-1]), lines

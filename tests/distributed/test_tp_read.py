"""A tensor-parallel rank reads only its slices of a `.base` file, and builds the same weights as
loading the whole file and slicing it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from baselm.backend import Backend
from baselm.distributed.tp.layers import DEFAULT_MOE_SPLIT, Sharding
from baselm.loader import _load_base_file, load_model, model_from_checkpoint
from baselm.models import model_class
from baselm.store import hf
from baselm.store.base_reader import BaseFile, model_weights
from baselm.store.convert import convert
from baselm.store.errors import SignatureError
from baselm.store.signed_file import sign_file
from baselm.store.signing import keygen
from tests.distributed.moe_fixtures import WIDENED_EXPERTS, widened_experts
from tests.paths import BPE_TOKENIZER, MODEL_FIXTURES
from tests.tiny_model import write_model_folder

ROOT = Path(__file__).resolve().parents[2]

BACKENDS = {
    "quantized": Backend("cpu", mx.float32, keep_quantized=True),
    "dense": Backend("cpu", mx.float32, keep_quantized=False),
}


def _widen_experts(folder: Path, key: str) -> None:
    """Rewrites the folder's expert tensors with 64 intermediate features (seeded random values)."""
    config, weights = widened_experts(folder, key)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))


def _base(tmp_path: Path, fixture: str, quant: str, group_size: int = 32) -> Path:
    """The fixture converted to a `.base` file (q4/q8 in groups of `group_size`, or f16)."""
    folder = tmp_path / fixture
    source = fixture.removesuffix("_split").removesuffix("_fused")  # the same weights stored otherwise
    shutil.copytree(MODEL_FIXTURES / source, folder, dirs_exist_ok=True)
    if source in WIDENED_EXPERTS:
        _widen_experts(folder, WIDENED_EXPERTS[source])
    if fixture.endswith("_split"):
        _split_gpt_oss_experts(folder)
    if fixture.endswith("_fused"):
        _fuse_experts(folder)
    shutil.copy(BPE_TOKENIZER / "tokenizer.json", folder / "tokenizer.json")
    target = tmp_path / f"{fixture}-{quant}-{group_size}.base"
    convert(folder, target, quant, group_size if quant != "f16" else None, "default")
    return target


def _split_gpt_oss_experts(folder: Path) -> None:
    """Rewrites a gpt-oss folder's experts as mlx-lm splits them: `gate_proj`/`up_proj`/`down_proj`
    (experts, out, in) with `.weight` and `.bias`, which `sanitize` interleaves back."""
    weights = hf.read_weights(folder)
    for name in [n for n in weights if n.endswith("experts.gate_up_proj")]:
        prefix = name.removesuffix(".gate_up_proj")
        fused, bias = (
            weights.pop(name),
            weights.pop(name + "_bias"),
        )  # (experts, hidden, 2 * inter), (experts, 2 * inter)
        for half, part in enumerate(("gate_proj", "up_proj")):
            weights[f"{prefix}.{part}.weight"] = mx.contiguous(fused[..., half::2].swapaxes(-1, -2))
            weights[f"{prefix}.{part}.bias"] = mx.contiguous(bias[..., half::2])
        down = weights.pop(f"{prefix}.down_proj")  # (experts, inter, hidden)
        weights[f"{prefix}.down_proj.weight"] = mx.contiguous(down.swapaxes(-1, -2))
        weights[f"{prefix}.down_proj.bias"] = weights.pop(f"{prefix}.down_proj_bias")
    mx.save_safetensors(str(folder / "model.safetensors"), weights)


def _fuse_experts(folder: Path) -> None:
    """Rewrites a MoE folder's per-expert tensors as some checkpoints store them: `gate_up_proj`
    (experts, 2 * inter, hidden), gate rows then up rows, and `down_proj` (experts, hidden, inter)."""
    weights = hf.read_weights(folder)
    for prefix in sorted({n.rsplit(".experts.", 1)[0] for n in weights if ".experts." in n}):
        experts = [n.removeprefix(f"{prefix}.experts.") for n in weights if n.startswith(f"{prefix}.experts.")]
        num_experts = 1 + max(int(n.split(".")[0]) for n in experts)

        def stacked(proj: str, prefix: str = prefix, num_experts: int = num_experts) -> mx.array:
            return mx.stack([weights.pop(f"{prefix}.experts.{e}.{proj}.weight") for e in range(num_experts)])

        gate, up = stacked("gate_proj"), stacked("up_proj")
        weights[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        weights[f"{prefix}.experts.down_proj"] = stacked("down_proj")
    mx.save_safetensors(str(folder / "model.safetensors"), weights)


def _load_then_slice(path: Path, backend: Backend, rank: int, moe_split: str = DEFAULT_MOE_SPLIT) -> nn.Module:
    base = BaseFile.open(path)
    weights, _ = model_weights(base.load())
    return model_from_checkpoint(base.header["config"], weights, backend, shard=Sharding(rank, 2, moe_split=moe_split))


# qwen3_moe_sparse_fused: its experts fused as some checkpoints store them (gate and up split at load).
CUT_FIXTURES = [
    "llama",
    "qwen2",
    "llama_rope3_mqa",
    "gemma3",
    "mixtral",
    "qwen3_moe_sparse",
    "qwen3_moe_sparse_fused",
    "phi3",
    "gpt_oss",
]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("quant", ["q4", "q8", "f16", "f32"])
@pytest.mark.parametrize("fixture", CUT_FIXTURES)
def test_a_rank_reading_its_slices_builds_the_weights_load_then_slice_builds(tmp_path, fixture, quant, backend):
    path = _base(tmp_path, fixture, quant)
    for rank in (0, 1):
        sharding = Sharding(rank, 2)
        sliced = _load_base_file(path, BACKENDS[backend], shard=sharding)[0]
        assert sharding.describe()["read_cut"], "the file was read whole"
        _same_parameters(sliced, _load_then_slice(path, BACKENDS[backend], rank), rank)


def _same_parameters(got: nn.Module, want: nn.Module, rank: int) -> None:
    got, want = dict(nn.utils.tree_flatten(got.parameters())), dict(nn.utils.tree_flatten(want.parameters()))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert mx.array_equal(got[name], value).item(), (rank, name)


def _split_weights(path: Path) -> set[str]:
    """Module paths of every weight a rank of two splits (the hook's plan of the whole model)."""
    config = BaseFile.open(path).header["config"]
    args_cls, model_cls = model_class(config["model_type"])
    return set(Sharding(0, 2).plan(model_cls(args_cls.from_dict(config)), {}))


@pytest.mark.parametrize("quant", ["q4", "f32"])
@pytest.mark.parametrize("fixture", CUT_FIXTURES)
def test_every_split_weight_is_read_cut(tmp_path, fixture, quant):
    path = _base(tmp_path, fixture, quant)
    for rank in (0, 1):
        plan = Sharding(rank, 2).read_plan(BaseFile.open(path))
        assert set(plan.cuts) == _split_weights(path)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_weights_that_cannot_be_traced_are_read_whole_and_the_others_cut(tmp_path, backend):
    path = _base(tmp_path, "gpt_oss_split", "q4")  # gate and up experts interleaved at load from two tensors
    split = _split_weights(path)
    fused = {p for p in split if p.endswith("experts.gate_up_proj")}
    for rank in (0, 1):
        sharding = Sharding(rank, 2)
        plan = sharding.read_plan(BaseFile.open(path))
        assert fused and set(plan.cuts) == split - fused
        assert not any(".gate_proj." in name or ".up_proj." in name for name in plan.reads)
        sliced = _load_base_file(path, BACKENDS[backend], shard=sharding)[0]
        _same_parameters(sliced, _load_then_slice(path, BACKENDS[backend], rank), rank)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("quant", ["q4", "q8", "f16"])
@pytest.mark.parametrize("fixture", ["mixtral", "qwen3_moe_sparse", "gpt_oss"])
def test_a_rank_with_whole_experts_builds_what_load_then_slice_builds(tmp_path, fixture, quant, backend):
    path = _base(tmp_path, fixture, quant)
    for rank in (0, 1):
        sliced = _load_base_file(path, BACKENDS[backend], shard=Sharding(rank, 2, moe_split="experts"))[0]
        whole = _load_then_slice(path, BACKENDS[backend], rank, "experts")
        got, want = dict(nn.utils.tree_flatten(sliced.parameters())), dict(nn.utils.tree_flatten(whole.parameters()))
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert mx.array_equal(got[name], value).item(), (rank, name)
        assert sliced.layers[0].mlp.inner.first == 2 * rank  # the fixtures have 4 experts


@pytest.mark.parametrize("fixture", ["mixtral", "qwen3_moe_sparse"])
def test_a_rank_with_whole_experts_reads_its_experts_and_none_of_the_others(tmp_path, fixture):
    path = _base(tmp_path, fixture, "q4")
    names = list(BaseFile.open(path).tensors)
    experts = {name: int(name.split(".experts.")[1].split(".")[0]) for name in names if ".experts." in name}
    assert experts and set(experts.values()) == {0, 1, 2, 3}
    for rank in (0, 1):
        base, sharding = BaseFile.open(path), Sharding(rank, 2, moe_split="experts")
        tensors = sharding.read(base)
        cuts = sharding.read_plan(BaseFile.open(path)).reads
        assert cuts and not any(name in cuts for name in experts)  # attention and dense MLPs are cut
        own = [name for name, e in experts.items() if 2 * rank <= e < 2 * rank + 2]
        rest = sum(e.length for name, e in base.tensors.items() if name not in cuts and name not in experts)
        own_bytes = sum(base.tensors[name].length for name in own)
        assert base.bytes_read == rest + _split_bytes(base, cuts) + own_bytes
        assert set(experts) <= set(tensors)  # the others' experts stand in, unread, for the stacking
        assert not set(cuts) & set(tensors)  # cut file tensors come as the weights made of them


def _split_bytes(base: BaseFile, cuts: dict) -> int:
    """Bytes a rank's cuts take of each cut tensor: its share of rows, or of each row's codes,
    scales and biases (the same fraction of every sub-region, as cuts fall on groups)."""
    total = 0
    for name, ranges in cuts.items():
        entry = base.tensors[name]
        total += sum(entry.length * (cut.stop - cut.start) // entry.shape[cut.axis] for cut in ranges)
    return total


@pytest.mark.parametrize("quant", ["q4", "q8", "f32"])
@pytest.mark.parametrize("fixture", ["llama", "mixtral", "phi3", "gpt_oss"])
def test_each_rank_reads_its_share_of_the_split_tensors_and_all_of_the_rest(tmp_path, fixture, quant):
    path = _base(tmp_path, fixture, quant)
    whole = BaseFile.open(path)
    whole.load()
    seen = 0
    for rank in (0, 1):
        base = BaseFile.open(path)
        cuts = Sharding(rank, 2).read_plan(base).reads
        base.load(cuts=cuts)
        rest = sum(e.length for name, e in base.tensors.items() if name not in cuts)
        assert base.bytes_read == rest + _split_bytes(base, cuts)
        split_total = sum(base.tensors[name].length for name in cuts)
        assert _split_bytes(base, cuts) == split_total // 2  # the fixture splits evenly over two ranks
        seen += base.bytes_read - rest
    assert whole.bytes_read == sum(e.length for e in whole.tensors.values())
    assert seen == sum(whole.tensors[name].length for name in cuts)  # together the ranks read each split byte once


def test_a_signed_load_and_a_checked_load_read_whole_regions(tmp_path):
    path = _base(tmp_path, "llama", "q4")
    base = BaseFile.open(path)
    cuts = Sharding(0, 2).read_plan(base).reads
    with pytest.raises(ValueError, match="sliced reads cannot be checked"):
        base.load(verify=True, cuts=cuts)
    with pytest.raises(ValueError, match="sliced reads cannot be checked"):
        base.load(digests={}, cuts=cuts)


def test_a_split_off_the_groups_reads_the_file_whole_and_slices_dense_weights_after(tmp_path):
    path = _base(tmp_path, "llama", "q4", group_size=64)  # 64 intermediate features: one group, two ranks
    sharding = Sharding(1, 2)
    assert sharding.read_plan(BaseFile.open(path)).reads == {}
    sliced = _load_base_file(path, BACKENDS["dense"], shard=Sharding(1, 2))[0]
    whole = _load_then_slice(path, BACKENDS["dense"], 1)
    got, want = dict(nn.utils.tree_flatten(sliced.parameters())), dict(nn.utils.tree_flatten(whole.parameters()))
    assert all(mx.array_equal(got[name], value).item() for name, value in want.items())


@pytest.mark.parametrize("fixture", ["tiny", "phi3", "gpt_oss"])
def test_base_run_of_a_base_file_over_two_processes_prints_what_one_process_prints(tmp_path, fixture):
    if fixture == "tiny":
        path, prompt = tmp_path / "tiny.base", "Hello there"
        convert(write_model_folder(tmp_path / "tiny"), path, "q4", 32, "default")
    else:  # 256-token fixtures: a prompt of ids below 256
        path, prompt = _base(tmp_path, fixture, "q4"), "x y z"
    assert set(Sharding(1, 2).read_plan(BaseFile.open(path)).cuts) == _split_weights(path)  # the ranks read it cut
    args = [sys.executable, "-m", "baselm.cli", "run", str(path), prompt, "-n", "12", "-t", "0", "--raw", "--json"]

    def run(*extra: str) -> list[int]:
        proc = subprocess.run([*args, "--device", "cpu", *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)["token_ids"]

    alone = run()
    assert len(alone) >= 4  # the quantized tiny model ends its answer after a few tokens, the others run to 12
    assert run("--tensor-parallel", "2") == alone


def test_a_signed_sharded_load_reads_and_checks_whole_regions(tmp_path, monkeypatch):
    monkeypatch.setenv("BASE_HOME", str(tmp_path / "home"))
    key, pub = keygen(tmp_path / "keys", "alice")
    (tmp_path / "home" / "trusted_keys").mkdir(parents=True)
    shutil.copy(pub, tmp_path / "home" / "trusted_keys" / pub.name)
    path = _base(tmp_path, "llama", "q4")
    sign_file(path, key, embed=True)
    backend = BACKENDS["quantized"]
    signed = load_model(path, backend, require_signature=True, shard=Sharding(0, 2)).model
    unsigned = load_model(path, backend, shard=Sharding(0, 2)).model
    want = dict(nn.utils.tree_flatten(unsigned.parameters()))
    assert all(mx.array_equal(v, want[k]).item() for k, v in nn.utils.tree_flatten(signed.parameters()))
    base = BaseFile.open(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    entry = base.tensors[name]
    last_row = base.blob_start + entry.scale_offset - 1  # a byte of rank 1's rows, outside rank 0's slice
    data = bytearray(path.read_bytes())
    data[last_row] ^= 0x01
    path.write_bytes(bytes(data))
    load_model(path, backend, shard=Sharding(0, 2))  # rank 0's cut reads never see the byte
    with pytest.raises(SignatureError, match=name):
        load_model(path, backend, require_signature=True, shard=Sharding(0, 2))

"""Tensor parallelism: each rank holds a slice of every layer and the layers' outputs are summed.

The split (Megatron-style, as mlx-lm and vLLM do it):
- attention: each rank takes a contiguous range of KV heads and the query heads that read them.
  q/k/v are split by output rows, o_proj by input columns; each rank's o_proj gives a partial
  sum, and one `all_sum` per layer makes the whole. Its KV pool holds only its own KV heads.
  When there are fewer KV heads than ranks, ranks that share a KV head each hold a copy
  (`Sharding.kv_replicated`), and each takes a share of the query heads reading it.
- gated MLP: gate/up split by output rows, down by input columns, one `all_sum`.
- MoE (Mixtral, Qwen3-MoE, gpt-oss), two ways (`moe_split`), the router whole on each rank:
  "experts": rank r of N holds experts [r*E/N, (r+1)*E/N) whole and computes only the
  (token, expert) pairs routed to them (baselm/distributed/tp/moe.py); the ranks' weighted sums meet
  in the MLP's one `all_sum`. "intermediate": every expert is split as a gated MLP along its
  intermediate size, so every rank computes every routed pair on its slice.
  The default (DEFAULT_MOE_SPLIT) is the one measured faster (docs/distributed.md).
- embedding, norms, router and LM head stay whole on every rank.
Splits fall on quantization group boundaries so quantized codes are sliced without repacking;
a split that cannot (a head range not a multiple of the group size) is a clear error.
Row-split biases stay on rank 0 only, so the sum adds them once.

From a `.base` file a rank reads only its slices (`read_plan`, baselm/distributed/tp/read.py): the
plan names each split weight's cut before anything is read, the reader reads those bytes alone,
and the hook then only resizes those layers. Other formats, and weights the plan cannot cut, load
whole and are sliced here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.distributed.comm import all_sum
from baselm.distributed.tp.moe import (
    MOE_SPLITS,
    RankExperts,
    expert_range,
    is_experts,
    num_experts_of,
    projections,
    shard_experts,
    stand_ins,
)
from baselm.models.attention import Attention
from baselm.models.base import ModelConfigError
from baselm.models.mlp import MLP
from baselm.models.moe import SwitchGLU
from baselm.store.base_slices import Cut

DEFAULT_MOE_SPLIT = "intermediate"


@dataclass(slots=True)
class Sharding:
    """Which rank of how many this process builds, and what the split did (for logs and doctor)."""

    rank: int
    size: int
    group: Any = None  # mx.distributed.Group; None only when nothing is summed (tests of the slicing)
    kv_replicated: bool = False  # fewer KV heads than ranks: some KV heads are held by several ranks
    notes: list[str] = field(default_factory=list)
    # NOTE: module path -> Cut of each split projection the loader read already cut (`read_plan`);
    # the hook takes those layers' ranges from here and leaves their weights alone.
    presliced: dict[str, Cut] = field(default_factory=dict)
    moe_split: str = DEFAULT_MOE_SPLIT  # "experts": whole experts per rank (tp_moe.py); "intermediate"
    first_experts: dict[str, int] = field(default_factory=dict)  # MoE module path -> its first local expert
    weight_bytes: int = 0  # this rank's parameters, once loaded

    def __post_init__(self) -> None:
        if self.moe_split not in MOE_SPLITS:
            raise ModelConfigError(f"--moe-split must be one of {', '.join(MOE_SPLITS)}, not {self.moe_split!r}")

    def read_plan(self, base: Any) -> Any:
        """This rank's `ReadPlan` of the `.base` file `base` (baselm/distributed/tp/read.py; empty: read
        all whole). Records its cuts, so the hook knows which weights arrive cut."""
        from baselm.distributed.tp.read import plan_reads

        plan = plan_reads(base, self)
        self.presliced = plan.cuts
        return plan

    def read(self, base: Any) -> dict[str, Any]:
        """This rank's tensors of the `.base` file `base`: its slices (`read_plan`, the split weights
        put together from them) and whole tensors, less other ranks' experts (`tp_moe.stand_ins`),
        which one of its own stands in for."""
        from baselm.distributed.tp.read import skeleton

        plan, skipped = self.read_plan(base), {}
        if self.moe_split == "experts":
            skipped = stand_ins(self, skeleton(base), plan.stacked)
        tensors = base.load(cuts=plan.reads, skip=set(skipped))
        tensors |= {name: tensors[other] for name, other in skipped.items()}
        return plan.assemble(tensors)

    def plan(self, model: nn.Module, group_sizes: dict[str, int]) -> dict[str, Cut]:
        """The cut the hook makes of each split projection of `model`, by module path, before
        any weight is read; `group_sizes`: the quantization group of each quantized projection.
        Raises `ModelConfigError` where the hook would (a split off its groups). Whole experts per
        rank are `Cut(0, first, stop)`: experts [first, stop) of each stacked projection."""
        cuts: dict[str, Cut] = {}
        for path, module in model.named_modules():
            if self.moe_split == "experts" and is_experts(module):
                first, stop = expert_range(num_experts_of(module), self.rank, self.size)
                cuts |= {f"{path}.{name}": Cut(0, first, stop) for name in projections(module)}
            elif isinstance(module, Attention):
                (q0, q1), (k0, k1) = head_ranges(module.num_heads, module.num_kv_heads, self.size)[self.rank]
                d = module.head_dim
                rows = {"q_proj": (q0, q1), "k_proj": (k0, k1), "v_proj": (k0, k1)}
                cuts |= {f"{path}.{n}": Cut(-2, a * d, b * d) for n, (a, b) in rows.items()}
                cuts[f"{path}.o_proj"] = Cut(-1, q0 * d, q1 * d)
            elif isinstance(module, (MLP, SwitchGLU)):
                inter = module.gate_proj.weight.shape[-2]
                a, b = even_ranges(inter, self.size, group_sizes.get(f"{path}.down_proj", 1))[self.rank]
                cuts |= {f"{path}.gate_proj": Cut(-2, a, b), f"{path}.up_proj": Cut(-2, a, b)}
                cuts[f"{path}.down_proj"] = Cut(-1, a, b)
            elif type(module).__name__ == "ClampedSwiGLUExperts":
                inter = module.down_proj.weight.shape[-1]
                a, b = even_ranges(inter, self.size, group_sizes.get(f"{path}.down_proj", 1))[self.rank]
                cuts[f"{path}.gate_up_proj"] = Cut(-2, 2 * a, 2 * b)
                cuts[f"{path}.down_proj"] = Cut(-1, a, b)
        return cuts

    def __call__(self, model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """`build_model`'s shard hook: resizes `model`'s layers to this rank's slice and slices
        `weights` (HF names after `sanitize`) to match; returns the sliced weights."""
        modules = dict(model.named_modules())
        for path, module in modules.items():
            if self.moe_split == "experts" and is_experts(module):
                first, stop = expert_range(num_experts_of(module), self.rank, self.size)
                shard_experts(path, module, weights, first, stop)
                self.first_experts[path.rpartition(".")[0]] = first
            elif isinstance(module, Attention):
                self._shard_attention(path, module, weights)
            elif isinstance(module, (MLP, SwitchGLU)):
                self._shard_mlp(path, module, weights)
            elif type(module).__name__ == "ClampedSwiGLUExperts":
                self._shard_interleaved_experts(path, module, weights)
        return weights

    # ---- attention -----------------------------------------------------------------------

    def _shard_attention(self, path: str, attn: Attention, weights: dict[str, mx.array]) -> None:
        (q0, q1), (k0, k1) = head_ranges(attn.num_heads, attn.num_kv_heads, self.size)[self.rank]
        if attn.num_kv_heads < self.size and not self.kv_replicated:
            self.kv_replicated = True
            self.notes.append(
                f"{attn.num_kv_heads} KV heads for {self.size} ranks: each KV head is held by "
                f"{self.size // attn.num_kv_heads} ranks"
            )
        d, cut = attn.head_dim, self.presliced
        split_out(attn.q_proj, weights, f"{path}.q_proj", q0 * d, q1 * d, f"{path}.q_proj" in cut)
        split_out(attn.k_proj, weights, f"{path}.k_proj", k0 * d, k1 * d, f"{path}.k_proj" in cut)
        split_out(attn.v_proj, weights, f"{path}.v_proj", k0 * d, k1 * d, f"{path}.v_proj" in cut)
        split_in(attn.o_proj, weights, f"{path}.o_proj", q0 * d, q1 * d, self.rank, f"{path}.o_proj" in cut)
        if attn.has_sinks:
            attn.sinks = attn.sinks[q0:q1]
            weights[f"{path}.sinks"] = _own(weights[f"{path}.sinks"][q0:q1])
        attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0

    # ---- MLPs and experts ----------------------------------------------------------------

    def _shard_mlp(self, path: str, mlp: nn.Module, weights: dict[str, mx.array]) -> None:
        a, b = self._inner_range(path, mlp.gate_proj.weight.shape[-2], weights)
        cut = self.presliced
        split_out(mlp.gate_proj, weights, f"{path}.gate_proj", a, b, f"{path}.gate_proj" in cut)
        split_out(mlp.up_proj, weights, f"{path}.up_proj", a, b, f"{path}.up_proj" in cut)
        split_in(mlp.down_proj, weights, f"{path}.down_proj", a, b, self.rank, f"{path}.down_proj" in cut)

    def _shard_interleaved_experts(self, path: str, experts: nn.Module, weights: dict[str, mx.array]) -> None:
        """gpt-oss: gate and up rows interleaved in one projection, so rows move in pairs."""
        a, b = self._inner_range(path, experts.down_proj.weight.shape[-1], weights)
        gate_up, down = f"{path}.gate_up_proj", f"{path}.down_proj"
        split_out(experts.gate_up_proj, weights, gate_up, 2 * a, 2 * b, gate_up in self.presliced)
        split_in(experts.down_proj, weights, down, a, b, self.rank, down in self.presliced)

    def _inner_range(self, path: str, inter: int, weights: dict[str, mx.array]) -> tuple[int, int]:
        """This rank's range of an MLP's (or each expert's) `inter` intermediate features: the
        planned one when the file was read cut, else on the down projection's groups."""
        cut = self.presliced.get(f"{path}.down_proj")
        if cut is not None:
            return cut.start, cut.stop
        unit = group_size_of(weights, f"{path}.down_proj", inter)
        return even_ranges(inter, self.size, unit)[self.rank]

    # ---- after loading -------------------------------------------------------------------

    def finish(self, model: nn.Module) -> None:
        """Sums each layer's attention and MLP partial outputs over the group, and gives the model
        its local head counts (its KV cache is sized from them)."""
        for i, layer in enumerate(model.layers):
            layer.self_attn = Summed(layer.self_attn, self.group)
            first = self.first_experts.get(f"layers.{i}.mlp")
            layer.mlp = Summed(layer.mlp if first is None else RankExperts(layer.mlp, first), self.group)
        attn = model.layers[0].self_attn.inner
        model.args = copy.copy(model.args)
        model.args.num_attention_heads, model.args.num_key_value_heads = attn.num_heads, attn.num_kv_heads
        model.sharding = self
        self.weight_bytes = sum(v.nbytes for _, v in nn.utils.tree_flatten(model.parameters()))

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "size": self.size,
            "kv_replicated": self.kv_replicated,
            "moe_split": self.moe_split,
            "weight_bytes": self.weight_bytes,
            "read_cut": bool(self.presliced),  # this rank read only its slices of some split weights of a `.base` file
            "notes": list(self.notes),
        }


class Summed(nn.Module):
    """A sublayer whose output is a partial sum on each rank: the whole after one all_sum."""

    def __init__(self, inner: nn.Module, group: Any):
        super().__init__()
        self.inner = inner
        self._group = group

    def __call__(self, *args: Any) -> mx.array:
        return all_sum(self.inner(*args), self._group)


# ---- ranges --------------------------------------------------------------------------------


def even_ranges(total: int, size: int, unit: int = 1) -> list[tuple[int, int]]:
    """`total` split into `size` contiguous ranges on multiples of `unit`, as even as they can be
    (the first ranks take one unit more)."""
    if total % unit:
        raise ModelConfigError(f"{total} is not a multiple of the quantization group size {unit}")
    units, extra = divmod(total // unit, size)
    if units == 0:
        raise ModelConfigError(f"{total // unit} groups of {unit} cannot be split over {size} ranks")
    ranges, start = [], 0
    for rank in range(size):
        stop = start + (units + (rank < extra)) * unit
        ranges.append((start, stop))
        start = stop
    return ranges


def head_ranges(num_heads: int, num_kv_heads: int, size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per rank: (query head range, KV head range). KV heads are split as evenly as they go, each
    rank taking the query heads that read them; with fewer KV heads than ranks each KV head is
    copied to `size // num_kv_heads` ranks that split its query heads."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= size:
        kv = even_ranges(num_kv_heads, size)
        return [((k0 * group, k1 * group), (k0, k1)) for k0, k1 in kv]
    copies = size // num_kv_heads
    if size % num_kv_heads or group % copies:
        raise ModelConfigError(
            f"{num_heads} query heads on {num_kv_heads} KV heads cannot be split over {size} ranks "
            f"(with fewer KV heads than ranks, the ranks must divide evenly among them)"
        )
    per_rank = group // copies
    return [((r * per_rank, (r + 1) * per_rank), (r // copies, r // copies + 1)) for r in range(size)]


# ---- slicing one layer ----------------------------------------------------------------------


def group_size_of(weights: dict[str, mx.array], prefix: str, in_features: int) -> int:
    """The quantization group size of tensor `prefix` (1 when it is not quantized)."""
    scales = weights.get(prefix + ".scales")
    return 1 if scales is None else in_features // scales.shape[-1]


def split_out(
    layer: nn.Module, weights: dict[str, mx.array], prefix: str, a: int, b: int, is_cut: bool = False
) -> None:
    """Keeps output rows [a, b) of a linear (or stacked experts) layer and of its tensors
    (`is_cut`: its weight tensors were read as those rows already; its bias is cut here)."""
    for suffix in ("weight", "scales", "biases"):
        if f"{prefix}.{suffix}" in weights and not is_cut:
            weights[f"{prefix}.{suffix}"] = _own(weights[f"{prefix}.{suffix}"][..., a:b, :])
    if f"{prefix}.bias" in weights:
        weights[f"{prefix}.bias"] = _own(weights[f"{prefix}.bias"][..., a:b])
    _resize(layer, -2, b - a)


def _own(view: mx.array) -> mx.array:
    """A slice in a buffer of its own: a view would keep the whole tensor alive (every rank would
    hold the whole model)."""
    return mx.contiguous(view)


def split_in(
    layer: nn.Module, weights: dict[str, mx.array], prefix: str, a: int, b: int, rank: int, is_cut: bool = False
) -> None:
    """Keeps input columns [a, b) of a linear (or stacked experts) layer and of its tensors (`is_cut`:
    they were read as those columns already); the layer's bias stays on rank 0 only (the ranks'
    outputs are summed)."""
    in_features = layer.weight.shape[-1]
    codes = weights[f"{prefix}.weight"]
    if is_cut:
        pass
    elif f"{prefix}.scales" in weights:
        group = group_size_of(weights, prefix, in_features)
        if a % group or b % group:
            raise ModelConfigError(
                f"{prefix}: inputs [{a}, {b}) do not fall on its quantization groups of {group}; "
                "this model cannot be split over this many ranks"
            )
        bits = codes.shape[-1] * 32 // in_features
        weights[f"{prefix}.weight"] = _own(codes[..., a * bits // 32 : b * bits // 32])
        for suffix in ("scales", "biases"):
            if f"{prefix}.{suffix}" in weights:
                weights[f"{prefix}.{suffix}"] = _own(weights[f"{prefix}.{suffix}"][..., a // group : b // group])
    else:
        weights[f"{prefix}.weight"] = _own(codes[..., a:b])
    if f"{prefix}.bias" in weights and rank != 0:
        weights[f"{prefix}.bias"] = mx.zeros_like(weights[f"{prefix}.bias"])
    _resize(layer, -1, b - a)


def _resize(layer: nn.Module, axis: int, length: int) -> None:
    """The layer's (lazy, never evaluated) initial weight reshaped to the slice, so the loader's
    shape checks and quantization see the sliced sizes."""
    shape = list(layer.weight.shape)
    shape[axis] = length
    layer.weight = mx.zeros(shape, dtype=layer.weight.dtype)
    if "bias" in layer and axis == -2:
        layer.bias = mx.zeros(shape[:-1], dtype=layer.bias.dtype)

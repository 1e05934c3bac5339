"""Whole experts per rank: the other way to split a routed mixture of experts over a group.

With `moe_split="experts"`, rank r of N holds experts [r*E/N, (r+1)*E/N) whole (each one's
projections, quantized or not, and their biases) and the router whole. Every rank routes every
token as one process would, then computes only the (token, expert) pairs routed to its own
experts, weighted by their router scores and added up per token; the all_sum that follows the
MLP (`tp.Summed`) adds the ranks' parts, so each pair counts once. Ranks whose experts no token
picked add zeros.

Which pairs are local depends on the router's answer, so a rank reads the picked expert ids back
to the host once per MoE layer (a synchronization point inside the forward) and gathers exactly
those rows: MLX has no fixed-shape way to compute a data-dependent subset.
The expert count must divide by the ranks: uneven shares would leave one rank the slowest at
every step. Dense layers (Qwen3-MoE's `mlp_only_layers`) and attention split as in `tp.py`.

From a `.base` file a rank reads only its experts where the file stores one tensor per expert
(Mixtral, Qwen3-MoE): the others are left unread, one of its own (same shape) takes their place
while `sanitize` stacks them, and the stack is cut to the rank's experts before use. Experts
stored stacked or transformed at load (gpt-oss) are read whole and cut after loading.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from baselm.distributed.comm import run_collective
from baselm.metal import AttentionMetadata
from baselm.models.base import ModelConfigError
from baselm.models.moe import SwitchGLU, SwitchLinear

MOE_SPLITS = ("experts", "intermediate")


def is_experts(module: nn.Module) -> bool:
    """Whether `module` is a layer of stacked experts (Mixtral/Qwen3-MoE's SwitchGLU, gpt-oss's)."""
    return isinstance(module, SwitchGLU) or type(module).__name__ == "ClampedSwiGLUExperts"


def num_experts_of(experts: nn.Module) -> int:
    return experts.down_proj.weight.shape[0]


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s experts [first, stop) of `num_experts` over `size` ranks."""
    if num_experts % size:
        raise ModelConfigError(
            f"{num_experts} experts cannot be split evenly over {size} ranks with --moe-split experts; "
            "use --moe-split intermediate or a rank count that divides the experts"
        )
    share = num_experts // size
    return rank * share, (rank + 1) * share


def projections(experts: nn.Module) -> dict[str, SwitchLinear]:
    """The stacked projections of a layer of experts, by attribute name."""
    return {name: child for name, child in experts.children().items() if isinstance(child, SwitchLinear)}


def shard_experts(path: str, experts: nn.Module, weights: dict[str, mx.array], first: int, stop: int) -> None:
    """Keeps experts [first, stop) of every stacked projection of `experts` (module path `path`)
    and of its tensors (codes, scales, biases and the projection's own bias), in place."""
    for name, layer in projections(experts).items():
        for suffix in ("weight", "scales", "biases", "bias"):
            key = f"{path}.{name}.{suffix}"
            if key in weights:
                weights[key] = mx.contiguous(weights[key][first:stop])  # its own buffer, not a view
        layer.weight = mx.zeros((stop - first, *layer.weight.shape[1:]), dtype=layer.weight.dtype)
        if "bias" in layer:
            layer.bias = mx.zeros((stop - first, *layer.bias.shape[1:]), dtype=layer.bias.dtype)


class RankExperts(nn.Module):
    """One rank's part of a routed MoE layer (`moe`, whose experts were cut to [first, first + n)):
    the whole routing, this rank's pairs computed, their weighted sum per token. Summed over the
    ranks it is the whole layer's output."""

    def __init__(self, moe: nn.Module, first: int):
        super().__init__()
        self.moe = moe
        self.first = first

    def __call__(self, x: mx.array, meta: AttentionMetadata | None = None) -> mx.array:
        """x: (num_tokens, hidden) -> this rank's part of the output, (num_tokens, hidden). `meta` is not
        read: experts take no adapters."""
        expert_ids, weights = self.moe.route(x)  # (num_tokens, k) each
        ids = np.array(run_collective(_evaluated, expert_ids))  # NOTE: waits for the router's answer
        local = ids.astype(np.int64) - self.first  # (num_tokens, k); signed: other ranks' experts go negative
        tokens, slots = np.nonzero((local >= 0) & (local < num_experts_of(self.moe.experts)))
        out = mx.zeros_like(x)  # (num_tokens, hidden)
        if tokens.size == 0:
            return out
        rows, picks = mx.array(tokens), mx.array(slots)
        pair_ids = mx.array(local[tokens, slots][:, None], dtype=mx.uint32)  # (num_pairs, 1)
        pair_out = self.moe.experts(x[rows], pair_ids)[:, 0, :]  # (num_pairs, hidden)
        pair_weights = weights[rows, picks][:, None].astype(pair_out.dtype)  # (num_pairs, 1)
        return out.at[rows].add(pair_out * pair_weights)


def _evaluated(array: mx.array) -> mx.array:
    mx.eval(array)
    return array


def stand_ins(sharding: Any, model: nn.Module, sources: dict[str, list[str]]) -> dict[str, str]:
    """File tensors this rank leaves unread: other ranks' experts where each expert is its own
    tensor, each mapped to a tensor of this rank's (same shape) that takes its place in the stack."""
    skipped: dict[str, str] = {}
    for path, experts in model.named_modules():
        if not is_experts(experts):
            continue
        first, stop = expert_range(num_experts_of(experts), sharding.rank, sharding.size)
        for name in projections(experts):
            names = sources.get(f"{path}.{name}", [])
            if len(names) == num_experts_of(experts) > 1:
                skipped |= {other: names[first] for other in names[:first] + names[stop:]}
    return skipped

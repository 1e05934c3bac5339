"""Linear layers: several projections of one input fused into one matmul (CPU decode is
dispatch-bound), and the layers that run through `baselm.cpu`'s kernels on the CPU.

On the CPU MLX runs every matmul as a BLAS GEMM and has no fast quantized matmul. With the
kernels loaded, `use_cpu_kernels` swaps a model's linear layers for `KernelLinear` (float32
weights, the kernel for few rows, BLAS GEMM for prefill-sized inputs) and
`KernelQuantizedLinear` / `KernelQuantizedEmbedding` (weights stay in MLX's affine layout and
are decoded as they stream through the kernel, at every number of rows); a GGUF's blocks kept as
they are become `BlockLinear` / `BlockEmbedding` (`use_block_layers`).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

from baselm import cpu, gguf_blocks
from baselm.models.base import ModelConfigError

# Activation rows up to which the float32 kernel beats OpenBLAS GEMM. Measured per call on
# SmolLM2's shapes (CPU ms, kernel vs GEMM): 1 row 0.19 vs 0.24, 8 rows 0.31 vs 0.53, 32 rows
# 0.70 vs 0.62 (1536x576); 49152x576: 32 rows 22 vs 26, 128 rows 75 vs 72. About even from
# 16 rows up, so prefill keeps GEMM.
DENSE_KERNEL_MAX_ROWS = 32


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.shape[-1] else 0


class KernelLinear(nn.Module):
    """A float32 linear layer: the CPU kernel for up to DENSE_KERNEL_MAX_ROWS rows, else BLAS GEMM."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None):
        super().__init__()
        self.weight = weight  # (out, in)
        if bias is not None:
            self.bias = bias  # (out,)

    def __call__(self, x: mx.array) -> mx.array:
        bias = self.get("bias")
        if x.dtype == mx.float32 and _rows(x) <= DENSE_KERNEL_MAX_ROWS:
            return cpu.kernels.dense_linear(x, self.weight, bias)
        return x @ self.weight.T if bias is None else mx.addmm(bias, x, self.weight.T)


def linear_shape(layer: nn.Module) -> tuple[int, int]:
    """(out, in) of a linear layer of any kind here: float, quantized, kernel-backed, GGUF blocks."""
    rows, columns = layer.weight.shape
    if type(layer) is BlockLinear:
        return rows, gguf_blocks.in_features(gguf_blocks.BY_SUFFIX[layer.kind].dtype, columns)
    bits = getattr(layer, "bits", None)
    return rows, columns if bits is None else columns * 32 // bits


def _dequantized(codes: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """The float32 values of an affine triplet (float16/bfloat16 scales widen exactly)."""
    return mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)


class KernelQuantizedLinear(nn.Module):
    """An affine-quantized linear layer (MLX's layout: codes, scales, biases), decoded inside the kernel."""

    def __init__(
        self, codes: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, bias: mx.array | None
    ):
        super().__init__()
        self.weight = codes  # (out, in * bits / 32) uint32
        self.scales = scales  # (out, in / group_size)
        self.biases = biases  # (out, in / group_size)
        if bias is not None:
            self.bias = bias  # (out,)
        self.group_size, self.bits = group_size, bits

    def __call__(self, x: mx.array) -> mx.array:
        return _affine_linear(x, self, self.get("bias"))


def _affine_linear(x: mx.array, layer: nn.Module, bias: mx.array | None) -> mx.array:
    """x through `layer`'s affine triplet by the kernel, at any number of rows: decoding the
    weight to float32 for GEMM costs more than it saves (128 rows of a 1536x576 q4 weight:
    1.95 CPU ms in the kernel, 3.5 ms dequantized + GEMM, 2.2 ms GEMM on float32 weights)."""
    if x.dtype == mx.float32:
        return cpu.kernels.affine_linear(
            x, layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits, bias
        )
    dense = _dequantized(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits).astype(x.dtype)
    return x @ dense.T if bias is None else mx.addmm(bias, x, dense.T)


class KernelQuantizedEmbedding(nn.Module):
    """An affine-quantized embedding: rows gathered then decoded; `as_linear` (a tied LM head) runs the kernel."""

    def __init__(self, codes: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int):
        super().__init__()
        self.weight, self.scales, self.biases = codes, scales, biases  # (vocab, ...) each
        self.group_size, self.bits = group_size, bits

    def __call__(self, ids: mx.array) -> mx.array:
        return _dequantized(self.weight[ids], self.scales[ids], self.biases[ids], self.group_size, self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        """x (..., dims) @ the embedding table.T: the tied LM head."""
        return _affine_linear(x, self, None)


class BlockLinear(nn.Module):
    """A linear layer whose weight is rows of GGUF blocks (baselm/gguf_blocks.py), decoded inside the
    kernel at every number of rows. `kind` is the blocks' suffix (q4_0 ... q8_0, q4_k, q5_k, q6_k);
    `runs`: a legacy type's rows in the kernels' runs layout (`cpu.kernels.block_runs`)."""

    def __init__(self, blocks: mx.array, kind: str, bias: mx.array | None = None, runs: bool = False):
        super().__init__()
        self.weight = blocks  # (out, in / block values * block bytes) uint8
        if bias is not None:
            self.bias = bias  # (out,)
        self.kind, self.runs = kind, runs

    @property
    def kernel_name(self) -> str:
        return gguf_blocks.BY_SUFFIX[self.kind].kernel_name(self.runs)

    def __call__(self, x: mx.array) -> mx.array:
        return _block_linear(x, self.weight, self.kernel_name, self.get("bias"))


def _block_linear(x: mx.array, blocks: mx.array, kind: str, bias: mx.array | None) -> mx.array:
    """`kind`: the kernels' name for the blocks (BlockType.kernel_name)."""
    if x.dtype == mx.float32:
        return cpu.kernels.block_linear(x, blocks, kind, bias)
    dense = cpu.kernels.block_dequantize(blocks, kind).astype(x.dtype)
    return x @ dense.T if bias is None else mx.addmm(bias, x, dense.T)


class BlockEmbedding(nn.Module):
    """An embedding of GGUF block rows: rows gathered then decoded; `as_linear` (a tied LM head) runs the kernel."""

    def __init__(self, blocks: mx.array, kind: str, runs: bool = False):
        super().__init__()
        self.weight = blocks  # (vocab, dims / block values * block bytes) uint8
        self.kind, self.runs = kind, runs

    @property
    def kernel_name(self) -> str:
        return gguf_blocks.BY_SUFFIX[self.kind].kernel_name(self.runs)

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self.weight[ids.reshape(-1)]
        return cpu.kernels.block_dequantize(rows, self.kernel_name).reshape(*ids.shape, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        """x (..., dims) @ the embedding table.T: the tied LM head."""
        return _block_linear(x, self.weight, self.kernel_name, None)


def use_block_layers(model: nn.Module, weights: dict[str, mx.array], runs_blocks: bool) -> None:
    """Puts a block layer in place of each linear layer or embedding of `model` whose weight
    `weights` holds as GGUF blocks (`x.q8_0`, `x.q4_k` ..., baselm/gguf_blocks.py), and names the
    blocks `x.weight`, the new layer's parameter, so loading `weights` fills it. Only the CPU
    kernels, unsharded, run blocks (`runs_blocks`); others get them converted by the loader."""
    modules = dict(model.named_modules())
    kept = [(name, split) for name in weights if (split := gguf_blocks.split_name(name))]
    if kept and not runs_blocks:
        raise ModelConfigError(f"{kept[0][0]}: GGUF blocks run on the CPU kernels only, unsharded")
    for name, (prefix, block_type) in kept:
        module, blocks = modules.get(prefix), weights.pop(name)
        if type(module) not in (nn.Linear, nn.Embedding):
            raise ModelConfigError(f"{name}: GGUF blocks for {prefix}, which is not a linear layer or an embedding")
        shape = (blocks.shape[0], gguf_blocks.in_features(block_type.dtype, blocks.shape[1]))
        if tuple(module.weight.shape) != shape:
            raise ModelConfigError(
                f"tensor {name} holds a {shape} matrix, the config implies {tuple(module.weight.shape)}"
            )
        # A legacy type's rows go to the runs layout (one copy at load, the same bytes): a run's
        # scales then load as one vector, where gathering them from 8 blocks cost a one-row matmul 1.1-1.3x.
        runs = not block_type.is_kquant
        if runs:  # made now, so that the file's bytes go as each is done (a peak of one tensor's copy)
            blocks = cpu.kernels.block_runs(blocks, block_type.suffix)
            mx.eval(blocks)
        if type(module) is nn.Embedding:
            twin = BlockEmbedding(blocks, block_type.suffix, runs)
        else:
            twin = BlockLinear(blocks, block_type.suffix, module.get("bias"), runs)
        parent, _, leaf = prefix.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, twin)
        weights[f"{prefix}.weight"] = blocks


def _kernel_twin(module: nn.Module) -> nn.Module | None:
    """The kernel-backed layer holding `module`'s arrays, or None when it has none."""
    if type(module) is nn.Linear and module.weight.dtype == mx.float32:
        return KernelLinear(module.weight, module.get("bias"))
    if type(module) in (nn.QuantizedLinear, nn.QuantizedEmbedding) and module.mode == "affine":
        parts = (module.weight, module.scales, module.biases, module.group_size, module.bits)
        if type(module) is nn.QuantizedEmbedding:
            return KernelQuantizedEmbedding(*parts)
        return KernelQuantizedLinear(*parts, module.get("bias"))
    return None


KERNEL_LAYERS = (KernelLinear, KernelQuantizedLinear, KernelQuantizedEmbedding, BlockLinear, BlockEmbedding)


def use_cpu_kernels(model: nn.Module) -> int:
    """Swaps every float32 and affine-quantized linear/embedding layer of `model` for its
    kernel-backed twin (sharing its arrays); returns how many were swapped. Quantized layers
    the kernels do not cover (MoE experts) get float32 scales, as MLX's own ops want them."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.children().items()):
            twin = _kernel_twin(child) if isinstance(child, nn.Module) else None
            if twin is not None:
                setattr(parent, name, twin)
                swapped += 1
    for module in model.modules():
        if not isinstance(module, KERNEL_LAYERS):
            for name in ("scales", "biases"):
                value = module.get(name)
                if isinstance(value, mx.array) and value.dtype != mx.float32:
                    module[name] = value.astype(mx.float32)
    return swapped


FUSABLE = (nn.Linear, KernelLinear, KernelQuantizedLinear, BlockLinear)


def can_fuse(linears: list[nn.Module]) -> bool:
    """Whether `linears` are one fusable kind in one format (same bits, group size and scale dtype)."""
    first = linears[0]
    if type(first) not in FUSABLE or any(type(lin) is not type(first) for lin in linears):
        return False
    if any(("bias" in lin) != ("bias" in first) for lin in linears):
        return False
    if type(first) is KernelQuantizedLinear:
        fmt = (first.group_size, first.bits, first.scales.dtype)
        return all((lin.group_size, lin.bits, lin.scales.dtype) == fmt for lin in linears)
    if type(first) is BlockLinear:
        return all((lin.kind, lin.runs) == (first.kind, first.runs) for lin in linears)
    return True


def fused_linear(x: mx.array, layer: nn.Module) -> mx.array:
    """x (..., in) through a fused layer made by `fuse_linears`: (..., sum of out)."""
    return layer(x)


def fuse_linears(linears: list[nn.Module]) -> tuple[nn.Module]:
    """(one layer of the stacked outputs,); each linear's own arrays become views into it (no
    extra memory). A tuple, so the fused layer is neither a child module nor a parameter."""
    names = [n for n in ("weight", "scales", "biases", "bias") if n in linears[0]]
    stacked = {n: mx.concatenate([lin[n] for lin in linears], axis=0) for n in names}  # (sum of out, ...)
    mx.eval(stacked)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        for n in names:
            lin[n] = stacked[n][start : start + rows]
        start += rows
    fused = copy.copy(linears[0])
    for n in names:
        fused[n] = stacked[n]
    return (fused,)

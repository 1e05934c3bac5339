"""Gemma 3 (text, `gemma3_text`): Gemma 2's layout with q/k norms, no score soft-capping, and
local (sliding, own RoPE base) layers interleaved with global ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from baselm.models import gemma2
from baselm.models.base import ModelConfigError


@dataclass
class ModelArgs(gemma2.ModelArgs):
    """Gemma 2's config without soft-caps, with a local RoPE base and a sliding-window pattern."""

    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float = 10000.0
    sliding_window_pattern: int = 6
    use_bidirectional_attention: bool = False

    default_rope_theta: ClassVar[float] = 1_000_000.0

    def resolve_layer_types(self) -> list[str]:
        """The config's `layer_types`, else every `sliding_window_pattern`-th layer is global."""
        if self.layer_types is not None:
            return list(self.layer_types)
        pattern = self.sliding_window_pattern
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.num_hidden_layers)]

    def validate(self) -> None:
        if self.use_bidirectional_attention:
            raise ModelConfigError("use_bidirectional_attention is set; only causal (decoder) Gemma 3 models can run")
        super().validate()

    def rope_params(self, layer_type: str) -> dict[str, Any]:
        """Per layer type: newer configs nest one rope dict per type; older ones give the global
        layers `rope_theta` + `rope_scaling` and the local ones `rope_local_base_freq`, unscaled."""
        nested = self.rope_parameters or {}
        if layer_type in nested:
            params = dict(nested[layer_type] or {})
            default_theta = self.rope_local_base_freq if layer_type == "sliding_attention" else self.rope_theta
            params.setdefault("rope_theta", default_theta or self.default_rope_theta)
            return self.complete_rope_params(params)
        if layer_type == "sliding_attention":
            return {"rope_type": "default", "rope_theta": self.rope_local_base_freq}
        return super().rope_params(layer_type)


class Model(gemma2.Model):
    """Gemma 2's decoder with (1 + w) RMS norms on each head's queries and keys."""

    def attention_options(self, args: ModelArgs, layer_idx: int) -> dict[str, Any]:
        options = super().attention_options(args, layer_idx)
        return {**options, "qk_norm_eps": args.rms_norm_eps, "norm_cls": gemma2.GemmaRMSNorm}

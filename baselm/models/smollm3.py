"""SmolLM3: Llama with no rotary embedding in every `no_rope_layer_interval`-th layer (NoPE layers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from baselm.models import llama
from baselm.models.base import ModelConfigError


@dataclass
class ModelArgs(llama.ModelArgs):
    """Llama's config plus which layers rotate (`no_rope_layers`: 1 = uses RoPE, as HF spells it)."""

    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    use_sliding_window: bool = False
    tie_word_embeddings: bool = True

    default_rope_theta: ClassVar[float] = 2_000_000.0

    def __post_init__(self) -> None:
        if self.no_rope_layers is None:
            if self.no_rope_layer_interval < 1:
                raise ModelConfigError(f"no_rope_layer_interval must be at least 1, got {self.no_rope_layer_interval}")
            interval = self.no_rope_layer_interval
            self.no_rope_layers = [int((i + 1) % interval != 0) for i in range(self.num_hidden_layers)]
        super().__post_init__()

    def resolve_layer_types(self) -> list[str]:
        """The config's `layer_types`, else as HF: with `use_sliding_window`, the NoPE layers slide."""
        if self.layer_types is not None:
            return list(self.layer_types)
        slides = self.use_sliding_window and self.sliding_window is not None
        return [
            "sliding_attention" if slides and not self.no_rope_layers[i] else "full_attention"
            for i in range(self.num_hidden_layers)
        ]

    def validate(self) -> None:
        if len(self.no_rope_layers) != self.num_hidden_layers:
            raise ModelConfigError(
                f"no_rope_layers lists {len(self.no_rope_layers)} layers but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        super().validate()

    def layer_uses_rope(self, layer_idx: int) -> bool:
        return bool(self.no_rope_layers[layer_idx])


class Model(llama.Model):
    """Llama's decoder; the NoPE layers are built without a RoPE by `layer_uses_rope`."""

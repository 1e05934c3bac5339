"""Engine settings: one slotted dataclass, validated once; sizes and lists read from text, sizes written for people."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Where `base serve` (and `base chat --serve`) listens unless told, and where `base ps` asks: loopback only.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# Tokens of one repeated n-gram after which an answer is cut (outputs.RunawayGuard): hundreds, so
# that a list or a table that repeats a line a few times is never cut, a loop soon is.
DEFAULT_RUNAWAY_GUARD = 256


class ConfigError(ValueError):
    """An engine setting has a value the engine cannot use."""


def parse_size(text: str | int) -> int:
    """Bytes from '4GiB', '256MiB', '1.5G', '1000000' (binary units with 'i', decimal without)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 4GiB, 512MiB or 2000000000")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    prefix = unit[:1] if unit[:1] in "kmgt" and unit[:1] else ""
    factor = 1024 ** ("kmgt".index(prefix) + 1) if prefix and "i" in unit else _UNITS[prefix]
    return int(number * factor)


def format_size(num_bytes: float, unit: str = "GiB", digits: int = 1) -> str:
    """`num_bytes` in a binary unit, for people: format_size(3 * 2**29) == '1.5 GiB'."""
    return f"{num_bytes / _BINARY_UNITS[unit]:.{digits}f} {unit}"


def parse_optional_size(text: str | None) -> int | None:
    """`parse_size`, with None (or an empty text) for "not given"."""
    return parse_size(text) if text else None


def parse_size_list(text: str) -> tuple[int, ...]:
    """Bytes of each size in a comma-separated list: '256MiB,4GiB'."""
    return tuple(parse_size(s) for s in text.split(",") if s.strip())


def parse_name_list(text: str) -> tuple[str, ...]:
    """Names from a comma-separated list, stripped, empty ones dropped: 'a, b,' -> ('a', 'b')."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def parse_int_list(text: str) -> tuple[int, ...]:
    """Integers from a comma-separated list: '1,4,8'."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes tokens and how many one request may verify per step."""

    method: str = "ngram"  # "ngram" (prompt lookup) or "draft" (a smaller model)
    draft_model: str | None = None  # for "draft": a model reference, as `base run` takes
    num_speculative_tokens: int = 4  # most drafts one request verifies in a step
    ngram_min: int = 2  # shortest suffix the n-gram proposer matches (1 matches almost anything)
    ngram_max: int = 5  # longest suffix it tries first
    adaptive: bool = True  # size each request's drafts by its measured acceptance and the step cost; False: always k

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ConfigError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative decoding with a draft model needs the draft model's name or path")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must lie in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                f"n-gram sizes need 1 <= ngram_min <= ngram_max, got min {self.ngram_min} and max {self.ngram_max}"
            )

    @classmethod
    def parse(
        cls, speculative: str | None, num_speculative_tokens: int = 4, adaptive: bool = True
    ) -> SpeculativeConfig | None:
        """From the CLI: None (off), "ngram", or a draft model reference."""
        if not speculative:
            return None
        if speculative == "ngram":
            return cls("ngram", num_speculative_tokens=num_speculative_tokens, adaptive=adaptive)
        return cls("draft", speculative, num_speculative_tokens=num_speculative_tokens, adaptive=adaptive)

    def to_json(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs a model. Defaults suit a laptop; the CLI exposes each as an option."""

    block_size: int = 16
    kv_memory: int | None = None  # bytes for the KV pools; None: from the context and the sequences (kv/sizing.py)
    kv_bits: int = 16  # 16: model dtype; 8 or 4: affine-quantized KV
    max_num_seqs: int = 16  # running requests at once
    max_num_batched_tokens: int = 1024  # tokens one step may feed (the chunked-prefill budget)
    max_model_len: int | None = None  # None: the model's own context length
    long_prefill_token_threshold: int = 0  # >0 caps one request's tokens per step
    enable_prefix_caching: bool = True
    max_waiting: int = 256  # queued requests beyond this are refused (the server answers 429/503)
    pipeline_decode: bool | None = None  # launch a decode step ahead of reading tokens; None: on GPUs
    seed: int | None = None  # for unseeded sampling
    prefix_cache_file: str | None = None  # full cached blocks saved here and loaded at start-up
    prefix_cache_save_interval: float = 300.0  # seconds between saves of a changed cache (and at shutdown)
    prefix_cache_max_size: int | None = None  # bytes of K/V the file may hold; None: the KV pool's size
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    runaway_guard: int = DEFAULT_RUNAWAY_GUARD  # tokens one n-gram may repeat before the answer is cut; 0: off

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.kv_bits not in (16, 8, 4):
            raise ConfigError(f"kv_bits must be 16, 8 or 4, got {self.kv_bits}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_memory is not None and self.kv_memory < 1:
            raise ConfigError("kv_memory must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.prefix_cache_save_interval <= 0:
            raise ConfigError(f"prefix_cache_save_interval must be positive, got {self.prefix_cache_save_interval}")
        if self.prefix_cache_max_size is not None and self.prefix_cache_max_size < 0:
            raise ConfigError("prefix_cache_max_size must not be negative")
        if self.prefix_cache_file and not self.enable_prefix_caching:
            raise ConfigError("a prefix cache file needs prefix caching; drop --no-prefix-caching or the file")
        if self.runaway_guard < 0:
            raise ConfigError(f"runaway_guard must be 0 (off) or a number of tokens, got {self.runaway_guard}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                f"long_prefill_token_threshold must be 0 (off) or positive, got {self.long_prefill_token_threshold}"
            )

"""What a chat starts with (`ChatOptions`) and the sampling settings /set changes (`ChatSettings`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from baselm.config import EngineConfig
from baselm.sampling.defaults import LLAMA_CPP, SamplingDefaults
from baselm.sampling.params import SamplingParams, SamplingParamsError


class ChatCommandError(ValueError):
    """A command with a bad argument; the message says what is wrong."""


@dataclass(slots=True)
class ChatSettings:
    """The sampling settings a user can change with /set; every turn's SamplingParams come from these.
    A chat starts from the generation defaults (`from_defaults`: the command line's, the model's, else
    llama.cpp's, as baselm/sampling/defaults.py orders them)."""

    temperature: float = LLAMA_CPP.temperature
    top_p: float = LLAMA_CPP.top_p
    top_k: int = LLAMA_CPP.top_k
    min_p: float = LLAMA_CPP.min_p
    repetition_penalty: float = LLAMA_CPP.repetition_penalty
    max_tokens: int | None = None  # None: until the model stops or the context is full
    seed: int | None = None

    def __post_init__(self) -> None:
        self.sampling_params()  # raises SamplingParamsError on a bad value

    @classmethod
    def from_defaults(cls, defaults: SamplingDefaults, seed: int | None = None) -> ChatSettings:
        """The settings a chat starts with: `defaults` resolved (every value set), and the seed."""
        values = defaults.as_dict()
        return cls(**{**values, "max_tokens": values.get("max_tokens") or None}, seed=seed)

    def sampling_params(self, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens if max_tokens is not None else self.max_tokens,
            seed=self.seed,
        )

    def with_value(self, name: str, text: str) -> ChatSettings:
        """These settings with `name` read from `text`; raises ChatCommandError saying what is wrong."""
        names = [f.name for f in fields(self)]
        if name not in names:
            raise ChatCommandError(f"/set knows {', '.join(names)}; got {name!r}")
        value = _parse_setting(name, text)
        try:
            return replace(self, **{name: value})
        except SamplingParamsError as exc:
            raise ChatCommandError(str(exc)) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChatSettings:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ChatCommandError(f"unknown settings {sorted(unknown)}")
        try:
            return cls(**data)
        except (SamplingParamsError, TypeError) as exc:
            raise ChatCommandError(f"bad settings: {exc}") from None

    def to_text(self) -> str:
        """`temperature=0.7, top_p=0.9, ...`: how the REPL shows the settings."""
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


def _parse_setting(name: str, text: str) -> float | int | None:
    text = text.strip()
    if name in ("max_tokens", "seed") and text.lower() in ("none", "off"):
        return None
    kind = int if name in ("top_k", "max_tokens", "seed") else float
    try:
        return kind(text)
    except ValueError:
        wanted = "a number" if kind is float else "a whole number (or none)"
        raise ChatCommandError(f"{name} takes {wanted}, got {text!r}") from None


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What a chat starts with, once its model is loaded: the engine's settings and the system prompt
    (the first sampling settings come from the generation defaults, `ChatSettings.from_defaults`).
    Its parts validate themselves where they are made."""

    engine: EngineConfig
    system: str | None = None
    resume: bool = False  # reopen the last conversation (kept under $BASE_HOME)


def chat_prefix_cache_file(choice: str, model: str) -> str | None:
    """The prefix cache file of `base chat`: a path, none, or auto (one per model under $BASE_HOME)."""
    if choice.lower() in ("none", "off", ""):
        return None
    if choice != "auto":
        return choice
    from baselm.store.default_model import base_home

    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model).strip("._") or "model"
    return str(base_home() / "prefix_cache" / f"{name}.kvc")

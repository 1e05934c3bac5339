"""Generation defaults: the sampling values and the token cap a request gets for what it leaves out.

One rule for `base run`, `base chat` and every API of `base serve`. A value a request leaves out
comes from the first of these that has it:

1. the command line: `--temperature`, `--top-p`, `--top-k`, `--min-p`, `--repeat-penalty`,
   `--max-tokens` (`SamplingDefaults`, parsed once by the command layer);
2. the model's own: HF's `generation_config.json` or a GGUF's `general.sampling.*` keys, which the
   store keeps as the config's `generation_config` in HF's names (`model_defaults`);
3. the API's own documented defaults, where it has them: Ollama's `options` (temperature 0.8,
   top_k 40, top_p 0.9, min_p 0, repeat_penalty 1.1), completions' 16 tokens (OpenAI's);
4. llama.cpp's (`LLAMA_CPP`): temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat penalty
   off, and at most `default_max_tokens(context)` tokens: 2,048, or half the context if less.

Why llama.cpp's set, not OpenAI's temperature 1 and top_p 1: those draw from the whole tail of the
distribution, and a small model that draws one unlikely token often never finds its way back to
an end; min_p drops every token less than 5% as likely as the best one, which keeps answers on
their feet without making them greedy. Why a cap: a request without a limit could otherwise run
to the end of the context, minutes of tokens no one reads (the runaway guard in outputs.py ends
the ones that loop sooner).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Any

from baselm.sampling.params import SamplingParams, SamplingParamsError

log = logging.getLogger("baselm.sampling")

DEFAULT_MAX_TOKENS = 2048  # the cap of a request without a token limit, where the context is long enough


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """One source of defaults: each value None leaves it to the next source; validated on construction.

    `max_tokens` 0 means no cap: a request without a limit may run until the context is full.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or self.max_tokens < 0):
            raise SamplingParamsError("max_tokens", f"max_tokens must be 0 (no cap) or more, got {self.max_tokens}.")
        given = {name: value for name, value in self.as_dict().items() if name != "max_tokens"}
        SamplingParams(**given)  # raises SamplingParamsError naming the first bad value

    def or_else(self, lower: SamplingDefaults) -> SamplingDefaults:
        """These defaults, with `lower`'s values where these have none."""
        return replace(self, **{name: value for name, value in lower.as_dict().items() if getattr(self, name) is None})

    def as_dict(self) -> dict[str, float | int]:
        """The values this source sets, by SamplingParams field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


NO_DEFAULTS = SamplingDefaults()
LLAMA_CPP = SamplingDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.0)
SAMPLING_NAMES = tuple(f.name for f in fields(SamplingDefaults))


def default_max_tokens(max_model_len: int) -> int:
    """The cap of a request without a token limit: 2,048 tokens, or half the context where that is less
    (the other half is left to the prompt)."""
    return max(1, min(DEFAULT_MAX_TOKENS, max_model_len // 2))


def model_defaults(config: dict[str, Any]) -> SamplingDefaults:
    """The model's own defaults, from its config's `generation_config` (HF's names and meaning: an
    explicit `do_sample: false` is greedy). A value this engine cannot sample with is left out, with
    a warning that names it; the model's `max_new_tokens` is not read (the cap is the server's)."""
    generation = config.get("generation_config")
    if not isinstance(generation, dict):
        return NO_DEFAULTS
    values = {name: generation[name] for name in SAMPLING_NAMES if generation.get(name) is not None}
    values.pop("max_tokens", None)
    if generation.get("do_sample") is False:
        values["temperature"] = 0.0
    kept: dict[str, Any] = {}
    for name, value in values.items():
        try:
            SamplingDefaults(**{name: value})
        except SamplingParamsError as exc:
            log.warning("the model's generation_config sets %s, which is left out: %s", name, exc)
            continue
        kept[name] = value
    return SamplingDefaults(**kept)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The defaults of one loaded model: the command line's, the model's own, and its context for the cap."""

    given: SamplingDefaults
    model: SamplingDefaults
    max_model_len: int

    @classmethod
    def for_model(cls, given: SamplingDefaults, config: dict[str, Any], max_model_len: int) -> GenerationDefaults:
        return cls(given, model_defaults(config), max_model_len)

    def resolved(self, api: SamplingDefaults = NO_DEFAULTS) -> SamplingDefaults:
        """Every value, from the first source that has it (see the module docstring); `api`: the
        API's own defaults, below the model's."""
        fallback = replace(LLAMA_CPP, max_tokens=default_max_tokens(self.max_model_len))
        return self.given.or_else(self.model).or_else(api).or_else(fallback)

    def fill(self, sampling: dict[str, Any], api: SamplingDefaults = NO_DEFAULTS) -> dict[str, Any]:
        """SamplingParams keyword arguments with each value `sampling` leaves out (absent or None) filled in."""
        resolved = self.resolved(api)
        filled = dict(sampling)
        for name in SAMPLING_NAMES:
            if filled.get(name) is None:
                filled[name] = getattr(resolved, name)
                if name == "max_tokens" and filled[name] == 0:
                    filled[name] = None  # no cap: up to the context's room
        return filled

    @property
    def max_tokens(self) -> int | None:
        """The cap of a request without a token limit; None: the context's room."""
        return self.resolved().max_tokens or None

    def describe(self) -> str:
        """The defaults in a line, for people: 'temperature 0.8, ... (from llama.cpp) and at most 2048 tokens'."""
        values = ", ".join(
            f"{name} {value:g}" for name, value in self.resolved().as_dict().items() if name != "max_tokens"
        )
        cap = f"at most {self.max_tokens} tokens" if self.max_tokens else "no token cap"
        return f"{values} ({self._sources()}) and {cap}"

    def _sources(self) -> str:
        """Where the values come from, in order: 'the command line', 'the model', 'llama.cpp'."""
        known = self.given.or_else(self.model)
        sources = [
            name for name, s in (("the command line", self.given), ("the model", self.model)) if s != NO_DEFAULTS
        ]
        if any(getattr(known, name) is None for name in SAMPLING_NAMES if name != "max_tokens"):
            sources.append("llama.cpp")
        return "from " + ", then ".join(sources)

"""Request bodies checked field by field with plain code: the `Body` reader and the fields
every OpenAI-style protocol shares (`read_common`); each protocol module reads the rest of its body.

Each field is either honoured or refused with a 400 that names it; nothing is silently
ignored. Unknown fields are refused too, except `user`, which is purely informational
(OpenAI uses it for abuse tracking) and is accepted and ignored.

NOTE: JSON nests at most MAX_JSON_DEPTH levels, the body counted as one (`check_depth`, on every
body as it is read, and `check_json_text` on JSON sent inside strings): the chat template, the
grammar compiler and the schema code recurse, and a 400-level schema would be a RecursionError.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baselm.api.errors import APIError, bad_request
from baselm.sampling.defaults import NO_DEFAULTS, SamplingDefaults

INFORMATIONAL_FIELDS = frozenset({"user"})
MAX_JSON_DEPTH = 64  # levels of JSON in a request, its body counted as one
# A logit_bias key: ASCII digits only (str.isdigit takes "²" and "١٢", int() the second), ids < 10**10.
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def check_choice(value: str, allowed: Sequence[str], field: str) -> str:
    """`value` when it is one of `allowed`, else a 400 naming `field` and the choices."""
    if value not in allowed:
        raise bad_request(f"{field} {value!r} is not one of {', '.join(allowed)}", field)
    return value


class Body:
    """A JSON object being read: typed getters that raise 400s naming the field, then `finish`."""

    def __init__(self, data: Any, where: str = "the request body") -> None:
        if not isinstance(data, dict):
            raise bad_request(f"{where} must be a JSON object")
        self.data = data
        self.where = where
        self._read: set[str] = set(INFORMATIONAL_FIELDS) if where == "the request body" else set()

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str) -> Any:
        self._read.add(name)
        return self.data.get(name)

    def string(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        value = self.raw(name)
        if value is None:
            if required:
                raise bad_request(f"{name} is required", name)
            return default
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string, got {_kind(value)}", name)
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be true or false, got {_kind(value)}", name)
        return value

    def integer(
        self, name: str, low: int | None = None, high: int | None = None, default: int | None = None
    ) -> int | None:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be an integer, got {_kind(value)}", name)
        _check_range(name, value, low, high)
        return value

    def number(
        self, name: str, low: float | None = None, high: float | None = None, default: float | None = None
    ) -> float | None:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"{name} must be a number, got {_kind(value)}", name)
        if not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number", name)
        _check_range(name, value, low, high)
        return float(value)

    def finish(self) -> None:
        """Refuses the fields nobody read: an unknown field is a mistake worth telling."""
        unknown = sorted(k for k in self.data if k not in self._read)
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise bad_request(f"unknown field{'s' if len(unknown) > 1 else ''} {names} in {self.where}", unknown[0])


def check_depth(data: Any) -> None:
    """A 400 naming the top-level field of `data` (a request body) that nests past MAX_JSON_DEPTH."""
    fields = data.items() if isinstance(data, dict) else [("the request body", data)]
    room = MAX_JSON_DEPTH - 1 if isinstance(data, dict) else MAX_JSON_DEPTH
    for name, value in fields:
        if _deeper_than(value, room):
            raise _too_deep(str(name))


def check_json_text(text: str, where: str) -> None:
    """A 400 naming `where` when `text` is JSON nested past MAX_JSON_DEPTH (text that is not JSON passes)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(where) from None
    except ValueError:
        return
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise _too_deep(where)


def _deeper_than(value: Any, levels: int) -> bool:
    """True when `value` nests more than `levels` arrays and objects; recurses at most `levels` + 1 deep."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if children is None:
        return False
    if levels == 0:
        return True
    return any(isinstance(c, (dict, list)) and _deeper_than(c, levels - 1) for c in children)


def _too_deep(where: str) -> APIError:
    return bad_request(
        f"{where} nests JSON deeper than {MAX_JSON_DEPTH} levels (counting the request body); flatten it", where
    )


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        raise bad_request(f"{name} must be at least {low}, got {value}", name)
    if high is not None and value > high:
        raise bad_request(f"{name} must be at most {high}, got {value}", name)


def array_field(value: Any, name: str, required: bool = False) -> list[Any]:
    """`value` as a list; absent is empty unless `required`."""
    if value is None:
        if required:
            raise bad_request(f"{name} is required", name)
        return []
    if not isinstance(value, list):
        raise bad_request(f"{name} must be an array, got {_kind(value)}", name)
    return value


# ---- shared sampling fields ---------------------------------------------------------------


@dataclass(slots=True)
class Common:
    """Fields chat and completions share."""

    model: str
    stream: bool
    include_usage: bool
    n: int
    sampling: dict[str, Any]  # keyword arguments for SamplingParams; None: left to the defaults
    max_tokens_field: str = "max_tokens"
    defaults: SamplingDefaults = NO_DEFAULTS  # the API's own, for what the body leaves out (see sampling/defaults.py)
    lora: list[tuple[int, float]] | None = None  # llama-server's `lora`: (adapter id, scale) pairs; None: not given


def read_common(body: Body, defaults: SamplingDefaults = NO_DEFAULTS) -> Common:
    """Reads the shared fields' types; SamplingParams checks the sampling ranges (see make_params).
    What the body leaves out is None, for the server's defaults (`ModelState.fill_defaults`)."""
    model = body.string("model", required=True)
    stream = body.boolean("stream")
    include_usage = _stream_options(body, stream)
    n = body.integer("n", default=1)
    sampling: dict[str, Any] = {"n": n}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        sampling[name] = body.number(name)
    for name in ("presence_penalty", "frequency_penalty"):
        sampling[name] = body.number(name, default=0.0)
    sampling["seed"] = body.integer("seed")
    sampling["stop"] = _stop(body)
    sampling["logit_bias"] = _logit_bias(body)
    sampling["top_k"] = body.integer("top_k")
    sampling["min_tokens"] = body.integer("min_tokens", default=0)
    sampling["ignore_eos"] = body.boolean("ignore_eos")
    sampling["speculative"] = body.boolean("speculative", default=True)  # extension: false opts out
    max_field = "max_tokens"
    max_tokens = body.integer("max_tokens")
    if body.has("max_completion_tokens"):
        if max_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        max_tokens, max_field = body.integer("max_completion_tokens"), "max_completion_tokens"
    sampling["max_tokens"] = max_tokens
    lora = body.raw("lora")
    lora = None if lora is None else read_lora(lora, "lora")
    return Common(model, stream, include_usage, n, sampling, max_field, defaults, lora)


def read_lora(value: Any, field: str) -> list[tuple[int, float]]:
    """llama-server's list of LoRA scales, `[{"id": 0, "scale": 0.5}, ...]`, as (id, scale) pairs; the
    ids are checked against the model's adapters where they are used (baselm/served_adapters.py)."""
    pairs = []
    for i, item in enumerate(array_field(value, field)):
        entry = Body(item, f"{field}[{i}]")
        adapter_id = entry.integer("id", low=0)
        scale = entry.number("scale")
        entry.finish()
        if adapter_id is None or scale is None:
            raise bad_request(f'{field}[{i}] needs an id and a scale, as {{"id": 0, "scale": 1.0}}', field)
        pairs.append((adapter_id, scale))
    ids = [adapter_id for adapter_id, _ in pairs]
    twice = next((i for i in ids if ids.count(i) > 1), None)
    if twice is not None:
        raise bad_request(f"{field} lists adapter id {twice} twice", field)
    return pairs


def _stream_options(body: Body, stream: bool) -> bool:
    options = body.raw("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    sub = Body(options, "stream_options")
    include = sub.boolean("include_usage")
    sub.finish()
    return include


def _stop(body: Body) -> list[str]:
    stop = body.raw("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or an array of strings", "stop")
    return stop


def _logit_bias(body: Body) -> dict[int, float] | None:
    bias = body.raw("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and _TOKEN_ID.fullmatch(key)):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"logit_bias value for token {key} must be a number", "logit_bias")
        out[int(key)] = float(value)
    return out

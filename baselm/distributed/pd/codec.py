"""The prefill/decode messages as JSON: plain data plus a fixed set of the engine's dataclasses.

Ranks never unpickle what a peer sends (that would run its code); a message is JSON in which
an instance of one of the known dataclasses is an object tagged with its class name, a tuple
is a list, and a dict with non-string keys (logit_bias) is a tagged list of pairs. Decoding
builds only the known classes, with their own constructors (SamplingParams validates itself).
Bytes that are not such a message (not JSON, nested past Python's recursion limit, an unknown
class, fields a class does not take or refuses) are a MessageError, never another exception.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from baselm.distributed.comm import MessageError

_TAG = "__pd"
_ITEMS = "__items"
_KNOWN: dict[str, type] = {}


def register(*classes: type) -> None:
    """Makes dataclasses encodable; the names must be unique."""
    for cls in classes:
        _KNOWN[cls.__name__] = cls


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _KNOWN:
        fields = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return {_TAG: type(obj).__name__, **fields}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _plain(v) for k, v in obj.items()}
        return {_ITEMS: [[k, _plain(v)] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"a {type(obj).__name__} cannot be sent between prefill and decode ranks")


def _hook(obj: dict) -> Any:
    if _ITEMS in obj:
        return {k: v for k, v in obj[_ITEMS]}
    name = obj.pop(_TAG, None)
    if name is None:
        return obj
    cls = _KNOWN.get(name) if isinstance(name, str) else None
    if cls is None:
        raise MessageError(f"a peer sent an unknown message type {name!r}")
    return cls(**obj)


def encode(obj: Any) -> bytes:
    return json.dumps(_plain(obj), separators=(",", ":"), allow_nan=True).encode()


def decode(data: bytes) -> Any:
    try:
        return json.loads(data, object_hook=_hook)
    except MessageError:
        raise
    except (ValueError, TypeError, RecursionError) as e:  # not JSON, or a class refused its fields
        raise MessageError(f"a peer sent {len(data)} bytes that are not a prefill/decode message: {e}") from e

"""Writes a copy of a GGUF's metadata with some keys changed and the token arrays cut to some ids.

Shared by the fixture generators (dev tools: needs the `gguf` package). The copy holds one tensor,
a one-row `token_embd.weight`, because `mx.load` wants a tensor in a GGUF file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKEN_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}


def rewrite_gguf(source: Path, out: Path, keys: dict[str, Any] | None = None, ids: list[int] | None = None) -> None:
    """`source`'s metadata with `keys` set (strings), the token arrays cut to `ids` (renumbered in that order)."""
    import gguf
    import numpy as np

    keys = keys or {}
    reader = gguf.GGUFReader(str(source))
    arch = keys.get("general.architecture") or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in keys:
            writer.add_string(name, keys[name])
            continue
        value = field.contents()
        if name in _TOKEN_ARRAYS and ids is not None:
            writer.add_array(name, [value[i] for i in ids])
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, field.types[0])
    writer.add_tensor("token_embd.weight", np.zeros((1, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

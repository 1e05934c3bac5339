"""`base inspect`: a summary of a `.base` file (header fields, context, chat template, tensor table in
layer order, totals) and its rendering. The facts it shares with `base show` are `model_card.py`'s."""

from __future__ import annotations

import os
from typing import Any

from rich.table import Table

from baselm.store.base_reader import BaseFile
from baselm.store.fs import human_size
from baselm.store.model_card import chat_template, context_length, natural_key, template_head, tensor_totals

TEMPLATE_LINES = 5  # of the chat template, above the tensor table


def inspect_report(path: str | os.PathLike, verify: bool = False) -> dict[str, Any]:
    """A summary of a `.base` file for `base inspect`: header fields, tensor table and totals.

    With `verify`, every checksum is checked first (a mismatch raises BaseFileError).
    """
    base = BaseFile.open(path)
    if verify:
        base.verify()
    header = base.header
    rows = [
        {
            "name": e.name,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "group_size": e.group_size,
            "bytes": e.length,
            "bits_per_weight": bits_per_weight(e.length, e.num_params),
        }
        for e in sorted(base.tensors.values(), key=lambda e: natural_key(e.name))  # layers.2 before layers.10
    ]
    profile = header["quant_profile"]
    return {
        "path": str(base.path),
        "file_bytes": base.path.stat().st_size,
        "schema": header["schema"],
        "arch": header["arch"],
        "quant_scheme": header["quant_scheme"],
        "quant_profile": profile.get("name") if isinstance(profile, dict) else profile,
        "source": header["source"],
        "created": header["created"],
        "flags": header["flags"],
        "context_length": context_length(header["config"]),
        "chat_template": chat_template(header["tokenizer"]),
        "verified": verify,
        "tensors": rows,
        "totals": tensor_totals(base),
    }


def bits_per_weight(num_bytes: int, num_params: int) -> float:
    """Stored bits a weight, scales and biases included (a block tensor's: Q4_0 4.5, Q8_0 8.5, Q6_K 6.5625)."""
    return round(8 * num_bytes / num_params, 4) if num_params else 0.0


def render_inspect(report: dict[str, Any], console: Any, max_rows: int | None = None) -> None:
    """Prints an `inspect_report` on a rich console: a summary, then the tensor table."""
    totals = report["totals"]
    source = report["source"]
    console.print(f"[bold]{report['path']}[/bold]  {report['schema']}  arch={report['arch']}")
    console.print(
        f"quant {report['quant_scheme']} (profile {report['quant_profile']}), "
        f"{totals['tensors']} tensors, {totals['params']:,} params, {human_size(totals['bytes'])} "
        f"({totals['bits_per_weight']} bits/weight), created {report['created']}"
    )
    if source:
        console.print("source: " + ", ".join(f"{k}={v}" for k, v in sorted(source.items()) if v))
    console.print("checksums: " + ("verified" if report["verified"] else "not checked (use --verify)"))
    console.print(f"context length: {report['context_length']} tokens")
    _render_template(report["chat_template"], console)
    table = Table("name", "dtype", "shape", "group", "bits/w", "bytes")
    table.columns[0].overflow = "fold"  # a narrow terminal wraps a long name, never cuts it
    rows = report["tensors"] if max_rows is None else report["tensors"][:max_rows]
    for row in rows:
        shape = "x".join(str(d) for d in row["shape"]) or "scalar"
        group = str(row["group_size"] or "")
        table.add_row(row["name"], row["dtype"], shape, group, f"{row['bits_per_weight']:g}", human_size(row["bytes"]))
    console.print(table)
    if len(rows) < len(report["tensors"]):
        console.print(f"... {len(report['tensors']) - len(rows)} more tensors")
    summary = Table("dtype", "tensors", "params", "bits/w", "bytes")
    for dtype, t in sorted(report["totals"]["by_dtype"].items()):
        bits = f"{bits_per_weight(t['bytes'], t['params']):g}"
        summary.add_row(dtype, str(t["tensors"]), f"{t['params']:,}", bits, human_size(t["bytes"]))
    console.print(summary)


def _render_template(template: str | None, console: Any) -> None:
    if template is None:
        console.print("chat template: none (base run --raw prompts it)")
        return
    console.print("chat template (base show MODEL --template prints it whole):")
    for line in template_head(template, TEMPLATE_LINES):
        console.print(f"  {line}", markup=False, highlight=False)

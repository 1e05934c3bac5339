"""`base inspect`: a summary of a `.base` file (header fields, tensor table, totals) and its rendering."""

from __future__ import annotations

import os
from typing import Any

from rich.table import Table

from baselm.store.base_reader import BaseFile
from baselm.store.fs import human_size


def inspect_report(path: str | os.PathLike, verify: bool = False) -> dict[str, Any]:
    """A summary of a `.base` file for `base inspect`: header fields, tensor table and totals.

    With `verify`, every checksum is checked first (a mismatch raises BaseFileError).
    """
    base = BaseFile.open(path)
    if verify:
        base.verify()
    header = base.header
    rows = [
        {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "group_size": e.group_size, "bytes": e.length}
        for e in base.tensors.values()
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
        "verified": verify,
        "tensors": rows,
        "totals": _totals(base),
    }


def _totals(base: BaseFile) -> dict[str, Any]:
    """Tensors, weights and bytes: in all, and by dtype."""
    by_dtype: dict[str, dict[str, int]] = {}
    for entry in base.tensors.values():
        totals = by_dtype.setdefault(entry.dtype, {"tensors": 0, "params": 0, "bytes": 0})
        totals["tensors"] += 1
        totals["params"] += entry.num_params
        totals["bytes"] += entry.length
    num_params = sum(t["params"] for t in by_dtype.values())
    tensor_bytes = sum(t["bytes"] for t in by_dtype.values())
    return {
        "tensors": len(base.tensors),
        "params": num_params,
        "bytes": tensor_bytes,
        "bits_per_weight": round(8 * tensor_bytes / num_params, 3) if num_params else 0.0,
        "by_dtype": by_dtype,
    }


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
    table = Table("name", "dtype", "shape", "group", "bytes")
    rows = report["tensors"] if max_rows is None else report["tensors"][:max_rows]
    for row in rows:
        shape = "x".join(str(d) for d in row["shape"]) or "scalar"
        table.add_row(row["name"], row["dtype"], shape, str(row["group_size"] or ""), human_size(row["bytes"]))
    console.print(table)
    if len(rows) < len(report["tensors"]):
        console.print(f"... {len(report['tensors']) - len(rows)} more tensors")
    summary = Table("dtype", "tensors", "params", "bytes")
    for dtype, t in sorted(report["totals"]["by_dtype"].items()):
        summary.add_row(dtype, str(t["tensors"]), f"{t['params']:,}", human_size(t["bytes"]))
    console.print(summary)

"""`base inspect`: the report of a `.base` file and its rendering."""

from __future__ import annotations

from pathlib import Path

from base_helpers import CREATED, Q_NAME, write_small
from rich.console import Console

from baselm.store.base_inspect import inspect_report, render_inspect

# ---------------------------------------------------------------------------------------------
# Inspection


def test_inspect_report_lists_tensors_and_totals(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    report = inspect_report(path, verify=True)
    assert report["arch"] == "llama" and report["quant_profile"] == "default-q4" and report["verified"] is True
    assert report["created"] == CREATED and report["file_bytes"] == path.stat().st_size
    assert report["tensors"][0] == {
        "name": Q_NAME,
        "dtype": "base_q4",
        "shape": [8, 128],
        "group_size": 64,
        "bytes": 576,
    }
    assert report["totals"]["tensors"] == 7
    assert report["totals"]["params"] == 8 * 128 + 64 + 4 * 64 + 6 * 128 + 64 + 6 + 15
    assert report["totals"]["by_dtype"]["base_q4"] == {"tensors": 1, "params": 1024, "bytes": 576}
    assert report["totals"]["bytes"] == sum(row["bytes"] for row in report["tensors"])


def test_render_inspect_prints_the_table(tmp_path: Path) -> None:
    console = Console(record=True, width=160)
    render_inspect(inspect_report(write_small(tmp_path / "m.base")), console)
    text = console.export_text()
    assert Q_NAME in text and "base_q4" in text and "8x128" in text and "not checked" in text

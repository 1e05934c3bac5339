"""`base inspect`: the report of a `.base` file and its rendering."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from base_helpers import CREATED, HEADER_FIELDS, Q_NAME, write_small
from rich.console import Console

from baselm.store.base_inspect import inspect_report, render_inspect
from baselm.store.base_writer import write_base_file

# ---------------------------------------------------------------------------------------------
# Inspection


def test_inspect_report_lists_tensors_and_totals(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    report = inspect_report(path, verify=True)
    assert report["arch"] == "llama" and report["quant_profile"] == "default-q4" and report["verified"] is True
    assert report["created"] == CREATED and report["file_bytes"] == path.stat().st_size
    assert next(row for row in report["tensors"] if row["name"] == Q_NAME) == {
        "name": Q_NAME,
        "dtype": "base_q4",
        "shape": [8, 128],
        "group_size": 64,
        "bytes": 576,
        "bits_per_weight": 4.5,  # 4-bit codes, an f16 scale and bias a group of 64
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


def test_tensors_are_listed_in_layer_order_not_text_order(tmp_path: Path) -> None:
    norm = np.ones(4, np.float32)
    names = [f"model.layers.{i}.input_layernorm.weight" for i in (10, 2, 1, 0)] + ["model.norm.weight"]
    path = write_base_file(tmp_path / "m.base", [(n, norm) for n in names], **HEADER_FIELDS)
    listed = [row["name"] for row in inspect_report(path)["tensors"]]
    assert [name.split(".")[2] for name in listed[:4]] == ["0", "1", "2", "10"]
    assert listed[4] == "model.norm.weight"


def test_render_inspect_shows_the_context_length_and_the_templates_first_lines(tmp_path: Path) -> None:
    template = "\n".join(f"line {i}" for i in range(8))
    tokenizer = {**HEADER_FIELDS["tokenizer"], "chat_template": template}
    config = {**HEADER_FIELDS["config"], "max_position_embeddings": 2048}
    path = write_small(tmp_path / "m.base", tokenizer=tokenizer, config=config)
    report = inspect_report(path)
    assert report["context_length"] == 2048 and report["chat_template"] == template
    console = Console(record=True, width=160)
    render_inspect(report, console)
    text = console.export_text()
    assert "context length: 2048 tokens" in text
    assert "  line 4\n  ... 3 more lines" in text and "line 5" not in text

"""`base list`: the models in the local store, as a table that fits the terminal or as JSON."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from baselm.config import format_size

# What the two quantization columns mean, under the table when it shows them.
COLUMN_NOTES = {
    "variant": "variant: the name's :tag, the source's own quantization (a GGUF's q4_k_m) or the one asked at pull",
    "quant": "quant: the bits most weights are stored with here (base show NAME has the rest)",
}

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from baselm.store.registry import StoredModel


def list_models(as_json: bool) -> None:
    """Prints the stored models: a table (a hint to pull one when there are none), or JSON."""
    from baselm.store.registry import Store, model_entry

    models = Store().list()
    if as_json:
        print(json.dumps([model_entry(m) for m in models], indent=2))
        return
    from baselm.commands.console import table_console

    console = table_console()
    if not models:
        console.print("No models yet. Try: base pull HuggingFaceTB/SmolLM2-135M-Instruct")
        return
    table = models_table(models, console)
    console.print(table)
    for column in table.columns:
        if column.header in COLUMN_NOTES:
            console.print(COLUMN_NOTES[column.header], style="dim", highlight=False)


def models_table(models: list[StoredModel], console: Console) -> Table:
    """The `base list` table. A name is what you type next, so it is never cut: when the terminal
    is narrow, the source, the pull time, then arch and quant are left out (the rest may be shortened)."""
    from rich.measure import Measurement
    from rich.table import Table

    from baselm.store.model_card import parameter_label

    rows = []
    for m in models:
        origin = m.source.get("repo") or m.source.get("path") or m.source.get("format", "")
        size = format_size(m.size, "MiB", 0)
        rows.append([m.name, m.variant, m.arch, parameter_label(m.params), size, m.quant, str(origin), m.pulled[:19]])
    names = ["name", "variant", "arch", "params", "size", "quant", "source", "pulled"]
    for shown in (names, names[:6] + names[7:], names[:6], ["name", "variant", "params", "size"]):
        table = Table()
        for name in shown:
            table.add_column(
                name, no_wrap=name == "name", min_width=max(len(r[0]) for r in rows) if name == "name" else None
            )
        for row in rows:
            table.add_row(*(value for name, value in zip(names, row) if name in shown))
        if Measurement.get(console, console.options.update_width(10**4), table).maximum <= console.width:
            break
    return table

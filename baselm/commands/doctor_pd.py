"""`base doctor`'s line on prefill/decode disaggregation, in its distributed section (doctor.py there)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def status() -> str:
    """How `--pd` would run here: it needs the ring backend (or another one MLX has)."""
    if not mx.distributed.is_available("ring"):
        return "unavailable: this MLX build has no ring backend"
    return (
        "base serve MODEL --pd P:D (ranks on this machine over loopback) or with --hostfile/--rank "
        "(ranks on several machines); KV blocks move with send/recv"
    )


def describe(report: dict[str, Any]) -> str:
    """The doctor table's words for the distributed section's `prefill_decode` entry."""
    return f"prefill/decode: {report['prefill_decode']}"

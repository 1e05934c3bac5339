"""What `base doctor` says about more than one process: MLX's distributed backends and the --pd modes."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from baselm.dist.group import BACKENDS


def status() -> dict[str, Any]:
    """Which of MLX's backends this build has, and how prefill/decode disaggregation would run here."""
    available = {name: bool(mx.distributed.is_available(name)) for name in BACKENDS}
    return {
        "backends": available,
        "prefill_decode": (
            "base serve MODEL --pd P:D (local ranks on loopback, ring backend) or --hostfile/--rank "
            "(ranks on several machines); KV blocks move with send/recv"
            if available.get("ring")
            else "unavailable: this MLX build has no ring backend"
        ),
    }


def describe(report: dict[str, Any]) -> str:
    """One line for doctor's table."""
    backends = ", ".join(f"{name}: {'yes' if ok else 'no'}" for name, ok in report["backends"].items())
    return f"{backends}; prefill/decode: {report['prefill_decode']}"

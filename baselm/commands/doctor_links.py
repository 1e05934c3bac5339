"""`base doctor`'s "distributed" section: which of MLX's backends this build has, whether this
process was started as a rank, and (asked for with --links) the measured loopback link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import mlx.core as mx

from baselm.distributed.group import BACKENDS, HOSTFILE_ENV, RANK_ENV

PROBE_TIMEOUT_S = 120


def collect(links: bool = False) -> dict[str, Any]:
    """Plain data: backends available, this process's rank settings, and the probe when `links`."""
    return {
        "backends": {name: bool(mx.distributed.is_available(name)) for name in BACKENDS},
        "rank": os.environ.get(RANK_ENV),
        "hostfile": os.environ.get(HOSTFILE_ENV),
        "links": probe_links() if links else None,
    }


def probe_links() -> dict[str, Any]:
    """Runs `python -m baselm.distributed.probe` (2 ranks on loopback); its JSON, or why it failed."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "baselm.distributed.probe"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the 2-rank probe did not finish within {PROBE_TIMEOUT_S} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["the probe printed nothing"])[-1]}
    return json.loads(lines[-1])


def summary(report: dict[str, Any]) -> str:
    """One line for the doctor table."""
    have = [name for name, ok in report["backends"].items() if ok]
    text = f"backends: {', '.join(have) or 'none'}"
    if report["rank"] is not None:
        text += f"; this process is rank {report['rank']} of {report['hostfile']}"
    links = report["links"]
    if links is None:
        return text + " (base doctor --links measures a 2-rank ring on loopback)"
    if "error" in links:
        return text + f"; loopback probe failed: {links['error']}"
    times = ", ".join(f"{int(b):,} B {us:.0f} us" for b, us in links["all_sum_us_by_bytes"].items())
    return text + f"; {links['backend']} all_sum over loopback: {times}"

"""Runs a prefill/decode test group: one process per rank on loopback (tests/distributed/pd_rank.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from baselm.distributed.group import reserve_ports

ROOT = Path(__file__).resolve().parents[2]


def run_group(spec: dict, timeout: float = 120.0) -> dict:
    """Starts every rank of `spec["layout"]`, returns rank 0's result and each rank's exit status."""
    num_prefill, num_decode = (int(n) for n in spec["layout"].split(":"))
    size = num_prefill + num_decode
    folder = Path(tempfile.mkdtemp(prefix="pd-test-"))
    hostfile = folder / "hosts.json"
    reserved = reserve_ports(size)  # held until the ranks have bound them (the group runs): nobody else takes one
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in reserved.ports]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "tests.distributed.pd_rank"]
    others = [
        subprocess.Popen(
            [*argv, json.dumps(spec)], env={**env, "MLX_RANK": str(r)}, cwd=ROOT, stderr=subprocess.DEVNULL
        )
        for r in range(1, size)
    ]
    spec = {**spec, "pids": {str(r): p.pid for r, p in enumerate(others, start=1)}}
    try:
        first = subprocess.run(
            [*argv, json.dumps(spec)],
            env={**env, "MLX_RANK": "0"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        codes = [p.wait(timeout=timeout) for p in others]
    finally:
        reserved.release()
        for p in others:
            if p.poll() is None:
                p.kill()
    lines = [line for line in first.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rank 0 exited with {first.returncode} and no result:\n{first.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    result["exit_codes"] = [first.returncode, *codes]
    result["stderr"] = first.stderr  # rank 0's
    return result

"""Links between ranks, measured: `python -m baselm.distributed.probe` starts 2 local ranks on loopback
and prints one JSON line with the ring all_sum round trip at a few sizes (what `base doctor
--links` shows). Each size: three warm-up calls, then the median of `REPEATS` timed calls."""

from __future__ import annotations

import json
import statistics
import sys
import time

import mlx.core as mx

from baselm.distributed import group as groups

SIZES = (4, 2304, 65536, 1 << 20)  # bytes: a scalar, one token's hidden state (576 floats), 64 KiB, 1 MiB
REPEATS = 30


def measure(group) -> dict[str, float]:
    """Median microseconds of an all_sum of float32 buffers of each size in SIZES."""
    result = {}
    for size in SIZES:
        x = mx.ones(size // 4)
        for _ in range(3):  # warm-up: first-call allocations
            mx.eval(mx.distributed.all_sum(x, group=group))
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            times.append(time.perf_counter() - t0)
        result[str(size)] = round(statistics.median(times) * 1e6, 1)
    return result


def main() -> None:
    group = groups.form([sys.executable, "-m", "baselm.distributed.probe"], 2)
    latency = measure(group.group)
    if group.rank == 0:
        print(json.dumps({"backend": group.backend, "ranks": group.size, "all_sum_us_by_bytes": latency}), flush=True)
        group.stop()


if __name__ == "__main__":
    main()

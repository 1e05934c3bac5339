"""`python -m baselm.distributed.tp.worker SPEC`: a rank that rank 0 started (`base ... --tensor-parallel N`).

SPEC is the JSON of a `launch.WorkerSpec`. The process joins the group rank 0 formed, loads its
shard of the model, follows rank 0's forwards until it stops, and exits with it.
"""

from __future__ import annotations

import json
import os
import sys

from baselm.distributed import group as groups
from baselm.distributed.tp.launch import WorkerSpec, load_shard, run_follower


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m baselm.distributed.tp.worker SPEC (started by rank 0, not by hand)")
    if groups.RANK_ENV not in os.environ:
        raise SystemExit(
            "baselm.distributed.tp.worker is started by rank 0 (`base ... --tensor-parallel N`), not by hand"
        )
    spec = WorkerSpec(**json.loads(argv[0]))
    group = groups.form([], spec.size, spec.backend)
    loaded = load_shard(spec.model, spec.device, spec.require_signature, group, spec.moe_split)
    raise SystemExit(run_follower(loaded, group, spec.step_timeout, spec.prefix_cache_file))


if __name__ == "__main__":
    main(sys.argv[1:])

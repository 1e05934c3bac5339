"""Times one image through a SigLIP tower with random weights on the CPU, as docs/images.md reports it:
Gemma 3's (896/14: 4096 patches, 27 layers of 1152) or SmolVLM's (512/16: 1024 patches, 12 layers of 768).

    python tests/tools/time_vision_tower.py [gemma3|smolvlm] [LAYERS]   # the CPU kernels
    BASE_CPU_KERNELS=0 python tests/tools/time_vision_tower.py           # MLX's own ops

Prints wall and CPU seconds (the CPU time of all threads: on a shared machine the wall time also
measures the other jobs).
"""

from __future__ import annotations

import sys
import time

from baselm import cpu
from baselm.models.siglip import VisionArgs, VisionModel

TOWERS = {
    "gemma3": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                   image_size=896, patch_size=14),
    "smolvlm": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=512, patch_size=16),
}  # fmt: skip


def main() -> None:
    import mlx.core as mx  # after baselm, which loads OpenBLAS before mlx.core

    name = sys.argv[1] if len(sys.argv) > 1 else "gemma3"
    config = dict(TOWERS[name])
    if len(sys.argv) > 2:
        config["num_hidden_layers"] = int(sys.argv[2])
    mx.set_default_device(mx.cpu)
    mx.random.seed(0)
    tower = VisionModel(VisionArgs(**config))
    mx.eval(tower.parameters())
    pixels = mx.random.uniform(-1, 1, (3, config["image_size"], config["image_size"]))
    mx.eval(pixels)
    wall, process = time.perf_counter(), time.process_time()
    mx.eval(tower(pixels))
    wall, process = time.perf_counter() - wall, time.process_time() - process
    print(f"{name}, {config['num_hidden_layers']} layers, {cpu.describe()}: {wall:.1f} s wall, {process:.1f} s CPU")


if __name__ == "__main__":
    main()

"""Writes small GGUF files of llama.cpp's own Q2_K, Q3_K, IQ4_NL and IQ4_XS blocks to tests/fixtures/low_bit/.

Dev tool (needs llama.cpp's `llama-quantize`, which neither the package nor the tests run):

    PYTHONPATH=. python tests/tools/make_low_bit_fixtures.py /path/to/llama-quantize

The gguf package quantizes none of these types (its classes have no `quantize_blocks` for them), so
the tests' random blocks cover every code but not the scales llama.cpp picks; these files hold what
its quantizer writes. The model is tests/store/test_gguf_kquants.py's one-layer 256-wide llama with
seeded normal weights (std 0.05) as F32, quantized with no importance matrix; norms stay F32.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.paths import FIXTURES
from tests.store.test_gguf_kquants import K_TENSORS, k_quant_llama

FOLDER = FIXTURES / "low_bit"
TYPES = ("Q2_K", "Q3_K_S", "IQ4_NL", "IQ4_XS")  # llama-quantize's names; Q3_K_S: Q3_K nearly throughout


def main(quantize: str) -> None:
    rng = np.random.default_rng(0)
    values = {
        f"{stem}.weight": ((rng.standard_normal((rows, 256)) * 0.05).astype(np.float32), "F32")
        for stem, (rows, _) in K_TENSORS.items()
    }
    FOLDER.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = k_quant_llama(Path(tmp) / "f32.gguf", values)
        for type_name in TYPES:
            target = FOLDER / f"llama-{type_name}.gguf"
            subprocess.run([quantize, str(source), str(target), type_name, "1"], check=True, capture_output=True)
            print(f"{target}: {target.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1])

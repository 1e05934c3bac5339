"""base: a local LLM runtime on MLX."""

from baselm import blas as _blas

# NOTE: must run before anything imports mlx.core (see baselm/blas.py).
_blas.preload()

__version__ = "0.1.0"

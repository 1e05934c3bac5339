"""base: a local LLM runtime on MLX."""

from baselm import blas as _blas

# NOTE: must run before anything imports mlx.core (see baselm/blas.py).
_blas.preload()


def version() -> str:
    """The installed package's version (pyproject.toml's, the one place it is written); "0.0.0" for
    a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("baselm")
    except PackageNotFoundError:
        return "0.0.0"

"""Handing freed memory back to the OS while a model loads.

Loading frees as much as it keeps: unfused and unpermuted tensors, a file's converted copies,
a vocabulary's strings. MLX keeps freed buffers in a cache of its own, and glibc keeps freed
heap pages in the process (a new, larger fused tensor rarely fits the holes the parts it was
made of leave), so without this a load peaks well above what it ends with.
"""

from __future__ import annotations

import ctypes
import sys

import mlx.core as mx


def release_freed_memory() -> None:
    """Empties MLX's cache of freed buffers and, on glibc, returns the heap's free pages."""
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass

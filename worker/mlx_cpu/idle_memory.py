"""Give an idle worker's spare memory back: MLX's cache of freed buffers (sized by the last
batches' shapes) to the allocator, and, on glibc, the allocator's free heap pages to the OS, so
an idle worker's RSS does not keep its busiest moment's peak."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import mlx.core as mx


def _malloc_trim() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # glibc only: musl has none
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_idle_memory() -> None:
    mx.clear_cache()
    if _TRIM is not None:
        _TRIM(0)

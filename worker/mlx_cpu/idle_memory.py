"""Give an idle worker's spare memory back: MLX's cache of freed buffers (sized by the last
batches' shapes) to the allocator, and, on glibc, the allocator's free heap pages to the OS, so
an idle worker's RSS does not keep its busiest moment's peak.

Only when the spare memory is a sizeable share of what the worker holds in use (its weights,
its KV): after one sequence's request the spare is a few of its own buffers, which the next
request would fault back in page by page (bench/README.md, "The idle memory release"), while
after a large batch it is a batch's worth."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

import mlx.core as mx

# Spare memory worth giving back: more than this share of the memory in use.
RELEASE_SHARE = 0.125


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 and later): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",  # free bytes in the heap's chunks: what malloc_trim can give back
            "keepcost",
        )
    ]


def _glibc() -> tuple[Any, Any]:
    """glibc's malloc_trim and mallinfo2 (None where absent: not Linux, musl, an old glibc)."""
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None, None
    trim = getattr(libc, "malloc_trim", None)
    info = getattr(libc, "mallinfo2", None)
    if info is not None:
        info.restype = _MallInfo2
        info.argtypes = []
    return trim, info


_TRIM, _MALLINFO2 = _glibc()


def heap_free_bytes() -> int:
    """Free bytes in glibc's main heap (0 where it cannot be read): mallinfo2 reads the main
    arena alone, not the arenas of other threads, nor the blocks malloc maps on their own."""
    return int(_MALLINFO2().fordblks) if _MALLINFO2 is not None else 0


def spare_bytes() -> int:
    """What a release would give back, about: MLX's cached buffers and the main heap's free
    bytes."""
    return int(mx.get_cache_memory()) + heap_free_bytes()


def worth_releasing(share: float = RELEASE_SHARE) -> bool:
    """Whether the spare memory is more than `share` of MLX's memory in use."""
    return spare_bytes() > share * mx.get_active_memory()


def release_idle_memory() -> None:
    mx.clear_cache()
    if _TRIM is not None:
        _TRIM(0)

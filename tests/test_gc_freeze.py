"""shared/gc_freeze.py: what startup built leaves the cyclic GC's full collections, and a router's
young generation is passed over less often."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from shared.gc_freeze import ROUTER_YOUNG_THRESHOLD, freeze_startup_heap, space_young_passes

CPYTHON_YOUNG_THRESHOLD = 700


def test_freeze_moves_live_objects_out_of_full_collections() -> None:
    heap = [[i] for i in range(200_000)]  # a startup-sized heap of tracked containers
    try:
        t = time.perf_counter()
        gc.collect()
        before = time.perf_counter() - t
        frozen = freeze_startup_heap(logging.getLogger("test"))
        assert frozen == gc.get_freeze_count() >= len(heap)
        t = time.perf_counter()
        gc.collect()
        after = time.perf_counter() - t
        # What a full collection walks no longer holds them (no timing assertion here).
        collectable = {id(o) for g in (0, 1, 2) for o in gc.get_objects(generation=g)}
        assert id(heap) not in collectable and id(heap[0]) not in collectable
        print(f"full collection {before * 1000:.1f} ms -> {after * 1000:.1f} ms")
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_spaced_young_passes_let_a_reads_worth_of_objects_die_unscanned() -> None:
    """2,000 containers alive at once (a read's worth at 128 streams): CPython's default passes
    over them twice or more; the router's threshold not at all."""
    passes: list[int] = []

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    # The process's own thresholds may be the router's already (a test that ran a router's
    # startup in this process): CPython's default is named, and what was there is restored.
    before = gc.get_threshold()
    gc.callbacks.append(count)
    try:
        for threshold in (CPYTHON_YOUNG_THRESHOLD, ROUTER_YOUNG_THRESHOLD):
            space_young_passes(threshold)
            gc.collect()  # an empty young generation to start from
            passes.clear()
            read = [[i] for i in range(2_000)]
            seen = len(passes)
            del read
            assert gc.get_threshold() == (threshold, *before[1:])
            expected = seen >= 2 if threshold == CPYTHON_YOUNG_THRESHOLD else seen == 0
            assert expected, (threshold, seen)
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*before)

"""Keep the cyclic GC off the hot path: freeze what startup built.

After the router loads its tokenizer, or the worker its model, the process tracks a large heap of
long-lived objects (transformers, tokenizers, mlx-lm, FastAPI), and a full collection walks all
of them: a stall of every stream the process serves (the router's relays, the worker's decode
step) whenever one happens to run. Moving them to the permanent generation once startup is done
(gc.freeze) leaves full collections only the objects made while serving.

A router also passes over its young generation less often than CPython's default: a relay read
makes more objects than 700 alive at once (the reply's lists, the events, the chunks), all dead
by the read's end, so a pass every 700 allocations ran in the middle of reads and scanned them
alive, moved them up, and freed them a moment later as old ones.
"""

from __future__ import annotations

import gc
import logging

# The router's young-generation threshold (CPython's default: 700): allocations less frees
# between passes. Above what one read holds alive at once, a pass comes as long-lived objects
# pile up, not inside every read (bench/README.md, "What a waiting stream holds, and the young
# generation").
ROUTER_YOUNG_THRESHOLD = 5000


def freeze_startup_heap(log: logging.Logger) -> int:
    """Collect once, then freeze everything still alive; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc: froze %d startup objects (full collections skip them)", frozen)
    return frozen


def space_young_passes(threshold: int = ROUTER_YOUNG_THRESHOLD) -> None:
    """Pass over the young generation every `threshold` allocations; the older generations'
    thresholds stay as they were."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)

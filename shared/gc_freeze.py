"""Keep the cyclic GC off the hot path: freeze what startup built.

After the router loads its tokenizer, or the worker its model, the process tracks a large heap of
long-lived objects (transformers, tokenizers, mlx-lm, FastAPI), and a full collection walks all
of them: a stall of every stream the process serves (the router's relays, the worker's decode
step) whenever one happens to run. Moving them to the permanent generation once startup is done
(gc.freeze) leaves full collections only the objects made while serving.
"""

from __future__ import annotations

import gc
import logging


def freeze_startup_heap(log: logging.Logger) -> int:
    """Collect once, then freeze everything still alive; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc: froze %d startup objects (full collections skip them)", frozen)
    return frozen

"""Batching of embedding inputs: every input of every job taken together, sorted by length and
cut into forward passes of at most BATCH_TOKENS padded tokens, then handed back per job in each
job's own order.

Sorting by length keeps padding small; a sequence's vector does not depend on what it is
batched with (right padding under causal attention, model.py), so the order is free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from worker.embedding.model import EmbeddingModel

# Padded tokens per forward pass (rows times the longest row); an input longer than this runs
# alone. Bounds the activations one pass holds, whatever a job's count of inputs.
BATCH_TOKENS = 8192


@dataclass(frozen=True)
class Chunk:
    """One forward pass: indices into the flat input list."""

    indices: list[int]


def plan(lengths: list[int], budget: int = BATCH_TOKENS) -> list[Chunk]:
    """Forward passes covering every input once, shortest first, each within `budget` padded
    tokens (a longer input alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[Chunk] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending: this input is the longest of the chunk it joins.
        if current and (len(current) + 1) * lengths[i] > budget:
            chunks.append(Chunk(current))
            current = []
        current.append(i)
    if current:
        chunks.append(Chunk(current))
    return chunks


def embed_jobs(
    model: EmbeddingModel,
    jobs: list[list[list[int]]],
    on_pass: Callable[[], None] = lambda: None,
    budget: int = BATCH_TOKENS,
) -> list[np.ndarray]:
    """Each job's vectors ([its inputs, dimensions], in its order), computed in shared forward
    passes; `on_pass` runs after each pass (the loop's progress, for its heartbeat)."""
    flat = [tokens for inputs in jobs for tokens in inputs]
    out = np.zeros((len(flat), model.dimensions), dtype=np.float32)
    for chunk in plan([len(t) for t in flat], budget):
        out[chunk.indices] = model.embed([flat[i] for i in chunk.indices])
        on_pass()
    per_job: list[np.ndarray] = []
    start = 0
    for inputs in jobs:
        per_job.append(out[start : start + len(inputs)])
        start += len(inputs)
    return per_job

"""Load-time check: does batching change this model's greedy tokens?

A few seeded prompts of different lengths are decoded greedily alone (a batch of one) and then
together, through mlx-lm's `BatchGenerator` built as the engine builds it; the largest batch
size whose tokens all equal the solo ones is the size the model is served at. A model whose
tokens differ even in a batch of two is served one sequence at a time.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.config import WorkerConfig
from worker.engine.first_token import generator_class
from worker.mlx_cpu.idle_memory import release_idle_memory

log = logging.getLogger("mlxcel.worker")

# The prompts' lengths: different, so a batch left-pads them as a real batch does.
PROMPT_LENGTHS: tuple[int, ...] = (8, 19, 31, 40)
NEW_TOKENS = 6
SEED = 0
# What the info hash says when the check was switched off (`worker.batch_invariance_check`).
UNCHECKED = "unchecked"


@dataclass(frozen=True)
class BatchInvariance:
    """The check's verdict: `limit` is the batch size the worker serves at, at most the
    `configured` one."""

    limit: int
    invariant: bool | None  # None: not checked
    configured: int
    sizes_checked: tuple[int, ...] = ()
    reason: str = ""
    seconds: float = 0.0

    @property
    def flag(self) -> str:
        """The info hash's `batch_invariant`: "1", "0", or "unchecked"."""
        if self.invariant is None:
            return UNCHECKED
        return "1" if self.invariant else "0"

    @property
    def summary(self) -> str:
        """A few words for the ready line."""
        if self.invariant is None:
            return "batch invariance not checked"
        if self.invariant:
            return "batch-invariant"
        return f"capped from {self.configured}: batching changes greedy tokens above {self.limit}"


def check_prompts(vocab_size: int, seed: int = SEED) -> list[list[int]]:
    """Seeded random token ids, one prompt per length in PROMPT_LENGTHS."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def generate(
    model: Any, prompts: Sequence[list[int]], config: WorkerConfig, batch: int
) -> list[list[int]]:
    """Greedy tokens of each prompt, decoded `batch` at a time the way the engine's generator
    decodes them (worker/engine/engine.py `_new_generator`); no stop tokens, so every sequence
    yields exactly NEW_TOKENS."""
    gen = generator_class()(
        model,
        max_tokens=NEW_TOKENS,
        completion_batch_size=batch,
        prefill_batch_size=min(config.prefill_batch_size, batch),
        prefill_step_size=config.prefill_step_size,
    )
    try:
        uids = gen.insert([list(p) for p in prompts], max_tokens=[NEW_TOKENS] * len(prompts))
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        done: set[int] = set()
        # Each step yields at most one token per sequence: this bounds a generator that stalls.
        for _ in range(len(prompts) * (NEW_TOKENS + max(PROMPT_LENGTHS) + 2)):
            if len(done) == len(uids):
                break
            _, responses = gen.next()
            for r in responses:
                tokens[r.uid].append(int(r.token))
                if r.finish_reason is not None:
                    done.add(r.uid)
        return [tokens[uid] for uid in uids]
    finally:
        gen.close()


def _batched(
    model: Any, prompts: list[list[int]], config: WorkerConfig, batch: int
) -> list[list[int]] | None:
    """`generate` in a batch; None when the batched path raises (the model cannot batch)."""
    try:
        return generate(model, prompts, config, batch)
    except Exception:  # a batched path that fails is one that differs: this size is not served
        log.warning("batch invariance: a batch of %d raised", batch, exc_info=True)
        return None


def _ladder(configured: int) -> list[int]:
    """Batch sizes to try, in order: 2 first (the cheapest that batches at all), then the
    configured size, then its halves while above 2 (tried only while the larger ones fail)."""
    sizes = [2]
    size = configured
    while size > 2:
        sizes.append(size)
        size //= 2
    return sizes


def check_batch_invariance(model: Any, config: WorkerConfig, vocab_size: int) -> BatchInvariance:
    """The largest batch size up to `config.batch_size` whose batched greedy tokens equal the
    tokens each prompt gets alone; 1 when even a batch of two differs."""
    t0 = time.perf_counter()
    configured = config.batch_size
    if configured < 2:
        return BatchInvariance(1, True, 1, (), "batch size 1: nothing is batched")
    prompts = check_prompts(vocab_size)
    solo = [generate(model, [p], config, 1)[0] for p in prompts]
    checked: list[int] = []
    failed: list[int] = []
    limit = 1
    for size in _ladder(configured):
        if size <= limit:
            continue
        batch = [prompts[i % len(prompts)] for i in range(size)]
        expected = [solo[i % len(prompts)] for i in range(size)]
        checked.append(size)
        if _batched(model, batch, config, size) != expected:
            failed.append(size)
            if size == 2:
                break
            continue
        limit = size
        if size == configured:
            break
    invariant = limit == configured
    if invariant:
        reason = f"batched greedy tokens equal solo ones at batch sizes {checked}"
    else:
        reason = f"batched greedy tokens differ from solo ones at batch size {min(failed)}" + (
            f", equal at {limit}" if limit > 1 else ""
        )
    release_idle_memory()  # the check's batches leave no buffers behind in an idle worker
    seconds = time.perf_counter() - t0
    return BatchInvariance(limit, invariant, configured, tuple(checked), reason, seconds)


def capped(config: WorkerConfig, verdict: BatchInvariance) -> WorkerConfig:
    """The worker settings the engine runs with: batch and prefill batch sizes at most the
    verdict's limit."""
    if verdict.limit >= config.batch_size:
        return config
    return config.model_copy(
        update={
            "batch_size": verdict.limit,
            "prefill_batch_size": min(config.prefill_batch_size, verdict.limit),
        }
    )

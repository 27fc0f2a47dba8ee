"""The scheduler's prompt-cache facade: adopt on admission, donate on a healthy finish.

What every storage mode shares lives here (the donate checks, checkpoints, the one reject
site); how a mode adopts and detaches KV is its class in prompt_cache.modes, chosen once. This
is the only place that records rejects, apart from the store's hook for its three insert
declines. A refusal is a
value (None), never an exception; mlx failures while laying out KV become `layout_constraints`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.config import PromptCacheConfig
from shared.reject import RejectReason
from worker.prompt_cache.checkpoints import checkpoint_positions
from worker.prompt_cache.counters import CacheCounters
from worker.prompt_cache.entries import (
    SNAPSHOT,
    DenseEntry,
    SnapshotEntry,
    StoredKV,
)
from worker.prompt_cache.gauges import gauges_of
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.modes import MODES, AdoptResult, CacheParts, DenseMode, StorageMode
from worker.prompt_cache.store import PromptStore
from worker.prompt_cache.trace import make_tracer

_log = logging.getLogger("mlxcel.prompt_cache")
_KIND_BY_MODE = {"dense": "trimmable", "paged": "trimmable", SNAPSHOT: "snapshot", "none": "none"}


@dataclass(frozen=True)
class ResetResult:
    cleared: bool
    freed_bytes: int
    freed_entries: int


def _layer_empty(cache: Any) -> bool:
    try:
        return bool(cache.empty())
    except Exception:
        return True


class PromptCache:
    def __init__(
        self,
        config: PromptCacheConfig,
        *,
        model_id: str,
        storage_mode: str,
        worker_id: str,
        clock: Callable[[], float] = time.time,
        cacheability: str | None = None,
    ) -> None:
        self.config = config
        self.model_id = model_id
        self.storage_mode = storage_mode
        self.cacheability = cacheability or _KIND_BY_MODE.get(storage_mode, "none")
        self._clock = clock
        self._min_adopt = max(config.min_prefix_tokens, 1)
        self.counters = CacheCounters()
        self._tracer = make_tracer(config.trace, worker_id)  # decided once, here
        self.store = PromptStore(
            config,
            mode=storage_mode,
            counters=self.counters,
            clock=clock,
            record_reject=self.record_reject,
        )
        parts = CacheParts(
            config, self.store, self.counters, self.record_reject, self._tracer, self._min_adopt
        )
        self.mode: StorageMode = MODES.get(storage_mode, DenseMode)(parts)
        # Snapshot mode keeps checkpoints while prompts prefill: every `checkpoint_tokens`.
        self.checkpoint_every = self.mode.checkpoint_every

    # -- the one reject site -----------------------------------------------------------------
    def record_reject(self, reason: RejectReason, seq_id: str | None, context_len: int) -> None:
        self.counters.record_reject(reason, seq_id, context_len, int(self._clock() * 1000))
        self._tracer.reject(reason, seq_id, context_len)

    # -- adopt -------------------------------------------------------------------------------
    def try_adopt_cached_prefix(
        self, ns: CacheNamespace, session_key: str, prompt_tokens: list[int], seq_id: str
    ) -> AdoptResult | None:
        """Cached KV for the longest usable prefix of the prompt, or None (miss or reject).
        Always leaves at least one prompt token to compute the first logits from."""
        if not self.store.enabled:
            return None
        return self.mode.adopt(ns, session_key, prompt_tokens, seq_id)

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_marks(self, ns: CacheNamespace, prompt: list[int], start: int) -> list[int]:
        """Where a prompt prefilled from `start` keeps checkpoints (prompt_cache.checkpoints):
        its regular ones, and the block boundary where it leaves the longest prefix it shares
        with a stored entry, the point the next prompt like both will diverge at too."""
        if not self.checkpoint_every or not self.store.enabled:
            return []
        block = self.config.apc_block_size
        marks = checkpoint_positions(
            start, len(prompt), every=self.checkpoint_every, block=block, min_tokens=self._min_adopt
        )
        shared = self.store.snapshots.shared_prefix(ns, tuple(prompt[:-1])) // block * block
        if shared > start and shared >= self._min_adopt and shared not in marks:
            marks = sorted([*marks, shared])
        return marks

    def keep_checkpoint(
        self,
        ns: CacheNamespace,
        session_key: str,
        seq_id: str,
        tokens: list[int],
        layer_caches: list[Any],
    ) -> None:
        """A prompt's state at one of its checkpoints, copied into the snapshot shelf (within
        its byte budget and LRU), unless an entry of exactly these tokens is there already."""
        # Only block boundaries: BatchGenerator also ends a segment before a prompt's last
        # token, and a checkpoint the routing index cannot name would make its guesses wrong.
        if not self.store.enabled or len(tokens) % self.config.apc_block_size:
            return
        known = self.store.snapshots.find_exact(ns, tuple(tokens))
        if known is not None:
            self.store.snapshots.touch(known, self._clock())
            return
        if not layer_caches or any(_layer_empty(c) for c in layer_caches):
            self.record_reject(RejectReason.EMPTY_SET, seq_id, len(tokens))
            return
        entry = SnapshotEntry.capture(tokens, layer_caches, checkpoint=True)
        if self.store.insert_snapshot(ns, session_key, entry, seq_id=seq_id) is None:
            self.counters.checkpoint_inserts += 1
            self._tracer.store(seq_id, entry.num_tokens, True)

    # -- donate ------------------------------------------------------------------------------
    def donate_finished_sequence_cache(
        self,
        ns: CacheNamespace,
        session_key: str,
        seq_id: str,
        tokens: list[int],
        layer_caches: list[Any] | None,
    ) -> None:
        """Offer a healthily finished sequence's KV (covering exactly `tokens`) to the store."""
        n = len(tokens)
        if not self.store.enabled:  # the store declines Disabled; nothing is copied first
            self._insert(ns, session_key, seq_id, n, DenseEntry(tuple(tokens), []))
            return
        if n < self.config.min_prefix_tokens:  # before detaching: nothing copied or pinned
            self.record_reject(RejectReason.PREFIX_TOO_SHORT, seq_id, n)
            return
        if not layer_caches or any(_layer_empty(c) for c in layer_caches):
            self.record_reject(RejectReason.EMPTY_SET, seq_id, n)
            return
        try:
            entry = self.mode.detach(ns, tokens, layer_caches)
        except Exception:
            _log.warning("prompt-cache: could not detach KV of %s", seq_id, exc_info=True)
            return
        if entry.is_empty():
            entry.release()
            self.record_reject(RejectReason.EMPTY_SET, seq_id, n)
            return
        self._insert(ns, session_key, seq_id, n, entry)

    def _insert(
        self, ns: CacheNamespace, session_key: str, seq_id: str, n: int, entry: StoredKV
    ) -> None:
        if self.mode.insert(ns, session_key, entry, seq_id, n) is None:
            self._tracer.store(seq_id, entry.num_tokens, self.mode.snapshot)

    # -- lifecycle / stats -------------------------------------------------------------------
    def reset(self) -> ResetResult:
        return ResetResult(*self.store.reset())

    def gauges(self) -> dict[str, int | str]:
        """Current state, limits and settings (shared.cache_stats GAUGE_FIELDS + SETTING_FIELDS,
        less batch_current_size and batch_kv_bytes, which the engine owns)."""
        return gauges_of(self.store, storage_mode=self.storage_mode, cacheability=self.cacheability)

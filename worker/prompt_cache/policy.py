"""The scheduler's prompt-cache facade: adopt on admission, donate on a healthy finish.

Decisions live here (which match to use, flooring, the resume rule) and this is the only place
that records rejects, apart from the store's hook for its three insert declines. A refusal is a
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
from worker.prompt_cache.block_pool import CacheLease
from worker.prompt_cache.checkpoints import checkpoint_positions
from worker.prompt_cache.counters import CacheCounters
from worker.prompt_cache.entries import (
    PAGED,
    SNAPSHOT,
    DenseEntry,
    PagedEntry,
    SnapshotEntry,
    StoredKV,
)
from worker.prompt_cache.gauges import gauges_of
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.shelf import Match
from worker.prompt_cache.store import PromptStore
from worker.prompt_cache.trace import make_tracer

_log = logging.getLogger("mlxcel.prompt_cache")
_KIND_BY_MODE = {"dense": "trimmable", "paged": "trimmable", SNAPSHOT: "snapshot", "none": "none"}


@dataclass
class AdoptResult:
    """Fresh per-layer caches holding KV for exactly `prompt[:cached_tokens]`."""

    caches: list[Any]
    cached_tokens: int
    snapshot: bool = False
    lease: CacheLease | None = None  # paged: the blocks held until the sequence leaves


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
        # Snapshot mode keeps checkpoints while prompts prefill: every `checkpoint_tokens`.
        self.checkpoint_every = config.checkpoint_tokens if storage_mode == SNAPSHOT else 0
        self.counters = CacheCounters()
        self._tracer = make_tracer(config.trace, worker_id)  # decided once, here
        self.store = PromptStore(
            config,
            mode=storage_mode,
            counters=self.counters,
            clock=clock,
            record_reject=self.record_reject,
        )

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
        if self.storage_mode == SNAPSHOT:
            return self._adopt_snapshot(ns, session_key, prompt_tokens, seq_id)
        c = self.counters
        c.lookups += 1
        match = self.store.lookup(ns, session_key, prompt_tokens)
        usable = min(match.matched, len(prompt_tokens) - 1) if match else 0
        result = self._adopt_match(match, usable, seq_id) if match and usable > 0 else None
        if result is None:
            c.misses += 1
            return None
        c.hits += 1
        c.prefix_tokens_reused += result.cached_tokens
        self._tracer.adopt(seq_id, result.cached_tokens, len(prompt_tokens), False)
        return result

    def _adopt_match(self, match: Match, usable: int, seq_id: str) -> AdoptResult | None:
        entry = match.entry
        partial_whole_only = entry.whole_only and match.matched < match.entry_len
        if entry.mode != self.storage_mode or partial_whole_only:
            self.record_reject(RejectReason.MODE_MISMATCH, None, match.matched)
            return None
        if self.storage_mode == PAGED:
            return self._adopt_paged(match, usable, seq_id)
        return self._adopt_dense(match, usable)

    def _adopt_dense(self, match: Match, usable: int) -> AdoptResult | None:
        """The entry leaves the store, cut back to the match."""
        entry = self.store.take(match.entry_id)
        if entry is None:
            return None  # lost a race for it: a miss, not a reject
        if entry.is_empty():
            entry.release()
            self.record_reject(RejectReason.EMPTY_SET, None, match.matched)
            return None
        try:
            caches = entry.materialise(usable)
        except Exception:
            entry.release()
            self.record_reject(RejectReason.LAYOUT_CONSTRAINTS, None, usable)
            return None
        return AdoptResult(caches, usable, False)

    def _adopt_paged(self, match: Match, usable: int, seq_id: str) -> AdoptResult | None:
        """Clone whole blocks into fresh caches and pin them; the entry stays."""
        bs = self.config.paged_block_size
        adoptable = (min(usable, match.entry_len) // bs) * bs
        if adoptable < self._min_adopt:
            self.record_reject(RejectReason.BLOCK_BOUNDARY_FLOOR, None, match.matched)
            return None
        entry = match.entry
        if entry.is_empty():
            self.record_reject(RejectReason.EMPTY_SET, None, match.matched)
            return None
        try:
            caches = entry.materialise(adoptable)
            if any(c.offset != adoptable for c in caches):
                raise ValueError("cloned caches do not cover the adoptable length")
        except Exception:
            self.record_reject(RejectReason.LAYOUT_CONSTRAINTS, None, adoptable)
            return None
        assert isinstance(entry, PagedEntry) and self.store.pool is not None
        lease = self.store.pool.pin(entry.block_ids[: adoptable // bs])
        self.store.touch(match)
        return AdoptResult(caches, adoptable, False, lease)

    def _adopt_snapshot(
        self, ns: CacheNamespace, session_key: str, prompt_tokens: list[int], seq_id: str
    ) -> AdoptResult | None:
        """Restore a copy of the deepest snapshot or checkpoint that is a whole, proper prefix
        of the prompt. A prompt that shares at least the minimum prefix with some entry but
        has none whole inside that share is `block_boundary_floor`: its match floored to the
        points a snapshot can resume at (as a paged match floors to whole blocks) is empty."""
        c = self.counters
        c.snapshot_lookups += 1
        if self.checkpoint_every:
            c.checkpoint_lookups += 1
        match = self.store.lookup_snapshot(ns, session_key, prompt_tokens)
        if match is None:
            c.snapshot_misses += 1
            shared = self.store.snapshots.shared_prefix(ns, tuple(prompt_tokens[:-1]))
            if shared >= self._min_adopt:
                self.record_reject(RejectReason.BLOCK_BOUNDARY_FLOOR, None, shared)
            return None
        caches = self._restore(match, seq_id)
        if caches is None:
            c.snapshot_misses += 1
            return None
        self.store.touch(match, snapshot=True)
        c.snapshot_hits += 1
        c.snapshot_tokens_reused += match.entry_len
        if match.entry.checkpoint:
            c.checkpoint_hits += 1
            c.checkpoint_tokens_reused += match.entry_len
        self._tracer.adopt(seq_id, match.entry_len, len(prompt_tokens), True)
        return AdoptResult(caches, match.entry_len, True)

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

    def _restore(self, match: Match, seq_id: str) -> list[Any] | None:
        if match.entry.is_empty():
            self.record_reject(RejectReason.EMPTY_SET, None, match.matched)
            return None
        try:
            return match.entry.materialise(match.entry_len)
        except Exception:
            self.record_reject(RejectReason.LAYOUT_CONSTRAINTS, seq_id, match.matched)
            return None

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
            entry = self._detach(ns, tokens, layer_caches)
        except Exception:
            _log.warning("prompt-cache: could not detach KV of %s", seq_id, exc_info=True)
            return
        if entry.is_empty():
            entry.release()
            self.record_reject(RejectReason.EMPTY_SET, seq_id, n)
            return
        self._insert(ns, session_key, seq_id, n, entry)

    def _detach(self, ns: CacheNamespace, tokens: list[int], layer_caches: list[Any]) -> StoredKV:
        if self.storage_mode == SNAPSHOT:
            return SnapshotEntry.capture(tokens, layer_caches)
        pool = self.store.pool
        if pool is None:
            return DenseEntry.detach(tokens, layer_caches)
        ids = pool.store(ns.seed(), tokens, layer_caches)
        return PagedEntry(
            tokens=tuple(tokens[: len(ids) * pool.block_size]),
            block_ids=ids,
            block_size=pool.block_size,
            block_nbytes=pool.block_nbytes,
            clone=pool.clone,
            free=pool.free,
        )

    def _insert(
        self, ns: CacheNamespace, session_key: str, seq_id: str, n: int, entry: StoredKV
    ) -> None:
        snapshot = self.storage_mode == SNAPSHOT
        insert = self.store.insert_snapshot if snapshot else self.store.insert
        if insert(ns, session_key, entry, seq_id=seq_id, context_len=n) is None:
            self._tracer.store(seq_id, entry.num_tokens, snapshot)

    # -- lifecycle / stats -------------------------------------------------------------------
    def reset(self) -> ResetResult:
        return ResetResult(*self.store.reset())

    def gauges(self) -> dict[str, int | str]:
        """Current state, limits and settings (shared.cache_stats GAUGE_FIELDS + SETTING_FIELDS,
        less batch_current_size, which the scheduler owns)."""
        return gauges_of(self.store, storage_mode=self.storage_mode, cacheability=self.cacheability)

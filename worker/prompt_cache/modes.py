"""How each storage mode adopts and detaches KV: one class per mode, chosen once when the cache
is built, so the policy holds the decisions common to all and never branches on the mode.

- `DenseMode`: a finished sequence's own caches; an adopt takes the entry out, cut back.
- `PagedMode`: whole blocks in a shared pool; an adopt clones blocks and pins them.
- `SnapshotMode`: caches that cannot be cut back (sliding windows, SSM state); an adopt
  restores a copy of a whole snapshot or prefill checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.config import PromptCacheConfig
from shared.reject import RejectReason
from worker.prompt_cache.block_pool import CacheLease
from worker.prompt_cache.counters import CacheCounters
from worker.prompt_cache.entries import (
    DENSE,
    PAGED,
    SNAPSHOT,
    DenseEntry,
    PagedEntry,
    SnapshotEntry,
    StoredKV,
)
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.shelf import Match
from worker.prompt_cache.store import InsertDecline, PromptStore
from worker.prompt_cache.trace import Tracer

RecordReject = Callable[[RejectReason, str | None, int], None]


@dataclass
class AdoptResult:
    """Fresh per-layer caches holding KV for exactly `prompt[:cached_tokens]`."""

    caches: list[Any]
    cached_tokens: int
    snapshot: bool = False
    lease: CacheLease | None = None  # paged: the blocks held until the sequence leaves


@dataclass
class CacheParts:
    """What every mode works with: the one store and the policy's reject site and tracer."""

    config: PromptCacheConfig
    store: PromptStore
    counters: CacheCounters
    record_reject: RecordReject
    tracer: Tracer
    min_adopt: int


class _TrimmableMode:
    """Dense and paged: the longest stored prefix of the prompt, cut back to the match."""

    name = DENSE
    snapshot = False
    checkpoint_every = 0

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    def adopt(
        self, ns: CacheNamespace, session_key: str, prompt: list[int], seq_id: str
    ) -> AdoptResult | None:
        p, c = self.parts, self.parts.counters
        c.lookups += 1
        match = p.store.lookup(ns, session_key, prompt)
        usable = min(match.matched, len(prompt) - 1) if match else 0
        result = self._adopt_match(match, usable, seq_id) if match and usable > 0 else None
        if result is None:
            c.misses += 1
            return None
        c.hits += 1
        c.prefix_tokens_reused += result.cached_tokens
        p.tracer.adopt(seq_id, result.cached_tokens, len(prompt), False)
        return result

    def _adopt_match(self, match: Match, usable: int, seq_id: str) -> AdoptResult | None:
        entry = match.entry
        partial_whole_only = entry.whole_only and match.matched < match.entry_len
        if entry.mode != self.name or partial_whole_only:
            self.parts.record_reject(RejectReason.MODE_MISMATCH, None, match.matched)
            return None
        return self._take(match, usable, seq_id)

    def _take(self, match: Match, usable: int, seq_id: str) -> AdoptResult | None:
        raise NotImplementedError

    def detach(self, ns: CacheNamespace, tokens: list[int], layer_caches: list[Any]) -> StoredKV:
        return DenseEntry.detach(tokens, layer_caches)

    def insert(
        self, ns: CacheNamespace, session_key: str, entry: StoredKV, seq_id: str, n: int
    ) -> InsertDecline | None:
        return self.parts.store.insert(ns, session_key, entry, seq_id=seq_id, context_len=n)


class DenseMode(_TrimmableMode):
    name = DENSE

    def _take(self, match: Match, usable: int, seq_id: str) -> AdoptResult | None:
        """The entry leaves the store, cut back to the match."""
        p = self.parts
        entry = p.store.take(match.entry_id)
        if entry is None:
            return None  # lost a race for it: a miss, not a reject
        if entry.is_empty():
            entry.release()
            p.record_reject(RejectReason.EMPTY_SET, None, match.matched)
            return None
        try:
            caches = entry.materialise(usable)
        except Exception:
            entry.release()
            p.record_reject(RejectReason.LAYOUT_CONSTRAINTS, None, usable)
            return None
        return AdoptResult(caches, usable, False)


class PagedMode(_TrimmableMode):
    name = PAGED

    def _take(self, match: Match, usable: int, seq_id: str) -> AdoptResult | None:
        """Clone whole blocks into fresh caches and pin them; the entry stays."""
        p = self.parts
        bs = p.config.paged_block_size
        adoptable = (min(usable, match.entry_len) // bs) * bs
        if adoptable < p.min_adopt:
            p.record_reject(RejectReason.BLOCK_BOUNDARY_FLOOR, None, match.matched)
            return None
        entry = match.entry
        if entry.is_empty():
            p.record_reject(RejectReason.EMPTY_SET, None, match.matched)
            return None
        try:
            caches = entry.materialise(adoptable)
            if any(c.offset != adoptable for c in caches):
                raise ValueError("cloned caches do not cover the adoptable length")
        except Exception:
            p.record_reject(RejectReason.LAYOUT_CONSTRAINTS, None, adoptable)
            return None
        assert isinstance(entry, PagedEntry) and p.store.pool is not None
        lease = p.store.pool.pin(entry.block_ids[: adoptable // bs])
        p.store.touch(match)
        return AdoptResult(caches, adoptable, False, lease)

    def detach(self, ns: CacheNamespace, tokens: list[int], layer_caches: list[Any]) -> StoredKV:
        pool = self.parts.store.pool
        assert pool is not None, "a paged store has a block pool"
        ids = pool.store(ns.seed(), tokens, layer_caches)
        return PagedEntry(
            tokens=tuple(tokens[: len(ids) * pool.block_size]),
            block_ids=ids,
            block_size=pool.block_size,
            block_nbytes=pool.block_nbytes,
            clone=pool.clone,
            free=pool.free,
        )


class SnapshotMode:
    """Whole snapshots and prefill checkpoints on the snapshot shelf."""

    name = SNAPSHOT
    snapshot = True

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts
        # Prompts keep checkpoints while they prefill: every `checkpoint_tokens`.
        self.checkpoint_every = parts.config.checkpoint_tokens

    def adopt(
        self, ns: CacheNamespace, session_key: str, prompt: list[int], seq_id: str
    ) -> AdoptResult | None:
        """Restore a copy of the deepest snapshot or checkpoint that is a whole, proper prefix
        of the prompt. A prompt that shares at least the minimum prefix with some entry but
        has none whole inside that share is `block_boundary_floor`: its match floored to the
        points a snapshot can resume at (as a paged match floors to whole blocks) is empty."""
        p, c = self.parts, self.parts.counters
        c.snapshot_lookups += 1
        if self.checkpoint_every:
            c.checkpoint_lookups += 1
        match = p.store.lookup_snapshot(ns, session_key, prompt)
        if match is None:
            c.snapshot_misses += 1
            shared = p.store.snapshots.shared_prefix(ns, tuple(prompt[:-1]))
            if shared >= p.min_adopt:
                p.record_reject(RejectReason.BLOCK_BOUNDARY_FLOOR, None, shared)
            return None
        caches = self._restore(match, seq_id)
        if caches is None:
            c.snapshot_misses += 1
            return None
        p.store.touch(match, snapshot=True)
        c.snapshot_hits += 1
        c.snapshot_tokens_reused += match.entry_len
        if match.entry.checkpoint:
            c.checkpoint_hits += 1
            c.checkpoint_tokens_reused += match.entry_len
        p.tracer.adopt(seq_id, match.entry_len, len(prompt), True)
        return AdoptResult(caches, match.entry_len, True)

    def _restore(self, match: Match, seq_id: str) -> list[Any] | None:
        if match.entry.is_empty():
            self.parts.record_reject(RejectReason.EMPTY_SET, None, match.matched)
            return None
        try:
            return match.entry.materialise(match.entry_len)
        except Exception:
            self.parts.record_reject(RejectReason.LAYOUT_CONSTRAINTS, seq_id, match.matched)
            return None

    def detach(self, ns: CacheNamespace, tokens: list[int], layer_caches: list[Any]) -> StoredKV:
        return SnapshotEntry.capture(tokens, layer_caches)

    def insert(
        self, ns: CacheNamespace, session_key: str, entry: StoredKV, seq_id: str, n: int
    ) -> InsertDecline | None:
        store = self.parts.store
        return store.insert_snapshot(ns, session_key, entry, seq_id=seq_id, context_len=n)


StorageMode = DenseMode | PagedMode | SnapshotMode

# "none": a disabled store (it declines every insert as `disabled`) behind the dense shape.
MODES: dict[str, type[DenseMode] | type[PagedMode] | type[SnapshotMode]] = {
    DENSE: DenseMode,
    PAGED: PagedMode,
    SNAPSHOT: SnapshotMode,
    "none": DenseMode,
}

"""The prompt-cache store: limits, declines and eviction over two shelves and a block pool.

Bookkeeping only. `insert` answers with None (stored) or a decline *value*; the three spec
declines are also handed to the `record_reject` hook, the one place the store classifies
anything. Which entry to adopt, flooring, and the other rejects are the policy's business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.config import PromptCacheConfig
from shared.reject import RejectReason
from worker.prompt_cache.apc import BlockHasher
from worker.prompt_cache.block_pool import BlockPool
from worker.prompt_cache.counters import CacheCounters
from worker.prompt_cache.entries import PAGED, PagedEntry, StoredKV
from worker.prompt_cache.index_log import BlockIndexLog
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.shelf import MAIN_COUNTERS, SNAPSHOT_COUNTERS, Limits, Match, Shelf


@dataclass(frozen=True)
class Disabled:
    pass


@dataclass(frozen=True)
class PrefixTooShort:
    got: int
    min_required: int


@dataclass(frozen=True)
class OversizedEntry:
    entry_bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class NoRoom:
    """Fits the budget in principle, but pinned blocks or a zero entry cap leave no room now.
    Not one of the spec's declines, so not a reject (like running out of sequence slots)."""

    needed_bytes: int


InsertDecline = Disabled | PrefixTooShort | OversizedEntry | NoRoom
RejectHook = Callable[[RejectReason, str | None, int], None]

_DECLINE_REASON: dict[type, RejectReason] = {
    Disabled: RejectReason.DISABLED,
    PrefixTooShort: RejectReason.PREFIX_TOO_SHORT,
    OversizedEntry: RejectReason.OVERSIZED,
}


def _no_hook(reason: RejectReason, seq_id: str | None, context_len: int) -> None:
    return None


class PromptStore:
    def __init__(
        self,
        config: PromptCacheConfig,
        *,
        mode: str,
        counters: CacheCounters,
        clock: Callable[[], float],
        record_reject: RejectHook = _no_hook,
    ) -> None:
        self.config = config
        self.mode = mode
        self.enabled = config.enabled and mode != "none"
        self.counters = counters
        self.clock = clock
        self.record_reject = record_reject
        hasher = BlockHasher(config.apc_block_size, config.apc_hash) if config.apc_enabled else None
        # The blocks routers may route by: what each entry can be resumed at (entries.py
        # resume_points: any block of a main entry, the end of a snapshot or checkpoint).
        self.index = BlockIndexLog()
        self.main = Shelf(
            Limits(
                config.capacity_bytes, config.max_entries, config.ttl_s, config.min_prefix_tokens
            ),
            MAIN_COUNTERS,
            counters,
            hasher,
            self.index,
        )
        self.snapshots = Shelf(
            Limits(
                config.snapshot_capacity_bytes,
                config.snapshot_max_entries,
                config.snapshot_ttl_s,
                config.min_prefix_tokens,
            ),
            SNAPSHOT_COUNTERS,
            counters,
            hasher,
            self.index,
        )
        self.pool: BlockPool | None = None
        if mode == PAGED:
            self.pool = BlockPool(
                block_size=config.paged_block_size,
                hash_algo=config.apc_hash,
                budget_blocks=config.paged_block_budget,
                capacity_bytes=config.capacity_bytes,
            )

    # -- sizes -------------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        """Bytes the main store holds; paged: the pool's live blocks, shared ones counted once."""
        return self.pool.bytes_in_use if self.pool else self.main.entry_bytes

    # -- insert ------------------------------------------------------------------------------
    def insert(
        self,
        ns: CacheNamespace,
        session: str,
        entry: StoredKV,
        *,
        seq_id: str | None = None,
        context_len: int | None = None,
    ) -> InsertDecline | None:
        """Store a donated dense/paged entry, or decline (the entry is then released)."""
        return self._insert(self.main, ns, session, entry, seq_id, context_len)

    def insert_entry(
        self, ns: CacheNamespace, session: str, entry: StoredKV
    ) -> InsertDecline | None:
        """Store any kind of entry as-is, whatever the running mode (tests and tools: a dense
        entry in a paged store is what an adopt sees as `mode_mismatch`)."""
        return self._insert(self.main, ns, session, entry, None, None)

    def insert_snapshot(
        self,
        ns: CacheNamespace,
        session: str,
        entry: StoredKV,
        *,
        seq_id: str | None = None,
        context_len: int | None = None,
    ) -> InsertDecline | None:
        return self._insert(self.snapshots, ns, session, entry, seq_id, context_len)

    def _insert(
        self,
        shelf: Shelf,
        ns: CacheNamespace,
        session: str,
        entry: StoredKV,
        seq_id: str | None,
        context_len: int | None,
    ) -> InsertDecline | None:
        decline = self._decline(shelf, entry)
        if decline is None:
            shelf.expire(self.clock())
            decline = self._make_room(shelf, entry)
        if decline is not None:
            entry.release()
            reason = _DECLINE_REASON.get(type(decline))
            if reason is not None:
                ctx = entry.num_tokens if context_len is None else context_len
                self.record_reject(reason, seq_id, ctx)
            return decline
        shelf.add(ns, session, entry, self.clock())
        return None

    def _decline(self, shelf: Shelf, entry: StoredKV) -> InsertDecline | None:
        """The spec's three declines, in the spec's order."""
        if not self.enabled:
            return Disabled()
        min_required = shelf.limits.min_prefix_tokens
        if entry.num_tokens < min_required:
            return PrefixTooShort(got=entry.num_tokens, min_required=min_required)
        if entry.nbytes > shelf.limits.capacity_bytes:
            self.counters.record(shelf.names.rejections_oversized)
            return OversizedEntry(entry.nbytes, shelf.limits.capacity_bytes)
        return None

    def _make_room(self, shelf: Shelf, entry: StoredKV) -> NoRoom | None:
        """LRU eviction over count, then bytes (paged: the pool's budget, with the new entry's
        blocks already counted, so shared blocks cost nothing)."""
        limits = shelf.limits
        while len(shelf) >= limits.max_entries:
            if not shelf.evict_lru():
                return NoRoom(entry.nbytes)
        if self.pool is not None and isinstance(entry, PagedEntry) and shelf is self.main:
            while self.pool.over_budget():
                if not shelf.evict_lru():
                    return NoRoom(entry.nbytes)
            return None
        while shelf.entry_bytes + entry.nbytes > limits.capacity_bytes:
            if not shelf.evict_lru():
                return NoRoom(entry.nbytes)
        return None

    # -- lookup / take -----------------------------------------------------------------------
    def lookup(self, ns: CacheNamespace, session: str, tokens: list[int]) -> Match | None:
        if not self.enabled:
            return None
        self.main.expire(self.clock())
        return self.main.lookup(ns, session, tuple(tokens))

    def lookup_snapshot(self, ns: CacheNamespace, session: str, tokens: list[int]) -> Match | None:
        if not self.enabled:
            return None
        self.snapshots.expire(self.clock())
        return self.snapshots.lookup_whole(ns, session, tuple(tokens))

    def touch(self, match: Match, snapshot: bool = False) -> None:
        (self.snapshots if snapshot else self.main).touch(match.entry_id, self.clock())

    def take(self, entry_id: int) -> StoredKV | None:
        """Dense adopt: the entry leaves the store. None if it is gone (a lost race)."""
        return self.main.pop(entry_id)

    # -- reset -------------------------------------------------------------------------------
    def reset(self) -> tuple[bool, int, int]:
        """(cleared, freed_bytes, freed_entries); zeros when disabled."""
        if not self.enabled:
            return False, 0, 0
        main_bytes = self.bytes
        n_main, _ = self.main.clear()
        n_snap, snap_bytes = self.snapshots.clear()
        if self.pool is not None:
            self.pool.reset()  # pinned blocks too: adopters hold clones, not the blocks
        return True, main_bytes + snap_bytes, n_main + n_snap

"""One set of entries with its own limits: entries, tries, LRU order, TTL, byte count.

Pure bookkeeping: it knows nothing of requests, reasons or storage modes. The store keeps two
(the main one and the snapshot one), each with its own caps and counter names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from worker.prompt_cache.apc import BlockHasher, clamp_to_blocks
from worker.prompt_cache.counters import CacheCounters
from worker.prompt_cache.entries import StoredKV, resume_points
from worker.prompt_cache.index_log import BlockIndexLog
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.trie import TokenTrie


@dataclass(frozen=True)
class Limits:
    capacity_bytes: int
    max_entries: int
    ttl_s: float
    min_prefix_tokens: int


@dataclass(frozen=True)
class CounterNames:
    """Which counters this shelf moves (main or snapshot_*)."""

    inserts: str
    evictions_lru: str
    evictions_ttl: str
    rejections_oversized: str


MAIN_COUNTERS = CounterNames("inserts", "evictions_lru", "evictions_ttl", "rejections_oversized")
SNAPSHOT_COUNTERS = CounterNames(
    "snapshot_inserts",
    "snapshot_evictions_lru",
    "snapshot_evictions_ttl",
    "snapshot_rejections_oversized",
)


@dataclass(eq=False)
class Slot:
    entry_id: int
    ns: CacheNamespace
    session: str
    entry: StoredKV
    last_used: float
    apc_hashes: list[bytes]


@dataclass(frozen=True)
class Match:
    """A lookup's answer: `matched` prompt tokens are shared with the entry (APC-clamped)."""

    entry_id: int
    entry: StoredKV
    matched: int
    entry_len: int


class Shelf:
    def __init__(
        self,
        limits: Limits,
        names: CounterNames,
        counters: CacheCounters,
        hasher: BlockHasher | None,
        index: BlockIndexLog | None = None,
    ) -> None:
        self.limits = limits
        self.names = names
        self.counters = counters
        self.hasher = hasher  # None: APC off, matches are not clamped to blocks
        self.index = index  # told of each block hash the shelf starts or stops holding
        self._slots: OrderedDict[int, Slot] = OrderedDict()  # oldest use first
        self._tries: dict[CacheNamespace, TokenTrie] = {}
        self._hash_refs: dict[bytes, int] = {}
        self._bytes = 0
        self._checkpoints = 0  # entries that are prefill checkpoints, and their bytes
        self._checkpoint_bytes = 0
        self._next_id = 0

    # -- state -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slots)

    @property
    def entry_bytes(self) -> int:
        return self._bytes

    @property
    def checkpoint_stats(self) -> tuple[int, int]:
        """(checkpoint entries, their bytes): part of the shelf's entries and bytes."""
        return self._checkpoints, self._checkpoint_bytes

    def slots(self) -> list[Slot]:
        return list(self._slots.values())

    def apc_stats(self) -> tuple[int, int, int]:
        """(total_blocks_stored, unique_block_hashes, apc_active_entries)."""
        total = sum(len(s.apc_hashes) for s in self._slots.values())
        active = sum(1 for s in self._slots.values() if s.apc_hashes)
        return total, len(self._hash_refs), active

    # -- mutation ----------------------------------------------------------------------------
    def add(self, ns: CacheNamespace, session: str, entry: StoredKV, now: float) -> int:
        hashes = []
        if self.hasher is not None:
            chain = self.hasher.chain(entry.tokens, ns.seed())
            hashes = resume_points(entry, chain, self.hasher.block_size)
        entry_id = self._next_id
        self._next_id += 1
        self._slots[entry_id] = Slot(entry_id, ns, session, entry, now, hashes)
        self._tries.setdefault(ns, TokenTrie()).insert(entry.tokens, entry_id)
        for h in hashes:
            n = self._hash_refs.get(h, 0)
            self._hash_refs[h] = n + 1
            if n == 0 and self.index is not None:
                self.index.add(h, first=h == chain[0])
        self._bytes += entry.nbytes
        if entry.checkpoint:
            self._checkpoints += 1
            self._checkpoint_bytes += entry.nbytes
        self.counters.record(self.names.inserts)
        return entry_id

    def pop(self, entry_id: int) -> StoredKV | None:
        """Take an entry out of the shelf (its owner now decides when to release it)."""
        slot = self._slots.pop(entry_id, None)
        if slot is None:
            return None
        trie = self._tries[slot.ns]
        trie.remove(slot.entry.tokens, entry_id)
        if not len(trie):
            del self._tries[slot.ns]
        for h in slot.apc_hashes:
            left = self._hash_refs[h] - 1
            if left:
                self._hash_refs[h] = left
            else:
                del self._hash_refs[h]
                if self.index is not None:
                    self.index.remove(h)
        self._bytes -= slot.entry.nbytes
        if slot.entry.checkpoint:
            self._checkpoints -= 1
            self._checkpoint_bytes -= slot.entry.nbytes
        return slot.entry

    def drop(self, entry_id: int) -> None:
        entry = self.pop(entry_id)
        if entry is not None:
            entry.release()

    def touch(self, entry_id: int, now: float) -> None:
        """A hit refreshes: the entry moves to the most-recently-used end."""
        slot = self._slots.get(entry_id)
        if slot is not None:
            slot.last_used = now
            self._slots.move_to_end(entry_id)

    def evict_lru(self) -> bool:
        """Evict the least recently used entry; False when there is none."""
        if not self._slots:
            return False
        self.drop(next(iter(self._slots)))
        self.counters.record(self.names.evictions_lru)
        return True

    def expire(self, now: float) -> None:
        """TTL since last use; the LRU order puts every expired entry at the front."""
        deadline = now - self.limits.ttl_s
        while self._slots:
            slot = next(iter(self._slots.values()))
            if slot.last_used > deadline:
                return
            self.drop(slot.entry_id)
            self.counters.record(self.names.evictions_ttl)

    def clear(self) -> tuple[int, int]:
        """Drop everything; returns (entries, entry bytes) freed."""
        n, freed = len(self._slots), self._bytes
        for entry_id in list(self._slots):
            self.drop(entry_id)
        return n, freed

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, ns: CacheNamespace, session: str, tokens: tuple[int, ...]) -> Match | None:
        """Longest shared prefix (APC-clamped); a tie prefers the same session, then the most
        recently used. Below `max(min_prefix_tokens, 1)` it is a miss."""
        trie = self._tries.get(ns)
        if trie is None:
            return None
        found = trie.longest_match(tokens)
        if not found.entry_ids:
            return None
        slot = max((self._slots[i] for i in found.entry_ids), key=_rank(session))
        matched = found.length
        if self.hasher is not None:
            prompt_hashes = self.hasher.chain(tokens[:matched], ns.seed())
            matched = clamp_to_blocks(
                matched, slot.apc_hashes, prompt_hashes, self.hasher.block_size
            )
        if matched < max(self.limits.min_prefix_tokens, 1):
            return None
        return Match(slot.entry_id, slot.entry, matched, slot.entry.num_tokens)

    def shared_prefix(self, ns: CacheNamespace, tokens: tuple[int, ...]) -> int:
        """How many leading tokens of `tokens` some entry shares (whole or not)."""
        trie = self._tries.get(ns)
        return trie.longest_match(tokens).length if trie is not None else 0

    def find_exact(self, ns: CacheNamespace, tokens: tuple[int, ...]) -> int | None:
        """An entry whose tokens are exactly `tokens`, if any."""
        trie = self._tries.get(ns)
        if trie is None:
            return None
        found = trie.longest_whole_prefix(tokens, len(tokens))
        return found.entry_ids[0] if found.entry_ids and found.length == len(tokens) else None

    def lookup_whole(
        self, ns: CacheNamespace, session: str, tokens: tuple[int, ...]
    ) -> Match | None:
        """Longest entry that is a whole prefix of `tokens` and shorter than it."""
        trie = self._tries.get(ns)
        if trie is None:
            return None
        found = trie.longest_whole_prefix(tokens, len(tokens) - 1)
        if not found.entry_ids:
            return None
        slot = max((self._slots[i] for i in found.entry_ids), key=_rank(session))
        return Match(slot.entry_id, slot.entry, found.length, slot.entry.num_tokens)


def _rank(session: str) -> Callable[[Slot], tuple[bool, float, int]]:
    return lambda s: (s.session == session, s.last_used, s.entry_id)

"""The prompt cache's counters: a plain dataclass, bumped in place, drained as deltas.

The decode path only adds integers here; the publisher calls `take()` once per step and ships the
delta, so nothing on the hot path touches Redis, Prometheus, logging or the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from shared.cache_stats import COUNTER_FIELDS
from shared.reject import REJECT_REASONS, RejectReason

# Precomputed so `record_reject` does no string formatting.
_REJECT_FIELD: dict[RejectReason, str] = {r: r.stats_field for r in REJECT_REASONS}


@dataclass
class CacheCounters:
    hits: int = 0
    lookups: int = 0
    misses: int = 0
    prefix_tokens_reused: int = 0
    inserts: int = 0
    evictions_lru: int = 0
    evictions_ttl: int = 0
    rejections_oversized: int = 0
    snapshot_hits: int = 0
    snapshot_lookups: int = 0
    snapshot_misses: int = 0
    snapshot_tokens_reused: int = 0
    snapshot_inserts: int = 0
    snapshot_evictions_lru: int = 0
    snapshot_evictions_ttl: int = 0
    snapshot_rejections_oversized: int = 0
    checkpoint_lookups: int = 0
    checkpoint_hits: int = 0
    checkpoint_tokens_reused: int = 0
    checkpoint_inserts: int = 0
    reject_oversized: int = 0
    reject_disabled: int = 0
    reject_prefix_too_short: int = 0
    reject_mode_mismatch: int = 0
    reject_empty_set: int = 0
    reject_layout_constraints: int = 0
    reject_block_boundary_floor: int = 0
    # (reason, seq_id, context_len, at_unix_ms) of the most recent reject; never drained.
    _last: tuple[RejectReason, str | None, int, int] | None = None

    def record(self, name: str, n: int = 1) -> None:
        setattr(self, name, getattr(self, name) + n)

    def record_reject(
        self, reason: RejectReason, seq_id: str | None, context_len: int, now_ms: int
    ) -> None:
        """One reject: its counter and the last-reject record. Cheap by design (no logging)."""
        name = _REJECT_FIELD[reason]
        setattr(self, name, getattr(self, name) + 1)
        self._last = (reason, seq_id, context_len, now_ms)

    @property
    def last_reject(self) -> dict[str, Any] | None:
        if self._last is None:
            return None
        reason, seq_id, context_len, at_ms = self._last
        return {
            "reason": reason.value,
            "seq_id": seq_id,
            "context_len": context_len,
            "at_unix_ms": at_ms,
        }

    def snapshot(self) -> dict[str, int]:
        """Current values without draining (tests, debugging)."""
        return {name: getattr(self, name) for name in OWNED_FIELDS}

    def take(self) -> dict[str, int]:
        """The counts since the last `take()`, zeroing them (the publisher's delta)."""
        out = self.snapshot()
        for name in OWNED_FIELDS:
            setattr(self, name, 0)
        return out


OWNED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(CacheCounters) if not f.name.startswith("_")
)
assert set(OWNED_FIELDS) <= set(COUNTER_FIELDS), set(OWNED_FIELDS) - set(COUNTER_FIELDS)

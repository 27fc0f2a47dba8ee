"""The prompt-cache stats schema (spec: `GET /v1/cache/stats` fields) and the pool-wide merge.

A worker keeps two Redis hashes (see shared.keys): `cache:counters` (monotonic HINCRBY deltas and
the last reject as named fields; no TTL, so a dead or restarted worker still counts) and `info`
(identity, settings and the current gauges, with the liveness TTL, so a dead worker's cache no
longer counts). The router merges them; both sides use the field lists below.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

from shared.reject import REJECT_REASONS

# Monotonic counts. The spec's fields first, then ones Prometheus and the server need.
COUNTER_FIELDS: tuple[str, ...] = (
    "hits",
    "lookups",
    "inserts",
    "evictions_lru",
    "evictions_ttl",
    "rejections_oversized",
    "snapshot_hits",
    "snapshot_lookups",
    "snapshot_inserts",
    "snapshot_evictions_lru",
    "snapshot_evictions_ttl",
    "snapshot_rejections_oversized",
    *(r.stats_field for r in REJECT_REASONS),
    "misses",
    "prefix_tokens_reused",
    "snapshot_misses",
    "snapshot_tokens_reused",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "batch_prefill_tokens",
    "batch_decode_tokens",
    "batch_decode_steps",
)

# Current state and limits of a live worker's store (summed over live workers only).
GAUGE_FIELDS: tuple[str, ...] = (
    "entries",
    "bytes",
    "capacity_bytes",
    "max_entries",
    "total_blocks_stored",
    "unique_block_hashes",
    "apc_active_entries",
    "snapshot_entries",
    "snapshot_bytes",
    "snapshot_capacity_bytes",
    "snapshot_max_entries",
    "paged_blocks_allocated",
    "paged_blocks_live",
    "paged_blocks_free",
    "paged_bytes_reserved",
    "paged_bytes_in_use",
    "paged_block_budget",
    "batch_current_size",
)

# Per-worker settings reported beside the gauges (not summed).
SETTING_FIELDS: tuple[str, ...] = (
    "enabled",
    "apc_enabled",
    "block_size",
    "hash",
    "paged_block_size",
    "storage_mode",
    "cacheability",
)

LAST_REJECT_FIELDS: tuple[str, ...] = ("reason", "seq_id", "context_len", "at_unix_ms")
# Where the last reject lives: named fields of the counters hash (it never expires either).
LAST_REJECT_HASH_FIELDS: tuple[str, ...] = tuple(f"last_reject_{f}" for f in LAST_REJECT_FIELDS)

# The worker's identity in its info hash, beside its gauges and settings.
INFO_FIELDS: tuple[str, ...] = (
    "worker_id", "model", "pid", "host", "started_at", "rq_name", "batch_size",
    "storage_modes", "last_seen",
)  # fmt: skip

# The spec's field order for `/v1/cache/stats`.
SPEC_FIELDS: tuple[str, ...] = (
    "enabled", "apc_enabled", "block_size", "hash",
    "entries", "bytes", "capacity_bytes", "max_entries", "hits", "lookups", "hit_rate",
    "inserts", "evictions_lru", "evictions_ttl", "rejections_oversized",
    "total_blocks_stored", "unique_block_hashes", "apc_active_entries",
    "snapshot_entries", "snapshot_bytes", "snapshot_capacity_bytes", "snapshot_max_entries",
    "snapshot_hits", "snapshot_lookups", "snapshot_hit_rate", "snapshot_inserts",
    "snapshot_evictions_lru", "snapshot_evictions_ttl", "snapshot_rejections_oversized",
    "paged_block_size", "paged_blocks_allocated", "paged_blocks_live", "paged_blocks_free",
    "paged_bytes_reserved", "paged_bytes_in_use", "paged_block_budget",
    *(r.stats_field for r in REJECT_REASONS),
    "last_reject_reason", "last_reject_seq_id", "last_reject_context_len", "last_reject_at_unix_ms",
)  # fmt: skip


def _rate(hits: int, lookups: int) -> float:
    return hits / lookups if lookups else 0.0


def _int(value: Any) -> int:
    if value is None or value == "":
        return 0
    return int(float(value))


def _str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode()
    return "" if value is None else str(value)


@dataclass
class WorkerCacheSnapshot:
    """What Redis holds for one worker, parsed."""

    worker_id: str
    alive: bool
    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, int] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    last_reject: dict[str, Any] | None = None
    info: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_values(
        cls,
        worker_id: str,
        counters: list[int],
        gauges: list[int],
        settings: list[Any],
        info: list[Any],
        last_reject: list[Any],
    ) -> WorkerCacheSnapshot:
        """From values read in the field lists' order (the router's Lua read); `info` holds
        INFO_FIELDS, all None when the info hash has expired (the worker is gone)."""
        snap = cls(
            worker_id=worker_id,
            alive=any(v is not None for v in info),
            counters=dict(zip(COUNTER_FIELDS, counters, strict=True)),
            gauges=dict(zip(GAUGE_FIELDS, gauges, strict=True)),
            settings={
                f: v.decode() if v else "" for f, v in zip(SETTING_FIELDS, settings, strict=True)
            },
            info={f: v.decode() for f, v in zip(INFO_FIELDS, info, strict=True) if v is not None},
        )
        lr = dict(zip(LAST_REJECT_FIELDS, last_reject, strict=True))
        if lr.get("reason"):
            snap.last_reject = {
                "reason": _str(lr["reason"]),
                "seq_id": _str(lr.get("seq_id")) or None,
                "context_len": _int(lr.get("context_len")),
                "at_unix_ms": _int(lr.get("at_unix_ms")),
            }
        return snap

    def stats(self) -> dict[str, Any]:
        """This worker's numbers in the spec's shape."""
        return _stats_shape(
            counters=self.counters,
            gauges=self.gauges if self.alive else dict.fromkeys(GAUGE_FIELDS, 0),
            settings=self.settings,
            last_reject=self.last_reject,
        )


# The spec's fields, then extras for operators (not part of the fixed interface).
_OUT_FIELDS: tuple[str, ...] = (
    *SPEC_FIELDS,
    "misses", "prefix_tokens_reused", "snapshot_misses", "snapshot_tokens_reused",
    "storage_mode", "cacheability",
)  # fmt: skip
_pick_out = operator.itemgetter(*_OUT_FIELDS)


def _stats_shape(
    counters: dict[str, int],
    gauges: dict[str, int],
    settings: dict[str, str],
    last_reject: dict[str, Any] | None,
) -> dict[str, Any]:
    lr = last_reject or {}
    out: dict[str, Any] = {
        "enabled": settings.get("enabled") == "1",
        "apc_enabled": settings.get("apc_enabled") == "1",
        "block_size": _int(settings.get("block_size")),
        "hash": settings.get("hash") or "sha256",
        "paged_block_size": _int(settings.get("paged_block_size")),
        "hit_rate": _rate(counters["hits"], counters["lookups"]),
        "snapshot_hit_rate": _rate(counters["snapshot_hits"], counters["snapshot_lookups"]),
        "last_reject_reason": lr.get("reason"),
        "last_reject_seq_id": lr.get("seq_id"),
        "last_reject_context_len": lr.get("context_len"),
        "last_reject_at_unix_ms": lr.get("at_unix_ms"),
    }
    out["storage_mode"] = settings.get("storage_mode") or ""
    out["cacheability"] = settings.get("cacheability") or ""
    merged = {**counters, **gauges, **out}
    # itemgetter + zip: built in C (this runs once per worker on every stats request).
    return dict(zip(_OUT_FIELDS, _pick_out(merged), strict=True))


def _column_sums(fields: tuple[str, ...], rows: list[dict[str, int]]) -> dict[str, int]:
    if not rows:
        return dict.fromkeys(fields, 0)
    columns = zip(*(r.values() for r in rows), strict=True)
    return dict(zip(fields, map(sum, columns), strict=True))


def merge_pool(workers: list[WorkerCacheSnapshot]) -> dict[str, Any]:
    """The pool's `/v1/cache/stats`: counters summed over every worker ever seen (dead ones too),
    gauges and limits summed over live workers, rates recomputed from the sums, the most recent
    last reject with its worker id, and a per-worker breakdown."""
    # Column sums over the dicts' values (each in its field list's order): C loops, not
    # 64 x 60 Python additions.
    counters = _column_sums(COUNTER_FIELDS, [w.counters for w in workers])
    gauges = _column_sums(GAUGE_FIELDS, [w.gauges for w in workers if w.alive])
    live = [w for w in workers if w.alive]
    enabled = [w for w in live if w.settings.get("enabled") == "1"]
    settings = dict((enabled or live)[0].settings) if live else {}
    last: dict[str, Any] | None = None
    for w in workers:
        if w.last_reject and (last is None or w.last_reject["at_unix_ms"] > last["at_unix_ms"]):
            last = {**w.last_reject, "worker_id": w.worker_id}
    pool = _stats_shape(counters, gauges, settings, last)
    pool["last_reject_worker_id"] = last["worker_id"] if last else None
    pool["workers_alive"] = sum(1 for w in workers if w.alive)
    pool["workers"] = {
        w.worker_id: {"alive": w.alive, **w.stats()}
        for w in sorted(workers, key=lambda w: w.worker_id)
    }
    return pool

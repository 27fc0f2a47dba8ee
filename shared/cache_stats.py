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
    "checkpoint_lookups",
    "checkpoint_hits",
    "checkpoint_tokens_reused",
    "checkpoint_inserts",
    "requests",
    "prompt_tokens",
    # Of those, the tokens whose KV came from the prompt cache (blocks, snapshots, checkpoints),
    # counted with them: once per prompt however many choices share it.
    "prompt_tokens_cached",
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
    "checkpoint_entries",
    "checkpoint_bytes",
    "batch_current_size",
    # The KV a worker holds against its budget (kv_usage): its running batch's caches, and the
    # byte budget of the store its mode fills (0: no prompt cache).
    "batch_kv_bytes",
    "kv_budget_bytes",
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
    "checkpoint_tokens",
)

LAST_REJECT_FIELDS: tuple[str, ...] = ("reason", "seq_id", "context_len", "at_unix_ms")
# Where the last reject lives: named fields of the counters hash (it never expires either).
LAST_REJECT_HASH_FIELDS: tuple[str, ...] = tuple(f"last_reject_{f}" for f in LAST_REJECT_FIELDS)

# The worker's identity in its info hash, beside its gauges and settings.
INFO_FIELDS: tuple[str, ...] = (
    "worker_id", "model", "pid", "host", "started_at", "rq_name", "batch_size",
    "storage_modes", "last_seen", "epoch", "model_dir", "batch_invariant", "batch_limit",
    "gemv_rows", "stuck_after_s", "loop_age_s",
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


# Every number a worker reports, in one list: its counters, then its gauges.
NUMBER_FIELDS: tuple[str, ...] = COUNTER_FIELDS + GAUGE_FIELDS
_N_COUNTERS = len(COUNTER_FIELDS)
_DEAD_GAUGES: tuple[int, ...] = (0,) * len(GAUGE_FIELDS)
_HELD_KV = tuple(NUMBER_FIELDS.index(f) for f in ("bytes", "snapshot_bytes", "batch_kv_bytes"))
_KV_BUDGET = NUMBER_FIELDS.index("kv_budget_bytes")


def kv_usage(held: int, budget: int) -> float:
    """The fraction of a KV budget in use, 0..1 (vLLM's kv_cache_usage_perc; 1 = full): a
    running batch that alone outgrows the budget reads 1, and no budget (no prompt cache) 0."""
    return min(1.0, held / budget) if budget > 0 else 0.0


@dataclass(slots=True)
class WorkerCacheSnapshot:
    """What Redis holds for one worker, parsed. `numbers` is NUMBER_FIELDS' values in order: one
    flat list, because the stats route shapes 64 of these per request."""

    worker_id: str
    alive: bool
    numbers: list[int]
    settings: dict[str, str] = field(default_factory=dict)
    last_reject: dict[str, Any] | None = None
    info: dict[str, str] = field(default_factory=dict)
    # Times a supervisor started this worker again after it exited (shared.keys
    # supervisor_restarts; a counter, kept for dead workers too).
    restarts: int = 0

    @classmethod
    def from_values(
        cls,
        worker_id: str,
        alive: bool,
        numbers: list[int],
        settings: list[str],
        info: list[str],
        last_reject: list[str],
        restarts: int = 0,
    ) -> WorkerCacheSnapshot:
        """From values read in the field lists' order (the router's Lua read): `numbers` in
        NUMBER_FIELDS' order, the strings with "" where a field is missing; `alive` while the
        worker's info hash (liveness TTL) exists."""
        if len(numbers) != len(NUMBER_FIELDS):
            raise ValueError(f"{len(numbers)} numbers for {len(NUMBER_FIELDS)} fields")
        snap = cls(
            worker_id=worker_id,
            alive=alive,
            numbers=numbers,
            settings=dict(zip(SETTING_FIELDS, settings, strict=True)),
            info={f: v for f, v in zip(INFO_FIELDS, info, strict=True) if v},
            restarts=restarts,
        )
        reason, seq_id, context_len, at_unix_ms = last_reject
        if reason:
            snap.last_reject = {
                "reason": reason,
                "seq_id": seq_id or None,
                "context_len": _int(context_len),
                "at_unix_ms": _int(at_unix_ms),
            }
        return snap

    @property
    def kv_held_and_budget(self) -> tuple[int, int]:
        """The KV bytes this worker holds and its budget, the terms of its kv_usage: what its
        prompt cache holds (the main store, paged blocks counted once, or its snapshots and
        checkpoints) plus its running batch's caches, over the byte budget of the store its mode
        fills. (0, 0) for a dead worker: its memory is gone."""
        if not self.alive:
            return 0, 0
        nums = self.numbers
        return sum(nums[i] for i in _HELD_KV), nums[_KV_BUDGET]

    def stats(self) -> dict[str, Any]:
        """This worker's numbers in the spec's shape (a dead worker's gauges count as zero)."""
        numbers = self.numbers if self.alive else [*self.numbers[:_N_COUNTERS], *_DEAD_GAUGES]
        return _stats_shape(numbers, self.settings, self.last_reject)


# The spec's fields, then extras for operators (not part of the fixed interface).
_OUT_FIELDS: tuple[str, ...] = (
    *SPEC_FIELDS,
    "misses", "prefix_tokens_reused", "snapshot_misses", "snapshot_tokens_reused",
    "checkpoint_lookups", "checkpoint_hits", "checkpoint_hit_rate", "checkpoint_tokens_reused",
    "checkpoint_inserts", "checkpoint_entries", "checkpoint_bytes", "checkpoint_tokens",
    "storage_mode", "cacheability",
)  # fmt: skip
# Fields computed from the settings, the counters and the last reject, in _derived's order.
_DERIVED_FIELDS: tuple[str, ...] = (
    "enabled", "apc_enabled", "block_size", "hash", "paged_block_size", "storage_mode",
    "cacheability", "checkpoint_tokens", "hit_rate", "snapshot_hit_rate", "checkpoint_hit_rate",
    "last_reject_reason", "last_reject_seq_id", "last_reject_context_len",
    "last_reject_at_unix_ms",
)  # fmt: skip
_SOURCE_FIELDS = NUMBER_FIELDS + _DERIVED_FIELDS
# One C call puts (numbers + derived) into the output order; dict(zip()) names them.
_pick_out = operator.itemgetter(*(_SOURCE_FIELDS.index(f) for f in _OUT_FIELDS))
_HITS, _LOOKUPS = COUNTER_FIELDS.index("hits"), COUNTER_FIELDS.index("lookups")
_S_HITS = COUNTER_FIELDS.index("snapshot_hits")
_S_LOOKUPS = COUNTER_FIELDS.index("snapshot_lookups")
_C_HITS = COUNTER_FIELDS.index("checkpoint_hits")
_C_LOOKUPS = COUNTER_FIELDS.index("checkpoint_lookups")
_NO_REJECT: dict[str, Any] = {}


def _stats_shape(
    numbers: list[int], settings: dict[str, str], last_reject: dict[str, Any] | None
) -> dict[str, Any]:
    lr = last_reject or _NO_REJECT
    get = settings.get
    derived = (
        get("enabled") == "1",
        get("apc_enabled") == "1",
        _int(get("block_size")),
        get("hash") or "sha256",
        _int(get("paged_block_size")),
        get("storage_mode") or "",
        get("cacheability") or "",
        _int(get("checkpoint_tokens")),
        _rate(numbers[_HITS], numbers[_LOOKUPS]),
        _rate(numbers[_S_HITS], numbers[_S_LOOKUPS]),
        _rate(numbers[_C_HITS], numbers[_C_LOOKUPS]),
        lr.get("reason"),
        lr.get("seq_id"),
        lr.get("context_len"),
        lr.get("at_unix_ms"),
    )
    return dict(zip(_OUT_FIELDS, _pick_out((*numbers, *derived)), strict=True))


def _column_sums(rows: list[list[int]], width: int) -> list[int]:
    # zip(*rows) + sum: C loops, not 64 x 60 Python additions.
    return list(map(sum, zip(*rows, strict=True))) if rows else [0] * width


def _identity(info: dict[str, str]) -> dict[str, Any]:
    """Who the worker is and when it last beat (operators' extras beside the spec's fields)."""
    return {
        "model": info.get("model"),
        "host": info.get("host"),
        "pid": int(float(info["pid"])) if _is_number(info.get("pid")) else None,
        "last_seen": float(info["last_seen"]) if _is_number(info.get("last_seen")) else None,
        # The load-time batch-invariance check's verdict and the batch size served at.
        "batch_invariant": info.get("batch_invariant"),
        "batch_limit": int(info["batch_limit"]) if _is_number(info.get("batch_limit")) else None,
        # The rows a float32 product may have to go to OpenBLAS's gemv (worker/mlx_cpu).
        "gemv_rows": int(info["gemv_rows"]) if _is_number(info.get("gemv_rows")) else None,
    }


def _is_number(text: str | None) -> bool:
    try:
        return text is not None and float(text) == float(text)
    except ValueError:
        return False


def merge_pool(workers: list[WorkerCacheSnapshot]) -> dict[str, Any]:
    """The pool's `/v1/cache/stats`: counters summed over every worker ever seen (dead ones too),
    gauges and limits summed over live workers, rates recomputed from the sums, the most recent
    last reject with its worker id, and a per-worker breakdown."""
    live = [w for w in workers if w.alive]
    counters = _column_sums([w.numbers[:_N_COUNTERS] for w in workers], _N_COUNTERS)
    gauges = _column_sums([w.numbers[_N_COUNTERS:] for w in live], len(GAUGE_FIELDS))
    enabled = [w for w in live if w.settings.get("enabled") == "1"]
    settings = (enabled or live)[0].settings if live else {}
    last: dict[str, Any] | None = None
    for w in workers:
        if w.last_reject and (last is None or w.last_reject["at_unix_ms"] > last["at_unix_ms"]):
            last = {**w.last_reject, "worker_id": w.worker_id}
    pool = _stats_shape([*counters, *gauges], settings, last)
    pool["last_reject_worker_id"] = last["worker_id"] if last else None
    pool["workers_alive"] = len(live)
    pool["workers"] = {
        w.worker_id: {"alive": w.alive, **w.stats(), **_identity(w.info)}
        for w in sorted(workers, key=lambda w: w.worker_id)
    }
    return pool

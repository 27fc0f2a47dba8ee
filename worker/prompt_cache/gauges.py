"""The store's current state, limits and settings, named as shared.cache_stats names them."""

from __future__ import annotations

from worker.prompt_cache.entries import SNAPSHOT
from worker.prompt_cache.store import PromptStore


def gauges_of(store: PromptStore, *, storage_mode: str, cacheability: str) -> dict[str, int | str]:
    cfg = store.config
    total, unique, active = store.main.apc_stats()
    checkpoints, checkpoint_bytes = store.snapshots.checkpoint_stats
    out: dict[str, int | str] = {
        "entries": len(store.main),
        "bytes": store.bytes,
        "capacity_bytes": cfg.capacity_bytes,
        "max_entries": cfg.max_entries,
        "total_blocks_stored": total,
        "unique_block_hashes": unique,
        "apc_active_entries": active,
        "snapshot_entries": len(store.snapshots),
        "snapshot_bytes": store.snapshots.entry_bytes,
        "snapshot_capacity_bytes": cfg.snapshot_capacity_bytes,
        "snapshot_max_entries": cfg.snapshot_max_entries,
        "checkpoint_entries": checkpoints,
        "checkpoint_bytes": checkpoint_bytes,
        "kv_budget_bytes": kv_budget_bytes(store),
        **_paged(store),
        # settings
        "enabled": "1" if store.enabled else "0",
        "apc_enabled": "1" if cfg.apc_enabled else "0",
        "block_size": cfg.apc_block_size,
        "hash": cfg.apc_hash,
        "paged_block_size": store.pool.block_size if store.pool else 0,
        "storage_mode": storage_mode,
        "cacheability": cacheability,
        "checkpoint_tokens": cfg.checkpoint_tokens if storage_mode == "snapshot" else 0,
    }
    return out


def kv_budget_bytes(store: PromptStore) -> int:
    """The byte budget of the store this worker's mode fills, the denominator of its KV usage:
    the main store's capacity (paged: the tighter of it and the block budget), the snapshot
    shelf's in snapshot mode, 0 with the cache off."""
    if not store.enabled:
        return 0
    cfg = store.config
    if store.mode == SNAPSHOT:
        return cfg.snapshot_capacity_bytes
    pool = store.pool
    if pool is not None and pool.block_nbytes:  # the block budget is known once a block is
        return min(cfg.capacity_bytes, pool.budget * pool.block_nbytes)
    return cfg.capacity_bytes


def _paged(store: PromptStore) -> dict[str, int]:
    if store.pool is None:
        return {
            "paged_blocks_allocated": 0,
            "paged_blocks_live": 0,
            "paged_blocks_free": 0,
            "paged_bytes_reserved": 0,
            "paged_bytes_in_use": 0,
            "paged_block_budget": 0,
        }
    c = store.pool.counts()
    return {
        "paged_blocks_allocated": c.allocated,
        "paged_blocks_live": c.live,
        "paged_blocks_free": c.free,
        "paged_bytes_reserved": c.bytes_reserved,
        "paged_bytes_in_use": c.bytes_in_use,
        "paged_block_budget": c.budget,
    }

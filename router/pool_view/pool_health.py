"""`GET /health`: which workers are alive (their info hash exists), what they report, and how
many jobs wait. One Lua round trip for the workers, one pipeline for the queue lengths."""

from __future__ import annotations

from typing import Any

from router.pool_view.cache_stats import read_pool
from router.state import RouterState
from shared import keys
from shared.cache_stats import WorkerCacheSnapshot


async def pool_health(state: RouterState) -> tuple[bool, dict[str, Any]]:
    """(healthy, body): healthy means at least one worker is alive."""
    live = [w for w in await read_pool(state.pool_script) if w.alive]
    depths = await queue_depths(state, live)
    body = {
        "status": "ok" if live else "unavailable",
        "model": state.model_id,
        "workers_alive": len(live),
        "queue_depth": depths[0],
        # Live models this router refuses (their files are not on its host), with the reason.
        "router_errors": state.catalog.refusals(),
        "workers": [
            {"worker_id": w.worker_id, "queue_depth": depth, **w.info, **_cache_mode(w.settings)}
            for w, depth in zip(live, depths[1:], strict=True)
        ],
    }
    return bool(live), body


async def queue_depths(state: RouterState, live: list[WorkerCacheSnapshot]) -> list[int]:
    """Jobs waiting: in the router's model's shared queue, then in each live worker's own."""
    worker_queue_keys = [keys.rq_queue_key(keys.worker_queue_name(w.worker_id)) for w in live]
    async with state.aredis.pipeline(transaction=False) as pipe:
        for key in (state.queue_key, *worker_queue_keys):
            pipe.llen(key)
        return [int(n) for n in await pipe.execute()]


def _cache_mode(settings: dict[str, str]) -> dict[str, str]:
    """The load-time cacheability check's verdict and the storage mode it chose."""
    return {k: settings[k] for k in ("cacheability", "storage_mode") if settings.get(k)}

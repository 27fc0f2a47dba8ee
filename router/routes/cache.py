"""GET /v1/cache/stats (the pool-wide merge) and POST /v1/cache/reset (every live worker)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Response

from router.placement.routing_stats import routing_stats
from router.pool_view.cache_control import reset_pool_cache
from router.pool_view.cache_stats import pool_cache_stats, read_pool
from router.routes.probe import get_and_head
from router.state import StateDep

router = APIRouter()


@get_and_head(router, "/v1/cache/stats")
async def cache_stats(state: StateDep) -> Response:
    # orjson directly: FastAPI's jsonable_encoder walks every value of the per-worker breakdown.
    stats = await pool_cache_stats(state.pool_script)
    stats["routing"] = await routing_stats(state.aredis, state.settings.routing.policy)
    body = orjson.dumps(stats)
    return Response(body, media_type="application/json")


@router.post("/v1/cache/reset")
async def cache_reset(state: StateDep) -> dict[str, Any]:
    return await reset_pool_cache(state.aredis, await read_pool(state.pool_script))

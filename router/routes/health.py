"""GET /health: 200 while at least one worker is alive, else 503 (requests still queue)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from router.pool_view.pool_health import pool_health
from router.routes.probe import get_and_head
from router.state import StateDep

router = APIRouter()


@get_and_head(router, "/health")
async def health(state: StateDep) -> JSONResponse:
    healthy, body = await pool_health(state)
    return JSONResponse(body, status_code=200 if healthy else 503)

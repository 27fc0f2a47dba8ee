"""GET /metrics: every process's series (prometheus_client multiprocess mode)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from router.state import StateDep
from shared.metrics import QUEUE_DEPTH, scrape

router = APIRouter()


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    # The queue depth is a fact of Redis, not of any process: sample it at scrape time.
    QUEUE_DEPTH.set(await state.aredis.llen(state.queue_key))
    # Reading the per-process files is file I/O: off the event loop.
    body = await anyio.to_thread.run_sync(scrape, state.settings.multiproc_dir)
    return Response(body, media_type=CONTENT_TYPE_LATEST)

"""GET /metrics: the router processes' own series (prometheus_client multiprocess mode) and the
pool's worker series, read from Redis at scrape time (router/pool_view/pool_metrics.py): one scrape
covers the workers of every host."""

from __future__ import annotations

from pathlib import Path

import anyio
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily

from router.metrics import scrape
from router.placement.routing_metrics import init_worker_series
from router.pool_view.cache_stats import read_pool
from router.pool_view.pool_health import queue_depths
from router.pool_view.pool_metrics import PoolCollector, pool_families
from router.routes.probe import get_and_head
from router.state import StateDep
from shared.cache_stats import WorkerCacheSnapshot

router = APIRouter()

QUEUE_DEPTH = "mlxcel_queue_depth"


def _scrape(
    path: Path, workers: list[WorkerCacheSnapshot], pool: PoolCollector, legacy_units: bool
) -> bytes:
    # Every worker in the roster has its per-worker series in this scrape, at 0 until routed to.
    init_worker_series(w.worker_id for w in workers)
    return scrape(path, pool, legacy_units=legacy_units)


@get_and_head(router, "/metrics")
async def metrics(state: StateDep) -> Response:
    workers = await read_pool(state.pool_script)
    families = pool_families(workers)
    depths = await queue_depths(state, [w for w in workers if w.alive])
    families.append(
        GaugeMetricFamily(QUEUE_DEPTH, "Jobs waiting in the pool's rq queues.", value=sum(depths))
    )
    # Creating series and reading the per-process files is file I/O: off the event loop.
    body = await anyio.to_thread.run_sync(
        _scrape,
        state.settings.multiproc_dir,
        workers,
        PoolCollector(families),
        state.settings.metrics.legacy_units,
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)

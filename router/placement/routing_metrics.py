"""The router's Prometheus view of its routing decisions (the pool-wide totals, over every
router, are in Redis: `mlxcel:routing:stats`, served as the `routing` section of
/v1/cache/stats)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from router.metrics import (
    ROUTING_DECISIONS,
    ROUTING_PREDICTED_TOKENS,
    ROUTING_PREDICTED_TOTAL,
    ROUTING_REUSED_TOTAL,
)


class Placed(Protocol):
    """What a placement's metrics read (`router.placement.ledger.Placement` has it): typed
    here, so this module does not import the ledger that imports it."""

    @property
    def outcome(self) -> str: ...

    @property
    def worker_id(self) -> str: ...

    @property
    def predicted_tokens(self) -> int: ...


def observe_placement(placed: Placed) -> None:
    ROUTING_DECISIONS.labels(placed.outcome).inc()
    if placed.worker_id:
        ROUTING_PREDICTED_TOKENS.observe(placed.predicted_tokens)
        ROUTING_PREDICTED_TOTAL.labels(placed.worker_id).inc(placed.predicted_tokens)


def observe_start(worker_id: str, cached_tokens: int) -> None:
    if worker_id:
        ROUTING_REUSED_TOTAL.labels(worker_id).inc(cached_tokens)


def init_worker_series(worker_ids: Iterable[str]) -> None:
    """Create each worker's routing series at 0: a registered worker's series exist before any
    request is routed to it (prometheus_client writes a new child's file entry at 0)."""
    for wid in worker_ids:
        ROUTING_PREDICTED_TOTAL.labels(wid).inc(0)
        ROUTING_REUSED_TOTAL.labels(wid).inc(0)

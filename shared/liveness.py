"""When the pool counts a worker as alive: one rule for /health, /v1/cache/stats and dispatch.

A worker refreshes its info hash's TTL (keys.LIVENESS_TTL_S) with every heartbeat
(keys.HEARTBEAT_INTERVAL_S), so the TTL left says how old its last heartbeat is, measured on
Redis's own clock: no clock skew between hosts enters. A worker whose heartbeat is older than
DEAD_AFTER_S is dead to the router, long before its hash expires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys

# Several missed heartbeats: a long engine step or a Redis hiccup does not look like a death.
DEAD_AFTER_S = 5.0
# A request's worker must look dead this many times, HEARTBEAT_INTERVAL_S or more apart, before
# the router acts on it: after a Redis stall every heartbeat is late until workers write again.
DEAD_CONFIRMATIONS = 2


def min_alive_pttl_ms() -> int:
    """The smallest PTTL of an info hash whose worker still counts as alive."""
    return int((keys.LIVENESS_TTL_S - DEAD_AFTER_S) * 1000)


def heartbeat_age_s(pttl_ms: int) -> float | None:
    """Seconds since the worker's last heartbeat, from its info hash's PTTL (None: no hash)."""
    if pttl_ms < 0:  # -2: no such key; -1: no TTL (never written so by a worker)
        return None
    return max(0.0, keys.LIVENESS_TTL_S - pttl_ms / 1000)


def is_alive(pttl_ms: int) -> bool:
    return pttl_ms > min_alive_pttl_ms()


# Starts the failure text of a job whose worker died mid-run, as the reaper records it in rq: the
# router reads it as "worker lost" (the request may run again), not as the request's own failure.
WORKER_LOST_MARK = "worker lost:"


@dataclass(frozen=True)
class WorkerRecord:
    """One roster member as Redis shows it now: its liveness, the info-hash fields asked for
    (absent when the hash or the field is gone) and the replies of any commands added per worker."""

    worker_id: str
    pttl_ms: int
    info: dict[str, str]
    extra: list[Any]

    @property
    def alive(self) -> bool:
        return is_alive(self.pttl_ms)


def read_roster(
    r: redis.Redis,
    fields: Sequence[str] = (),
    per_worker: Callable[[Any, str], None] | None = None,
    skip: str = "",
) -> list[WorkerRecord]:
    """Every worker in the roster but `skip`, by id, in one pipeline: PTTL of its info hash, the
    `fields` of it, and whatever `per_worker(pipe, wid)` adds."""
    wids = sorted(w for w in (m.decode() for m in r.smembers(keys.workers_roster())) if w != skip)
    if not wids:
        return []
    with r.pipeline(transaction=False) as pipe:
        for wid in wids:
            pipe.pttl(keys.worker_info(wid))
            if fields:
                pipe.hmget(keys.worker_info(wid), list(fields))
            if per_worker is not None:
                per_worker(pipe, wid)
        replies = pipe.execute()
    width = len(replies) // len(wids)
    out = []
    for i, wid in enumerate(wids):
        row = replies[i * width : (i + 1) * width]
        values = row[1] if fields else []
        info = {f: v.decode() for f, v in zip(fields, values, strict=True) if v is not None}
        out.append(WorkerRecord(wid, int(row[0]), info, row[2:] if fields else row[1:]))
    return out

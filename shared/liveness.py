"""When the pool counts a worker as alive: one rule for /health, /v1/cache/stats and dispatch.

A worker refreshes its info hash's TTL (keys.LIVENESS_TTL_S) with every heartbeat
(keys.HEARTBEAT_INTERVAL_S), so the TTL left says how old its last heartbeat is, measured on
Redis's own clock: no clock skew between hosts enters. A worker whose heartbeat is older than
DEAD_AFTER_S is dead to the router, long before its hash expires.
"""

from __future__ import annotations

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

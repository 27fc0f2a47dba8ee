"""The `routing` section of GET /v1/cache/stats: every router's decisions, pool-wide, from the
counters the placement script and the routers keep in `mlxcel:routing:stats` (shared.keys).

Per worker, `predicted_tokens` (what the router expected the worker to hold, summed over the
requests placed there) beside `reused_tokens` (what the worker reported reusing, over the
requests it started): a stale index or a hashing mismatch shows as predictions the worker never
meets.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from router.metrics import ROUTING_OUTCOMES
from shared import keys

WORKER_FIELDS = ("routed", "predicted_tokens", "started", "reused_tokens", "taken_over")


async def routing_stats(aredis: aioredis.Redis, policy: str) -> dict[str, Any]:
    raw = await aredis.hgetall(keys.routing_stats())
    decisions = dict.fromkeys(ROUTING_OUTCOMES, 0)
    workers: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        name, _, wid = k.decode().partition(":")
        try:
            n = int(v)
        except ValueError:
            continue  # a hand-edited field counts as nothing
        if name == "decisions":
            decisions[wid] = decisions.get(wid, 0) + n
        elif name in WORKER_FIELDS and wid:
            workers.setdefault(wid, dict.fromkeys(WORKER_FIELDS, 0))[name] = n
    predicted = sum(w["predicted_tokens"] for w in workers.values())
    reused = sum(w["reused_tokens"] for w in workers.values())
    return {
        "policy": policy,
        "decisions": decisions,
        "predicted_tokens": predicted,
        "reused_tokens": reused,
        "workers": dict(sorted(workers.items())),
    }

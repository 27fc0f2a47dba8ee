"""`POST /v1/cache/reset` across the pool: one ControlCommand to each live worker's control list,
then the replies collected from one reply list within a total deadline."""

from __future__ import annotations

import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from shared import keys
from shared.cache_stats import WorkerCacheSnapshot
from shared.wire import ControlCommand, ControlReply, WireError

RESET_TIMEOUT_S = 5.0


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


async def _send(client: aioredis.Redis, worker_ids: list[str], reply_id: str) -> None:
    command = ControlCommand(kind="cache_reset", reply_id=reply_id).to_wire()
    async with client.pipeline(transaction=False) as pipe:
        for wid in worker_ids:
            pipe.rpush(keys.worker_control(wid), command)
            pipe.expire(keys.worker_control(wid), keys.CONTROL_TTL_S)
        await pipe.execute()


async def _collect(
    client: aioredis.Redis, expected: int, reply_id: str, timeout_s: float
) -> list[ControlReply]:
    replies: list[ControlReply] = []
    deadline = time.monotonic() + timeout_s
    reply_key = keys.control_reply(reply_id)
    while len(replies) < expected:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        popped = await client.blpop([reply_key], timeout=max(left, 0.01))
        if popped is None:
            break
        try:
            replies.append(ControlReply.from_wire(popped[1]))
        except (WireError, ValueError):
            continue  # a malformed reply counts as no reply
    await client.delete(reply_key)
    return replies


async def reset_pool_cache(
    client: aioredis.Redis, workers: list[WorkerCacheSnapshot], timeout_s: float = RESET_TIMEOUT_S
) -> dict[str, Any]:
    """Summed `{cleared, freed_bytes, freed_entries}` plus each worker's answer. `cleared` means
    every live worker replied and cleared; with no live worker the answer is all zeros."""
    live = [w.worker_id for w in workers if w.alive]
    per_worker: dict[str, Any] = {wid: {"replied": False} for wid in live}
    if live:
        reply_id = uuid.uuid4().hex
        await _send(client, live, reply_id)
        for reply in await _collect(client, len(live), reply_id, timeout_s):
            result = reply.result or {}
            per_worker[reply.worker_id] = {
                "replied": True,
                "cleared": bool(result.get("cleared")) and not reply.error,
                "freed_bytes": _int(result.get("freed_bytes")),
                "freed_entries": _int(result.get("freed_entries")),
                "error": reply.error or None,
            }
    answers = list(per_worker.values())
    return {
        "cleared": bool(answers) and all(a.get("cleared") for a in answers),
        "freed_bytes": sum(a.get("freed_bytes", 0) for a in answers),
        "freed_entries": sum(a.get("freed_entries", 0) for a in answers),
        "workers": per_worker,
    }

"""When the pool counts a worker as alive, and who decides that it is lost.

A worker's heartbeat thread (worker.broker.presence.Heartbeat, its own thread and connection,
independent of the loop) refreshes its info hash's TTL (keys.LIVENESS_TTL_S) every
keys.HEARTBEAT_INTERVAL_S, so the TTL left says how old its last heartbeat is, measured on
Redis's own clock: no clock skew between hosts enters. A worker whose heartbeat is older than
DEAD_AFTER_S is not alive (/health, placement, /v1/cache/stats), long before its hash expires.

A long pass holds a worker's loop, never its heartbeat. The loop's own progress is a separate
age (`loop_age_s` in the info hash, as the heartbeat thread measures it): past STUCK_AFTER_S
(`worker.stuck_after_s`) the heartbeat thread stops beating, so a loop stuck that long, or a
process stopped or gone, is what "no heartbeat" means.

Death is decided once: by the reaper of a live peer (worker.broker.reaper), after heartbeats
older than DEAD_AFTER_S on DEAD_CONFIRMATIONS passes a second apart; its verdict is the
`keys.worker_reaped` key (and the worker-lost failure of the jobs it ran). The router reads that
verdict (`lost_verdict`) and never judges a heartbeat age itself; with no live peer left to
judge, the info hash expiring (LIVENESS_TTL_S without a heartbeat) is the verdict.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys

# Several missed heartbeats from a thread that beats whatever the loop does: a Redis hiccup does
# not look like a death.
DEAD_AFTER_S = 5.0
# The reaper counts a peer dead only when it looked dead on this many passes, HEARTBEAT_INTERVAL_S
# or more apart: after a Redis stall every heartbeat is late until workers write again.
DEAD_CONFIRMATIONS = 2
# The default of worker.stuck_after_s: a loop that has not progressed for this long is stuck,
# its heartbeat stops and its jobs are lost DEAD_AFTER_S later.
STUCK_AFTER_S = 60.0


def min_alive_pttl_ms() -> int:
    """The smallest PTTL of an info hash whose worker still counts as alive."""
    return int((keys.LIVENESS_TTL_S - DEAD_AFTER_S) * 1000)


def alive_ttl_ms() -> int:
    """The TTL of a worker's alive key (keys.worker_alive), written with its info hash's: it
    lapses exactly when the hash's PTTL falls to min_alive_pttl_ms."""
    return keys.LIVENESS_TTL_S * 1000 - min_alive_pttl_ms()


def heartbeat_age_s(pttl_ms: int) -> float | None:
    """Seconds since the worker's last heartbeat, from its info hash's PTTL (None: no hash)."""
    if pttl_ms < 0:  # -2: no such key; -1: no TTL (never written so by a worker)
        return None
    return max(0.0, keys.LIVENESS_TTL_S - pttl_ms / 1000)


def is_alive(pttl_ms: int) -> bool:
    return pttl_ms > min_alive_pttl_ms()


def lost_verdict(r: redis.Redis, worker_id: str) -> str | None:
    """Why the pool has found `worker_id` lost, or None while it has not: the verdict a live
    peer's reaper wrote (its reason), else the liveness hash gone (no peer left to judge)."""
    with r.pipeline(transaction=False) as pipe:
        pipe.get(keys.worker_reaped(worker_id))
        pipe.exists(keys.worker_info(worker_id))
        reaped, exists = pipe.execute()
    if reaped is not None:
        return reaped.decode(errors="replace").partition(" ")[2] or "reaped by a live peer"
    if not exists:
        return "its liveness key is gone"
    return None


def reaped_value(reaper_id: str, reason: str) -> str:
    """What the reaper writes as its verdict: its own id, then why (what `lost_verdict` reads)."""
    return f"{reaper_id} {reason}"


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


# The roster in one command (read_roster's two round trips, and its SMEMBERS's wake of Redis,
# made one): per member its id, its info hash's PTTL and HMGET of the fields (ARGV[2..]), flat.
# Keys only as the roster key and the shared.keys info template (ARGV[1]), as cache_stats's
# script names them.
ROSTER_LUA = """
local at = string.find(ARGV[1], '{wid}', 1, true)
local head, tail = string.sub(ARGV[1], 1, at - 1), string.sub(ARGV[1], at + 5)
local out = {}
for _, wid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = head .. wid .. tail
  out[#out + 1] = wid
  out[#out + 1] = redis.call('PTTL', key)
  out[#out + 1] = redis.call('HMGET', key, unpack(ARGV, 2))
end
return out
"""


def roster_script_args(fields: Sequence[str]) -> tuple[list[str], list[str]]:
    """ROSTER_LUA's keys and args for these info-hash fields (at least one)."""
    if not fields:
        raise ValueError("ROSTER_LUA reads at least one info-hash field")
    return [keys.workers_roster()], [keys.WORKER_KEY_TEMPLATES["info"], *fields]


def roster_from_reply(reply: Sequence[Any], fields: Sequence[str]) -> list[WorkerRecord]:
    """ROSTER_LUA's raw reply as read_roster's records, by worker id."""
    out = []
    for i in range(0, len(reply), 3):
        values = reply[i + 2]
        info = {f: v.decode() for f, v in zip(fields, values, strict=True) if v is not None}
        out.append(WorkerRecord(reply[i].decode(), int(reply[i + 1]), info, []))
    out.sort(key=lambda w: w.worker_id)
    return out


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (one another user owns counts as running)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

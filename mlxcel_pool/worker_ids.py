"""Which ids a host's workers take, and whether another live worker already holds one.

A worker id names its queue, statistics and routing index pool-wide, so two hosts must never
pick the same. `mlxcel-pool up` with its own embedded Redis is the whole pool and numbers its
workers w1..wN; one that joins a Redis other hosts share prefixes them with this host's name
(`<host>-w1`), or with `--worker-prefix`. `holders` reads the same liveness hash a worker's own
claim reads (worker.broker.presence), with the same rule: a live hash is held unless it names a
process of this host that is gone (a crash's leftover, which a worker takes over). It reads
only, so checking an id another host's worker holds never disturbs that worker.
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass

import redis

from shared import keys
from shared.config import ConfigError
from shared.liveness import pid_alive

EMBEDDED_PREFIX = "w"  # `up` with its own Redis: w1..wN
_PREFIX_CHARS = re.compile(r"[A-Za-z0-9_-]+")


def host_prefix(hostname: str | None = None) -> str:
    """`<host>-w`: this host's short name (its first label, lower case, only letters, digits,
    '-' and '_'), as the prefix of the workers it adds to a shared pool."""
    short = (hostname or socket.gethostname()).split(".")[0].lower()
    cleaned = re.sub(r"[^a-z0-9_-]+", "-", short).strip("-")
    return f"{cleaned or 'host'}-w"


def check_prefix(prefix: str) -> str:
    if not _PREFIX_CHARS.fullmatch(prefix):
        raise ConfigError(
            f"--worker-prefix {prefix!r}: use letters, digits, '-' and '_' only (worker ids name "
            "Redis keys and rq queues)"
        )
    return prefix


def worker_ids(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(1, count + 1)]


@dataclass(frozen=True)
class IdHolder:
    """A live worker that holds `worker_id` (from its liveness hash)."""

    worker_id: str
    pid: str
    host: str
    age_s: float | None  # since its last heartbeat; None: the hash names no time

    def message(self, fix: str) -> str:
        seen = f", last heartbeat {self.age_s:.0f} s ago" if self.age_s is not None else ""
        return (
            f"worker id {self.worker_id!r} is in use by pid {self.pid} on {self.host}{seen}: {fix}"
        )


def holders(
    conn: redis.Redis, ids: list[str], hostname: str | None = None, now: float | None = None
) -> list[IdHolder]:
    """The ids of `ids` that a live worker holds (one round trip)."""
    mine = hostname or socket.gethostname()
    with conn.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hgetall(keys.worker_info(worker_id))
        replies = pipe.execute()
    now = time.time() if now is None else now
    held: list[IdHolder] = []
    for worker_id, raw in zip(ids, replies, strict=True):
        info = {k.decode(): v.decode() for k, v in raw.items()}
        if not info:
            continue
        pid = info.get("pid", "")
        if info.get("host") == mine and not pid_alive(int(pid) if pid.isdigit() else 0):
            continue  # a crashed process of this host: its successor takes the id over
        try:
            age: float | None = max(0.0, now - float(info["last_seen"]))
        except (KeyError, ValueError):
            age = None
        held.append(IdHolder(worker_id, pid or "?", info.get("host") or "?", age))
    return held

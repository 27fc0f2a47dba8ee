"""The worker's one Redis round trip per step.

Each step's pipeline carries: every request's new stream events (XADD; the stream's TTL with its
first event and then every STREAM_TTL_REFRESH_S, not with every token),
the rq bookkeeping of jobs that ended, the drained cache/scheduler counter deltas (HINCRBY on a
hash that never expires, so counts never go backwards or vanish with the worker), the last reject,
the gauges and heartbeats (at most once a second), and the reads the loop needs: cancel flags of
running requests, control commands, and how many jobs are queued. No per-token round trips; when
idle the loop calls `flush` at least once a second.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from shared import keys
from shared.wire import STREAM_FIELD, ControlCommand, WireError

# A stream's TTL (keys.REQUEST_TTL_S) is set with its first event and renewed this often while
# the request runs, so it never lapses mid-stream and a step sends one command per stream, not two.
STREAM_TTL_REFRESH_S = keys.REQUEST_TTL_S / 4


@dataclass
class PublishResult:
    cancelled: list[str] = field(default_factory=list)
    commands: list[ControlCommand] = field(default_factory=list)
    queued: int = 0


@dataclass
class StepWrites:
    """What the loop hands the publisher for one step."""

    events: dict[str, list[bytes]] = field(default_factory=dict)  # request id -> packed events
    ended: list[Any] = field(default_factory=list)  # callables(pipe) doing rq bookkeeping
    counters: dict[str, int] = field(default_factory=dict)
    last_reject: dict[str, Any] | None = None
    gauges: dict[str, Any] | None = None  # with liveness, when due


class Publisher:
    def __init__(
        self,
        connection: redis.Redis,
        worker_id: str,
        queue_keys: list[str],
        info: dict[str, str],
    ) -> None:
        self.r = connection
        self.worker_id = worker_id
        self.queue_keys = queue_keys
        self.info = info
        self._k_counters = keys.worker_cache_counters(worker_id)
        self._k_info = keys.worker_info(worker_id)
        self._k_control = keys.worker_control(worker_id)
        self._last_gauges = 0.0
        self._last_heartbeat = 0.0
        self._ttl_due: dict[str, float] = {}  # request id -> when its stream's TTL is renewed

    def claim_worker_id(self) -> None:
        """Refuse to run beside a live worker with the same id (their counters would mix); a
        leftover from a crashed process on this host (its pid gone) is taken over."""
        info = {k.decode(): v.decode() for k, v in self.r.hgetall(self._k_info).items()}
        if not info or info.get("pid") == str(os.getpid()):
            return
        same_host = info.get("host") == socket.gethostname()
        if same_host and not _pid_alive(int(info.get("pid") or 0)):
            return
        raise WorkerIdInUse(
            f"worker id {self.worker_id!r} is in use by pid {info.get('pid')} on "
            f"{info.get('host')}; give this worker another id (MLXCEL_WORKER_ID)"
        )

    def register(self, pipe: Any, gauges: dict[str, Any]) -> None:
        """Liveness and gauges together, so a reader that sees the worker alive sees its state."""
        pipe.delete(self._k_info)
        self._write_liveness(pipe, gauges)

    def unregister(self, pipe: Any) -> None:
        # Counters and last reject stay: the pool's totals include workers that are gone.
        pipe.delete(self._k_info)

    def liveness_due(self, now: float | None = None) -> bool:
        """Gauges and heartbeats go out once per keys.HEARTBEAT_INTERVAL_S (the caller builds
        them on its own thread, then hands them to `publish`)."""
        now = time.monotonic() if now is None else now
        if now - self._last_gauges < keys.HEARTBEAT_INTERVAL_S:
            return False
        self._last_gauges = now
        return True

    def publish(self, writes: StepWrites, active_request_ids: list[str]) -> PublishResult:
        """Send one step's writes and reads in a single pipeline."""
        now = time.monotonic()
        with self.r.pipeline(transaction=False) as pipe:
            for rid, packed in writes.events.items():
                stream = keys.request_stream(rid)
                for data in packed:
                    pipe.xadd(stream, {STREAM_FIELD: data})
                if self._ttl_due.get(rid, 0.0) <= now:
                    pipe.expire(stream, keys.REQUEST_TTL_S)
                    self._ttl_due[rid] = now + STREAM_TTL_REFRESH_S
            for end in writes.ended:
                end(pipe)
            for name, delta in writes.counters.items():
                pipe.hincrby(self._k_counters, name, delta)
            if writes.last_reject is not None:
                last = {f"last_reject_{k}": v for k, v in writes.last_reject.items()}
                pipe.hset(self._k_counters, mapping=_strs(last))
            if writes.gauges is not None:
                self._write_liveness(pipe, writes.gauges)
            n_reads = len(pipe)
            if active_request_ids:
                pipe.mget([keys.request_cancel(rid) for rid in active_request_ids])
            pipe.lpop(self._k_control, 16)
            for qk in self.queue_keys:
                pipe.llen(qk)
            replies = pipe.execute()[n_reads:]
        if len(self._ttl_due) > 2 * len(active_request_ids) + 64:  # forget ended requests
            active = set(active_request_ids)
            self._ttl_due = {r: t for r, t in self._ttl_due.items() if r in active}
        return self._parse_reads(replies, active_request_ids)

    def _write_liveness(self, pipe: Any, gauges: dict[str, Any]) -> None:
        """The info hash is the worker's liveness: identity, settings and gauges, one TTL."""
        live = {**self.info, **_strs(gauges), "last_seen": f"{time.time():.3f}"}
        pipe.hset(self._k_info, mapping=live)
        pipe.expire(self._k_info, keys.LIVENESS_TTL_S)
        pipe.sadd(keys.workers_roster(), self.worker_id)

    def _parse_reads(self, replies: list[Any], active: list[str]) -> PublishResult:
        res = PublishResult()
        i = 0
        if active:
            res.cancelled = [rid for rid, flag in zip(active, replies[0], strict=True) if flag]
            i = 1
        for raw in replies[i] or []:
            try:
                res.commands.append(ControlCommand.from_wire(raw))
            except (WireError, ValueError):
                continue  # a malformed command is dropped, never executed
        res.queued = sum(int(n or 0) for n in replies[i + 1 :])
        return res

    def reply(self, reply_key: str, payload: bytes) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            pipe.rpush(reply_key, payload)
            pipe.expire(reply_key, keys.CONTROL_TTL_S)
            pipe.execute()


class WorkerIdInUse(RuntimeError):
    pass


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _strs(mapping: dict[str, Any]) -> dict[str, str]:
    return {k: ("" if v is None else str(v)) for k, v in mapping.items()}

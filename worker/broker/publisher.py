"""The worker's one Redis round trip per step.

Each step's pipeline carries: every request's new stream events (one script per stream: its XADDs
and its TTL in one atomic write, so no stream ever exists without a TTL, and one a router deleted
is never created again by a later step's events; one EXPIRE per stream per step, not per token),
the rq bookkeeping of jobs that ended (as `JobEnd` data), the drained counter deltas (HINCRBY on
a hash that never expires, so counts never go backwards or vanish with the worker), the last
reject, rq's busy state, liveness and gauges (at most once a second, through `presence`), and
the reads the loop needs: cancel flags of running requests, control commands, how many jobs are
queued, and whether a peer has found this worker dead (read with the cancel flags, so the loop
never acts on what this publish read without knowing it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from shared import keys
from shared.wire import ControlCommand, WireError
from worker.broker.intake import JobEnd, RqIntake, TakenJob, append_events
from worker.broker.presence import WorkerPresence


@dataclass
class Liveness:
    """Sent once per heartbeat interval: the gauges and the jobs whose executions to extend."""

    gauges: dict[str, Any]
    running: list[TakenJob]


@dataclass
class StepWrites:
    """Everything one step sends, as data (the publisher thread owns no other state)."""

    streams: list[tuple[TakenJob, list[bytes]]] = field(default_factory=list)  # packed events
    # Jobs whose events continue a stream this worker started in an earlier step: written only
    # while that stream exists (a router's delete is final).
    ongoing: set[str] = field(default_factory=set)
    ended: list[JobEnd] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    last_reject: dict[str, Any] | None = None
    busy: bool = False
    liveness: Liveness | None = None
    watched: list[str] = field(default_factory=list)  # running request ids: read cancel flags
    index: dict[bytes, bool] = field(default_factory=dict)  # block index changes
    index_full: list[bytes] | None = None  # every block held: the index was found lost


@dataclass
class PublishResult:
    cancelled: list[str] = field(default_factory=list)
    commands: list[ControlCommand] = field(default_factory=list)
    queued: int = 0
    # The block set was gone: Redis lost it (restart, flush), a peer's reaper deleted it, or it
    # lapsed; the loop reads the worker's standing to tell which.
    index_lost: bool = False
    reaped: bool = False  # a peer's reaper has found this worker dead (its claim is there)

    def merge(self, later: PublishResult) -> PublishResult:
        """Two publishes' reads as one (nothing read may be lost); `queued` is the later one."""
        return PublishResult(
            [*self.cancelled, *later.cancelled],
            [*self.commands, *later.commands],
            later.queued,
            self.index_lost or later.index_lost,
            self.reaped or later.reaped,
        )


class Publisher:
    def __init__(self, presence: WorkerPresence, intake: RqIntake) -> None:
        self.r: redis.Redis = presence.connection
        self.presence = presence
        self.intake = intake
        self._k_counters = keys.worker_cache_counters(presence.worker_id)
        self._k_control = keys.worker_control(presence.worker_id)
        self._k_reaped = keys.worker_reaped(presence.worker_id)

    def publish(self, writes: StepWrites) -> PublishResult:
        """Send one step's writes and reads in a single pipeline."""
        blocks = keys.worker_blocks(self.presence.worker_id, self.presence.epoch)
        check_index = (
            bool(writes.index) or writes.index_full is not None or (writes.liveness is not None)
        )
        with self.r.pipeline(transaction=False) as pipe:
            if check_index:  # first, so this pipeline's own SADDs cannot hide a lost set
                pipe.expire(blocks, keys.LIVENESS_TTL_S)
            _write_index(pipe, blocks, writes)
            for taken, packed in writes.streams:
                append_events(pipe, taken.id, packed, taken.id not in writes.ongoing)
            for end in writes.ended:
                self.intake.end(pipe, end)
            # A zero delta changes nothing: a step sends the counters that moved (about 3 of
            # 31 for a decoding sequence); a heartbeat's publish sends every field, so each
            # exists from the worker's first beat on.
            every = writes.liveness is not None
            for name, delta in writes.counters.items():
                if delta or every:
                    pipe.hincrby(self._k_counters, name, delta)
            if writes.last_reject is not None:
                last = {f"last_reject_{k}": v for k, v in writes.last_reject.items()}
                pipe.hset(
                    self._k_counters,
                    mapping={k: "" if v is None else str(v) for k, v in last.items()},
                )
            self.presence.set_busy(writes.busy, pipe)
            if writes.liveness is not None:
                self.presence.beat(pipe, writes.liveness.gauges, writes.liveness.running)
            n_writes = len(pipe)
            pipe.exists(self._k_reaped)
            if writes.watched:
                pipe.mget([keys.request_cancel(rid) for rid in writes.watched])
            pipe.lpop(self._k_control, 16)
            for qk in self.intake.queue_keys:
                pipe.llen(qk)
            replies = pipe.execute()
        res = _parse_reads(replies[n_writes:], writes.watched)
        res.index_lost = check_index and not replies[0]
        return res

    def reply(self, reply_key: str, payload: bytes) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            pipe.rpush(reply_key, payload)
            pipe.expire(reply_key, keys.CONTROL_TTL_S)
            pipe.execute()


# Members per SADD when a whole block set is written (keeps each command's reply small).
INDEX_CHUNK = 10_000


def _write_index(pipe: Any, blocks: str, writes: StepWrites) -> None:
    if writes.index_full is not None:
        full = writes.index_full
        pipe.sadd(blocks, keys.INDEX_MARKER)
        for i in range(0, len(full), INDEX_CHUNK):
            pipe.sadd(blocks, *full[i : i + INDEX_CHUNK])
        pipe.expire(blocks, keys.LIVENESS_TTL_S)
    added = [m for m, held in writes.index.items() if held]
    removed = [m for m, held in writes.index.items() if not held]
    if added:
        pipe.sadd(blocks, *added)
    if removed:
        pipe.srem(blocks, *removed)


def _parse_reads(replies: list[Any], watched: list[str]) -> PublishResult:
    res = PublishResult(reaped=bool(replies[0]))
    replies = replies[1:]
    i = 0
    if watched:
        res.cancelled = [rid for rid, flag in zip(watched, replies[0], strict=True) if flag]
        i = 1
    for raw in replies[i] or []:
        try:
            res.commands.append(ControlCommand.from_wire(raw))
        except (WireError, ValueError):
            continue  # a malformed command is dropped, never executed
    res.queued = sum(int(n or 0) for n in replies[i + 1 :])
    return res

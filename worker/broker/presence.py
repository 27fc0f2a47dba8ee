"""The worker's presence: the one owner of its rq registration and of the pool's liveness hash.

rq's worker record (`rq:worker:mlxcel-<wid>`, what `rq info` and rq-dashboard list) and the
pool's info hash (`mlxcel:worker:<wid>:info`, what the router reads) are born, beat and die
together here, in the same pipelines, so the two can never disagree about whether the worker
is alive. Built on rq's own worker class: its birth, heartbeat, state and death methods.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.worker import WorkerStatus

from shared import keys
from shared.wire import MsgpackSerializer

log = logging.getLogger("mlxcel.worker.presence")

# A running job's rq execution (its StartedJobRegistry entry) lives this long past its last
# heartbeat: the worker beats every HEARTBEAT_INTERVAL_S, so it lapses only once the worker is gone.
EXECUTION_TTL_S = 60


class WorkerIdInUse(RuntimeError):
    pass


class RqWorkerRecord(SimpleWorker):
    """rq's worker class for reading, writing and retiring worker records. It leaves the
    connection's socket timeout alone: rq raises it to fit its own 405 s dequeue block, which
    would void the pool's stall bound; our blocking dequeue waits a second."""

    def _set_connection(self, connection: redis.Redis) -> redis.Redis:
        return connection


class WorkerPresence(RqWorkerRecord):
    """rq's worker class as a registration holder: jobs run in the engine's batch, never here."""

    def __init__(
        self, connection: redis.Redis, worker_id: str, queues: list[Queue], info: dict[str, str]
    ) -> None:
        super().__init__(
            queues,
            connection=connection,
            name=keys.rq_worker_name(worker_id),
            serializer=MsgpackSerializer,
        )
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.worker_id = worker_id
        # New at every process start: routers read the block index under this epoch only, so a
        # restarted or zombie process can never leave entries for a cache it no longer holds.
        self.epoch = secrets.token_hex(6)
        self.info = {**info, "rq_name": self.name, "epoch": self.epoch}
        self._k_info = keys.worker_info(worker_id)
        self._busy = False
        self._next_beat = 0.0

    # -- birth -----------------------------------------------------------------------------

    def arrive(self, gauges: dict[str, Any]) -> None:
        """Claim the worker id, write the liveness hash, then rq's birth (IDLE)."""
        self._claim()
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.delete(self._k_info, keys.worker_reaped(self.worker_id))
            self._write_liveness(pipe, gauges)
            blocks = keys.worker_blocks(self.worker_id, self.epoch)
            pipe.sadd(blocks, keys.INDEX_MARKER)  # the cache's blocks follow with the next beat
            pipe.expire(blocks, keys.LIVENESS_TTL_S)
            pipe.execute()
        self._retire_stale_record()
        self.register_birth()
        self._busy = False
        self.set_state(WorkerStatus.IDLE)
        self._next_beat = time.monotonic() + keys.HEARTBEAT_INTERVAL_S

    def _claim(self) -> None:
        """Refuse to run beside a live worker with the same id (their counters would mix); a
        leftover from a crashed process on this host (its pid gone) is taken over."""
        raw = self.connection.hgetall(self._k_info)
        info = {k.decode(): v.decode() for k, v in raw.items()}
        if not info or info.get("pid") == str(os.getpid()):
            return
        if info.get("host") == self.hostname and not _pid_alive(int(info.get("pid") or 0)):
            return
        raise WorkerIdInUse(
            f"worker id {self.worker_id!r} is in use by pid {info.get('pid')} on "
            f"{info.get('host')}; give this worker another id (MLXCEL_WORKER_ID)"
        )

    def _retire_stale_record(self) -> None:
        # A worker restarted under the same id finds its old rq record still there (rq keeps it
        # until its heartbeat TTL runs out): retire it, as rq's own death would have.
        if not self.connection.exists(self.key):
            return
        stale = RqWorkerRecord.find_by_key(
            self.key, connection=self.connection, serializer=MsgpackSerializer
        )
        if stale is not None:
            stale.register_death()
        self.connection.srem(self.redis_workers_keys, self.key)
        self.connection.delete(self.key)

    # -- life ------------------------------------------------------------------------------

    def beat_due(self, now: float) -> bool:
        """Liveness goes out once per HEARTBEAT_INTERVAL_S (the caller then builds the gauges)."""
        if now < self._next_beat:
            return False
        self._next_beat = now + keys.HEARTBEAT_INTERVAL_S
        return True

    def beat(self, pipe: Any, gauges: dict[str, Any], running: list[Any]) -> None:
        """rq's heartbeat, each running job's execution heartbeat, and the liveness hash with
        the current gauges, in the caller's pipeline."""
        # rq's record lives as long as the liveness hash: `rq info` drops a dead worker with it.
        self.heartbeat(keys.LIVENESS_TTL_S, pipeline=pipe)
        for taken in running:
            taken.execution.heartbeat(
                taken.job.started_job_registry, EXECUTION_TTL_S, pipeline=pipe
            )
        self._write_liveness(pipe, gauges)

    def set_busy(self, busy: bool, pipe: Any) -> None:
        """rq's busy/idle state, written only when it changes."""
        if busy != self._busy:
            self._busy = busy
            self.set_state(WorkerStatus.BUSY if busy else WorkerStatus.IDLE, pipe)

    def _write_liveness(self, pipe: Any, gauges: dict[str, Any]) -> None:
        live = {**self.info, **_strs(gauges), "last_seen": f"{time.time():.3f}"}
        pipe.hset(self._k_info, mapping=live)
        pipe.expire(self._k_info, keys.LIVENESS_TTL_S)
        pipe.sadd(keys.workers_roster(), self.worker_id)

    # -- death -----------------------------------------------------------------------------

    def leave(self) -> None:
        """rq's death and the liveness hash gone; the counters stay (pool totals outlive it)."""
        self.connection.delete(self._k_info)
        self.register_death()


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

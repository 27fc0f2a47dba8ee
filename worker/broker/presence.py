"""The worker's presence: the one owner of its rq registration and of the pool's liveness hash.

rq's worker record (`rq:worker:mlxcel-<wid>`, what `rq info` and rq-dashboard list) and the
pool's info hash (`mlxcel:worker:<wid>:info`, what the router reads) are born, beat and die
together here, in the same pipelines, so the two can never disagree about whether the worker
is alive. Built on rq's own worker class: its birth, heartbeat, state and death methods.

Two clocks (shared.liveness): the `Heartbeat` thread, with its own Redis connection, keeps the
liveness hash, rq's worker record and the block index alive every HEARTBEAT_INTERVAL_S whatever
the loop does, and reports the loop's progress (`loop_age_s`); the loop's own once-a-second
beat (`beat`, in its step's pipeline) writes the gauges, rq's heartbeat and its running jobs'
executions. The thread stops beating once the loop has not progressed for `stuck_after_s`, so a
process stuck for good is found dead, and it tells the loop when a peer reaped it meanwhile.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.worker import WorkerStatus

from shared import keys
from shared.liveness import DEAD_AFTER_S, STUCK_AFTER_S
from shared.wire import MsgpackSerializer

log = logging.getLogger("mlxcel.worker.presence")

# A running job's rq execution (its StartedJobRegistry entry) lives this long past the loop's last
# beat beyond the stuck threshold: it lapses only once the worker is gone, never in a long pass.
EXECUTION_MARGIN_S = 2 * keys.LIVENESS_TTL_S
EXECUTION_TTL_S = int(STUCK_AFTER_S) + EXECUTION_MARGIN_S  # at the default stuck threshold

# The heartbeat thread's one round trip: the TTLs of a hash that exists (a deleted or flushed one
# is the loop's to write again, never recreated here), the loop's age, and whether a peer reaped
# this worker. KEYS: info, rq worker record, block set, reaped claim; ARGV: ttl, loop age.
_BEAT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'loop_age_s', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[3], ARGV[1])
end
return redis.call('EXISTS', KEYS[4])
"""


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
        self,
        connection: redis.Redis,
        worker_id: str,
        queues: list[Queue],
        info: dict[str, str],
        stuck_after_s: float = STUCK_AFTER_S,
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
        self.stuck_after_s = stuck_after_s
        self.info = {
            **info,
            "rq_name": self.name,
            "epoch": self.epoch,
            "stuck_after_s": f"{stuck_after_s:g}",
        }
        self._k_info = keys.worker_info(worker_id)
        self._busy = False
        self._next_beat = 0.0
        self.heartbeat_thread: Heartbeat | None = None

    @property
    def execution_ttl_s(self) -> int:
        """A running job's execution outlives any pass shorter than the stuck threshold."""
        return int(self.stuck_after_s) + EXECUTION_MARGIN_S

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
        if self.heartbeat_thread is not None:  # a new life: a verdict found before is spent
            self.heartbeat_thread.reaped.clear()
            self.heartbeat_thread.progress()
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
                taken.job.started_job_registry, self.execution_ttl_s, pipeline=pipe
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
        self.stop_heartbeat()
        self.connection.delete(self._k_info)
        self.register_death()

    # -- the heartbeat thread ----------------------------------------------------------------

    def start_heartbeat(self) -> Heartbeat:
        """Start the thread that beats for this process (once; `progress` feeds it)."""
        if self.heartbeat_thread is None:
            self.heartbeat_thread = Heartbeat(self)
            self.heartbeat_thread.start()
        return self.heartbeat_thread

    def progress(self) -> None:
        """The loop went round once: its age starts again from zero."""
        if self.heartbeat_thread is not None:
            self.heartbeat_thread.progress()

    def reaped(self) -> bool:
        """Whether a peer reaped this worker since the last `arrive` (a false death: a stopped
        process, a loop stuck past stuck_after_s that then went on)."""
        return self.heartbeat_thread is not None and self.heartbeat_thread.reaped.is_set()

    def stop_heartbeat(self) -> None:
        if self.heartbeat_thread is not None:
            self.heartbeat_thread.stop()
            self.heartbeat_thread = None


class Heartbeat(threading.Thread):
    """The process's heartbeat, beside the loop: a long pass (mx.eval, a tokenizer, a grammar
    build) cannot stop it, and only a loop stuck for `stuck_after_s` can."""

    def __init__(
        self,
        presence: WorkerPresence,
        interval_s: float = keys.HEARTBEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name=f"heartbeat-{presence.worker_id}", daemon=True)
        self.presence = presence
        self.interval_s = interval_s
        self.clock = clock
        self.reaped = threading.Event()  # set when a beat found this worker reaped
        self._loop_at = clock()
        self._stop_event = threading.Event()
        self._keys = [
            keys.worker_info(presence.worker_id),
            presence.key,  # rq's worker record (`rq info`)
            keys.worker_blocks(presence.worker_id, presence.epoch),
            keys.worker_reaped(presence.worker_id),
        ]
        # Its own connection (taken from the pool at the first beat), so a publish or a blocking
        # dequeue on the loop's never delays a beat.
        self._conn: redis.Redis | None = None

    def progress(self) -> None:
        self._loop_at = self.clock()

    def loop_age_s(self) -> float:
        return max(0.0, self.clock() - self._loop_at)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)

    def run(self) -> None:
        state = "ok"  # "ok", "slow" (reported), "stuck" (not beating)
        script: Any = None
        try:
            while not self._stop_event.wait(self.interval_s):
                if self._conn is None:
                    try:
                        self._conn = self.presence.connection.client()
                    except redis.RedisError:
                        continue  # Redis down: the loop is reconnecting
                    script = self._conn.register_script(_BEAT_SCRIPT)
                state = self._beat(self._conn, script, state)
        finally:
            if self._conn is not None:
                self._conn.close()

    def _beat(self, conn: redis.Redis, script: Any, state: str) -> str:
        age = self.loop_age_s()
        wid, stuck = self.presence.worker_id, self.presence.stuck_after_s
        if age >= stuck:
            if state != "stuck":
                log.error(
                    "worker %s: its loop has not progressed for %.0fs (worker.stuck_after_s "
                    "%gs): heartbeat stopped, so peers find it dead and fail its jobs",
                    wid,
                    age,
                    stuck,
                )
            return "stuck"
        if state == "stuck":
            log.warning("worker %s: its loop goes on after %.0fs; heartbeat again", wid, age)
        if age >= DEAD_AFTER_S and state == "ok":
            log.warning(
                "worker %s: one pass has held its loop for %.0fs; heartbeat goes on, "
                "its jobs are lost only past %gs",
                wid,
                age,
                stuck,
            )
            state = "slow"
        elif age < DEAD_AFTER_S:
            state = "ok"
        try:
            reaped = script(keys=self._keys, args=[keys.LIVENESS_TTL_S, f"{age:.1f}"], client=conn)
        except redis.RedisError as exc:  # the loop finds a lost Redis itself and reconnects
            log.debug("heartbeat of %s failed: %s", wid, exc)
            return state
        except Exception:  # never let the thread die: a dead heartbeat is a false death
            log.warning("heartbeat of %s failed", wid, exc_info=True)
            return state
        if reaped:
            self.reaped.set()
        return state


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

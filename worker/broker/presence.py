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
process stuck for good is found dead.

Each beat also reads the worker's standing: whether a peer reaped it, and whether its
registration is whole (liveness hash, rq's record alive and listed). When it is not, the thread
tells the loop, which reads the whole `Standing` (`standing`: what happened, e.g. found dead by
a peer, Redis restarted, a flush, a registration that lapsed) and registers again (`arrive`).
The thread also keeps how long Redis went unheard (`take_silence`), so the loop can say how long
the worker was cut off, and whether it was cut off at all or merely did not run.
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
from shared.liveness import DEAD_AFTER_S, STUCK_AFTER_S, alive_ttl_ms, pid_alive
from shared.wire import MsgpackSerializer
from worker.broker.standing import Silence, Standing, redis_run_id

log = logging.getLogger("mlxcel.worker.presence")

# A running job's rq execution (its StartedJobRegistry entry) lives this long past the loop's last
# beat beyond the stuck threshold: it lapses only once the worker is gone, never in a long pass.
EXECUTION_MARGIN_S = 2 * keys.LIVENESS_TTL_S
EXECUTION_TTL_S = int(STUCK_AFTER_S) + EXECUTION_MARGIN_S  # at the default stuck threshold

# The heartbeat thread's one round trip: the TTLs of a hash that exists (a deleted or flushed one
# is the loop's to write again, never recreated here), the loop's age, and the worker's standing:
# 2 when a peer reaped it, 1 when its registration is not whole (its liveness hash gone; rq's
# record gone, dead, not in rq's worker set, or only rq's heartbeat fields written again after
# it lapsed, without its birth: `rq info` would not list it rightly), else 0.
# The alive key (keys.worker_alive) is written with the hash's TTL, for as long as it counts.
# KEYS: info, rq worker record, block set, reaped claim, rq's worker set, alive key;
# ARGV: ttl, loop age, epoch, the alive key's ttl in ms.
_BEAT_SCRIPT = """
local whole = redis.call('EXISTS', KEYS[1]) == 1
if whole then
  redis.call('HSET', KEYS[1], 'loop_age_s', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[6], ARGV[3], 'PX', ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[3], ARGV[1])
end
if redis.call('EXISTS', KEYS[4]) == 1 then return 2 end
if not whole or redis.call('SISMEMBER', KEYS[5], KEYS[2]) == 0
    or redis.call('HEXISTS', KEYS[2], 'birth') == 0
    or redis.call('HEXISTS', KEYS[2], 'death') == 1 then
  return 1
end
return 0
"""
BEAT_WHOLE, BEAT_UNREGISTERED, BEAT_REAPED = 0, 1, 2


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
            # Its publisher publishes a request's events to the channel the request names
            # (broker.publisher.STEP_LUA): routers name one only for a worker that says so.
            "relay_push": "1",
        }
        self._k_info = keys.worker_info(worker_id)
        self._k_alive = keys.worker_alive(worker_id)
        self.redis_run_id = ""  # the server's run_id at the last arrive (a new one: restarted)
        self._busy = False
        self._next_beat = 0.0
        self.heartbeat_thread: Heartbeat | None = None

    @property
    def execution_ttl_s(self) -> int:
        """A running job's execution outlives any pass shorter than the stuck threshold."""
        return int(self.stuck_after_s) + EXECUTION_MARGIN_S

    # -- birth -----------------------------------------------------------------------------

    def arrive(self, gauges: dict[str, Any]) -> None:
        """Claim the worker id, write the liveness hash, then rq's birth (IDLE), with the
        worker's queues in rq's queue set: `rq info` lists the workers of those queues only,
        and rq adds a queue there only at its first enqueue."""
        self._claim()
        self.redis_run_id = redis_run_id(self.connection)
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.delete(self._k_info, keys.worker_reaped(self.worker_id))
            self._write_liveness(pipe, gauges)
            # Only here: a roster without this worker then means Redis lost its keys (`standing`).
            pipe.sadd(keys.workers_roster(), self.worker_id)
            blocks = keys.worker_blocks(self.worker_id, self.epoch)
            pipe.sadd(blocks, keys.INDEX_MARKER)  # the cache's blocks follow with the next beat
            pipe.expire(blocks, keys.LIVENESS_TTL_S)
            if self.queues:
                pipe.sadd(Queue.redis_queues_keys, *(q.key for q in self.queues))
            pipe.execute()
        self._retire_stale_record()
        self.register_birth()
        if self.heartbeat_thread is not None:  # a new life: a verdict found before is spent
            self.heartbeat_thread.arrived()
        self._busy = False
        self.set_state(WorkerStatus.IDLE)
        self._next_beat = time.monotonic() + keys.HEARTBEAT_INTERVAL_S

    def standing(self) -> Standing:
        """The worker's registration as Redis shows it now (read it before `arrive`, which
        deletes the reaped claim)."""
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.get(keys.worker_reaped(self.worker_id))
            pipe.exists(self._k_info)
            pipe.sismember(keys.workers_roster(), self.worker_id)
            pipe.sismember(self.redis_workers_keys, self.key)
            pipe.hmget(self.key, ["birth", "death"])
            reaped, info, roster, listed, (birth, death) = pipe.execute()
        run_id = redis_run_id(self.connection)
        verdict = reaped.decode(errors="replace") if reaped is not None else ""
        reaper, _, reason = verdict.partition(" ")
        return Standing(
            reaped_by=reaper if reaped is not None else "",
            reaped_reason=reason or "no reason given",
            server_changed=bool(self.redis_run_id and run_id and run_id != self.redis_run_id),
            info=bool(info),
            roster=bool(roster),
            rq_listed=bool(listed) and birth is not None and death is None,
        )

    def _claim(self) -> None:
        """Refuse to run beside a live worker with the same id (their counters would mix); a
        leftover from a crashed process on this host (its pid gone) is taken over."""
        raw = self.connection.hgetall(self._k_info)
        info = {k.decode(): v.decode() for k, v in raw.items()}
        if not info or info.get("pid") == str(os.getpid()):
            return
        if info.get("host") == self.hostname and not pid_alive(int(info.get("pid") or 0)):
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

    @property
    def busy(self) -> bool:
        """rq's busy state as this worker last wrote it."""
        return self._busy

    def set_busy(self, busy: bool, pipe: Any) -> None:
        """rq's busy/idle state, written only when it changes."""
        if busy != self._busy:
            self._busy = busy
            self.set_state(WorkerStatus.BUSY if busy else WorkerStatus.IDLE, pipe)

    def _write_liveness(self, pipe: Any, gauges: dict[str, Any]) -> None:
        live = {**self.info, **_strs(gauges), "last_seen": f"{time.time():.3f}"}
        pipe.hset(self._k_info, mapping=live)
        pipe.expire(self._k_info, keys.LIVENESS_TTL_S)
        pipe.set(self._k_alive, self.epoch, px=alive_ttl_ms())

    # -- death -----------------------------------------------------------------------------

    def leave(self) -> None:
        """rq's death and the liveness hash gone; the counters stay (pool totals outlive it)."""
        self.stop_heartbeat()
        self.connection.delete(self._k_info, self._k_alive)
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
        """Whether a beat found this worker reaped by a peer since the last `arrive` (a false
        death: a stopped process, a lost link, a loop stuck past stuck_after_s that went on)."""
        return self.heartbeat_thread is not None and self.heartbeat_thread.reaped.is_set()

    def needs_check(self) -> bool:
        """Whether a beat found the worker reaped or its registration not whole since the last
        `arrive` or `checked` (the loop then reads its `standing`)."""
        return self.heartbeat_thread is not None and self.heartbeat_thread.doubt.is_set()

    def checked(self) -> None:
        """The loop read a whole standing: what the beat saw was a passing moment (a beat
        that ran while `arrive` was writing)."""
        if self.heartbeat_thread is not None:
            self.heartbeat_thread.doubt.clear()

    def take_silence(self) -> Silence:
        """How long Redis went unheard since the last call (see `Silence`)."""
        if self.heartbeat_thread is None:
            return Silence(0.0, 0.0, 0, 0.0)
        return self.heartbeat_thread.take_silence()

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
        self.doubt = threading.Event()  # set when a beat found it reaped or not whole
        self._loop_at = clock()
        self._stop_event = threading.Event()
        self._keys = [
            keys.worker_info(presence.worker_id),
            presence.key,  # rq's worker record (`rq info`)
            keys.worker_blocks(presence.worker_id, presence.epoch),
            keys.worker_reaped(presence.worker_id),
            presence.redis_workers_keys,  # rq's set of live workers
            keys.worker_alive(presence.worker_id),
        ]
        # Its own connection (taken from the pool at the first beat), so a publish or a blocking
        # dequeue on the loop's never delays a beat.
        self._conn: redis.Redis | None = None
        self._script: Any = None  # the beat script, registered on that connection
        # How long Redis went unheard, for `take_silence` (under the lock: two threads).
        self._lock = threading.Lock()
        self._landed_at = clock()  # when the last beat got Redis's reply
        self._calling_since: float | None = None  # when the call still waiting began
        self._unheard_s = 0.0
        self._no_reply_s = 0.0
        self._failed_calls = 0
        self._stuck_s = 0.0

    def progress(self) -> None:
        self._loop_at = self.clock()

    def arrived(self) -> None:
        """The worker registered again: verdicts found before are spent."""
        self.reaped.clear()
        self.doubt.clear()
        self.progress()

    def take_silence(self) -> Silence:
        """The longest stretches without Redis's word since the last call, and start over."""
        now = self.clock()
        with self._lock:
            waiting = now - self._calling_since if self._calling_since is not None else 0.0
            silence = Silence(
                unheard_s=max(self._unheard_s, now - self._landed_at),
                no_reply_s=max(self._no_reply_s, waiting),
                failed_calls=self._failed_calls,
                stuck_s=self._stuck_s,
            )
            self._unheard_s, self._no_reply_s, self._failed_calls = 0.0, 0.0, 0
            self._stuck_s = 0.0
        return silence

    def loop_age_s(self) -> float:
        return max(0.0, self.clock() - self._loop_at)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)

    def run(self) -> None:
        state = "ok"  # "ok", "slow" (reported), "stuck" (not beating)
        try:
            while not self._stop_event.wait(self.interval_s):
                state = self._beat(state)
        finally:
            if self._conn is not None:
                self._conn.close()

    def _beat(self, state: str) -> str:
        age = self.loop_age_s()
        wid, stuck = self.presence.worker_id, self.presence.stuck_after_s
        if age >= stuck:
            with self._lock:
                self._stuck_s = max(self._stuck_s, age)
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
        standing = self._call(age)
        if standing == BEAT_REAPED:
            self.reaped.set()
        if standing in (BEAT_REAPED, BEAT_UNREGISTERED):
            self.doubt.set()
        return state

    def _call(self, age: float) -> int | None:
        """One beat's round trip, timed: its standing code, None when it failed. The thread's
        connection is opened by its first beat, inside the timing: a cut that catches its
        handshake is a call that waited, not a worker that did not run."""
        started = self.clock()
        with self._lock:
            self._calling_since = started
        reply: int | None = None
        try:
            if self._conn is None:
                conn = self.presence.connection.client()
                self._script = conn.register_script(_BEAT_SCRIPT)
                self._conn = conn  # both or neither: the next beat opens it again
            reply = int(
                self._script(
                    keys=self._keys,
                    args=[keys.LIVENESS_TTL_S, f"{age:.1f}", self.presence.epoch, alive_ttl_ms()],
                    client=self._conn,
                )
            )
        except redis.RedisError as exc:  # the loop finds a lost Redis itself and reconnects
            log.debug("heartbeat of %s failed: %s", self.presence.worker_id, exc)
        except Exception:  # never let the thread die: a dead heartbeat is a false death
            log.warning("heartbeat of %s failed", self.presence.worker_id, exc_info=True)
        now = self.clock()
        with self._lock:
            self._calling_since = None
            self._no_reply_s = max(self._no_reply_s, now - started)
            if reply is None:
                self._failed_calls += 1
            else:
                self._unheard_s = max(self._unheard_s, now - self._landed_at)
                self._landed_at = now
        return reply


def _strs(mapping: dict[str, Any]) -> dict[str, str]:
    return {k: ("" if v is None else str(v)) for k, v in mapping.items()}

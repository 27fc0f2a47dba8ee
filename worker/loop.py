"""The worker's loop, read top to bottom like rq's `work()`: run one engine step, act on what the
last publish read back (cancels, control commands), take jobs and admit them, send the step's
writes to the outbox, repeat. The first SIGTERM/SIGINT asks for a warm stop (finish what runs,
take no more work); a second forces a cold stop.

The step runs before the loop waits for the publish it overlapped, so a step never waits on
the round trip it just submitted; admissions come after the step, so a warm request's first
token goes out in this step's publish.

Each iteration tells the presence's heartbeat thread that the loop progresses (its age, reported
as `loop_age_s`; past `worker.stuck_after_s` the thread stops beating). A worker that a peer
reaped meanwhile (its link was cut, it was stopped, or stuck past the threshold) learns it from
a beat or from the publish that read its cancel flags, whichever comes first; it then drops
exactly the requests the pool ended (rq no longer has them started) without a word to rq or
their streams (the reaper and the routers ended them), keeps those started after the verdict,
says in one line what happened, and registers again. A registration found incomplete for any
other reason (Redis restarted or was flushed, a lapse, rq's record retired) is read the same
way (`Standing`) and redone, so `rq info` lists the worker again.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import redis

from shared import keys
from shared.errors import ErrorKind
from shared.wire import REDIS_UNAVAILABLE, ControlCommand, ControlReply, StreamEvent
from worker.broker.event_hold import EventHold
from worker.broker.intake import JobEnd, JobOutcome, RqIntake, TakenJob
from worker.broker.outbox import Outbox
from worker.broker.peer_queues import PeerQueues
from worker.broker.presence import WorkerPresence
from worker.broker.publisher import Liveness, Publisher, PublishResult, StepWrites
from worker.broker.reaper import REAP_INTERVAL_S, Reaper
from worker.broker.standing import Standing
from worker.engine.engine import Engine
from worker.engine.request import Request, RequestStatus
from worker.engine.results import StepResult

log = logging.getLogger("mlxcel.worker")

IDLE_BLOCK_S = 1.0
# How often a worker runs rq's registry maintenance (rq's own workers: every 10 minutes).
MAINTENANCE_INTERVAL_S = 60.0
# Backoff while Redis is unreachable.
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 5.0
_OUTCOME = {
    RequestStatus.FINISHED: JobOutcome.FINISHED,
    RequestStatus.FAILED: JobOutcome.FAILED,
    RequestStatus.CANCELLED: JobOutcome.CANCELED,
}
# Fault injection, for tests only: while this variable names a file (`{worker_id}` in it becomes the
# worker's id), an iteration that finds the file reads a number of seconds from it, deletes it and
# sleeps that long in the loop (as one long pass would), so liveness is testable without one.
FAULT_LOOP_STALL_ENV = "MLXCEL_FAULT_INJECT_LOOP_STALL_FILE"


@dataclass
class WorkerLoop:
    engine: Engine
    presence: WorkerPresence
    intake: RqIntake
    publisher: Publisher
    outbox: Outbox
    reaper: Reaper
    static_gauges: dict[str, Any]
    # When idle, how long a burst of arrivals may be gathered to prefill as one batch.
    admission_window_s: float = 0.0
    peers: PeerQueues | None = None
    banner: str = ""  # what it runs, for the ready line
    _stop_requests: int = 0
    _queued: int = 0  # jobs waiting in this worker's queues, as the last publish read
    _next_maintenance: float = 0.0
    _next_reap: float = 0.0
    _maintenance: Future[None] | None = None
    _index_full_due: str = ""  # why the next publish writes the block index whole ("": no)
    # Non-streamed requests' tokens between their stream's writes (event_hold).
    _hold: EventHold = field(default_factory=EventHold)
    _fault_stall_file: str = field(default_factory=lambda: os.environ.get(FAULT_LOOP_STALL_ENV, ""))

    def install_signal_handlers(self) -> None:
        def ask_stop(signum: int, _frame: Any) -> None:
            self._stop_requests += 1
            log.info("signal %s: %s stop", signum, "warm" if self._stop_requests == 1 else "cold")

        signal.signal(signal.SIGTERM, ask_stop)
        signal.signal(signal.SIGINT, ask_stop)

    def run(self) -> None:
        self.presence.arrive(self._gauges())
        self.presence.start_heartbeat()
        self.reaper.reap_own_past()
        try:
            while self._stop_requests == 0 or (self.engine.active and self._stop_requests == 1):
                try:
                    self.iterate()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self._reconnect(exc)
        finally:
            self.shutdown()

    def iterate(self) -> None:
        self.presence.progress()
        if self._fault_stall_file:
            self._fault_stall()
        carried = self._check_standing(StepResult()) if self.presence.needs_check() else None
        out = self.engine.step()
        if carried is not None:
            out.merge(carried)
        writes = StepWrites()
        reads = self.outbox.take_reads()  # the publish that overlapped the step
        if reads is not None:
            if reads.reaped or reads.index_lost:  # before anything this publish read is acted on
                out = self._check_standing(out, reads.index_lost)
            out.merge(self._act_on(reads))
        admitted = False
        if self._stop_requests == 0:
            admitted = self._take_jobs(out, writes)
        self._send(out, writes)
        if admitted:
            # New requests' first events land before the next step starts: a publish on the
            # publisher thread (one with a busy change, say) would wait for the GIL the step's
            # Python holds.
            self.outbox.settle()

    # -- intake ----------------------------------------------------------------------------

    def _take_jobs(self, out: StepResult, writes: StepWrites) -> bool:
        slots = self.engine.free_slots
        idle = self.engine.active == 0
        if slots <= 0:
            return False
        if not idle and self._queued <= 0:  # the last publish saw nothing of its own queued
            return self._take_from_peers(slots, out, writes)
        # Block for work only with nothing to send: a step's last events (a finished request's
        # `done`) must not wait out the idle timeout.
        block = IDLE_BLOCK_S if idle and not (out.events or out.ended) else None
        taken = self.intake.take(slots, block)
        if not taken:
            return self._take_from_peers(slots, out, writes)
        self._admit(taken, out, writes)
        # A burst's jobs arrive a few ms apart: an idle worker whose new work still has its
        # prefill ahead gathers the rest of the burst, so they prefill as one batch. A warm
        # request that already started gains nothing from waiting, so it never does.
        if idle and out.prefill_pending and self.admission_window_s > 0:
            held = {req.id for req in self.engine.running}
            more = self.intake.gather(self.engine.free_slots, self.admission_window_s, held)
            self._admit(more, out, writes)
            taken += more
        return bool(taken)

    def _take_from_peers(self, slots: int, out: StepResult, writes: StepWrites) -> bool:
        """Free slots and nothing of its own to run: take what waits too long in a busy peer's
        queue, or anything in a dead peer's (peer_queues)."""
        if self.peers is None or not self.peers.due(time.monotonic()):
            return False
        taken: list[TakenJob] = []
        for waiting in self.peers.waiting():
            if slots <= 0:
                break
            got = self.intake.take_from(waiting.queue, min(slots, waiting.takeable))
            if got:
                log.info(
                    "took %d job(s) from %s (%s)",
                    len(got),
                    waiting.queue.name,
                    "its worker is dead" if waiting.dead else "waiting there too long",
                )
            slots -= len(got)
            taken += got
        self._admit(taken, out, writes)
        return bool(taken)

    def _admit(self, taken_jobs: list[TakenJob], out: StepResult, writes: StepWrites) -> None:
        for taken in taken_jobs:
            if taken.request is None:  # a payload the router would never have written
                log.warning("job %s: %s", taken.id, taken.error)
                self._reject(taken, taken.error, writes)
                continue
            out.merge(self.engine.admit(taken.request, taken, taken.timeout_s))

    @staticmethod
    def _reject(taken: TakenJob, error: str, writes: StepWrites) -> None:
        event = StreamEvent(kind="error", error=error, error_type=ErrorKind.INVALID_REQUEST)
        writes.streams.append((taken, [event.to_wire()]))
        ended = JobEnd(
            taken, JobOutcome.FAILED, error=error, failure_ttl_s=keys.MALFORMED_JOB_TTL_S
        )
        writes.ended.append(ended)

    # -- reads -----------------------------------------------------------------------------

    def _act_on(self, reads: PublishResult) -> StepResult:
        """Drop cancelled requests and run control commands, as the last publish read them."""
        self._queued = reads.queued
        out = self._cancel(reads.cancelled)
        for cmd in reads.commands:
            self._handle_command(cmd)
        if reads.commands:  # a reset empties the cache: its blocks leave the index now
            out.merge(self.engine.drain())
        return out

    def _cancel(self, request_ids: list[str]) -> StepResult:
        """Drop requests whose cancel flag is up. One the pool already ended (a peer's reaper
        failed it while this worker was cut off) is dropped without a word to rq: its end is
        the reaper's, and rq keeps saying why."""
        found = [req for rid in request_ids if (req := self.engine.find(rid)) is not None]
        out = StepResult()
        if not found:
            return out
        started = self.intake.still_started([req.ticket for req in found])
        for req, ours in zip(found, started, strict=True):
            dropped = self.engine.cancel(req.id)
            out.merge(dropped if ours else _without(dropped, {req}))
        return out

    def _handle_command(self, cmd: ControlCommand) -> None:
        reply = ControlReply(worker_id=self.presence.worker_id, kind=cmd.kind)
        if cmd.kind == "cache_reset":
            reply.result = self.engine.reset_cache()
        else:
            reply.error = f"unknown command {cmd.kind!r}"
        self.publisher.reply(keys.control_reply(cmd.reply_id), reply.to_wire())

    # -- writes ----------------------------------------------------------------------------

    def _send(self, out: StepResult, writes: StepWrites) -> None:
        """Turn the engine's result into this step's writes and hand them to the outbox."""
        now = time.monotonic()
        _fill(writes, out, self.presence.worker_id, self._hold, now)
        writes.index = out.index
        writes.index_firsts = out.index_firsts
        if self._index_full_due:
            why, self._index_full_due = self._index_full_due, ""
            writes.index_full = self.engine.held_blocks()
            writes.index_firsts = writes.index_firsts | self.engine.held_first_blocks()
            log.info("block index %s: writing its %d block(s)", why, len(writes.index_full))
        running = self.engine.running
        writes.busy = bool(running)
        writes.watched = [req.id for req in running]
        self._hold.keep_only(writes.watched)
        if self.presence.beat_due(now):
            writes.liveness = Liveness(self._gauges(), [req.ticket for req in running])
        self.outbox.send(writes)
        # After this step's publish, on the same thread; never queued twice (a Redis stall
        # would pile chores up behind the blocked publish).
        idle = self._maintenance is None or self._maintenance.done()
        if now >= self._next_reap and idle:
            self._next_reap = now + REAP_INTERVAL_S
            self._maintenance = self.outbox.after(self._maintain)

    def _maintain(self) -> None:
        """Peers' deaths every REAP_INTERVAL_S, rq's own registry cleaning less often."""
        try:
            self.reaper.reap()
            now = time.monotonic()
            if now >= self._next_maintenance:
                self._next_maintenance = now + MAINTENANCE_INTERVAL_S
                self.intake.clean_registries()
        except Exception:  # a chore on the publisher thread: log it, never lose it silently
            log.warning("rq registry maintenance failed; retrying later", exc_info=True)

    def _gauges(self) -> dict[str, Any]:
        gauges = {**self.static_gauges, **self.engine.gauges()}
        return gauges

    # -- a false death, a registration lost; fault injection --------------------------------

    def _check_standing(self, pending: StepResult, index_lost: bool = False) -> StepResult:
        """A beat or a publish saw the worker reaped, its registration incomplete or its block
        index gone: read what Redis shows, and register again unless all is whole. `pending`
        (this step's results, not sent yet) comes back less what belongs to requests dropped."""
        self.outbox.settle()  # what is in flight lands first; its reads wait for take_reads
        standing = self.presence.standing()
        if not standing.whole:
            return self._rejoin(standing, pending)
        self.presence.checked()  # a beat that saw arrive half-written, or nothing at all
        if index_lost:  # the set lapsed or was deleted, while the worker stayed registered
            self._index_full_due = "was gone (it lapsed or was deleted)"
        return pending

    def _rejoin(self, standing: Standing, pending: StepResult) -> StepResult:
        """The worker's registration is not whole (see Standing): a peer reaped it (its link was
        cut, or it was stopped or stuck, longer than peers wait), or Redis lost its keys, or
        they lapsed. The requests rq no longer has started were ended by the pool (the reaper
        failed them in rq and the routers moved on and set their cancel flags): they are dropped
        without a write, their events of this step too. Requests still started (the link came
        back before the verdict, or a job was taken after it) run on. Then register again."""
        tracked = {req for req in self.engine.running if isinstance(req.ticket, TakenJob)}
        tracked.update(r for r in pending.events if isinstance(r.ticket, TakenJob))
        tracked.update(e.request for e in pending.ended if isinstance(e.request.ticket, TakenJob))
        candidates = list(tracked)
        started = self.intake.still_started([req.ticket for req in candidates])
        gone = {req for req, ours in zip(candidates, started, strict=True) if not ours}
        dropped = StepResult()
        for req in gone:
            dropped.merge(self.engine.cancel(req.id))  # no-op for one that ended this step
        log.warning(
            "worker %s: %s, and %s: dropped %d request(s) the pool had failed, kept %d it had "
            "not; registering again",
            self.presence.worker_id,
            self.presence.take_silence().describe(),
            standing.what_happened(),
            len(gone),
            len(self.engine.running),
        )
        self.presence.arrive(self._gauges())
        self.outbox.answered()
        self._index_full_due = _index_reason(standing)
        kept = _without(pending, gone)
        kept.merge(_without(dropped, gone))
        return kept

    def _fault_stall(self) -> None:
        """The FAULT_LOOP_STALL_ENV hook (tests only): one long pass, on request."""
        path = self._fault_stall_file.replace("{worker_id}", self.presence.worker_id)
        try:
            with open(path) as f:
                seconds = float(f.read().strip() or 0)
            os.unlink(path)
        except (OSError, ValueError):
            return
        log.warning("fault injection: the loop sleeps %.1fs in one iteration", seconds)
        time.sleep(seconds)

    # -- Redis lost, stop ------------------------------------------------------------------

    def _reconnect(self, exc: Exception) -> None:
        """Redis did not answer (a restart, a lost link, a failover): drop what runs (its last
        publish may or may not have landed, so its streams cannot go on), wait for Redis with
        backoff, read what happened meanwhile, register again and go on serving. The model and
        the prompt cache stay loaded; a step's counter deltas may be lost."""
        log.warning(
            "lost Redis (%s): dropping %d running request(s), reconnecting", exc, self.engine.active
        )
        self.outbox.abandon()
        dropped = self.engine.fail_all("the worker lost Redis mid-request", REDIS_UNAVAILABLE)
        # What they held is not written: the publish in flight may not have landed, so it
        # could follow a gap; each stream gets its request's error alone (_fail_orphans).
        self._hold.clear()
        lost_at = time.monotonic()
        delay = RECONNECT_MIN_S
        standing: Standing | None = None
        while self._stop_requests == 0:
            self.presence.progress()  # waiting for Redis is progress: the loop is not stuck
            try:
                # Read before arrive deletes the reaped claim; kept if arrive fails half-way.
                standing = standing or self.presence.standing()
                self.presence.arrive(self._gauges())
            except redis.RedisError as again:
                log.info("Redis still unreachable (%s); retrying in %.1fs", again, delay)
                time.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            self._index_full_due = _index_reason(standing)
            by_pool, by_us = self._fail_orphans(dropped)
            # It runs nothing now: a job rq still shows as its own ended on a primary that was
            # lost before its replica heard (a failover), or on a restart from a snapshot.
            self._fail_leftovers()
            self._give_back_taken()
            log.warning(
                "worker %s reconnected to Redis: %s, and %s: dropped %d request(s) the pool had "
                "failed or Redis lost, failed %d it could no longer finish; registered again",
                self.presence.worker_id,
                self.presence.take_silence().describe(time.monotonic() - lost_at),
                standing.what_happened(),
                by_pool,
                by_us,
            )
            return

    def _fail_orphans(self, dropped: StepResult) -> tuple[int, int]:
        """Jobs rq still has started (a link that came back before any verdict, a persistent
        Redis that kept them) are failed, so their clients get an error and rq shows the truth;
        jobs the pool ended meanwhile (a peer's reaper) or Redis lost are left alone. Returns
        (left alone, failed here)."""
        try:
            tickets = [e.request.ticket for e in dropped.ended]
            started = self.intake.still_started(tickets)
            unstarted = self.intake.reclaim_unstarted(tickets)
            kept = StepResult(counters=dropped.counters)
            for ended, *ours in zip(dropped.ended, started, unstarted, strict=True):
                if any(ours):
                    kept.events[ended.request] = dropped.events.get(ended.request, [])
                    kept.ended.append(ended)
            writes = StepWrites()
            _fill(writes, kept, self.presence.worker_id, self._hold, time.monotonic())
            self.publisher.publish(writes)
        except redis.RedisError:
            log.warning("could not fail the requests dropped with Redis", exc_info=True)
            return 0, 0
        return len(dropped.ended) - len(kept.ended), len(kept.ended)

    def _fail_leftovers(self) -> None:
        try:
            self.reaper.reap_own_leftovers(
                "lost Redis (which lost the job's end)",
                "rq still showed as its own after Redis came back: their ends were lost",
            )
        except redis.RedisError:
            log.warning("could not fail the jobs whose end Redis lost", exc_info=True)

    def _give_back_taken(self) -> None:
        try:
            back = self.intake.give_back()
        except redis.RedisError:
            log.warning("could not return the jobs a lost take left unstarted", exc_info=True)
            return
        if back:
            log.warning("returned %d job(s) a lost take left unstarted to their queues", back)

    def shutdown(self) -> None:
        try:
            self.outbox.settle()
            if self.engine.active:  # a cold stop: no client may wait on a stopped worker
                self._send(
                    self.engine.fail_all("worker stopped before the request finished"), StepWrites()
                )
                self.outbox.settle()
            self.presence.leave()
        except redis.RedisError as exc:
            # Redis went first (e.g. honcho stops everything at once): nothing left to tell.
            log.warning("could not unregister from Redis: %s", exc)
        finally:
            self.outbox.close()
        log.info("worker %s stopped", self.presence.worker_id)


def _fill(writes: StepWrites, out: StepResult, worker_id: str, hold: EventHold, now: float) -> None:
    """The engine's result as the publisher's data: packed events per job (a non-streamed
    request's as `hold` lets them go), and job ends."""
    for req, step_events in out.events.items():
        events = hold.take(req.id, req.spec.stream, step_events, now)
        if not events:
            continue
        writes.streams.append((req.ticket, [e.to_wire() for e in events]))
        if events[0].seq > 0:  # its stream was started by an earlier step's events
            writes.ongoing.add(req.ticket.id)
    for ended in out.ended:
        req = ended.request
        outcome = _OUTCOME[req.status]
        result = (
            {**ended.result(), "worker_id": worker_id} if outcome is JobOutcome.FINISHED else None
        )
        writes.ended.append(JobEnd(req.ticket, outcome, result, req.error))
    writes.counters.update(out.counters)
    if out.last_reject is not None:
        writes.last_reject = out.last_reject


def _without(out: StepResult, requests: set[Request]) -> StepResult:
    """`out` less the events and ends of `requests` (the pool ended them: nothing of theirs is
    written); its counters, index changes and last reject stay."""
    return StepResult(
        events={req: evs for req, evs in out.events.items() if req not in requests},
        ended=[e for e in out.ended if e.request not in requests],
        counters=out.counters,
        last_reject=out.last_reject,
        prefill_pending=out.prefill_pending,
        index=out.index,
        index_firsts=out.index_firsts,
    )


def _index_reason(standing: Standing) -> str:
    """Why the block index is written whole after registering again, as the log says it."""
    if standing.data_lost:
        return f"lost (Redis restart or flush: {standing.what_happened()})"
    return "rewritten with the new registration"

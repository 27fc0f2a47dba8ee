"""The worker's loop, read top to bottom like rq's `work()`: run one step, act on what the last
publish read back (cancels, control commands), take jobs and admit them into the batch, hand the
step's writes to the publisher thread, repeat. The first SIGTERM/SIGINT asks for a warm stop
(finish what runs, take no more work); a second forces a cold stop.

Publishing runs on one background thread, in step order, so the Redis round trip overlaps the
next decode step (mx.eval releases the GIL) instead of adding to it: the step runs first, and
only then does the loop wait for (and act on) the publish it overlapped."""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis

from shared import keys
from shared.wire import ControlCommand, ControlReply, StreamEvent
from worker.broker.intake import RqIntake, TakenJob
from worker.broker.metrics_sink import MetricsSink
from worker.broker.publisher import Publisher, PublishResult, StepWrites
from worker.prompt_cache.policy import PromptCache
from worker.scheduler import Scheduler, StepOutput

log = logging.getLogger("mlxcel.worker")

IDLE_BLOCK_S = 1.0
# How often a worker runs rq's registry maintenance (rq's own workers: every 10 minutes).
MAINTENANCE_INTERVAL_S = 60.0
# Backoff while Redis is unreachable.
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 5.0


@dataclass
class WorkerLoop:
    intake: RqIntake
    scheduler: Scheduler
    publisher: Publisher
    prompt_cache: PromptCache | None
    metrics: MetricsSink
    static_gauges: dict[str, Any]
    # When idle, how long a burst of arrivals may be gathered to prefill as one batch.
    admission_window_s: float = 0.0
    jobs: dict[str, TakenJob] = field(default_factory=dict)
    _stop_requests: int = 0
    _queued: int = 0
    _last_reject_sent: dict[str, Any] | None = None
    _pending: Future[PublishResult] | None = None
    _next_maintenance: float = 0.0
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="publish")
    )

    def install_signal_handlers(self) -> None:
        def ask_stop(signum: int, _frame: Any) -> None:
            self._stop_requests += 1
            log.info("signal %s: %s stop", signum, "warm" if self._stop_requests == 1 else "cold")

        signal.signal(signal.SIGTERM, ask_stop)
        signal.signal(signal.SIGINT, ask_stop)

    def run(self) -> None:
        self._register()
        try:
            while self._stop_requests == 0 or (self.jobs and self._stop_requests == 1):
                try:
                    self.iterate()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self._reconnect(exc)
        finally:
            self.shutdown()

    def _register(self) -> None:
        self.publisher.claim_worker_id()
        with self.publisher.r.pipeline(transaction=False) as pipe:
            self.publisher.register(pipe, self._gauges())
            pipe.execute()
        self.intake.register()

    def _reconnect(self, exc: Exception) -> None:
        """Redis went away (restart, network): drop what runs (its streams and jobs may be gone
        with Redis), wait for Redis with backoff, register again and go on serving. The model
        and the prompt cache stay loaded; a step's counter deltas may be lost."""
        log.warning("lost Redis (%s): dropping %d running request(s), reconnecting", exc,
                    len(self.jobs))  # fmt: skip
        self._pending = None  # what it was sending went with the connection
        orphans = list(self.jobs.values())
        for rid in list(self.jobs):
            self.scheduler.cancel(rid)  # frees the slot; not a healthy finish, so no donation
        self.jobs.clear()
        delay = RECONNECT_MIN_S
        while self._stop_requests == 0:
            try:
                self._register()
            except redis.RedisError as again:
                log.info("Redis still unreachable (%s); retrying in %.1fs", again, delay)
                time.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            log.info("reconnected to Redis; serving again")
            self._fail_orphans(orphans)
            return

    def _fail_orphans(self, orphans: list[TakenJob]) -> None:
        """Jobs that survived in Redis (a persistent Redis kept them) are failed, so their
        clients get an error and rq shows the truth; jobs Redis lost are left alone."""
        try:
            with self.publisher.r.pipeline(transaction=False) as pipe:
                for taken in orphans:
                    pipe.exists(taken.job.key)
                alive = pipe.execute()
            writes = StepWrites()
            for taken, exists in zip(orphans, alive, strict=True):
                if exists:
                    error = StreamEvent(kind="error", error="the worker lost Redis mid-request",
                                        error_type="server_error")  # fmt: skip
                    self._collect(StepOutput(taken.job.id, [error], "failed",
                                             error="lost Redis"), writes, taken)  # fmt: skip
            if writes.events:
                self.publisher.publish(writes, [])
        except redis.RedisError:
            log.warning("could not fail the requests dropped with Redis", exc_info=True)

    def iterate(self) -> None:
        writes = StepWrites()
        # Step first, while the last step's publish is still in flight on the publisher thread;
        # only then wait for it. Waiting before the step serialized the two (measured over 600
        # steps: 1,056 ms of waiting before, 26 ms after).
        for out in self.scheduler.step():
            self._collect(out, writes)
        self._act_on_reads(writes)
        # Admit after the step, so what admission emits (a warm request's first token) goes out
        # in this step's publish instead of waiting for the next step to finish.
        running = len(self.jobs)
        if self._stop_requests == 0:
            self._take_jobs(writes)
        self._publish(writes)
        if len(self.jobs) > running and self._pending is not None:
            # New requests' first events go out before the next step starts: the step's Python
            # would hold the GIL the publisher thread needs (measured: 5-8 ms late at times).
            # The result stays pending: the next `_act_on_reads` consumes it.
            self._pending.result()

    def _take_jobs(self, writes: StepWrites) -> None:
        slots = self.scheduler.free_slots
        if slots <= 0:
            return
        idle = not self.jobs
        if not idle and self._queued <= 0:
            return  # the last step's pipeline saw nothing queued: no extra round trip
        # Block for work only with nothing to send: a step's last events (a finished request's
        # `done`) must not wait out the idle timeout.
        pending_writes = bool(writes.events or writes.ended)
        block = IDLE_BLOCK_S if idle and not pending_writes else None
        needs_prefill = self._admit(self.intake.take(slots, block), writes)
        # A burst's jobs arrive a few ms apart: an idle worker whose new work still has its
        # prefill ahead gathers the rest of the burst, so they prefill as one batch. A warm
        # request that already started (its short remainder ran at admission) gains nothing
        # from waiting, so it never does.
        if idle and needs_prefill and self.admission_window_s > 0:
            more = self.intake.gather(self.scheduler.free_slots, self.admission_window_s)
            self._admit(more, writes)

    def _admit(self, taken_jobs: list[TakenJob], writes: StepWrites) -> bool:
        """Admit taken jobs into the batch; whether any of them still has its prefill ahead."""
        if taken_jobs:
            log.debug("admitting %d job(s); %d running", len(taken_jobs), len(self.jobs))
        needs_prefill = False
        for taken in taken_jobs:
            if taken.request is None:
                self._collect(
                    StepOutput(
                        taken.job.id,
                        [
                            StreamEvent(
                                kind="error", error=taken.error, error_type="invalid_request_error"
                            )
                        ],
                        "failed",
                        error=taken.error,
                    ),
                    writes,
                    taken,
                )
                continue
            self.jobs[taken.request.request_id] = taken
            out = self.scheduler.admit(taken.request)
            needs_prefill = needs_prefill or out.needs_prefill
            self._collect(out, writes)
        return needs_prefill

    def _collect(self, out: StepOutput, writes: StepWrites, taken: TakenJob | None = None) -> None:
        if out.events:
            writes.events.setdefault(out.request_id, []).extend(e.to_wire() for e in out.events)
        if out.status == "running":
            return
        taken = taken or self.jobs.pop(out.request_id, None)
        if taken is None:
            return
        if out.status == "finished":
            result = out.result or {}
            writes.ended.append(lambda p, t=taken, r=result: self.intake.finish(p, t, r))
        elif out.status == "cancelled":
            writes.ended.append(lambda p, t=taken: self.intake.cancel(p, t))
        else:
            writes.ended.append(lambda p, t=taken, e=out.error: self.intake.fail(p, t, e))

    def _publish(self, writes: StepWrites) -> None:
        """Drain this step's counters and hand everything to the publisher thread."""
        counters = self.scheduler.counters.take()
        if self.prompt_cache is not None:
            counters.update(self.prompt_cache.counters.take())
            last = self.prompt_cache.counters.last_reject
            if last is not None and last != self._last_reject_sent:
                writes.last_reject = self._last_reject_sent = dict(last)
        writes.counters = counters
        self.metrics.apply(counters, self.scheduler.active)
        busy = bool(self.jobs)
        writes.ended.append(lambda p: self.intake.set_busy(busy, p))
        if self.publisher.liveness_due():
            writes.gauges = self._gauges()
            running = list(self.jobs.values())
            writes.ended.append(lambda p: self.intake.heartbeat(p, running))
        self._flush()  # at most one step in flight (normally already consumed by _act_on_reads)
        self._pending = self._executor.submit(self.publisher.publish, writes, list(self.jobs))
        now = time.monotonic()
        if now >= self._next_maintenance:  # after this step's publish, on the same thread
            self._next_maintenance = now + MAINTENANCE_INTERVAL_S
            self._executor.submit(self._maintain)

    def _maintain(self) -> None:
        try:
            self.intake.clean_registries()
        except redis.RedisError:
            log.warning("rq registry maintenance failed; retrying later", exc_info=True)

    def _act_on_reads(self, writes: StepWrites) -> None:
        """The last publish's reads: drop cancelled requests, run control commands. It had a whole
        step to finish, so this rarely waits; a Redis error it met is raised here."""
        if self._pending is None:
            return
        result, self._pending = self._pending.result(), None
        self._queued = result.queued
        for rid in result.cancelled:
            out = self.scheduler.cancel(rid)
            if out is not None:
                self._collect(out, writes)
        for cmd in result.commands:
            self._handle_command(cmd)

    def _flush(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def _gauges(self) -> dict[str, Any]:
        g: dict[str, Any] = dict(self.static_gauges)
        if self.prompt_cache is not None:
            g.update(self.prompt_cache.gauges())
        g["batch_current_size"] = self.scheduler.active
        self.metrics.set_gauges(g)
        return g

    def _handle_command(self, cmd: ControlCommand) -> None:
        reply = ControlReply(worker_id=self.scheduler.worker_id, kind=cmd.kind)
        if cmd.kind == "cache_reset":
            if self.prompt_cache is None:
                reply.result = {"cleared": True, "freed_bytes": 0, "freed_entries": 0}
            else:
                r = self.prompt_cache.reset()
                reply.result = {
                    "cleared": bool(r.cleared),
                    "freed_bytes": int(r.freed_bytes),
                    "freed_entries": int(r.freed_entries),
                }
        else:
            reply.error = f"unknown command {cmd.kind!r}"
        self.publisher.reply(keys.control_reply(cmd.reply_id), reply.to_wire())

    def shutdown(self) -> None:
        try:
            self._flush()
            self._fail_running("worker stopped before the request finished")
            self._flush()
            with self.publisher.r.pipeline(transaction=False) as pipe:
                self.publisher.unregister(pipe)
                pipe.execute()
            self.intake.unregister()
        except redis.RedisError as exc:
            # Redis went first (e.g. honcho stops everything at once): nothing left to tell.
            log.warning("could not unregister from Redis: %s", exc)
        log.info("worker %s stopped", self.scheduler.worker_id)

    def _fail_running(self, reason: str) -> None:
        """A cold stop leaves running jobs: fail them so no client waits on a dead worker."""
        if not self.jobs:
            return
        writes = StepWrites()
        for rid in list(self.jobs):
            error = StreamEvent(kind="error", error="worker stopped", error_type="server_error")
            self._collect(StepOutput(rid, [error], "failed", error=reason), writes)
        self._publish(writes)

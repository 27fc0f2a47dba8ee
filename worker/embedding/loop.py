"""The embedding worker's loop, read top to bottom like rq's `work()` (and worker/loop.py): take
the jobs waiting (blocking a second when there are none), compute every input of every job in
shared forward passes, write each job's one reply and its end to rq in one publish (which also
beats and reads control commands), repeat. The first SIGTERM/SIGINT stops it after the jobs in
hand; a second one at once.

A job is answered within the iteration that took it, so nothing is ever running between two
iterations: no cancels to watch, no executions to extend; a client that left has its cancel flag
up, and the stream write then writes nothing (broker.intake.append_events).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys
from shared.embedding_wire import EmbeddingReply, float32_bytes
from shared.errors import ErrorKind
from shared.wire import ControlCommand, ControlReply
from worker.broker.intake import JobEnd, JobOutcome, TakenJob
from worker.broker.presence import WorkerPresence
from worker.broker.publisher import Liveness, Publisher, PublishResult, StepWrites
from worker.broker.reaper import REAP_INTERVAL_S, Reaper
from worker.embedding.batcher import embed_jobs
from worker.embedding.intake import EmbeddingIntake, EmbeddingJob
from worker.embedding.model import EmbeddingModel

log = logging.getLogger("mlxcel.worker.embedding")

IDLE_BLOCK_S = 1.0
MAINTENANCE_INTERVAL_S = 60.0
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 5.0


@dataclass
class EmbeddingLoop:
    model: EmbeddingModel
    presence: WorkerPresence
    intake: EmbeddingIntake
    publisher: Publisher
    reaper: Reaper
    vocab_size: int
    context_length: int
    max_jobs: int  # jobs taken per iteration (their inputs share forward passes)
    static_gauges: dict[str, Any]
    banner: str = ""
    _stop_requests: int = 0
    _next_reap: float = 0.0
    _next_maintenance: float = 0.0
    _jobs_done: int = 0

    def install_signal_handlers(self) -> None:
        def ask_stop(signum: int, _frame: Any) -> None:
            self._stop_requests += 1
            log.info("signal %s: stop", signum)

        signal.signal(signal.SIGTERM, ask_stop)
        signal.signal(signal.SIGINT, ask_stop)

    def run(self) -> None:
        self.presence.arrive(self._gauges())
        self.presence.start_heartbeat()
        self.reaper.reap_own_past()
        try:
            while self._stop_requests == 0:
                try:
                    self.iterate()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self._reconnect(exc)
        finally:
            self.shutdown()

    def iterate(self) -> None:
        self.presence.progress()
        taken = self.intake.take(self.max_jobs, IDLE_BLOCK_S)
        writes = StepWrites()
        if taken:
            self._answer(taken, writes)
        now = time.monotonic()
        if self.presence.beat_due(now):
            writes.liveness = Liveness(self._gauges(), [])
        self._act_on(self.publisher.publish(writes))
        if now >= self._next_reap:
            self._next_reap = now + REAP_INTERVAL_S
            self._maintain(now)

    # -- answering -------------------------------------------------------------------------

    def _answer(self, taken: list[TakenJob], writes: StepWrites) -> None:
        """Every valid job's vectors from shared forward passes; a malformed or out-of-bounds
        job fails alone with its reason."""
        valid: list[EmbeddingJob] = []
        for job in taken:
            error = self._refusal(job)
            if error is None:
                valid.append(job)
            else:
                log.warning("job %s: %s", job.id, error)
                self._fail(job, error, ErrorKind.INVALID_REQUEST, writes)
        if not valid:
            return
        inputs = [job.embedding.inputs for job in valid if job.embedding is not None]
        # rq's state says busy while the passes run (`rq info`); the publish sets it idle.
        self.presence.set_busy(True, self.presence.connection)
        try:
            vectors = embed_jobs(self.model, inputs, on_pass=self.presence.progress)
        except Exception as exc:  # a fault in the model: each job says so, the loop goes on
            log.exception("embedding %d job(s) failed", len(valid))
            for job in valid:
                self._fail(job, f"the embedding failed: {exc}", ErrorKind.SERVER_ERROR, writes)
            return
        wid = self.presence.worker_id
        for job, vecs in zip(valid, vectors, strict=True):
            assert job.embedding is not None
            tokens = job.embedding.total_tokens
            reply = EmbeddingReply(
                kind="done",
                embeddings=[float32_bytes(v) for v in vecs],
                dimensions=self.model.dimensions,
                prompt_tokens=tokens,
                worker_id=wid,
            )
            writes.streams.append((job, [reply.to_wire()]))
            result = {"worker_id": wid, "inputs": len(vecs), "prompt_tokens": tokens}
            writes.ended.append(JobEnd(job, JobOutcome.FINISHED, result))
        self._jobs_done += len(valid)

    def _refusal(self, job: TakenJob) -> str | None:
        """Why this job cannot run (the router checks the same bounds first), else None."""
        req = job.embedding if isinstance(job, EmbeddingJob) else None
        if req is None:
            return job.error or "not an embedding job"
        for i, tokens in enumerate(req.inputs):
            if len(tokens) > self.context_length:
                return (
                    f"input {i} has {len(tokens)} tokens; the model's context is "
                    f"{self.context_length}"
                )
            if max(tokens) >= self.vocab_size:
                return f"input {i} holds a token id >= the vocabulary size {self.vocab_size}"
        return None

    def _fail(self, job: TakenJob, error: str, kind: ErrorKind, writes: StepWrites) -> None:
        reply = EmbeddingReply(
            kind="error", error=error, error_type=kind.value, worker_id=self.presence.worker_id
        )
        writes.streams.append((job, [reply.to_wire()]))
        writes.ended.append(JobEnd(job, JobOutcome.FAILED, error=error))

    # -- reads and chores ------------------------------------------------------------------

    def _act_on(self, reads: PublishResult) -> None:
        for cmd in reads.commands:
            self._handle_command(cmd)

    def _handle_command(self, cmd: ControlCommand) -> None:
        reply = ControlReply(worker_id=self.presence.worker_id, kind=cmd.kind)
        if cmd.kind == "cache_reset":  # no prompt cache: nothing to clear
            reply.result = {"cleared": True, "freed_bytes": 0, "freed_entries": 0}
        else:
            reply.error = f"unknown command {cmd.kind!r}"
        self.publisher.reply(keys.control_reply(cmd.reply_id), reply.to_wire())

    def _maintain(self, now: float) -> None:
        """Peers' deaths every REAP_INTERVAL_S, rq's registry cleaning less often."""
        try:
            self.reaper.reap()
            if now >= self._next_maintenance:
                self._next_maintenance = now + MAINTENANCE_INTERVAL_S
                self.intake.clean_registries()
        except redis.RedisError:
            raise
        except Exception:
            log.warning("rq registry maintenance failed; retrying later", exc_info=True)

    def _gauges(self) -> dict[str, Any]:
        return {**self.static_gauges, "active": 0, "embedding_jobs_done": self._jobs_done}

    # -- Redis lost, stop ------------------------------------------------------------------

    def _reconnect(self, exc: Exception) -> None:
        """Redis went away: nothing runs between iterations, so the registration is redone
        once Redis answers, and the jobs rq still shows as this worker's (the failed
        iteration's, or ones whose end a failover lost) are failed as lost."""
        log.warning("lost Redis (%s); reconnecting", exc)
        delay = RECONNECT_MIN_S
        while self._stop_requests == 0:
            self.presence.progress()
            try:
                self.presence.arrive(self._gauges())
            except redis.RedisError as again:
                log.info("Redis still unreachable (%s); retrying in %.1fs", again, delay)
                time.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            try:
                self.reaper.reap_own_leftovers(
                    "lost Redis", "rq still showed as its own after Redis came back"
                )
            except redis.RedisError:
                log.warning("could not fail the jobs left started by the lost Redis")
            try:  # a take the lost connection cut short: its jobs back to their queues
                back = self.intake.give_back()
            except redis.RedisError:
                log.warning("could not return the jobs a lost take left unstarted")
            else:
                if back:
                    log.warning("returned %d job(s) a lost take left unstarted", back)
            log.info("reconnected to Redis; serving again")
            return

    def shutdown(self) -> None:
        try:
            self.presence.leave()
        except redis.RedisError as exc:
            log.warning("could not unregister from Redis: %s", exc)
        log.info("worker %s stopped", self.presence.worker_id)

"""rq intake: the worker registers as an rq worker and pulls MANY jobs into its running batch.

rq's own worker forks one child per job and runs one job at a time, which defeats batching. This
keeps rq's registration, dequeue and registries (see ../shared/notes/rq-batching.md) so that
`rq info` and rq-dashboard show the truth: a job is in the StartedJobRegistry from the moment it
joins the batch, then in the Finished, Failed or Canceled registry, and the worker is listed with
heartbeats, busy while it has jobs. It relies on private rq methods (`Job._handle_success`,
`Job._handle_failure`): rq is pinned, and tests/test_rq_intake.py fails loudly if they change.

Left out (as rq's job features go): job timeouts (max_tokens and the context bound a generation),
success/failure callbacks, dependents, retries.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import DequeueTimeout
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, clean_registries
from rq.utils import now
from rq.worker import WorkerStatus

from shared import keys
from shared.wire import GenerationRequest, MsgpackSerializer, WireError

log = logging.getLogger("mlxcel.worker.intake")

RESULT_TTL_S = 600
# A burst's jobs arrive a few ms apart (the router tokenizes and enqueues each): a pause this long
# ends the burst.
GATHER_GAP_S = 0.008
# A running job's rq execution (its StartedJobRegistry entry) lives this long past its last
# heartbeat. The loop heartbeats every second, so this only lapses when the worker is gone; rq's
# default (job timeout + 60 s, ~16 min here) would keep a dead worker's jobs "started" that long.
EXECUTION_TTL_S = 60


@dataclass
class TakenJob:
    job: Job
    execution: Execution
    request: GenerationRequest | None  # None: the payload was malformed (failed right away)
    error: str = ""


class RqIntake:
    def __init__(self, connection: redis.Redis, worker_id: str) -> None:
        self.connection = connection
        self.worker_id = worker_id
        # Own queue first (cache-aware routing will target it), then the shared one.
        self.queues = [
            Queue(keys.worker_queue_name(worker_id), connection=connection,
                  serializer=MsgpackSerializer),
            Queue(keys.SHARED_QUEUE, connection=connection, serializer=MsgpackSerializer),
        ]  # fmt: skip
        # SimpleWorker is only a holder for rq's registration/heartbeat bookkeeping.
        self.rq_worker = SimpleWorker(
            self.queues,
            connection=connection,
            name=keys.rq_worker_name(worker_id),
            serializer=MsgpackSerializer,
        )
        self.rq_worker.hostname = socket.gethostname()
        self.rq_worker.pid = os.getpid()
        self._busy = False

    @property
    def name(self) -> str:
        return self.rq_worker.name

    @property
    def queue_keys(self) -> list[str]:
        return [q.key for q in self.queues]

    def register(self) -> None:
        # A worker restarted under the same id after a crash finds its old registration still
        # there (rq keeps it until the heartbeat TTL runs out): retire it, as rq would have.
        if self.connection.exists(self.rq_worker.key):
            stale = SimpleWorker.find_by_key(
                self.rq_worker.key, connection=self.connection, serializer=MsgpackSerializer
            )
            if stale is not None:
                stale.register_death()
            self.connection.srem(self.rq_worker.redis_workers_keys, self.rq_worker.key)
            self.connection.delete(self.rq_worker.key)
        self.rq_worker.register_birth()
        self.rq_worker.set_state(WorkerStatus.IDLE)

    def clean_registries(self) -> None:
        """rq's own registry maintenance for this worker's queues (its workers run it every few
        minutes): a job whose worker died (its execution no longer heartbeats) moves from the
        StartedJobRegistry to the FailedJobRegistry, so `rq info` and rq-dashboard stop calling it
        started."""
        for queue in self.queues:
            clean_registries(queue)

    def unregister(self) -> None:
        try:
            self.rq_worker.register_death()
        except redis.RedisError:
            log.warning("could not register worker death (Redis unreachable)")

    def take(self, max_jobs: int, block_s: float | None) -> list[TakenJob]:
        """Dequeue up to `max_jobs` jobs: block up to `block_s` for the first one (None: don't
        block), then take what is already queued. Each job taken is marked started (Execution,
        StartedJobRegistry) in one pipeline."""
        first = self._dequeue(None if block_s is None else max(1, round(block_s)))
        if first is None:
            return []
        return self._start(self._take_more([first], max_jobs, 0.0))

    def gather(self, max_jobs: int, window_s: float) -> list[TakenJob]:
        """Take the jobs of a burst still arriving, until it pauses (GATHER_GAP_S) or the window
        ends, so they prefill as one batch with what was just admitted."""
        if max_jobs <= 0 or window_s <= 0:
            return []
        taken = self._take_more([], max_jobs, window_s)
        return self._start(taken) if taken else []

    def _take_more(
        self, taken: list[tuple[Job, Queue]], max_jobs: int, window_s: float
    ) -> list[tuple[Job, Queue]]:
        deadline = time.monotonic() + window_s
        quiet_until = time.monotonic() + min(GATHER_GAP_S, window_s)
        while len(taken) < max_jobs:
            got = self._dequeue(None)
            now = time.monotonic()
            if got is not None:
                taken.append(got)
                quiet_until = now + GATHER_GAP_S
            elif now >= min(deadline, quiet_until):
                break
            else:
                time.sleep(0.001)
        return taken

    def _dequeue(self, timeout: int | None) -> tuple[Job, Queue] | None:
        try:
            return Queue.dequeue_any(
                self.queues, timeout, connection=self.connection, serializer=MsgpackSerializer
            )
        except DequeueTimeout:
            return None

    def _start(self, taken: list[tuple[Job, Queue]]) -> list[TakenJob]:
        out: list[TakenJob] = []
        with self.connection.pipeline(transaction=False) as pipe:
            for job, queue in taken:
                execution = Execution.create(
                    job, EXECUTION_TTL_S, pipeline=pipe, worker_name=self.name
                )
                job.prepare_for_execution(self.name, pipeline=pipe)
                pipe.lrem(queue.intermediate_queue_key, 0, job.id)
                out.append(self._parse(job, execution))
            pipe.execute()
        return out

    @staticmethod
    def _parse(job: Job, execution: Execution) -> TakenJob:
        try:
            request = GenerationRequest.from_wire(job.kwargs.get("request"))
        except (WireError, AttributeError, TypeError, ValueError) as exc:
            return TakenJob(job, execution, None, f"malformed job payload: {exc}")
        return TakenJob(job, execution, request)

    def set_busy(self, busy: bool, pipe: Any) -> None:
        """rq's busy/idle state; written only from the publisher's pipeline, in step order."""
        if busy != self._busy:
            self._busy = busy
            self.rq_worker.set_state(WorkerStatus.BUSY if busy else WorkerStatus.IDLE, pipe)

    # -- ending jobs: each writes into the caller's pipeline (the publisher's per-step one) --------

    def _end_execution(self, pipe: Any, taken: TakenJob) -> dict[str, Any]:
        """Close the job's execution (leaves the StartedJobRegistry); rq's handlers' kwargs."""
        job = taken.job
        job.ended_at = now()
        taken.execution.delete(job, pipe)
        if job.started_at is not None:  # rq-dashboard shows the worker's total working time
            self.rq_worker.increment_total_working_time(job.ended_at - job.started_at, pipe)
        return {
            "pipeline": pipe,
            "worker_name": self.name,
            "execution_id": taken.execution.id,
            "execution_started_at": taken.execution.created_at,
            "execution_ended_at": job.ended_at,
        }

    def finish(self, pipe: Any, taken: TakenJob, result: dict[str, Any]) -> None:
        job = taken.job
        job._result = result
        job._handle_success(RESULT_TTL_S, **self._end_execution(pipe, taken))
        job.cleanup(RESULT_TTL_S, pipeline=pipe, remove_from_queue=False)
        self.rq_worker.increment_successful_job_count(pipeline=pipe)

    def fail(self, pipe: Any, taken: TakenJob, error: str) -> None:
        job = taken.job
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        job._handle_failure(error, **self._end_execution(pipe, taken))
        self.rq_worker.increment_failed_job_count(pipe)

    def cancel(self, pipe: Any, taken: TakenJob) -> None:
        job = taken.job
        job.set_status(JobStatus.CANCELED, pipeline=pipe)
        self._end_execution(pipe, taken)
        CanceledJobRegistry(
            job.origin, connection=self.connection, serializer=MsgpackSerializer
        ).add(job, ttl=RESULT_TTL_S, pipeline=pipe)

    def heartbeat(self, pipe: Any, active: list[TakenJob]) -> None:
        """Worker heartbeat plus each running job's execution, so the started registry holds."""
        self.rq_worker.heartbeat(pipeline=pipe)
        for t in active:
            t.execution.heartbeat(t.job.started_job_registry, EXECUTION_TTL_S, pipeline=pipe)

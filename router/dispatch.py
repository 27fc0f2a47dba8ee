"""Dispatch: enqueue a GenerationRequest as an rq job, then read its Redis stream back.

rq is synchronous, so enqueueing and job-status checks run in the threadpool on a sync client;
stream reads come from the process's StreamHub (one multi-stream XREAD for every request), so
the event loop never blocks and a request is never left hanging: no event within
`request_timeout_s`, or a failed rq job, ends the stream with a synthetic `error` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

import anyio
import redis
import redis.asyncio as aioredis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from router.stream_hub import Entry, StreamHub
from shared import keys
from shared.wire import (
    JOB_FUNC,
    STREAM_FIELD,
    GenerationRequest,
    MsgpackSerializer,
    StreamEvent,
    WireError,
)

log = logging.getLogger(__name__)

# How long a request waits on its stream before it checks its client and its job.
IDLE_CHECK_S = 1.0
# How often (at most) a waiting request asks rq whether its job failed.
JOB_CHECK_INTERVAL_S = 2.0
RESULT_TTL_S = 600
FAILURE_TTL_S = 3600
QUEUED_TTL_S = 600
# A cancelled request's stream lingers this long instead of being deleted: the worker may XADD
# a step or two more before it reads the cancel flag, and XADD on a deleted key would create a
# new stream without a TTL (the worker sets a stream's TTL with its first event only).
CANCELLED_STREAM_TTL_S = 60

# error_type of the events the router makes up itself (the worker never sends these).
TIMEOUT = "timeout"
JOB_FAILED = "job_failed"

Disconnected = Callable[[], Awaitable[bool]]


@dataclass
class Dispatcher:
    """Built once in lifespan; one per router process."""

    sync_redis: redis.Redis
    aredis: aioredis.Redis
    hub: StreamHub
    queue: Queue
    job_timeout_s: int
    request_timeout_s: float

    def enqueue(self, req: GenerationRequest) -> None:
        """Put the job on the shared queue (blocking: call it off the event loop)."""
        # rq's enqueue in one transaction (one round trip instead of rq's own two or three):
        # the job hash, its TTLs and the queue push land together or not at all.
        with self.sync_redis.pipeline() as pipe:
            self.queue.enqueue_call(
                func=JOB_FUNC,
                kwargs={"request": req.to_wire()},
                job_id=req.request_id,
                timeout=self.job_timeout_s,
                result_ttl=RESULT_TTL_S,
                failure_ttl=FAILURE_TTL_S,
                ttl=QUEUED_TTL_S,
                pipeline=pipe,
            )
            pipe.execute()

    async def events(
        self, req_id: str, disconnected: Disconnected | None = None
    ) -> AsyncIterator[StreamEvent]:
        """The request's events up to and including its `done` or `error`. Closing the iterator
        early (client gone) tells the worker to drop the sequence; the stream is deleted after."""
        finished = False
        try:
            async with aclosing(self._read(req_id, disconnected)) as reader:
                async for event in reader:
                    finished = event.kind in ("done", "error")
                    yield event
                    if finished:
                        return
        finally:
            # Shielded: this also runs when the client's task is being cancelled.
            with anyio.CancelScope(shield=True):
                await self._cleanup(req_id, cancel=not finished)

    async def _read(
        self, req_id: str, disconnected: Disconnected | None
    ) -> AsyncIterator[StreamEvent]:
        stream = keys.request_stream(req_id)
        queue = await self.hub.subscribe(stream)
        try:
            async for event in self._watch(req_id, queue, disconnected):
                yield event
        finally:
            self.hub.unsubscribe(stream)

    async def _watch(
        self, req_id: str, queue: asyncio.Queue[Entry], disconnected: Disconnected | None
    ) -> AsyncIterator[StreamEvent]:
        """Relay the hub's entries; between them, notice a vanished client, a failed or lost
        job, or the request timeout."""
        last_event_at = time.monotonic()
        next_check = last_event_at + JOB_CHECK_INTERVAL_S
        job_finished = False
        while True:
            # Per streamed token: take what the hub already queued without a wait; otherwise
            # wait under asyncio.timeout (wait_for would wrap each get in a new task).
            try:
                _, fields = queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(IDLE_CHECK_S):
                        _, fields = await queue.get()
                except TimeoutError:
                    fields = None
            if fields is not None:
                yield _decode(fields)
                last_event_at = time.monotonic()
                continue
            now = time.monotonic()
            if disconnected is not None and await disconnected():
                return
            if job_finished:  # rq says done, and nothing more came: the worker lost the end
                yield _error(JOB_FAILED, "the worker finished the job without a final event")
                return
            if now - last_event_at >= self.request_timeout_s:
                yield _error(TIMEOUT, f"no response from a worker in {self.request_timeout_s:g}s")
                return
            if now >= next_check:
                next_check = now + JOB_CHECK_INTERVAL_S
                try:
                    failure, job_finished = await anyio.to_thread.run_sync(self._job_state, req_id)
                except (redis.ConnectionError, redis.TimeoutError) as exc:  # Redis restarting
                    log.info("job check for %s failed (%s); retrying", req_id, exc)
                    continue
                if failure is not None:
                    yield _error(JOB_FAILED, failure)
                    return

    def _job_state(self, req_id: str) -> tuple[str | None, bool]:
        """(failure message or None, finished) from rq, on the sync client."""
        try:
            job = Job.fetch(req_id, connection=self.sync_redis, serializer=MsgpackSerializer)
            status = job.get_status(refresh=False)
        except NoSuchJobError:
            return "the job no longer exists (expired or deleted before a worker took it)", False
        if status == JobStatus.FINISHED:
            return None, True
        if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
            return _failure_text(job, status), False
        if status == JobStatus.STARTED:
            # rq only learns of a killed worker when its registries are cleaned, long after: the
            # worker's own liveness key (refreshed every second, LIVENESS_TTL_S) tells sooner.
            wid = keys.parse_rq_worker_name(job.worker_name or "")
            if wid is not None and not self.sync_redis.exists(keys.worker_info(wid)):
                return (
                    f"worker {wid} stopped while running this request (its liveness key "
                    f"expired); the request was not finished",
                    False,
                )
        return None, False

    async def _cleanup(self, req_id: str, cancel: bool) -> None:
        try:
            async with self.aredis.pipeline(transaction=False) as pipe:
                stream = keys.request_stream(req_id)
                if cancel:
                    pipe.set(keys.request_cancel(req_id), "1", ex=keys.REQUEST_TTL_S)
                    pipe.expire(stream, CANCELLED_STREAM_TTL_S)
                else:  # the worker wrote its last event: nothing will recreate the key
                    pipe.delete(stream)
                await pipe.execute()
        except redis.RedisError:
            log.warning("could not clean up request %s", req_id, exc_info=True)


def _failure_text(job: Job, status: JobStatus) -> str:
    result = job.latest_result()
    text = (result.exc_string if result is not None else None) or job.exc_info or ""
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return f"the worker's job {status.value}" + (f": {last}" if last else "")


def _decode(fields: dict[bytes, bytes]) -> StreamEvent:
    data = fields.get(STREAM_FIELD)
    if data is None:
        return _error(JOB_FAILED, "a stream entry without the event field")
    try:
        return StreamEvent.from_wire(data)
    except (WireError, ValueError) as exc:
        return _error(JOB_FAILED, f"an unreadable stream entry: {exc}")


def _error(error_type: str, message: str) -> StreamEvent:
    return StreamEvent(kind="error", error=message, error_type=error_type)


def build_queue(sync_redis: redis.Redis) -> Queue:
    return Queue(keys.SHARED_QUEUE, connection=sync_redis, serializer=MsgpackSerializer)

"""Dispatch: enqueue a GenerationRequest as an rq job, then read its Redis stream back.

rq is synchronous, so enqueueing and job-status checks run in the threadpool on a sync client;
stream reads come from the process's StreamHub (one multi-stream XREAD for every request), so
the event loop never blocks and a request is never left hanging: no event within
`request_timeout_s`, or a failed rq job, ends the stream with a synthetic `error` event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import redis
import redis.asyncio as aioredis
from redis.client import Pipeline
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.utils import get_version

from router.admission.inline import INLINE_PROMPT_SIZE
from router.placement.ledger import AdmissionLedger
from router.redis_batch import RedisBatch
from router.relay.attempt import Attempt, JobState
from router.relay.direct_lane import DirectLane
from router.relay.job_template import JobTemplate
from router.relay.stream_hub import StreamHub
from router.relay.watch import Disconnected, Watch
from shared import keys
from shared.errors import ErrorKind
from shared.liveness import WORKER_LOST_MARK, lost_verdict
from shared.wire import (
    JOB_FUNC,
    GenerationRequest,
    MsgpackSerializer,
    StreamEvent,
)

log = logging.getLogger(__name__)

# A request that ended without its worker's last event (client gone, timeout, worker lost) gets its
# cancel flag and its stream lingers this long instead of being deleted: the worker may write a
# step or two more before it reads the flag (each of its writes sets the stream's TTL too).
CANCELLED_STREAM_TTL_S = 60

# How far a job check looks for a queued job in its queue and that queue's taken list: past this
# many entries it cannot tell, and takes the job for on its queue.
QUEUE_SCAN_MAX = 1024

# A request's worker found lost (the reaper's verdict, shared.liveness.lost_verdict) costs it its
# attempt: one more is made while no token has reached the client.
MAX_ATTEMPTS = 2


@dataclass
class Dispatcher:
    """Built once in lifespan; one per router process."""

    sync_redis: redis.Redis
    aredis: aioredis.Redis
    hub: StreamHub
    job_timeout_s: int
    request_timeout_s: float
    ledger: AdmissionLedger
    batch: RedisBatch  # the event loop's small writes (router.redis_batch)
    _queues: dict[str, Queue] = dataclasses.field(default_factory=dict)
    # Each queue's job template; None: rq's own enqueue (router.relay.job_template).
    _templates: dict[str, JobTemplate | None] = dataclasses.field(default_factory=dict)
    _ending: set[asyncio.Future[None]] = dataclasses.field(default_factory=set)  # held to the end

    def queue_for(self, worker_id: str, model_id: str) -> Queue:
        """The worker's own rq queue, or ("" for the worker) the model's shared one, which every
        worker of the model reads after its own."""
        name = keys.worker_queue_name(worker_id) if worker_id else keys.model_queue_name(model_id)
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = Queue(
                name, connection=self.sync_redis, serializer=MsgpackSerializer
            )
        return q

    async def enqueue(self, req: GenerationRequest, worker_id: str = "") -> None:
        """Put the job on the worker's queue, or the shared one (see enqueue_all)."""
        await self.enqueue_all([(req, worker_id)])

    async def enqueue_all(self, jobs: list[tuple[GenerationRequest, str]]) -> None:
        """Put each job on its worker's queue, or the shared one ("" for a worker): rq's
        enqueue as commands (its queue's template filled in, or rq's own written into a
        pipeline that never runs: rq does no I/O for a job without dependencies once it has
        read the server's version, warm_rq), all of them sent as one MULTI/EXEC in the command
        batch, so every job hash, its TTLs and its queue push land together or none does: a
        request's choices reach their worker's queue at once, and it takes them together."""

        # Long prompts' jobs (msgpack, then deflate) are built off the event loop.
        long = sum(len(req.prompt_tokens) for req, _ in jobs) > INLINE_PROMPT_SIZE
        if long:
            commands = await anyio.to_thread.run_sync(self._jobs_commands, jobs)
        else:
            commands = self._jobs_commands(jobs)
        # A job placed on a worker that pushes (router.relay.submit names the channel): its
        # stream subscribed before the job exists, so the relay neither wakes the hub's read nor
        # waits for one (the relay's own end unsubscribes it). A job for the shared queue may go
        # to a worker that does not push: its stream is read.
        pushed = [
            keys.request_stream(req.request_id) for req, wid in jobs if req.relay_channel and wid
        ]
        for stream in pushed:
            self.hub.expect_push(stream)
        try:
            await self.batch.transaction(commands)
        except BaseException:
            for stream in pushed:
                self.hub.unsubscribe(stream)
            raise

    def _jobs_commands(self, jobs: list[tuple[GenerationRequest, str]]) -> list[tuple[Any, ...]]:
        return [c for req, worker_id in jobs for c in self._job_commands(req, worker_id)]

    def _job_commands(self, req: GenerationRequest, worker_id: str) -> list[tuple[Any, ...]]:
        """rq's enqueue of the request's job, as the commands of its transaction: its queue's
        template filled in (router.relay.job_template), or rq's own where it has none."""
        queue = self.queue_for(worker_id, req.model)
        kwargs: dict[str, object] = {"request": req.to_wire()}
        description = describe(req, worker_id)
        if queue.name not in self._templates:
            # Made at the queue's first job, which is the first it fills in. Two made at once
            # (the event loop's and a thread's) are both good: the last one stays.
            made = JobTemplate.made_by(self._rq_commands, queue, JOB_FUNC)
            self._templates[queue.name] = made
        template = self._templates[queue.name]
        if template is not None:
            return template.commands(req.request_id, kwargs, description)
        return self._rq_commands(queue, req.request_id, kwargs, description)

    def _rq_commands(
        self, queue: Queue, job_id: str, kwargs: dict[str, object], description: str
    ) -> list[tuple[Any, ...]]:
        """rq's own enqueue of a generation job, as commands."""
        pipe = self._job_pipeline(queue, JOB_FUNC, kwargs, job_id, description)
        commands = [args for args, _ in pipe.command_stack]
        pipe.reset()
        return commands

    def enqueue_job(
        self, queue: Queue, func: str, kwargs: dict[str, object], job_id: str, description: str
    ) -> None:
        """Any of the pool's jobs (a generation, an embedding), blocking (off the event loop):
        rq's enqueue in one transaction (one round trip instead of rq's own two or three)."""
        with self._job_pipeline(queue, func, kwargs, job_id, description) as pipe:
            pipe.execute()

    def _job_pipeline(
        self, queue: Queue, func: str, kwargs: dict[str, object], job_id: str, description: str
    ) -> Pipeline:
        pipe = self.sync_redis.pipeline()
        queue.enqueue_call(
            func=func,
            kwargs=kwargs,
            job_id=job_id,
            timeout=self.job_timeout_s,
            result_ttl=keys.JOB_RESULT_TTL_S,
            failure_ttl=keys.JOB_FAILURE_TTL_S,
            ttl=keys.JOB_QUEUED_TTL_S,
            description=description,
            pipeline=pipe,
        )
        return pipe

    def warm_rq(self) -> None:
        """Blocking, once at startup: rq reads the server's version (INFO) at a queue's first
        enqueue and keeps it on the client; read here, the event loop's enqueues do no I/O."""
        get_version(self.sync_redis)

    async def cancel(self, request_ids: list[str]) -> None:
        """Ask the workers to drop these requests (best effort: a job whose cancel is lost runs
        to its end and its stream expires)."""
        if not request_ids:
            return
        try:
            await asyncio.gather(
                *[
                    self.batch.call("SET", keys.request_cancel(rid), "1", "EX", keys.REQUEST_TTL_S)
                    for rid in request_ids
                ]
            )
        except redis.RedisError:
            log.warning("could not cancel %d enqueued choice(s)", len(request_ids), exc_info=True)

    async def events(
        self,
        gen: GenerationRequest,
        disconnected: Disconnected | None = None,
        streamed: bool = True,
    ) -> AsyncIterator[StreamEvent]:
        """The request's events one by one (batches() has them a stream read at a time)."""
        async with aclosing(self.batches(gen, disconnected, streamed)) as batches:
            async for batch in batches:
                # By index: no event stays bound while the next read is awaited (Watch.batches).
                for i in range(len(batch)):
                    yield batch[i]
                del batch

    async def batches(
        self,
        gen: GenerationRequest,
        disconnected: Disconnected | None = None,
        streamed: bool = True,
        lane: DirectLane | None = None,
    ) -> AsyncIterator[list[StreamEvent]]:
        """The request's events up to and including its `done` or `error`, in lists of what one
        stream read brought (never empty), less the token deltas `lane` (a streamed choice's)
        relayed itself. A request whose worker died before any token reached
        the client (a streamed one that had sent none, or any non-streamed one) is enqueued once
        more, onto whichever worker is live: a new attempt begins with its own `start`, after
        which the reader drops what it gathered; the client never sees the death. One that had
        streamed tokens ends with an error. Closing the iterator early (client gone) tells the
        worker to drop the sequence."""
        attempt = Attempt(gen)
        relayed_tokens = started = False
        try:
            while True:
                lost: StreamEvent | None = None
                async with self._watching(attempt, disconnected, not streamed, lane) as reader:
                    async for batch in reader:
                        if batch[0].kind == "delta" and batch[-1].kind == "delta":
                            # Only deltas (a start is an attempt's first event, and a `done`
                            # or an `error` its last): relayed as they are, with no scan.
                            relayed_tokens = relayed_tokens or streamed
                            yield batch
                            batch = []  # not held while the next read is awaited (Watch)
                            continue
                        last = False
                        for i, event in enumerate(batch):
                            kind = event.kind
                            if kind == "error" and event.error_type == ErrorKind.WORKER_LOST:
                                lost, batch = event, batch[:i]
                                break
                            if kind == "start" and not started:
                                started = True
                                # Its reply is not waited for: the relay goes on at once.
                                self.ledger.started(
                                    gen.request_id, event.worker_id or "", event.cached_tokens
                                )
                            elif kind == "delta":
                                relayed_tokens = relayed_tokens or streamed
                            elif kind == "done" or kind == "error":
                                last, batch = True, batch[: i + 1]
                                break
                        if batch:
                            yield batch
                            batch = []
                        if last:
                            return
                        if lost is not None:
                            break
                if lost is None:
                    return  # the client went away (or nothing more will come)
                # A lost worker may be only stopped: the cleanup below (or the requeue) sets the
                # lost attempt's cancel flag, so it drops the request when it goes on.
                relayed_tokens = relayed_tokens or (lane is not None and lane.relayed)
                if relayed_tokens or attempt.number >= MAX_ATTEMPTS:
                    yield [lost]
                    return
                try:
                    attempt = await self._requeue(attempt)
                except redis.RedisError as exc:
                    log.warning("request %s: could not enqueue it again: %s", gen.request_id, exc)
                    yield [lost]
                    return
                log.warning("request %s: %s; enqueued again", gen.request_id, lost.error)
        finally:
            # A task of its own under asyncio.shield: a cancel of this one (anyio's scope, or
            # asyncio's own Task.cancel, which an anyio shield does not stop) cannot cut the
            # end short, so a request never keeps its reservation or leaves its job running.
            end = asyncio.ensure_future(self._end(attempt, gen.request_id))
            self._ending.add(end)
            end.add_done_callback(self._ending.discard)
            await asyncio.shield(end)

    async def _end(self, attempt: Attempt, request_id: str) -> None:
        # Side by side: both go out in one write of the command batch.
        await asyncio.gather(
            self.cleanup(attempt.job_id, cancel=not attempt.finished),
            self.ledger.release(request_id),
        )

    async def _requeue(self, lost: Attempt) -> Attempt:
        """The next attempt, under a new job id (the lost worker's job keeps its own), on the
        shared queue (any live worker takes it; the lost one may still look live); the lost
        job gets its cancel flag, so a worker that was only slow drops it instead of racing."""
        await self.cleanup(lost.job_id, cancel=True)
        again = dataclasses.replace(lost.gen, request_id=f"{lost.gen.request_id}-{lost.number}")
        await self.enqueue(again)
        return Attempt(again, number=lost.number + 1)

    @asynccontextmanager
    async def _watching(
        self,
        attempt: Attempt,
        disconnected: Disconnected | None,
        in_flow: bool,
        lane: DirectLane | None,
    ) -> AsyncIterator[AsyncIterator[list[StreamEvent]]]:
        """The attempt's stream subscribed and watched, its batches iterated by the caller
        itself (a generator of their own here would be one more hop a read), and let go."""
        stream = keys.request_stream(attempt.job_id)
        feed = await self.hub.subscribe(stream)
        watch = Watch(
            attempt,
            feed,
            disconnected,
            in_flow,
            self.request_timeout_s,
            job_state=lambda: self.checked_job_state(attempt.job_id, attempt.worker_id),
            unread=lambda: self._unread(attempt),
            lane=lane,
        )
        try:
            async with aclosing(watch.batches()) as batches:
                yield batches
        finally:
            self.hub.unsubscribe(stream)

    async def checked_job_state(self, job_id: str, worker_id: str = "") -> JobState | None:
        """The job's state, off the event loop; None while Redis restarts (checked again)."""
        try:
            return await anyio.to_thread.run_sync(self.job_state, job_id, worker_id)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.info("job check for %s failed (%s); retrying", job_id, exc)
            return None

    async def _unread(self, attempt: Attempt) -> bool:
        """Whether the attempt's stream holds events not relayed yet (one per seq number)."""
        try:
            return int(await self.aredis.xlen(keys.request_stream(attempt.job_id))) > (
                attempt.next_seq
            )
        except redis.RedisError:
            return False

    def job_state(self, job_id: str, worker_id: str = "") -> JobState:
        """The job as rq records it and, while it runs, whether the pool found its worker lost
        (the reaper's verdict: never judged here from a heartbeat), on the sync client, in a
        worker thread."""
        try:
            job = Job.fetch(job_id, connection=self.sync_redis, serializer=MsgpackSerializer)
            status = job.get_status(refresh=False)
        except NoSuchJobError:
            return JobState(
                failure="the job no longer exists (Redis lost it, or it expired unstarted)",
                failure_type=ErrorKind.REDIS_UNAVAILABLE,
            )
        except redis.RedisError:
            raise
        except Exception as exc:  # a job hash rq cannot load (written by hand, not by us)
            return JobState(failure=f"the job's record is unreadable: {exc}")
        if status == JobStatus.FINISHED:
            return JobState(finished=True)
        if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
            text = _failure_text(job, status)
            if WORKER_LOST_MARK in text:  # a live worker reaped it: its worker died, not it
                return JobState(lost=text)
            return JobState(failure=text)
        if status == JobStatus.QUEUED:
            return JobState(off_queue=self._off_queue(job))
        if status != JobStatus.STARTED:
            return JobState()
        # The worker that runs it: named by its start event, else by rq's record of the job.
        wid = worker_id or keys.parse_rq_worker_name(job.worker_name or "")
        if wid is None:
            return JobState()
        since = lost_verdict(self.sync_redis, wid)
        if since is None:
            return JobState()
        return JobState(lost=f"worker {wid} stopped while running this request ({since})")

    def _off_queue(self, job: Job) -> bool:
        """Whether rq still says the job is queued while neither its queue nor that queue's
        taken list holds it (read in one transaction, so a take and start cannot fall between
        the reads and make a started job look stranded)."""
        queue, taken = keys.rq_queue_key(job.origin), keys.rq_intermediate_key(job.origin)
        with self.sync_redis.pipeline() as pipe:  # MULTI/EXEC: one moment's view
            pipe.hget(job.key, "status")
            pipe.llen(queue)
            pipe.lpos(queue, job.id, maxlen=QUEUE_SCAN_MAX)
            pipe.llen(taken)
            pipe.lpos(taken, job.id, maxlen=QUEUE_SCAN_MAX)
            status, queued, at, in_take, taken_at = pipe.execute()
        if status is None or status.decode() != JobStatus.QUEUED.value:
            return False
        if at is not None or taken_at is not None:
            return False
        return queued <= QUEUE_SCAN_MAX and in_take <= QUEUE_SCAN_MAX

    async def cleanup(self, req_id: str, cancel: bool) -> None:
        """A request's end: its stream deleted once its worker wrote its last event, else the
        job's cancel flag set and the stream left to lapse (the worker may write once more)."""
        stream = keys.request_stream(req_id)
        try:
            if not cancel:  # the worker wrote its last event: nothing will recreate the key
                await self.batch.call("DEL", stream)
                return
            await asyncio.gather(
                self.batch.call("SET", keys.request_cancel(req_id), "1", "EX", keys.REQUEST_TTL_S),
                self.batch.call("EXPIRE", stream, CANCELLED_STREAM_TTL_S),
            )
        except redis.RedisError:
            log.warning("could not clean up request %s", req_id, exc_info=True)


def _failure_text(job: Job, status: JobStatus) -> str:
    result = job.latest_result()
    text = (result.exc_string if result is not None else None) or job.exc_info or ""
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return f"the worker's job {status.value}" + (f": {last}" if last else "")


def describe(req: GenerationRequest, worker_id: str) -> str:
    """What `rq info` and rq-dashboard show for the job (rq's default is the call with every
    prompt token in it)."""
    where = f"placed on {worker_id}" if worker_id else "for any worker"
    return (
        f"{req.model}: {len(req.prompt_tokens)} prompt tokens, max_tokens {req.max_tokens}, {where}"
    )


def build_queue(sync_redis: redis.Redis, model_id: str) -> Queue:
    return Queue(
        keys.model_queue_name(model_id), connection=sync_redis, serializer=MsgpackSerializer
    )

"""The embeddings relay: find the embedding model, admit the request, enqueue it as an rq job on
its model's queue (every worker of the model reads it), and wait for its one reply on the
request's stream, through the process's StreamHub.

A request never hangs: a failed rq job, a worker the pool found lost, a client gone or no reply
within `router.request_timeout_s` ends it with its error. It is not run again on another worker:
an embedding is cheap to ask for again, and the 503 says the client may.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import anyio
import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from router.admission.admit import quoted
from router.admission.embedding_admit import admit_embedding
from router.admission.tokenization import TokenizerLoadError
from router.edge.embedding_types import EmbeddingBody
from router.edge.errors import APIError
from router.pool_view.model_catalog import unknown_model_message
from router.state import RouterState
from shared import keys
from shared.canary_check import CanaryMismatch
from shared.embedding_wire import EMBED_JOB_FUNC, EmbeddingReply, EmbeddingRequest
from shared.errors import ErrorKind, kind_of
from shared.liveness import WORKER_LOST_MARK, lost_verdict
from shared.wire import STREAM_FIELD, MsgpackSerializer, WireError

log = logging.getLogger(__name__)

# How long a request waits on its stream before it checks its client and its job.
IDLE_CHECK_S = 1.0
RESULT_TTL_S = 600
FAILURE_TTL_S = 3600
QUEUED_TTL_S = 600
# An unanswered request's stream lingers this long with its cancel flag up (the worker may still
# write its reply once; the flag makes that write a no-op).
CANCELLED_STREAM_TTL_S = 60

Disconnected = Callable[[], Awaitable[bool]]


def submit_embeddings(body: EmbeddingBody, state: RouterState) -> EmbeddingRequest:
    """The admitted request, enqueued (blocking: run it in the threadpool), or APIError: 404 for
    a model the pool does not serve, 400 for a generation model or bad input."""
    catalog = state.catalog
    model = catalog.embedding_model(body.model)
    if model is None:
        if body.model == state.model_id or body.model in catalog.live():
            raise APIError.of(
                ErrorKind.INVALID_REQUEST,
                f"The model {quoted(body.model)} is a generation model: it serves completions, not "
                "embeddings; name an embedding model",
                param="model",
            )
        message = unknown_model_message(body.model, catalog.served())
        raise APIError.of(ErrorKind.UNKNOWN_MODEL, message, param="model")
    try:
        ctx = catalog.get(model.model_id)
    except (TokenizerLoadError, CanaryMismatch) as exc:  # its workers', not the caller's
        raise APIError.of(
            ErrorKind.NO_LIVE_WORKER, f"The pool cannot serve '{model.model_id}': {exc}"
        ) from exc
    if ctx is None:  # its last worker went between the two looks
        raise APIError.of(ErrorKind.NO_LIVE_WORKER, f"No live worker serves '{model.model_id}'.")
    req = admit_embedding(body, ctx, model.dimensions)
    _enqueue(state, req)
    return req


def _enqueue(state: RouterState, req: EmbeddingRequest) -> None:
    queue = state.dispatcher.queue_for("", req.model)
    # One transaction: the job hash, its TTLs and the queue push land together or not at all.
    with state.dispatcher.sync_redis.pipeline() as pipe:
        queue.enqueue_call(
            func=EMBED_JOB_FUNC,
            kwargs={"embedding": req.to_wire()},
            job_id=req.request_id,
            timeout=state.settings.worker.job_timeout_s,
            result_ttl=RESULT_TTL_S,
            failure_ttl=FAILURE_TTL_S,
            ttl=QUEUED_TTL_S,
            description=f"{req.model}: embeddings of {len(req.inputs)} input(s), "
            f"{req.total_tokens} tokens",
            pipeline=pipe,
        )
        pipe.execute()


async def embedding_reply(
    state: RouterState, req: EmbeddingRequest, disconnected: Disconnected
) -> EmbeddingReply:
    """The worker's `done` reply, or APIError (the worker's error, a failed or lost job, the
    client gone, the timeout)."""
    hub = state.dispatcher.hub
    stream = keys.request_stream(req.request_id)
    queue = await hub.subscribe(stream)
    answered = False
    try:
        deadline = time.monotonic() + state.settings.router.request_timeout_s
        while True:
            try:
                async with asyncio.timeout(IDLE_CHECK_S):
                    _, fields = await queue.get()
            except TimeoutError:
                await _check(state, req, disconnected, deadline)
                continue
            reply = _decode(fields)
            answered = True
            if reply.kind == "error":
                raise APIError.of(kind_of(reply.error_type) or ErrorKind.SERVER_ERROR, reply.error)
            return reply
    finally:
        hub.unsubscribe(stream)
        with anyio.CancelScope(shield=True):
            await _cleanup(state, req.request_id, answered)


async def _check(
    state: RouterState, req: EmbeddingRequest, disconnected: Disconnected, deadline: float
) -> None:
    """Between waits: the client still there, the job not failed, its worker not lost, the
    timeout not passed; else the matching APIError."""
    if await disconnected():
        raise APIError.of(ErrorKind.CLIENT_CLOSED, "The client closed the request.")
    if time.monotonic() >= deadline:
        timeout = state.settings.router.request_timeout_s
        raise APIError.of(ErrorKind.TIMEOUT, f"no response from a worker in {timeout:g}s")
    try:
        failure = await anyio.to_thread.run_sync(_job_failure, state, req.request_id)
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # Redis restarting: wait on
        log.info("job check for %s failed (%s); retrying", req.request_id, exc)
        return
    if failure is not None:
        raise failure


def _job_failure(state: RouterState, job_id: str) -> APIError | None:
    """The job's failure as rq records it, or its worker found lost (the reaper's verdict)."""
    r = state.dispatcher.sync_redis
    try:
        job = Job.fetch(job_id, connection=r, serializer=MsgpackSerializer)
        status = job.get_status(refresh=False)
    except NoSuchJobError:
        return APIError.of(
            ErrorKind.REDIS_UNAVAILABLE,
            "the job no longer exists (Redis lost it, or it expired unstarted)",
        )
    except redis.RedisError:
        raise
    except Exception as exc:  # a job hash rq cannot load (written by hand, not by us)
        return APIError.of(ErrorKind.JOB_FAILED, f"the job's record is unreadable: {exc}")
    if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
        result = job.latest_result()
        text = (result.exc_string if result is not None else None) or job.exc_info or ""
        kind = ErrorKind.WORKER_LOST if WORKER_LOST_MARK in text else ErrorKind.JOB_FAILED
        return APIError.of(kind, f"the worker's job {status.value}: {text.strip()[-500:]}")
    if status != JobStatus.STARTED:
        return None
    wid = keys.parse_rq_worker_name(job.worker_name or "")
    since = lost_verdict(r, wid) if wid else None
    if since is None:
        return None
    return APIError.of(
        ErrorKind.WORKER_LOST, f"worker {wid} stopped while running this request ({since})"
    )


def _decode(fields: dict[bytes, bytes]) -> EmbeddingReply:
    data = fields.get(STREAM_FIELD)
    try:
        if data is None:
            raise WireError("a stream entry without the reply field")
        return EmbeddingReply.from_wire(data)
    except (WireError, ValueError) as exc:
        return EmbeddingReply(
            kind="error",
            error=f"an unreadable embedding reply: {exc}",
            error_type=ErrorKind.JOB_FAILED.value,
        )


async def _cleanup(state: RouterState, req_id: str, answered: bool) -> None:
    try:
        async with state.aredis.pipeline(transaction=False) as pipe:
            stream = keys.request_stream(req_id)
            if answered:  # the worker wrote its one reply: nothing will recreate the key
                pipe.delete(stream)
            else:
                pipe.set(keys.request_cancel(req_id), "1", ex=keys.REQUEST_TTL_S)
                pipe.expire(stream, CANCELLED_STREAM_TTL_S)
            await pipe.execute()
    except redis.RedisError:
        log.warning("could not clean up request %s", req_id, exc_info=True)

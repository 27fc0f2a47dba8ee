"""The embeddings relay: find the embedding model, admit the request, enqueue it as an rq job on
its model's queue (every worker of the model reads it), and wait for its one reply on the
request's stream, through the process's StreamHub.

A request never hangs: a failed rq job, a worker the pool found lost, a client gone or no reply
within `router.request_timeout_s` ends it with its error. It is not run again on another worker:
an embedding is cheap to ask for again, and the 503 says the client may.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from router.admission.admit import quoted
from router.admission.embedding_admit import admit_embedding
from router.admission.tokenization import TokenizerLoadError
from router.edge.embedding_types import EmbeddingBody
from router.edge.errors import APIError
from router.pool_view.model_catalog import unknown_model_message, unservable_error
from router.relay.event_decode import entry_payload
from router.state import RouterState
from shared import keys
from shared.canary_check import CanaryMismatch
from shared.embedding_wire import EMBED_JOB_FUNC, EmbeddingReply, EmbeddingRequest
from shared.errors import ErrorKind, kind_of
from shared.wire import WireError

log = logging.getLogger(__name__)

# How long a request waits on its stream before it checks its client and its job.
IDLE_CHECK_S = 1.0

Disconnected = Callable[[], Awaitable[bool]]


def submit_embeddings(body: EmbeddingBody, state: RouterState) -> EmbeddingRequest:
    """The admitted request, enqueued (blocking: run it in the threadpool), or APIError: 404 for
    a model the pool does not serve, 400 for a generation model or bad input."""
    catalog = state.catalog
    model = catalog.embedding_model(body.model)
    if model is None and body.model != state.model_id:  # a worker of it may have just registered
        model = catalog.embedding_model(body.model, fresh=True)
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
        raise unservable_error(model.model_id, exc) from exc
    if ctx is None:  # its last worker went between the two looks
        raise APIError.of(ErrorKind.NO_LIVE_WORKER, f"No live worker serves '{model.model_id}'.")
    req = admit_embedding(body, ctx, model.dimensions)
    _enqueue(state, req)
    return req


def _enqueue(state: RouterState, req: EmbeddingRequest) -> None:
    state.dispatcher.enqueue_job(
        state.dispatcher.queue_for("", req.model),
        EMBED_JOB_FUNC,
        {"embedding": req.to_wire()},
        req.request_id,
        f"{req.model}: embeddings of {len(req.inputs)} input(s), {req.total_tokens} tokens",
    )


async def embedding_reply(
    state: RouterState, req: EmbeddingRequest, disconnected: Disconnected
) -> EmbeddingReply:
    """The worker's `done` reply, or APIError (the worker's error, a failed or lost job, the
    client gone, the timeout)."""
    hub = state.dispatcher.hub
    stream = keys.request_stream(req.request_id)
    feed = await hub.subscribe(stream)
    answered = False
    try:
        deadline = time.monotonic() + state.settings.router.request_timeout_s
        while True:
            if not await feed.wait(IDLE_CHECK_S):
                await _check(state, req, disconnected, deadline)
                continue
            _, fields = feed.take()[0]
            reply = _decode(fields)
            answered = True
            if reply.kind == "error":
                raise APIError.of(kind_of(reply.error_type) or ErrorKind.SERVER_ERROR, reply.error)
            return reply
    finally:
        hub.unsubscribe(stream)
        with anyio.CancelScope(shield=True):
            await state.dispatcher.cleanup(req.request_id, cancel=not answered)


async def _check(
    state: RouterState, req: EmbeddingRequest, disconnected: Disconnected, deadline: float
) -> None:
    """Between waits: the client still there, the job not failed or finished without its reply,
    its worker not lost, the timeout not passed; else the matching APIError."""
    if await disconnected():
        raise APIError.of(ErrorKind.CLIENT_CLOSED, "The client closed the request.")
    if time.monotonic() >= deadline:
        timeout = state.settings.router.request_timeout_s
        raise APIError.of(ErrorKind.TIMEOUT, f"no response from a worker in {timeout:g}s")
    job = await state.dispatcher.checked_job_state(req.request_id)
    if job is None:  # Redis restarting: wait on
        return
    if job.failure is not None:
        raise APIError.of(kind_of(job.failure_type) or ErrorKind.JOB_FAILED, job.failure)
    if job.lost is not None:
        raise APIError.of(ErrorKind.WORKER_LOST, job.lost)
    if job.finished and not await state.aredis.exists(keys.request_stream(req.request_id)):
        raise APIError.of(ErrorKind.JOB_FAILED, "the worker finished the job without its reply")


def _decode(fields: list[Any]) -> EmbeddingReply:
    data = entry_payload(fields)
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

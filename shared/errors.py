"""The pool's error kinds, one table to their HTTP status and OpenAI error type and code.

A kind's value is what crosses Redis (a stream `error` event's `error_type`), so engine, worker,
dispatcher and routes name a failure the same way and the router answers it the same way
whichever side found it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorKind(enum.StrEnum):
    INVALID_REQUEST = "invalid_request_error"  # the request itself is wrong: fix it, not retry
    CONTEXT_EXCEEDED = "context_length_exceeded"
    UNKNOWN_MODEL = "model_not_found"
    NOT_FOUND = "not_found"  # an unknown URL or object (a stored response)
    METHOD_NOT_ALLOWED = "method_not_allowed"
    BODY_TOO_LARGE = "body_too_large"
    UNAUTHORIZED = "invalid_api_key"
    POOL_BUSY = "rate_limit_exceeded"  # the pool's bound: retry after Retry-After
    NO_LIVE_WORKER = "no_live_worker"
    # A live worker's model whose tokenizer files are not on the router's host: an operator's
    # fix (copy or mount them), not a client's retry.
    MODEL_FILES_MISSING = "model_files_missing"
    WORKER_LOST = "worker_lost"  # the worker running it died or stalled: retry
    REDIS_UNAVAILABLE = "redis_unavailable"  # the pool's queue is unreachable: retry
    TIMEOUT = "timeout"  # the request outlived its deadline
    CLIENT_CLOSED = "client_closed"
    JOB_FAILED = "job_failed"  # rq failed the job, or its stream is unreadable
    SERVER_ERROR = "server_error"  # a fault in the engine or the router: a bug, not the caller's


@dataclass(frozen=True)
class ErrorShape:
    status: int
    type: str  # OpenAI's `error.type`
    code: str | None  # OpenAI's `error.code`


# nginx's code for "client closed request": nobody reads it, but logs should not say 200.
CLIENT_CLOSED_STATUS = 499

SHAPES: dict[ErrorKind, ErrorShape] = {
    ErrorKind.INVALID_REQUEST: ErrorShape(400, "invalid_request_error", None),
    ErrorKind.CONTEXT_EXCEEDED: ErrorShape(400, "invalid_request_error", "context_length_exceeded"),
    ErrorKind.UNKNOWN_MODEL: ErrorShape(404, "invalid_request_error", "model_not_found"),
    ErrorKind.NOT_FOUND: ErrorShape(404, "invalid_request_error", None),
    ErrorKind.METHOD_NOT_ALLOWED: ErrorShape(405, "invalid_request_error", None),
    ErrorKind.BODY_TOO_LARGE: ErrorShape(413, "invalid_request_error", "body_too_large"),
    ErrorKind.UNAUTHORIZED: ErrorShape(401, "invalid_request_error", "invalid_api_key"),
    ErrorKind.POOL_BUSY: ErrorShape(429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorKind.NO_LIVE_WORKER: ErrorShape(503, "server_error", "no_live_worker"),
    ErrorKind.MODEL_FILES_MISSING: ErrorShape(503, "server_error", "model_files_missing"),
    ErrorKind.WORKER_LOST: ErrorShape(503, "server_error", "worker_lost"),
    ErrorKind.REDIS_UNAVAILABLE: ErrorShape(503, "server_error", "redis_unavailable"),
    ErrorKind.TIMEOUT: ErrorShape(504, "server_error", "timeout"),
    ErrorKind.CLIENT_CLOSED: ErrorShape(CLIENT_CLOSED_STATUS, "invalid_request_error", None),
    ErrorKind.JOB_FAILED: ErrorShape(500, "server_error", "job_failed"),
    ErrorKind.SERVER_ERROR: ErrorShape(500, "server_error", "server_error"),
}


def kind_of(error_type: str | None) -> ErrorKind | None:
    """A stream event's `error_type` as its kind; None: one this side does not know (a newer
    peer's), which the router answers as a server error under that code."""
    try:
        return ErrorKind(error_type or "")
    except ValueError:
        return None

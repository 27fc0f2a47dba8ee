"""Errors in the Messages API's shape: `{"type": "error", "error": {"type", "message"}}`, with
the status the pool answers any API with.

The edge (router.edge.errors, router.edge.auth) asks `speaks_anthropic(path)` of every error it
answers and renders it here for the Messages API's paths, so a refusal anywhere (auth, body
validation, admission, the worker) reaches an Anthropic client in the shape its SDK parses.
This module imports nothing of the router: the edge imports it.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

# The Messages API's routes, and every path under them (an unknown one is its 404).
MESSAGES_PATH = "/v1/messages"

# HTTP status -> Anthropic's error type; any other status is the nearest of its class.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # no live worker, a lost worker, an unreachable queue: retry
    504: "api_error",
}


def speaks_anthropic(path: str) -> bool:
    """`path` (the route path, less any mount prefix) is one of the Messages API's."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    # As router.edge.errors.error_body: a lone surrogate quoted from the client stays an escape.
    if not message.isascii():
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)

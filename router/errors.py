"""OpenAI-style error objects and the exception handlers that produce them.

Every failure leaves the router as `{"error": {"message", "type", "param", "code"}}`: clients
built for OpenAI parse nothing else. Bad input is always a 4xx, never a 500.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "role")` -> `"messages.0.role"` (OpenAI names the field)."""
    parts = [str(p) for p in loc if p != "body"]
    # Union members show up as extra loc parts ("str", "list[int]"); they name types, not fields.
    parts = [p for p in parts if "[" not in p and p not in ("str", "int", "float", "bool")]
    return ".".join(parts) or None


def _validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    if err.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request.", None
    param = _param_of(tuple(err.get("loc", ())))
    if param is None and err.get("type") in ("model_type", "model_attributes_type"):
        return "The request body must be a JSON object.", None
    where = f"'{param}'" if param else "the request body"
    return f"Invalid value for {where}: {err.get('msg', 'invalid value')}.", param


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    # FastAPI answers 422 with its own shape; OpenAI clients expect a 400 error object.
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    message, param = _validation_message(errors[0]) if errors else ("Invalid request.", None)
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    else:
        message = str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(
        error_body(message, kind, None, None), status_code=exc.status_code, headers=exc.headers
    )


async def _redis_unreachable(request: Request, exc: Exception) -> JSONResponse:
    """Redis down or restarting (after the client's own retries): the pool cannot take the
    request now. A 503 the client may retry, not a 500."""
    log.warning("Redis error on %s %s: %s", request.method, request.url.path, exc)
    return JSONResponse(
        error_body("The pool's queue (Redis) is unreachable; retry shortly.", "server_error",
                   None, "redis_unavailable"),
        status_code=503,
        headers={"Retry-After": "1"},
    )  # fmt: skip


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(
        error_body("The server had an error while processing your request.", "server_error"),
        status_code=500,
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # Only an unreachable Redis is the client's 503; any other Redis error is a bug: a 500.
    app.add_exception_handler(redis.ConnectionError, _redis_unreachable)
    app.add_exception_handler(redis.TimeoutError, _redis_unreachable)
    app.add_exception_handler(Exception, _unexpected)

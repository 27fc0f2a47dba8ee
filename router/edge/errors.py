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
from starlette.types import Scope

from router.dialects.anthropic_errors import error_response as anthropic_error_response
from router.dialects.anthropic_errors import speaks_anthropic
from shared.errors import SHAPES, ErrorKind

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client as an OpenAI error object (another API's routes render
    it in their own shape from its `kind`). Made with `APIError.of(kind, message)`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        kind: ErrorKind | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers
        self.kind = kind or _kind_for(status)

    @classmethod
    def of(
        cls,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> APIError:
        """The error of one of the pool's kinds, with its status, type and code from the one
        table (shared.errors.SHAPES)."""
        shape = SHAPES[kind]
        return cls(shape.status, message, shape.type, param, shape.code, headers, kind)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _kind_for(status: int) -> ErrorKind:
    if status == 404:
        return ErrorKind.NOT_FOUND
    return ErrorKind.INVALID_REQUEST if status < 500 else ErrorKind.SERVER_ERROR


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    # An error body must always encode: client text quoted in a message keeps a lone surrogate
    # only as a `\udXXX` escape, never as a character UTF-8 cannot write.
    if not message.isascii():
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "role")` -> `"messages.0.role"` (OpenAI names the field)."""
    parts = [str(p) for p in loc if p != "body"]
    # Union members show up as extra loc parts ("str", "list[int]"); they name types, not fields.
    parts = [p for p in parts if "[" not in p and p not in ("str", "int", "float", "bool")]
    return ".".join(parts) or None


def _is_type_mismatch(err: dict[str, Any]) -> bool:
    return str(err.get("type", "")).endswith("_type")


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """A union reports one error per member it tried (`prompt: ["\\ud800"]`: "not a string",
    "item 0 is not an int", "item 0 holds a lone surrogate"): the deepest error that is not a
    type mismatch is the one that names what is actually wrong."""
    return max(errors, key=lambda err: (len(err.get("loc", ())), not _is_type_mismatch(err)))


def validation_failure(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The (message, param) of the 400 that answers pydantic's errors for a request body."""
    if not errors:
        return "Invalid request.", None
    err = _most_specific(errors)
    if err.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request.", None
    param = _param_of(tuple(err.get("loc", ())))
    # A body that is a JSON array, string, number or null has no field to name.
    if param is None and err.get("type") in ("model_type", "model_attributes_type", "missing"):
        return "The request body must be a JSON object.", None
    message = str(err.get("msg", "invalid value"))
    if _is_type_mismatch(err):
        # Each member of a union refused the type: name every type the field takes.
        wanted = [
            str(e.get("msg"))
            for e in errors
            if _is_type_mismatch(e) and _param_of(tuple(e.get("loc", ()))) == param
        ]
        rest = [m.removeprefix("Input should be ") for m in dict.fromkeys(wanted) if m != message]
        message = " or ".join([message, *rest])
    where = f"'{param}'" if param else "the request body"
    return f"Invalid value for {where}: {message}.", param


def response_for(scope: Scope, err: APIError) -> JSONResponse:
    """`err` in the shape of the API the request called: the Messages API's routes answer in
    Anthropic's, every other route in OpenAI's."""
    path: str = scope["path"]
    if speaks_anthropic(path.removeprefix(scope.get("root_path", ""))):
        return anthropic_error_response(err.status, err.message, err.headers)
    return err.response()


def _respond(request: Request, err: APIError) -> JSONResponse:
    return response_for(request.scope, err)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return _respond(request, exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    # FastAPI answers 422 with its own shape; OpenAI clients expect a 400 error object.
    assert isinstance(exc, RequestValidationError)
    message, param = validation_failure(list(exc.errors()))
    return _respond(request, APIError.of(ErrorKind.INVALID_REQUEST, message, param))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    else:
        message = str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _respond(request, APIError(exc.status_code, message, kind, headers=exc.headers))


async def _redis_unreachable(request: Request, exc: Exception) -> JSONResponse:
    """Redis down or restarting (after the client's own retries): the pool cannot take the
    request now. A 503 the client may retry, not a 500."""
    log.warning("Redis error on %s %s: %s", request.method, request.url.path, exc)
    message = "The pool's queue (Redis) is unreachable; retry shortly."
    headers = {"Retry-After": "1"}
    return _respond(request, APIError.of(ErrorKind.REDIS_UNAVAILABLE, message, headers=headers))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    message = "The server had an error while processing your request."
    return _respond(request, APIError(500, message, "server_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # Only an unreachable Redis is the client's 503; any other Redis error is a bug: a 500.
    app.add_exception_handler(redis.ConnectionError, _redis_unreachable)
    app.add_exception_handler(redis.TimeoutError, _redis_unreachable)
    app.add_exception_handler(Exception, _unexpected)

"""Request bodies past `router.max_body_bytes` are refused with a 413 before they are read whole:
at once when Content-Length says so, else as soon as the bytes received pass the bound (a
chunked body), so no handler ever holds more than the bound in memory."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.edge.errors import APIError, response_for
from shared.errors import ErrorKind


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"The request body is larger than this pool accepts ({self.max_bytes} bytes)."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            refusal = APIError.of(ErrorKind.BODY_TOO_LARGE, self._message())
            await response_for(scope, refusal)(scope, receive, send)  # in the API's shape
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # the app's error handlers answer it as a 413
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, bounded, send)

"""Request bodies parsed by orjson.

FastAPI parses a JSON body with the standard library's json (Starlette's Request.json), which
for a prompt of a thousand token ids was a few percent of the router's CPU. A route of this
class hands its handler a Request whose json() tries orjson first. Where orjson refuses a body
the standard library takes (NaN, a lone surrogate escape) or neither takes it, the standard
library parses it, so every body means what it meant and a malformed one gets the same 400,
word for word.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

# orjson reads an integer outside 64 bits as a float, where the standard library keeps it an
# int (so `seed: 2**64` is refused for its range, not its type): a run of this many digits
# sends the body to the standard library. The run is looked for in the body with every digit
# made '9' and every other byte a space (bytes.translate, then a substring search): a regex
# tried a match at every digit of a prompt's thousand token ids, twice the parse's time.
LONG_DIGITS = 19
_DIGITS_ONLY = bytes(ord("9") if b in b"0123456789" else ord(" ") for b in range(256))
_LONG_RUN = b"9" * LONG_DIGITS


def has_long_number(body: bytes) -> bool:
    """Whether the body holds a run of LONG_DIGITS digits or more."""
    return _LONG_RUN in body.translate(_DIGITS_ONLY)


class JSONBodyRequest(Request):
    """Starlette's Request, its json() orjson's where orjson reads the body as json would."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if not has_long_number(body):
                try:
                    self._json = orjson.loads(body)
                    return self._json
                except orjson.JSONDecodeError:
                    pass
            self._json = json.loads(body)
        return self._json


class JSONBodyRoute(APIRoute):
    """An APIRoute whose handler reads its body through JSONBodyRequest."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return route_handler

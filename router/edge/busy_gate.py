"""Load shedding at the door: while this router process knows the pool is at its bound of
requests in flight, a generation request is refused with the same 429 the ledger would give,
before its body is read, parsed, tokenized or sent to Redis.

The ledger's script stays the one judge of the bound: the gate only remembers its last
`inflight` refusal, for `hold_s` or until a request of this process ends (a slot it can see
free), whichever comes first. So a flood costs one script call per hold period rather than one
per request, and a slot freed by another router process is seen at most `hold_s` late.

A refusal at the pool's bound (`max_inflight`, every model's requests) closes the gate for every
request, here in the ASGI layer; one because every live worker of a model is at its own bound
(`max_inflight_per_worker`) only for that model, checked once the body names it (`refusal`),
still before tokenizing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from router.edge.errors import APIError, response_for
from router.metrics import ADMISSION_REFUSED
from shared.errors import ErrorKind

# The routes whose requests the ledger admits.
GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"}
)
ALL_MODELS = ""


@dataclass(frozen=True)
class Shut:
    """The last refusal's message, standing until `until` (monotonic)."""

    message: str
    until: float


@dataclass
class BusyGate:
    hold_s: float
    clock: Callable[[], float] = time.monotonic
    # model id (ALL_MODELS: the pool-wide bound) -> the refusal that shut it
    _shut: dict[str, Shut] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    opened: int = 0  # releases so far (a refusal read before the latest one is stale)

    def close(self, model: str, message: str, pool_wide: bool, opened: int | None = None) -> None:
        """The ledger refused a request at a bound of requests in flight (from any thread).
        `opened`: `self.opened` when the ledger was asked; a release since then (this process's
        slot freed after the count was read) makes the refusal stale, and it shuts nothing."""
        if self.hold_s <= 0:
            return
        shut = Shut(message, self.clock() + self.hold_s)
        with self._lock:
            if opened is not None and opened != self.opened:
                return
            self._shut[ALL_MODELS if pool_wide else model] = shut

    def open(self) -> None:
        """A request of this process ended and its reservation is gone: the next one asks the
        ledger."""
        with self._lock:
            self.opened += 1
            self._shut.clear()

    def refusal(self, model: str = ALL_MODELS) -> Shut | None:
        """The refusal still standing for `model` (the pool-wide one applies to every model)."""
        if not self._shut:  # the common case, read without the lock
            return None
        now = self.clock()
        with self._lock:
            for key in {ALL_MODELS, model}:
                shut = self._shut.get(key)
                if shut is not None and shut.until <= now:
                    del self._shut[key]
                elif shut is not None:
                    return shut
        return None


def busy_error(shut: Shut, retry_after_s: int) -> APIError:
    """The 429 the ledger's refusal would have produced, counted as one."""
    ADMISSION_REFUSED.labels("inflight").inc()
    headers = {"Retry-After": str(retry_after_s)}
    return APIError.of(ErrorKind.POOL_BUSY, shut.message, headers=headers)


class BusyGateMiddleware:
    """Answers a generation request from the gate's pool-wide refusal without reading it; runs
    after authentication (an unauthenticated caller learns nothing of the pool's load)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GENERATION_PATHS
        ):
            state = getattr(scope["app"].state, "router", None)
            shut = state.dispatcher.ledger.gate.refusal() if state is not None else None
            if shut is not None:
                retry = state.settings.admission.retry_after_s
                await response_for(scope, busy_error(shut, retry))(scope, receive, send)
                return
        await self.app(scope, receive, send)

"""A streamed choice's token deltas written to its client from the stream hub's callback.

A relayed step used to wake the response's task and climb four frames of async generators (the
watch, the dispatcher, the renderer, the response body) to reach the ASGI send; the hub now
hands a read's entries to the choice's watch, which, while its task waits for them, relays them
where they came when each is the attempt's next token delta (Watch.take_direct): rendered by the
choice's renderer and sent through the same ASGI send, driven here to its end (`send_now`).
Everything else (a start, the last event, a gap, an unreadable entry, a watch not waiting) takes
the task's own way, so the lane carries only what that way would have written, in the same
order: the task's wait ends, and the lane closes, before any entry the lane refused.

A send that must wait (the client's socket is full: uvicorn waits for it to drain) or fails
closes the lane and wakes the task, which waits for that send or raises its error (`settled`)
before it relays anything else; a task cancelled meanwhile (its client left) cancels that send
(`abandon`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from starlette.types import Message, Send

from shared.wire import StreamEvent

# A choice's renderer for a read's token deltas: the bytes of its chunks (empty while the text
# is held back).
Render = Callable[[list[StreamEvent]], bytes]


class DirectLane:
    """One streamed choice's lane: its renderer (the body that renders the choice's stream sets
    it: openai_render._chunks, the Messages and Responses bodies), its ASGI send
    (streams.SSEResponse sets it), and what became of its last write."""

    __slots__ = ("render", "send", "relayed", "_pending", "_failure")

    def __init__(self) -> None:
        self.render: Render | None = None
        self.send: Send | None = None
        # The lane took a read of deltas (sent, held back by the renderer, or its write left to
        # the task): the request has streamed tokens, and gets no second attempt.
        self.relayed = False
        self._pending: asyncio.Future[None] | None = None  # a send waiting for the client
        self._failure: Exception | None = None  # what the last write raised

    @property
    def open(self) -> bool:
        """Both ends set and the last write done: the lane may take a read's deltas."""
        return (
            self.render is not None
            and self.send is not None
            and self._pending is None
            and self._failure is None
        )

    def relay(self, events: list[StreamEvent]) -> bool:
        """The deltas rendered and written; False when the write waits for the client or failed
        (the lane is closed until the task has `settled` it)."""
        assert self.render is not None and self.send is not None
        self.relayed = True
        try:
            data = self.render(events)
            if data:
                message = {"type": "http.response.body", "body": data, "more_body": True}
                self._pending = send_now(self.send, message)
        except Exception as exc:  # the task's own send would have raised it: it raises it
            self._failure = exc
        return self._pending is None and self._failure is None

    def abandon(self) -> None:
        """The task was cancelled (its client left): a write still waiting for the client ends."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()

    async def settled(self) -> None:
        """The lane's last write to its end, or its error raised: before the task writes. The
        lane stays closed until then."""
        if self._pending is not None:
            try:
                await self._pending
            finally:
                self._pending = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


def send_now(send: Send, message: Message) -> asyncio.Future[None] | None:
    """`await send(message)` run here: None when it ended without waiting (uvicorn's send waits
    only while the client's socket is full), else a task that goes on from its wait. Its error
    is raised here when it fails before waiting."""
    coro = send(message)
    if not isinstance(coro, Coroutine):  # another kind of awaitable: the task awaits it
        return asyncio.ensure_future(coro)
    try:
        waited = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_Resumed(coro, waited))


class _Resumed:
    """A coroutine already run up to a wait, awaited from there: what it waits on goes up to the
    task, what the task sends or throws goes down to it."""

    def __init__(self, coro: Coroutine[Any, Any, None], waited: Any) -> None:
        self._coro = coro
        self._waited = waited

    def __await__(self) -> Generator[Any, Any, None]:
        coro, waited = self._coro, self._waited
        while True:
            try:
                value = yield waited
            except BaseException as exc:  # a cancel: the coroutine's own handling runs
                try:
                    waited = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    waited = coro.send(value)
                except StopIteration:
                    return

"""What every API's relay does with a request's event streams, whatever shape its answer has:
fold them into each choice's progress, hold the 200 until each has its first event, and the
SSE framing and headers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, NoReturn, TypeVar

import anyio
import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from router.edge.errors import APIError
from router.relay.direct_lane import DirectLane
from router.relay.progress import ChoiceProgress, error_for
from router.relay.routed import RoutedRequest
from router.state import RouterState
from shared.errors import ErrorKind
from shared.wire import StreamEvent

log = logging.getLogger(__name__)

# Names the worker that ran the request (its first attempt, when streamed): why a request went
# where it went is in the router's route log line, keyed by the same worker id.
WORKER_HEADER = "X-Mlxcel-Worker"

Events = AsyncIterator[StreamEvent]
Batches = AsyncIterator[list[StreamEvent]]  # a choice's events, a stream read's worth at a time
T = TypeVar("T")


def served_by(worker_id: str | None) -> dict[str, str]:
    return {WORKER_HEADER: worker_id} if worker_id else {}


def sse_headers(first: StreamEvent) -> dict[str, str]:
    return {
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        **served_by(first.worker_id if first.kind == "start" else ""),
    }


def sse(payload: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE message; `event`: its type line (the Responses and Messages APIs name theirs)."""
    # orjson: one chunk per streamed token, and stdlib json was the costlier half of building it.
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


async def coalesced(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A response's SSE chunks, each write carrying every chunk made by then: the events one
    stream read brought (a worker step's, or several steps' when the relay fell behind) go
    through the ASGI stack in one send, not one each. The chunks are made in a task of their
    own, which runs through the events already read before this side wakes; closing this side
    (the client went away) cancels it, and its error is this side's."""
    ready: asyncio.Queue[bytes | None] = asyncio.Queue()
    failure: list[BaseException] = []

    async def make() -> None:
        try:
            async for chunk in chunks:
                ready.put_nowait(chunk)
        except Exception as exc:
            failure.append(exc)
        finally:
            ready.put_nowait(None)

    task = asyncio.create_task(make())
    try:
        done = False
        while not done:
            parts = [await ready.get()]
            while not ready.empty():
                parts.append(ready.get_nowait())
            done = parts[-1] is None
            data = b"".join(p for p in parts if p is not None)
            if data:
                yield data
        if failure:
            raise failure[0]
    finally:
        if not task.done():
            task.cancel()
        # Shielded: the response ends only once the request's own cleanup (its job's cancel
        # flag, its reservation) is done, as when the chunks were made on this side.
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, return_exceptions=True)


class LastWrite(bytes):
    """A response's last chunk: it goes out with the body's end in one write, so a client that
    stops reading at its last event finds the response complete (and keeps the connection)."""


class SSEResponse(StreamingResponse):
    """Starlette's StreamingResponse with the body's end in the last write, and (ASGI before
    2.4, where a send to a client that left is dropped, not an error) the client's leaving
    watched by one plain task that cancels the streaming one: lighter than an anyio task group
    per response, and the body's cleanup, cancelled once, runs to its end before the response
    does. `lane`: the body's choice's direct lane, given this response's send."""

    lane: DirectLane | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        spec = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
        if scope["type"] != "http" or spec >= (2, 4):
            await super().__call__(scope, receive, send)
            return
        owner = asyncio.current_task()
        assert owner is not None
        streaming, left = True, False

        async def watch() -> None:
            nonlocal left
            await self.listen_for_disconnect(receive)
            if streaming:  # the client left mid-stream: the stream ends (its cleanup runs)
                left = True
                owner.cancel()

        watcher = asyncio.ensure_future(watch())
        watcher.add_done_callback(_retrieved)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # This task's own cancel (the client left) ends the response quietly, as
            # Starlette's does; any other cancel goes on.
            if not left or owner.uncancel() > 0:
                raise
        finally:
            streaming = False
            watcher.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        # The body in a task of its own, awaited here: each read's wake-up then resumes its few
        # frames, not the two dozen of the server, middleware and routing above this one. A
        # cancel of this task (the client left) cancels it, and its cleanup runs in it.
        await asyncio.ensure_future(self._send_body(send))

    async def _send_body(self, send: Send) -> None:
        if self.lane is not None:
            self.lane.send = send
        more = True
        async for chunk in self.body_iterator:  # to its end: its cleanup runs in it
            if more:
                more = not isinstance(chunk, LastWrite)
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("watching for the client's leaving failed", exc_info=task.exception())


def sse_response(
    chunks: AsyncIterator[bytes],
    first: StreamEvent,
    coalesce: bool = True,
    lane: DirectLane | None = None,
) -> StreamingResponse:
    """The streamed answer: `chunks` coalesced per write (`coalesce` False: chunks that already
    are a stream read's writes each, sent as they come, the last a LastWrite), the SSE headers
    (the worker that took the request, from its first event); `lane`: the direct lane of the
    choice that `chunks` renders (not coalesced)."""
    # A lane writes between the body's own writes, which only a body that makes its chunks in
    # the response's task (not coalesced's task of its own) leaves room for.
    assert lane is None or not coalesce, "a lane's body is not coalesced"
    body = coalesced(chunks) if coalesce else chunks
    response = SSEResponse(body, media_type="text/event-stream", headers=sse_headers(first))
    response.lane = lane
    return response


# A streamed choice's body: its SSE writes from its first read, its later reads and its lane
# (given the renderer of its token deltas).
LaneBody = Callable[[list[StreamEvent], Batches, DirectLane], AsyncIterator[bytes]]


async def lane_response(
    request: Request, state: RouterState, routed: RoutedRequest, body: LaneBody
) -> StreamingResponse:
    """A one-choice stream, one write a stream read, its token deltas by its direct lane: its
    reads opened, its first awaited before the 200 (so an early failure keeps its status code),
    its writes made by `body`."""
    lane = DirectLane()
    (batches,) = open_batches(request, state, routed, lane)
    (first,) = await first_batches([batches])
    return sse_response(body(first, batches, lane), first[0], coalesce=False, lane=lane)


def open_streams(request: Request, state: RouterState, routed: RoutedRequest) -> list[Events]:
    """Each choice's events (routed.start_relay() made their progress)."""
    return [
        state.dispatcher.events(gen, request.is_disconnected, streamed=routed.stream)
        for gen in routed.gens
    ]


def open_batches(
    request: Request, state: RouterState, routed: RoutedRequest, lane: DirectLane | None = None
) -> list[Batches]:
    """Each choice's events, a stream read's worth at a time (routed.start_relay() made their
    progress); `lane`: the one choice's direct lane."""
    assert lane is None or len(routed.gens) == 1, "a lane is one choice's"
    return [
        state.dispatcher.batches(gen, request.is_disconnected, streamed=routed.stream, lane=lane)
        for gen in routed.gens
    ]


async def collect(events: Events, progress: ChoiceProgress) -> None:
    """Fold a choice's events into its progress until `done`; an error raises its API error."""
    async with aclosing(events):
        async for ev in events:
            if ev.kind == "error":
                raise error_for(ev)
            progress.on_event(ev)
            if ev.kind == "done":
                return
    raise APIError.of(ErrorKind.CLIENT_CLOSED, "The client closed the request.")


async def collect_all(streams: list[Events], progress: list[ChoiceProgress]) -> None:
    """Every choice to its end, side by side; the first failure is the request's."""
    if len(streams) == 1:
        await collect(streams[0], progress[0])
        return
    try:
        async with asyncio.TaskGroup() as tg:
            for events, p in zip(streams, progress, strict=True):
                tg.create_task(collect(events, p))
    except* APIError as group:
        raise group.exceptions[0] from None


async def first_events(streams: list[Events]) -> list[StreamEvent]:
    """Every choice's first event before the 200, so an early failure keeps its status code."""
    return await _firsts(streams, lambda first: first)


async def first_batches(streams: list[Batches]) -> list[list[StreamEvent]]:
    """Every choice's first batch before the 200, so an early failure keeps its status code."""
    return await _firsts(streams, lambda first: first[0])


async def _firsts(streams: list[AsyncIterator[T]], head: Callable[[T], StreamEvent]) -> list[T]:
    """Each stream's first item; an end or an `error` first (`head` finds its first event) closes
    every stream and raises the request's error. Several choices wait side by side: a relay arms
    its cleanup (its job's cancel flag, its reservation) only when it starts, so one not started
    when another choice fails would leave its job running for nobody and its place held."""
    if len(streams) == 1:
        first = await anext(streams[0], None)
        if first is None or head(first).kind == "error":
            await _close(streams)
            _raise_for(first, head)
        return [first]
    waits = [asyncio.ensure_future(anext(s, None)) for s in streams]
    failed: asyncio.Future[T | None] | None = None
    try:
        pending: set[asyncio.Future[T | None]] = set(waits)
        while pending and failed is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # The first to fail, in the order they ended (choices' order within one wake-up).
            failed = next((w for w in waits if w in done and _failed(w, head)), None)
    except BaseException:  # this request was cancelled: every relay ends here
        await _end_all(waits, streams)
        raise
    if failed is None:
        return [w.result() for w in waits]  # type: ignore[misc]
    await _end_all(waits, streams)
    exc = failed.exception()
    if exc is not None:  # a relay's own failure is the request's
        raise exc
    _raise_for(failed.result(), head)


def _failed(wait: asyncio.Future[Any], head: Callable[[Any], StreamEvent]) -> bool:
    if wait.exception() is not None:
        return True
    first = wait.result()
    return first is None or head(first).kind == "error"


def _raise_for(first: T | None, head: Callable[[T], StreamEvent]) -> NoReturn:
    if first is None:
        raise APIError.of(ErrorKind.CLIENT_CLOSED, "The client closed the request.")
    raise error_for(head(first))


async def _end_all(waits: list[asyncio.Future[Any]], streams: list[AsyncIterator[Any]]) -> None:
    """Every relay ended, shielded (a second cancel cannot cut it short): those still waiting for
    their first item cancelled, each ending through its own cleanup, then every stream closed
    (those that had their first item end there)."""
    with anyio.CancelScope(shield=True):
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        await _close(streams)


async def _close(streams: list[AsyncIterator[Any]]) -> None:
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]

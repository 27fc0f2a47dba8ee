"""A streamed choice's direct lane writes what the response's own task would have written, in the
same order: its token deltas go out in the hub's callback, through the response's ASGI send; a
start, an end, a gap or an unreadable entry takes the task's way; a send that must wait for the
client closes the lane, and what comes next goes out only after it; a send that fails fails the
response. The feed offers a sink only what comes while its reader waits with nothing taken."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn

from mlxcel_pool.redis_server import free_port
from router.dialects import anthropic_service
from router.dialects.anthropic_render import MessageShape
from router.dialects.responses import ResponsesRequest
from router.dialects.responses_output import ResponseShape
from router.dialects.responses_stream import stream_response
from router.edge.openai_types import ResponseFormat
from router.relay.attempt import Attempt
from router.relay.direct_lane import DirectLane, send_now
from router.relay.openai_render import _chunks
from router.relay.progress import ChoiceProgress
from router.relay.stream_hub import Deadlines, Feed, RawEntry
from router.relay.streams import sse_response
from router.relay.watch import Watch
from shared.wire import STREAM_FIELD, GenerationRequest, StreamEvent


def _entry(seq: int, kind: str = "delta", text: str | None = None) -> RawEntry:
    body = f"t{seq}" if text is None else text
    event = StreamEvent(kind=kind, seq=seq, text=body, token_ids=[seq + 5])  # type: ignore[arg-type]
    if kind == "done":
        event = StreamEvent(kind="done", seq=seq, finish_reason="stop", completion_tokens=seq)
    return [b"%d-0" % (seq + 1), [STREAM_FIELD, event.to_wire()]]


async def _none() -> None:
    return None


async def _passes(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# --- the feed's sink --------------------------------------------------------------------------


def test_a_sink_takes_reads_while_its_reader_waits_and_a_refused_one_waits_for_the_reader() -> None:
    async def run() -> tuple[list[list[bytes]], list[bytes], bool, bool]:
        deadlines = Deadlines()
        feed = Feed(deadlines)
        offered: list[list[bytes]] = []
        refuse = False

        def sink(entries: list[RawEntry]) -> bool:
            offered.append([e[0] for e in entries])
            return not refuse

        try:
            waiting = asyncio.ensure_future(feed.wait(30.0, sink))
            await _passes()
            feed.push([_entry(0), _entry(1)])
            await _passes()
            woken_by_taken = waiting.done()
            refuse = True
            feed.push([_entry(2)])  # refused: the reader's, and the sink is offered no more
            feed.push([_entry(3)])
            has_entries = await asyncio.wait_for(waiting, 30)
            return offered, [e[0] for e in feed.take()], woken_by_taken, has_entries
        finally:
            deadlines.close()

    offered, taken, woken_by_taken, has_entries = asyncio.run(run())
    assert offered == [[b"1-0", b"2-0"], [b"3-0"]]
    assert taken == [b"3-0", b"4-0"] and has_entries and not woken_by_taken


def test_a_sink_is_not_offered_a_read_while_entries_wait_for_the_reader() -> None:
    async def run() -> list[bytes]:
        deadlines = Deadlines()
        feed = Feed(deadlines)
        feed.push([_entry(0)])  # nobody waits: kept

        def sink(entries: list[RawEntry]) -> bool:
            raise AssertionError("offered a read behind entries not taken")

        try:
            assert await feed.wait(30.0, sink)  # returns at once: entries are there
            feed.push([_entry(1)])
            return [e[0] for e in feed.take()]
        finally:
            deadlines.close()

    assert asyncio.run(run()) == [b"1-0", b"2-0"]


# --- send_now ---------------------------------------------------------------------------------


def test_a_send_that_needs_no_wait_ends_in_the_call() -> None:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def run() -> Any:
        return send_now(send, {"n": 1})

    assert asyncio.run(run()) is None and sent == [{"n": 1}]


def test_a_send_that_waits_goes_on_from_its_wait_and_a_cancel_reaches_it() -> None:
    async def run() -> tuple[list[str], list[str]]:
        log: list[str] = []
        drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def send(message: str) -> None:
            log.append(f"wait {message}")
            try:
                await drained
                log.append(f"wrote {message}")
            finally:
                log.append(f"left {message}")

        pending = send_now(send, "a")
        assert pending is not None and not pending.done()
        await _passes()
        drained.set_result(None)
        await asyncio.wait_for(pending, 30)
        first = list(log)
        log.clear()
        drained = asyncio.get_running_loop().create_future()
        cancelled = send_now(send, "b")
        assert cancelled is not None
        await _passes()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return first, log

    first, second = asyncio.run(run())
    assert first == ["wait a", "wrote a", "left a"]
    assert second == ["wait b", "left b"]


def test_a_send_that_returns_another_awaitable_is_left_to_the_task() -> None:
    sent: list[Any] = []

    def send(message: Any) -> asyncio.Future[None]:  # an ASGI server of another kind
        sent.append(message)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def run() -> asyncio.Future[None] | None:
        pending = send_now(send, {"n": 1})  # type: ignore[arg-type]
        if pending is not None:
            await asyncio.wait_for(pending, 30)
        return pending

    assert asyncio.run(run()) is not None and sent == [{"n": 1}]


def test_a_send_that_fails_before_any_wait_raises_in_the_call() -> None:
    async def send(message: Any) -> None:
        raise OSError("the client is gone")

    async def run() -> None:
        send_now(send, {})

    with pytest.raises(OSError, match="the client is gone"):
        asyncio.run(run())


# --- a streamed choice: its watch, its renderer and its response -----------------------------


class _Client:
    """The ASGI side of one streamed response: what it was sent, and a send that waits while
    `paused` is set (uvicorn's, while the client's socket is full) or raises `fail`."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.entered: list[dict[str, Any]] = []  # every send begun, waiting or not
        self.drained = asyncio.Event()
        self.drained.set()
        self.fail: Exception | None = None

    async def send(self, message: dict[str, Any]) -> None:
        self.entered.append(message)
        if self.fail is not None and message.get("body"):
            raise self.fail
        await self.drained.wait()
        self.sent.append(message)

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


Body = Callable[
    [list[StreamEvent], AsyncIterator[list[StreamEvent]], ChoiceProgress, DirectLane],
    AsyncIterator[bytes],
]


def _completion(
    first: list[StreamEvent],
    batches: AsyncIterator[list[StreamEvent]],
    progress: ChoiceProgress,
    lane: DirectLane,
) -> AsyncIterator[bytes]:
    routed = SimpleNamespace(fmt=ResponseFormat(chat=False, model="m"), include_usage=False)
    return _chunks(first, batches, routed, progress, None, lane=lane)  # type: ignore[arg-type]


def _message(
    first: list[StreamEvent],
    batches: AsyncIterator[list[StreamEvent]],
    progress: ChoiceProgress,
    lane: DirectLane,
) -> AsyncIterator[bytes]:
    return anthropic_service._chunks(first, batches, progress, MessageShape("m"), lane)


def _response(
    first: list[StreamEvent],
    batches: AsyncIterator[list[StreamEvent]],
    progress: ChoiceProgress,
    lane: DirectLane,
) -> AsyncIterator[bytes]:
    async def stored(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        return None

    shape = ResponseShape(ResponsesRequest.model_validate({"input": "x"}), "m")
    return stream_response(first, batches, progress, shape, stored, lane)


async def _stream(
    client: _Client, feed: Feed, body: Body = _completion, timeout_s: float = 60.0
) -> tuple[asyncio.Task[None], Attempt, DirectLane]:
    """A streamed answer (`body`: a completion's, by default) over `feed`, its first read (a
    start) taken and its response started: the response's task waits for the next read."""
    gen = GenerationRequest(request_id="lane", model="m", prompt_tokens=[1], max_tokens=99)
    attempt, lane = Attempt(gen), DirectLane()
    watch = Watch(attempt, feed, None, False, timeout_s, _none, _none, lane=lane)  # type: ignore[arg-type]
    batches = watch.batches()
    feed.push([_entry(0, "start")])
    first = await anext(batches)
    chunks = body(first, batches, ChoiceProgress(gen), lane)
    response = sse_response(chunks, first[0], coalesce=False, lane=lane)
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    task = asyncio.ensure_future(response(scope, client.receive, client.send))
    await _passes()
    assert not task.done() and lane.open
    return task, attempt, lane


@asynccontextmanager
async def _streamed(
    body: Body = _completion, timeout_s: float = 60.0
) -> AsyncIterator[tuple[asyncio.Task[None], Attempt, DirectLane, Feed, _Client]]:
    """_stream over a feed and a client of its own: (its task, attempt, lane, feed, client)."""
    deadlines = Deadlines()
    feed, client = Feed(deadlines), _Client()
    try:
        task, attempt, lane = await _stream(client, feed, body, timeout_s)
        yield task, attempt, lane, feed, client
    finally:
        deadlines.close()


def test_a_reads_token_deltas_go_out_in_the_hubs_callback_and_the_end_by_the_task() -> None:
    async def run() -> tuple[list[bytes], list[bytes], int, bool]:
        async with _streamed() as (task, attempt, lane, feed, client):
            feed.push([_entry(1), _entry(2)])
            in_the_call = client.bodies()  # before any loop pass
            feed.push([_entry(3), _entry(4, "done")])  # the end: the task's
            await asyncio.wait_for(task, 30)
            return in_the_call, client.bodies(), attempt.next_seq, lane.relayed

    in_the_call, bodies, next_seq, relayed = asyncio.run(run())
    assert len(in_the_call) == 1 and b'"t1"' in in_the_call[0] and b'"t2"' in in_the_call[0]
    assert b'"t3"' in bodies[1] and bodies[1].endswith(b"data: [DONE]\n\n")
    assert len(bodies) == 2 and next_seq == 5 and relayed


@pytest.mark.parametrize(
    ("body", "delta", "end"),
    [
        (_message, b"event: content_block_delta", b"event: message_stop"),
        (_response, b"event: response.output_text.delta", b"event: response.completed"),
    ],
)
def test_the_messages_and_responses_streams_deltas_go_out_by_their_lanes(
    body: Body, delta: bytes, end: bytes
) -> None:
    async def run() -> tuple[list[bytes], list[bytes]]:
        async with _streamed(body) as (task, _, _, feed, client):
            before = len(client.bodies())
            feed.push([_entry(1), _entry(2)])
            in_the_call = client.bodies()[before:]  # before any loop pass
            feed.push([_entry(3, "done")])
            await asyncio.wait_for(task, 30)
            return in_the_call, client.bodies()

    in_the_call, bodies = asyncio.run(run())
    assert len(in_the_call) == 1 and in_the_call[0].count(delta) == 2
    assert b'"t1"' in in_the_call[0] and b'"t2"' in in_the_call[0]
    assert end in bodies[-1] and end not in b"".join(bodies[:-1])


def test_a_gap_is_the_tasks_to_end_on_as_ever() -> None:
    async def run() -> list[bytes]:
        async with _streamed() as (task, _, _, feed, client):
            feed.push([_entry(1)])
            feed.push([_entry(3)])  # seq 2 lost
            assert len(client.bodies()) == 1  # refused: not written in the call
            await asyncio.wait_for(task, 30)
            return client.bodies()

    bodies = asyncio.run(run())
    assert b'"t1"' in bodies[0] and b"lost events 2..2" in bodies[1]
    assert b'"t3"' not in b"".join(bodies) and bodies[-1].endswith(b"data: [DONE]\n\n")


def test_a_send_that_waits_for_the_client_closes_the_lane_and_what_follows_goes_after_it() -> None:
    async def run() -> list[bytes]:
        async with _streamed() as (task, _, lane, feed, client):
            client.drained.clear()  # the client's socket is full
            feed.push([_entry(1)])
            assert not lane.open
            feed.push([_entry(2)])  # the task's, behind the write that waits
            feed.push([_entry(3)])
            await _passes(20)
            assert client.bodies() == [] and len(client.entered) == 2  # the head, t1
            client.drained.set()
            await _passes(20)
            assert lane.open  # the task waits again, its lane open
            feed.push([_entry(4), _entry(5, "done")])
            await asyncio.wait_for(task, 30)
            return client.bodies()

    bodies = asyncio.run(run())
    text = b"".join(bodies)
    at = [text.index(b'"t%d"' % i) for i in range(1, 5)]
    assert at == sorted(at) and bodies[-1].endswith(b"data: [DONE]\n\n")


def test_a_cancel_while_a_lane_write_waits_ends_that_write_with_the_task() -> None:
    """The client left (its response's task is cancelled) right after the lane's write woke the
    task to wait for it, before the task ran: that write ends with the task, unwritten."""

    async def run() -> tuple[bool, list[bytes]]:
        async with _streamed() as (task, _, _, feed, client):
            client.drained.clear()
            feed.push([_entry(1)])  # its write waits, and wakes the task
            task.cancel()  # before the task has run
            with pytest.raises(asyncio.CancelledError):
                await task
            client.drained.set()
            await _passes()
            return task.cancelled(), client.bodies()

    cancelled, bodies = asyncio.run(run())
    assert cancelled and bodies == []


def test_a_read_that_comes_after_the_task_was_cancelled_is_not_offered_to_the_lane() -> None:
    async def run() -> list[dict[str, Any]]:
        async with _streamed() as (task, _, _, feed, client):
            task.cancel()  # the client left; the task has not run its cancel yet
            feed.push([_entry(1)])
            with pytest.raises(asyncio.CancelledError):
                await task
            return client.entered

    assert [m["type"] for m in asyncio.run(run())] == ["http.response.start"]


def test_an_entry_the_lane_cannot_decode_fails_its_request_not_the_hubs_callback() -> None:
    async def run() -> list[bytes]:
        async with _streamed() as (task, _, _, feed, client):
            feed.push([_entry(1)])
            feed.push([[b"3-0", None]])  # no fields at all: decode_entry raises TypeError
            with pytest.raises(TypeError):
                await asyncio.wait_for(task, 30)
            return client.bodies()

    bodies = asyncio.run(run())
    assert len(bodies) == 1 and b'"t1"' in bodies[0]


def test_a_stream_quiet_after_its_lane_relayed_still_times_out() -> None:
    """Tokens by the lane wake no task; when they stop, the watch's quiet checks still come."""

    async def run() -> list[bytes]:
        async with _streamed(timeout_s=0.5) as (task, _, _, feed, client):
            feed.push([_entry(1)])
            await asyncio.wait_for(task, 30)  # no more entries: the request's timeout ends it
            return client.bodies()

    bodies = asyncio.run(run())
    assert b'"t1"' in bodies[0] and b"no response from a worker in 0.5s" in bodies[-1]


def test_a_send_that_fails_in_the_lane_fails_the_response() -> None:
    async def run() -> None:
        async with _streamed() as (task, _, _, feed, client):
            client.fail = OSError("the client is gone")
            feed.push([_entry(1)])
            await asyncio.wait_for(task, 30)

    with pytest.raises(OSError, match="the client is gone"):
        asyncio.run(run())


# --- under uvicorn, a client that stops reading ----------------------------------------------

MB_TEXT = "x" * 1_000_000


class _LaneApp:
    """One streamed completion over a feed the test pushes into from its own thread."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.feed: Feed | None = None
        self.lane: DirectLane | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        deadlines = Deadlines()
        feed = Feed(deadlines)
        gen = GenerationRequest(request_id="lane", model="m", prompt_tokens=[1], max_tokens=99)
        lane = DirectLane()
        watch = Watch(Attempt(gen), feed, None, False, 60.0, _none, _none, lane=lane)  # type: ignore[arg-type]
        batches = watch.batches()
        feed.push([_entry(0, "start")])
        first = await anext(batches)
        chunks = _completion(first, batches, ChoiceProgress(gen), lane)
        response = sse_response(chunks, first[0], coalesce=False, lane=lane)
        self.loop, self.feed, self.lane = asyncio.get_running_loop(), feed, lane
        self.ready.set()
        try:
            await response(scope, receive, send)
        finally:
            deadlines.close()

    def push(self, entry: RawEntry) -> None:
        assert self.loop is not None and self.feed is not None
        self.loop.call_soon_threadsafe(self.feed.push, [entry])


def test_under_uvicorn_a_client_that_stops_reading_gets_every_write_in_order() -> None:
    """uvicorn's send waits while the client's socket and its own buffer are full: the lane's
    write then goes on in the response's task, the lane closes, and the reads that come
    meanwhile follow it. Read at last, the body holds every token once, in order."""
    app = _LaneApp()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(60)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: lane\r\nConnection: close\r\n\r\n")
            assert app.ready.wait(30)
            while not (app.lane and app.lane.open):  # the response's task waits on its lane
                assert time.monotonic() < deadline + 30, "the lane never opened"
                time.sleep(0.01)
            closed = False
            for seq in range(1, 13):  # 12 MB: past the kernel's send buffer (4 MB at most)
                app.push(_entry(seq, text=f"{seq}{MB_TEXT}"))
                time.sleep(0.05)
                closed = closed or not (app.lane and app.lane.open)
            app.push(_entry(13, "done"))
            head, body = _read_chunked(sock)
    finally:
        server.should_exit = True
        thread.join(10)
    assert head.startswith(b"HTTP/1.1 200") and closed  # a write waited for the client
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert [t for t in texts if t] == [f"{seq}{MB_TEXT}" for seq in range(1, 13)]


def _read_chunked(sock: socket.socket) -> tuple[bytes, bytes]:
    """An HTTP/1.1 response read to its end: its head, and its body with the chunked transfer
    coding undone."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 20)
    head, _, rest = data.partition(b"\r\n\r\n")
    parts: list[bytes] = []
    while True:
        while b"\r\n" not in rest:
            rest += sock.recv(1 << 20)
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        while len(rest) < size + 2:
            more = sock.recv(1 << 20)
            assert more, "the connection closed mid-body"
            rest += more
        if size == 0:
            return head, b"".join(parts)
        parts.append(rest[:size])
        rest = rest[size + 2 :]

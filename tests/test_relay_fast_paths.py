"""The relay's per-token shortcuts give what the long ways give: the stream hub over a real Redis
(RESP2 and RESP3) hands each stream its entries once and in order, a read at a time, and wakes a
read in flight for a stream subscribed meanwhile; an entry decodes to the event (or the error)
StreamEvent.from_wire makes, its shape known or not; a text chunk from its template is the bytes
the chunk's dict makes; an SSE response's last write carries the body's end."""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from router.edge.openai_types import ResponseFormat
from router.relay import event_decode, stream_hub
from router.relay.attempt import Attempt
from router.relay.event_decode import decode_entry, decode_event, entry_ms
from router.relay.openai_render import _chunks, chunk_writer, text_chunk_writer
from router.relay.progress import ChoiceProgress
from router.relay.stream_hub import Deadlines, Feed, RawEntry, StreamHub
from router.relay.streams import LastWrite, sse_response
from router.relay.timings import Timings
from router.relay.watch import Watch
from shared import keys
from shared.config import RedisConfig
from shared.wire import STREAM_FIELD, GenerationRequest, StreamEvent, WireError

# --- the stream hub ---------------------------------------------------------------------------


def _events(feed: Feed) -> list[StreamEvent]:
    return [decode_entry(fields) for _, fields in feed.take()]


async def _gather(feed: Feed, n: int) -> list[StreamEvent]:
    """`n` events from the feed (failing after a long wait: nothing is timed here)."""
    got: list[StreamEvent] = []
    while len(got) < n:
        assert await feed.wait(30.0), f"{len(got)} of {n} events came"
        got += _events(feed)
    return got


def _write(r: redis.Redis, stream: str, seqs: range) -> None:
    with r.pipeline(transaction=False) as pipe:
        for seq in seqs:
            event = StreamEvent(kind="delta", seq=seq, text=f"t{seq}", token_ids=[seq + 5])
            pipe.xadd(stream, {STREAM_FIELD: event.to_wire()})
        pipe.execute()


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_hub_hands_each_stream_its_entries_once_and_in_order(
    redis_url: str, protocol: int
) -> None:
    r = redis.Redis.from_url(redis_url)
    streams = [keys.request_stream(f"hub-{uuid.uuid4().hex}") for _ in range(3)]
    _write(r, streams[0], range(0, 2))  # written before the subscription: read from the start

    async def run() -> dict[str, list[int]]:
        hub = StreamHub(RedisConfig(url=f"{redis_url}?protocol={protocol}"))
        await hub.start()
        try:
            feeds = [await hub.subscribe(s) for s in streams]
            await asyncio.to_thread(_write, r, streams[1], range(0, 3))
            await asyncio.to_thread(_write, r, streams[0], range(2, 5))
            await asyncio.to_thread(_write, r, streams[2], range(0, 1))
            got = [await _gather(f, n) for f, n in zip(feeds, (5, 3, 1), strict=True)]
            return {s: [e.seq for e in events] for s, events in zip(streams, got, strict=True)}
        finally:
            await hub.stop()

    seqs = asyncio.run(run())
    assert seqs == {streams[0]: [0, 1, 2, 3, 4], streams[1]: [0, 1, 2], streams[2]: [0]}


def test_a_stream_subscribed_while_a_read_blocks_wakes_it(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a block far longer than the wait below, only the wake brings the blocked read back
    to name the new streams; several subscribed during one read share one wake."""
    monkeypatch.setattr(stream_hub, "BLOCK_MS", 600_000)
    r = redis.Redis.from_url(redis_url)
    first = keys.request_stream(f"hub-{uuid.uuid4().hex}")
    later = [keys.request_stream(f"hub-{uuid.uuid4().hex}") for _ in range(3)]

    async def run() -> list[list[int]]:
        hub = StreamHub(RedisConfig(url=redis_url))
        await hub.start()
        try:
            feed = await hub.subscribe(first)
            await asyncio.to_thread(_write, r, first, range(0, 1))
            await _gather(feed, 1)  # the hub reads, then blocks again with `first` alone
            while not hub._reading:
                await asyncio.sleep(0.01)
            feeds = [await hub.subscribe(s) for s in later]
            for s in later:
                await asyncio.to_thread(_write, r, s, range(0, 2))
            return [[e.seq for e in await _gather(f, 2)] for f in feeds]
        finally:
            await hub.stop()

    assert asyncio.run(run()) == [[0, 1]] * 3


def test_a_feed_wait_ends_at_its_deadline_or_with_entries_and_leaves_nothing_behind() -> None:
    async def run() -> tuple[bool, bool, int, int]:
        deadlines = Deadlines()
        feed = Feed(deadlines)
        try:
            empty = await feed.wait(0.01)  # nothing comes: its deadline ends it
            asyncio.get_running_loop().call_soon(feed.push, [[b"1-0", [STREAM_FIELD, b"x"]]])
            came = await feed.wait(60.0)  # entries end it long before its deadline
            return empty, came, len(feed.take()), len(deadlines._waiting)
        finally:
            deadlines.close()

    assert asyncio.run(asyncio.wait_for(run(), 60)) == (False, True, 1, 0)


def test_a_short_wait_added_after_a_long_one_still_ends_at_its_own_deadline() -> None:
    """The long wait planned the deadlines' one timer a minute out; the short one re-plans it
    (else it would wait the minute)."""

    async def run() -> tuple[bool, int]:
        deadlines = Deadlines()
        long_feed, short_feed = Feed(deadlines), Feed(deadlines)
        long_wait = asyncio.ensure_future(long_feed.wait(60.0))
        await asyncio.sleep(0)  # the long wait is in, its deadline planned
        try:
            came = await asyncio.wait_for(short_feed.wait(0.05), 30.0)
            return came, len(deadlines._waiting)
        finally:
            long_wait.cancel()
            deadlines.close()

    assert asyncio.run(run()) == (False, 1)  # the long one still waits


# --- what a waiting relay holds -----------------------------------------------------------------


def _entry(seq: int, kind: str = "delta") -> RawEntry:
    event = StreamEvent(kind=kind, seq=seq, text=f"t{seq}", token_ids=[seq + 5])  # type: ignore[arg-type]
    return [b"%d-0" % (seq + 1), [STREAM_FIELD, event.to_wire()]]


async def _none() -> None:
    return None


async def _started(task: asyncio.Future[Any]) -> None:
    """Until `task` has run up to its wait (a few loop passes; it never ends here)."""
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()


def test_a_watch_waiting_for_its_next_read_holds_nothing_of_the_last() -> None:
    """Each waiting stream used to keep its last read's entries and events alive until the next
    read: thousands of objects at 128 streams, which every pass of the young GC generation
    scanned and moved up."""

    async def run() -> tuple[list[bool], list[int]]:
        deadlines = Deadlines()
        feed = Feed(deadlines)
        gen = GenerationRequest(request_id="held", model="m", prompt_tokens=[1], max_tokens=4)
        watch = Watch(Attempt(gen), feed, None, False, 60.0, _none, _none)  # type: ignore[arg-type]
        batches = watch.batches()
        try:
            feed.push([_entry(0), _entry(1)])
            batch = await anext(batches)
            refs = [weakref.ref(event) for event in batch]
            del batch
            following = asyncio.ensure_future(anext(batches))
            await _started(following)
            held = [ref() is not None for ref in refs]
            feed.push([_entry(2, "done")])
            return held, [event.seq for event in await following]
        finally:
            await batches.aclose()
            deadlines.close()

    assert asyncio.run(asyncio.wait_for(run(), 60)) == ([False, False], [2])


def test_a_streamed_choice_waiting_for_its_next_read_holds_none_of_its_events() -> None:
    gen = GenerationRequest(request_id="held", model="m", prompt_tokens=[1], max_tokens=4)
    routed = SimpleNamespace(fmt=ResponseFormat(chat=False, model="m"), include_usage=False)
    more = asyncio.Event()
    refs: list[weakref.ref[StreamEvent]] = []

    def delta(seq: int) -> list[StreamEvent]:
        event = StreamEvent(kind="delta", seq=seq, text=f"t{seq}", token_ids=[seq + 5])
        refs.append(weakref.ref(event))
        return [event]

    async def reads() -> AsyncIterator[list[StreamEvent]]:
        yield delta(1)
        await more.wait()
        yield [StreamEvent(kind="done", seq=2, completion_tokens=2)]

    async def run() -> tuple[list[bytes], list[bool]]:
        progress = ChoiceProgress(gen)
        chunks = _chunks(delta(0), reads(), routed, progress, None)  # type: ignore[arg-type]
        got = [await anext(chunks), await anext(chunks)]  # the first read's write, the next's
        following = asyncio.ensure_future(anext(chunks))
        await _started(following)
        held = [ref() is not None for ref in refs]
        more.set()
        got.append(await following)
        await chunks.aclose()
        return got, held

    got, held = asyncio.run(asyncio.wait_for(run(), 60))
    assert held == [False, False]
    assert [b"t0" in got[0], b"t1" in got[1], got[2].endswith(b"data: [DONE]\n\n")] == [True] * 3


# --- decoding ---------------------------------------------------------------------------------

_TEXT = st.text(st.characters(codec="utf-8"), max_size=8)
_IDS = st.lists(st.integers(min_value=0, max_value=2**31), max_size=4)
_FLOAT = st.floats(min_value=-50, max_value=0, allow_nan=False)
_ENTRY = st.tuples(_FLOAT, st.lists(st.integers(0, 1000), max_size=3)).map(
    lambda t: [t[0], t[1], [-1.5] * len(t[1])]
)


@st.composite
def _worker_events(draw: st.DrawFn) -> StreamEvent:
    kind = draw(st.sampled_from(["start", "delta", "done", "error"]))
    ids = draw(_IDS)
    return StreamEvent(
        kind=kind,
        seq=draw(st.integers(0, 10_000)),
        text=draw(_TEXT),
        token_ids=ids,
        logprobs=draw(
            st.one_of(st.just([]), st.lists(_ENTRY, min_size=len(ids), max_size=len(ids)))
        ),
        prompt_logprobs=draw(st.one_of(st.just([]), st.lists(_ENTRY, max_size=2))),
        finish_reason=draw(st.sampled_from([None, "stop", "length"])),
        prompt_tokens=draw(st.integers(0, 99)),
        completion_tokens=draw(st.integers(0, 99)),
        cached_tokens=draw(st.integers(0, 99)),
        worker_id=draw(st.sampled_from(["", "w1"])),
        error=draw(st.sampled_from(["", "boom"])),
        error_type=draw(st.sampled_from(["", "server_error"])),
        stop_str=draw(st.sampled_from([None, "END"])),
    )


# What a worker writes for each token of a request without logprobs: a delta whose other
# fields are at their defaults (left off the wire), the event decode_event checks in line.
_TOKEN_DELTAS = st.builds(
    StreamEvent,
    kind=st.just("delta"),
    seq=st.integers(1, 10_000),
    text=_TEXT.filter(bool),
    token_ids=_IDS.filter(bool),
)
_EVENTS = st.one_of(_worker_events(), _TOKEN_DELTAS)


def _from_wire_or_error(data: bytes) -> StreamEvent | str:
    try:
        return StreamEvent.from_wire(data)
    except (WireError, ValueError) as exc:
        return f"an unreadable stream entry: {exc}"


def _as_decoded(event: StreamEvent) -> StreamEvent | str:
    if event.kind == "error" and event.error.startswith("an unreadable stream entry: "):
        return event.error
    return event


@settings(max_examples=300, deadline=None)
@given(_EVENTS)
def test_an_event_decodes_as_from_wire_decodes_it(event: StreamEvent) -> None:
    event_decode._shapes.clear()  # each example's shape new, then known (the cache is bounded)
    data = event.to_wire()
    for _ in range(2):  # the second time its shape is known
        assert decode_event(data) == StreamEvent.from_wire(data) == event
    # A token's delta (kind, seq, text, token ids and nothing else) is checked in line; any
    # other shape is learnt once.
    fields = set(msgpack.unpackb(data))
    token_delta = event.kind == "delta" and fields == {"kind", "seq", "text", "token_ids"}
    assert len(event_decode._shapes) == (0 if token_delta else 1)


_NEAR_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False),
    _TEXT,
    st.lists(st.one_of(st.integers(-2, 2), _TEXT, st.none()), max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(
    _EVENTS,
    st.dictionaries(
        st.sampled_from(sorted(StreamEvent.WIRE_TYPES) + ["odd"]), _NEAR_VALUES, max_size=3
    ),
)
def test_a_near_miss_decodes_as_from_wire_decodes_it(
    event: StreamEvent, changes: dict[str, Any]
) -> None:
    """A worker's event with some fields swapped for values of any type: whatever from_wire
    makes of it (an event, or an error), decode_event makes too, before and after the shape of
    the same fields with the right types is known."""
    event_decode._shapes.clear()
    message = {**msgpack.unpackb(event.to_wire()), **changes}
    data = msgpack.packb(message, use_bin_type=True)
    good = event.to_wire()
    for _ in range(2):
        assert _as_decoded(decode_event(data)) == _from_wire_or_error(data)
        decode_event(good)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # not msgpack
        msgpack.packb([1, 2]),
        msgpack.packb({"kind": "delta", "seq": 0, "text": "a", "token_ids": [1, "2"]}),
        msgpack.packb({"kind": "later", "seq": 0, "text": "a", "token_ids": [1]}),
        msgpack.packb({"kind": "delta", "seq": True, "text": "a", "token_ids": [1]}),
        msgpack.packb(
            {"kind": "delta", "seq": 0, "text": "a", "token_ids": [1], "logprobs": [[0.0]]}
        ),
    ],
)
def test_a_bad_entry_of_a_known_shape_is_the_error_from_wire_gives(data: bytes) -> None:
    event_decode._shapes.clear()
    # A delta of these four fields is checked in line, never learnt as a shape; a `start` of
    # the same fields is: the bad entries meet both checks.
    ok = msgpack.packb({"kind": "start", "seq": 0, "text": "a", "token_ids": [1]})
    decode_event(ok)  # the shape of the last three, with good values, is known
    assert len(event_decode._shapes) == 1
    assert _as_decoded(decode_event(data)) == _from_wire_or_error(data)
    assert isinstance(_from_wire_or_error(data), str)


def test_an_entry_without_the_event_field_is_an_error_event() -> None:
    event = decode_entry([b"other", b"x"])
    assert event.kind == "error" and "without the event field" in event.error
    good = StreamEvent(kind="delta", seq=1, text="x").to_wire()
    assert decode_entry([b"other", b"x", STREAM_FIELD, good]).text == "x"


# --- rendering --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=12),
    st.booleans(),
    st.sampled_from([0, 1, 3]),
    st.booleans(),
    st.sampled_from(["m", 'a "quoted" \\ model', "modèle-✓"]),
)
def test_a_text_chunk_from_its_template_is_the_chunk_its_dict_makes(
    text: str, chat: bool, index: int, include_usage: bool, model: str
) -> None:
    """Any text the relay writes with the template: a chunk without text (a chat delta without
    content) is made from its dict."""
    fmt = ResponseFormat(chat=chat, model=model)
    chunk = chunk_writer(index, include_usage)
    assert text_chunk_writer(chunk, fmt)(text) == chunk(fmt.chunk(text))


def _asgi(chunks: list[bytes]) -> tuple[list[dict[str, Any]], bool]:
    """The ASGI messages an SSE response of these chunks sends, and whether its chunk iterator
    ran to its end."""
    sent: list[dict[str, Any]] = []
    ended = False

    async def body() -> AsyncIterator[bytes]:
        nonlocal ended
        try:
            for c in chunks:
                yield c
        finally:
            ended = True

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    first = StreamEvent(kind="start", worker_id="w1")
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(sse_response(body(), first, coalesce=False)(scope, receive, send))
    return sent, ended


def test_an_sse_responses_last_write_carries_the_end_of_its_body() -> None:
    sent, ended = _asgi([b"data: 1\n\n", LastWrite(b"data: 2\n\ndata: [DONE]\n\n")])
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 2
    assert dict(sent[0]["headers"])[b"x-mlxcel-worker"] == b"w1"
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 1\n\n", True),
        (b"data: 2\n\ndata: [DONE]\n\n", False),
    ]
    assert ended


def test_an_sse_response_without_a_last_write_ends_with_an_empty_one() -> None:
    sent, ended = _asgi([b"data: 1\n\n"])
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"data: 1\n\n", True), (b"", False)]
    assert ended


def test_a_client_that_leaves_mid_stream_ends_the_body_and_its_cleanup_first() -> None:
    """The client leaves while the body waits for its next chunk: the body is cancelled once,
    so its cleanup (an await in its finally) runs to its end before the response returns, and
    the response ends quietly."""
    sent: list[dict[str, Any]] = []
    first_out = asyncio.Event()
    cleaned = False

    async def body() -> AsyncIterator[bytes]:
        nonlocal cleaned
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # the next batch never comes
        finally:
            await asyncio.sleep(0.01)  # a cleanup that takes a while (a Redis round trip)
            cleaned = True

    async def receive() -> dict[str, Any]:
        await first_out.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("body"):
            first_out.set()

    async def run() -> None:
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await sse_response(body(), StreamEvent(kind="start"), coalesce=False)(scope, receive, send)

    asyncio.run(asyncio.wait_for(run(), 60))  # a response that missed the leaving hangs
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n"]
    assert cleaned


def test_an_entry_id_gives_the_millisecond_redis_stored_it() -> None:
    assert entry_ms(b"1733100000123-4") == 1733100000123
    assert entry_ms("1733100000123-0") == 1733100000123
    assert entry_ms(b"not-an-id") == 0


def test_decode_timing_is_the_workers_not_how_a_read_batched_the_tokens() -> None:
    # Five tokens stored 40 ms apart in Redis, read together by one router read (same `now`):
    # the gap observed is 10 ms a token, not the 0 the router's own clock would give.
    model = f"timing-{uuid.uuid4().hex[:8]}"

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"model_name": model}) or 0.0

    timings = Timings(model, enqueued_at=99.0)
    timings.first_token(100.0, written_ms=1_000_000)
    timings.done(100.0, completion_tokens=5, finish_reason="length", written_ms=1_000_040)
    itl = "mlxcel_request_inter_token_latency_seconds"
    assert sample(f"{itl}_count") == 1
    assert sample(f"{itl}_sum") == pytest.approx(0.010)
    # Entries stored within one millisecond tell nothing: no observation, never an infinite speed.
    same = Timings(model, enqueued_at=99.0)
    same.first_token(100.0, written_ms=2_000_000)
    same.done(100.0, completion_tokens=3, finish_reason="length", written_ms=2_000_000)
    assert sample(f"{itl}_count") == 1
    # Without Redis's times (an event the router made up), the router's clock is what there is.
    own = Timings(model, enqueued_at=99.0)
    own.first_token(100.0)
    own.done(100.5, completion_tokens=6, finish_reason="stop")
    assert sample(f"{itl}_count") == 2
    assert sample(f"{itl}_sum") == pytest.approx(0.110)

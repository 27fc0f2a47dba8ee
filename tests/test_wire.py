"""The wire decoders over arbitrary input (hypothesis): a message either decodes to an object
whose every field has its declared type and range, or raises WireError; nothing else escapes,
so a malformed job or stream entry fails alone instead of killing the process that read it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.relay.event_decode import decode_event
from shared.wire import (
    MAX_GRAMMAR_BYTES,
    MAX_GROUP_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_SEED,
    MAX_TOP_LOGPROBS,
    ControlCommand,
    ControlReply,
    GenerationRequest,
    StreamEvent,
    WireError,
    pack,
    unpack,
)

PROPERTY = settings(max_examples=200, deadline=None)

# What msgpack can carry: ints span int64 and uint64, text has no lone surrogates.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
MSGPACK = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=12,
)

VALID_REQUESTS = st.builds(
    GenerationRequest,
    request_id=st.text(min_size=1, max_size=16),
    model=st.text(max_size=16),
    prompt_tokens=st.lists(st.integers(0, 2**31), min_size=1, max_size=32),
    max_tokens=st.integers(0, 2**31),
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1, exclude_min=True),
    seed=st.none() | st.integers(0, MAX_SEED),
    top_k=st.integers(0, 2**31),
    min_p=st.floats(0, 1),
    repetition_penalty=st.floats(0, 10, exclude_min=True),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    logit_bias=st.dictionaries(st.integers(0, 2**31), st.floats(-100, 100), max_size=4),
    logprobs=st.none() | st.integers(0, MAX_TOP_LOGPROBS),
    prompt_logprobs=st.none() | st.integers(0, MAX_TOP_LOGPROBS),
    echo=st.booleans(),
    stop=st.lists(st.text(max_size=8), max_size=16),
    grammar=st.none() | st.text(min_size=1, max_size=32),
    session_key=st.text(max_size=16),
    template_signature=st.text(max_size=16),
    adapter_id=st.text(max_size=16),
    enqueued_at=st.floats(0, 2e9),
    group=st.text(max_size=MAX_GROUP_CHARS),
)


def assert_valid_request(req: GenerationRequest) -> None:
    """Every field has exactly its declared type (no bool for an int) and range."""
    assert type(req.request_id) is str and req.request_id
    assert type(req.model) is str
    assert type(req.prompt_tokens) is list and req.prompt_tokens
    assert all(type(t) is int and t >= 0 for t in req.prompt_tokens)
    assert type(req.max_tokens) is int and req.max_tokens >= 0
    assert type(req.temperature) is float and math.isfinite(req.temperature)
    assert req.temperature >= 0
    assert type(req.top_p) is float and 0 < req.top_p <= 1
    assert req.seed is None or (type(req.seed) is int and 0 <= req.seed <= MAX_SEED)
    assert type(req.stop) is list and all(type(s) is str for s in req.stop)
    assert type(req.top_k) is int and req.top_k >= 0
    assert type(req.min_p) is float and 0 <= req.min_p <= 1
    assert type(req.repetition_penalty) is float and 0 < req.repetition_penalty <= 10
    for name in ("presence_penalty", "frequency_penalty"):
        assert type(getattr(req, name)) is float and -2 <= getattr(req, name) <= 2
    assert type(req.logit_bias) is dict and len(req.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES
    for token, bias in req.logit_bias.items():
        assert type(token) is int and token >= 0 and type(bias) is float and -100 <= bias <= 100
    for k in (req.logprobs, req.prompt_logprobs):
        assert k is None or (type(k) is int and 0 <= k <= 20)
    assert type(req.echo) is bool
    assert req.grammar is None or (
        type(req.grammar) is str and 0 < len(req.grammar.encode("utf-8")) <= MAX_GRAMMAR_BYTES
    )
    for name in ("session_key", "template_signature", "adapter_id"):
        assert type(getattr(req, name)) is str
    assert type(req.group) is str and len(req.group) <= MAX_GROUP_CHARS
    assert type(req.enqueued_at) is float and math.isfinite(req.enqueued_at)


def decode_request(data: Any) -> None:
    try:
        req = GenerationRequest.from_wire(data)
    except WireError:
        return
    assert_valid_request(req)


@st.composite
def mangled_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request's wire map with one field replaced by any value, or dropped, or one
    unknown field added: near misses, which whole-cloth random maps almost never are."""
    wire = draw(VALID_REQUESTS).to_wire()
    name = draw(st.sampled_from([*wire, "extra"]))
    if draw(st.booleans()) and name in wire:
        del wire[name]
    else:
        wire[name] = draw(MSGPACK)
    return wire


@PROPERTY
@given(MSGPACK)
def test_request_decoder_takes_any_msgpack_value(data: Any) -> None:
    decode_request(data)


@PROPERTY
@given(mangled_requests())
def test_request_decoder_takes_any_near_miss(data: dict[str, Any]) -> None:
    decode_request(data)
    decode_request(unpack(pack(data)))


@PROPERTY
@given(VALID_REQUESTS)
def test_valid_requests_round_trip(req: GenerationRequest) -> None:
    back = GenerationRequest.from_wire(unpack(pack(req.to_wire())))
    assert back == req
    assert_valid_request(back)


BASE = GenerationRequest(request_id="r1", model="m", prompt_tokens=[1, 2], max_tokens=4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", -1),
        ("seed", MAX_SEED + 1),
        ("seed", True),
        ("seed", 1.0),
        ("temperature", "hot"),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("max_tokens", -1),
        ("max_tokens", True),
        ("max_tokens", 4.0),
        ("stop", 5),
        ("stop", [5]),
        ("stop", "x"),
        ("prompt_tokens", []),
        ("prompt_tokens", [1, -1]),
        ("prompt_tokens", [True]),
        ("prompt_tokens", [1.0]),
        ("request_id", ""),
        ("request_id", 7),
        ("model", None),
        ("session_key", b"k"),
        ("adapter_id", 0),
        ("enqueued_at", "now"),
        ("enqueued_at", math.nan),
        ("top_k", -1),
        ("top_k", 1.0),
        ("top_k", None),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_p", math.nan),
        ("repetition_penalty", 0),
        ("repetition_penalty", 10.5),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("presence_penalty", math.nan),
        ("frequency_penalty", -3),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", {5: "x"}),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {5: math.nan}),
        ("logit_bias", {i: 1.0 for i in range(301)}),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", 1.0),
        ("grammar", ""),
        ("grammar", 5),
        ("grammar", b"start: /a/"),
        ("grammar", ["x"]),
        ("grammar", "x" * (MAX_GRAMMAR_BYTES + 1)),
        ("grammar", "\u00e9" * MAX_GRAMMAR_BYTES),
        ("group", None),
        ("group", 5),
        ("group", b"g"),
        ("group", "g" * (MAX_GROUP_CHARS + 1)),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", True),
        ("echo", 1),
        ("echo", None),
        ("echo", "yes"),
    ],
)
def test_each_bad_field_is_a_wire_error_naming_it(field: str, value: Any) -> None:
    wire = {**BASE.to_wire(), field: value}
    with pytest.raises(WireError, match=field):
        GenerationRequest.from_wire(wire)


@pytest.mark.parametrize(
    "data", [None, [], "request", {}, {"request_id": "r"}, {**BASE.to_wire(), 1: 2}]
)
def test_non_requests_are_wire_errors(data: Any) -> None:
    with pytest.raises(WireError):
        GenerationRequest.from_wire(data)


def test_ints_become_floats_where_a_float_is_declared() -> None:
    req = GenerationRequest.from_wire({**BASE.to_wire(), "temperature": 1, "enqueued_at": 5})
    assert type(req.temperature) is float and type(req.enqueued_at) is float


# --- the small messages: any bytes at all -------------------------------------------------------


VALID_EVENTS = st.builds(
    StreamEvent,
    kind=st.sampled_from(sorted(StreamEvent.KINDS)),
    text=st.text(max_size=8),
    token_ids=st.lists(st.integers(0, 2**31), max_size=4),
    finish_reason=st.none() | st.sampled_from(["stop", "length"]),
    prompt_tokens=st.integers(0, 2**31),
    completion_tokens=st.integers(0, 2**31),
    cached_tokens=st.integers(0, 2**31),
    worker_id=st.text(max_size=8),
    error=st.text(max_size=8),
    error_type=st.text(max_size=8),
)


@st.composite
def events_with_logprobs(draw: st.DrawFn) -> StreamEvent:
    ev = draw(VALID_EVENTS)
    lp = st.floats(-9999.0, 0.0)
    top = draw(st.integers(0, MAX_TOP_LOGPROBS))
    ev.logprobs = [
        [
            draw(lp),
            draw(st.lists(st.integers(0, 2**31), min_size=top, max_size=top)),
            draw(st.lists(lp, min_size=top, max_size=top)),
        ]
        for _ in ev.token_ids
    ]
    ev.prompt_logprobs = [[draw(lp), [], []] for _ in range(draw(st.integers(0, 3)))]
    return ev


MESSAGE_TYPES = (StreamEvent, ControlCommand, ControlReply)


@st.composite
def message_bytes(draw: st.DrawFn) -> bytes:
    """Random bytes, a packed random value, or a valid message's bytes cut short or with one
    field replaced."""
    choice = draw(st.sampled_from(["bytes", "value", "cut", "field"]))
    if choice == "bytes":
        return draw(st.binary(max_size=64))
    if choice == "value":
        return pack(draw(MSGPACK))
    valid = [
        draw(VALID_EVENTS),
        ControlCommand("cache_reset", draw(st.text(max_size=8))),
        ControlReply(draw(st.text(max_size=8)), "cache_reset", {"freed": 1}),
    ]
    wire = dataclasses.asdict(draw(st.sampled_from(valid)))
    if choice == "cut":
        raw = pack(wire)
        return raw[: draw(st.integers(0, len(raw) - 1))]
    wire[draw(st.sampled_from(sorted(wire)))] = draw(MSGPACK)
    return pack(wire)


def assert_valid_message(msg: Any) -> None:
    for f in dataclasses.fields(msg):
        assert type(getattr(msg, f.name)) in type(msg).WIRE_TYPES[f.name], f.name
    if isinstance(msg, StreamEvent):
        assert msg.kind in StreamEvent.KINDS and all(type(t) is int for t in msg.token_ids)
    if isinstance(msg, ControlCommand):
        assert msg.kind in ControlCommand.KINDS


@PROPERTY
@given(message_bytes())
def test_message_decoders_take_any_bytes(data: bytes) -> None:
    for cls in MESSAGE_TYPES:
        try:
            msg = cls.from_wire(data)
        except WireError:
            continue
        assert_valid_message(msg)


@PROPERTY
@given(VALID_EVENTS | events_with_logprobs())
def test_valid_events_round_trip(ev: StreamEvent) -> None:
    assert StreamEvent.from_wire(ev.to_wire()) == ev


@pytest.mark.parametrize(
    "logprobs",
    [
        [[-0.5, [], []], [-0.1, [], []]],
        [[-0.5, [1], []]],
        [[-0.5, [1], [math.nan]]],
        [[math.inf, [], []]],
        [[-0.5, [-1], [-1.0]]],
        [[-0.5, [1.0], [-1.0]]],
        [[-0.5, []]],
        [[-1, [], []]],
        [-0.5],
        [[-0.5, {}, []]],
        [[-0.5, list(range(21)), [-1.0] * 21]],
    ],
)
def test_malformed_logprobs_are_wire_errors(logprobs: list[Any]) -> None:
    # One token, so one entry is due: two, a short or mistyped entry, a NaN, a negative id...
    data = pack({"kind": "delta", "token_ids": [7], "logprobs": logprobs})
    with pytest.raises(WireError, match="logprobs"):
        StreamEvent.from_wire(data)


@pytest.mark.parametrize(
    "entries",
    [
        [[-0.5, [1], []]],
        [[math.nan, [], []]],
        [[-0.5, [-1], [-1.0]]],
        [-0.5],
        [[None, [], []]],
        [[-0.5, list(range(21)), [-1.0] * 21]],
    ],
)
def test_malformed_prompt_logprobs_are_wire_errors(entries: list[Any]) -> None:
    data = pack({"kind": "start", "prompt_logprobs": entries})
    with pytest.raises(WireError, match="prompt_logprobs"):
        StreamEvent.from_wire(data)


def test_a_well_formed_logprobs_entry_decodes() -> None:
    data = pack({"kind": "delta", "token_ids": [7], "logprobs": [[-0.5, [7, 3], [-0.5, -2.0]]]})
    assert StreamEvent.from_wire(data).logprobs == [[-0.5, [7, 3], [-0.5, -2.0]]]


@pytest.mark.parametrize("data", [None, "text", 5, b"", b"\xc1", b"\x91" * 3000])
def test_non_msgpack_is_a_wire_error(data: Any) -> None:
    for cls in MESSAGE_TYPES:
        with pytest.raises(WireError):
            cls.from_wire(data)


def test_control_command_kind_is_checked() -> None:
    with pytest.raises(WireError, match="kind"):
        ControlCommand.from_wire(pack({"kind": "shutdown", "reply_id": "r"}))


def test_wire_types_name_every_field() -> None:
    for cls in (GenerationRequest, *MESSAGE_TYPES):
        local = getattr(cls, "LOCAL_FIELDS", frozenset())
        assert not local & set(cls.WIRE_TYPES), cls.__name__  # a local field is never sent
        assert set(cls.WIRE_TYPES) | local == {f.name for f in dataclasses.fields(cls)}, cls
    # A reader's own note stays off the wire, and one sent anyway is refused.
    assert b"written_ms" not in StreamEvent(kind="delta", text="x").to_wire()
    with pytest.raises(WireError, match="unknown field 'written_ms'"):
        StreamEvent.from_wire(pack({"kind": "delta", "written_ms": 5}))


# GenerationRequest's fields as the last release before `grammar`, `group`, `echo` and prompt
# logprobs wrote and read them (a worker of that version refuses any other field).
RELEASED_FIELDS = {
    "adapter_id",
    "enqueued_at",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "min_p",
    "model",
    "presence_penalty",
    "prompt_tokens",
    "repetition_penalty",
    "request_id",
    "seed",
    "session_key",
    "stop",
    "temperature",
    "template_signature",
    "top_k",
    "top_p",
}


def test_newer_fields_stay_off_the_wire_at_their_default() -> None:
    """A worker or router from before `grammar`, `group`, `echo` and prompt logprobs still reads
    every message that does not use them (a rolling upgrade mixes versions)."""
    assert set(BASE.to_wire()) == RELEASED_FIELDS
    used = dataclasses.replace(BASE, grammar="start: /a/", group="g", echo=True, prompt_logprobs=0)
    assert GenerationRequest.from_wire(unpack(pack(used.to_wire()))) == used
    assert "prompt_logprobs" not in unpack(StreamEvent(kind="delta", text="x").to_wire())
    start = StreamEvent(kind="start", prompt_logprobs=[[-0.5, [], []]])
    assert StreamEvent.from_wire(start.to_wire()) == start


def test_an_event_goes_with_only_its_fields_that_differ_from_their_defaults() -> None:
    """A delta, the one message a token costs, is its kind, seq, text and token ids on the wire;
    the reader (from_wire, and the router's decode) fills the rest with their defaults."""
    delta = StreamEvent(kind="delta", seq=7, text=" to", token_ids=[5])
    assert unpack(delta.to_wire()) == {"kind": "delta", "seq": 7, "text": " to", "token_ids": [5]}
    done = StreamEvent(kind="done", seq=9, finish_reason="length", completion_tokens=8)
    assert set(unpack(done.to_wire())) == {"kind", "seq", "finish_reason", "completion_tokens"}
    first = StreamEvent(kind="start")  # seq 0, no worker id: only its kind
    assert unpack(first.to_wire()) == {"kind": "start"}
    for ev in (delta, done, first):
        assert StreamEvent.from_wire(ev.to_wire()) == ev
        assert decode_event(ev.to_wire()) == ev

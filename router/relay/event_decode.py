"""A request stream's entry, as the stream hub hands it over, and the StreamEvent it holds.

Decoded once per relayed token. `StreamEvent.from_wire` checks each field's name and exact type
one by one. A token's own event, a delta of kind, seq, text and token ids (what the worker writes
for every token of a request without logprobs), is checked field by field here, in line; any
other event's shape (its field names in order, and their types) repeats within a request, so a
shape from_wire accepted once is known again by one dict lookup. What depends on the values (the
kind, the token ids) is checked every time, and an event with logprobs, or of a shape not seen
yet, goes through from_wire whole: either way the event equals the one from_wire makes, and a
bad entry is the same `error` event with from_wire's message.

The event is the unpacked map itself as the instance's attributes: a field the wire left out at
a scalar default is read from the class (a dataclass keeps such defaults there), and only the
list fields, each event's own, are added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shared.errors import ErrorKind
from shared.wire import STREAM_FIELD, StreamEvent, WireError, unpack

Shape = tuple[tuple[str, ...], tuple[type, ...]]
# Shapes are few (an event's fields at their defaults are left off the wire, so a worker writes a
# score or two of them); the bound only keeps odd writers from growing the cache.
MAX_SHAPES = 256
# The fields whose default each event gets anew (a list), by their factory: every other
# field's default is the class's attribute, read where the instance has none.
_OWN_DEFAULTS: dict[str, Callable[[], Any]] = {
    f.name: f.default_factory
    for f in dataclasses.fields(StreamEvent)
    if f.default_factory is not dataclasses.MISSING
}
# A token's delta: these fields, and those of _OWN_DEFAULTS it lacks.
_DELTA = ("kind", "seq", "text", "token_ids")
_DELTA_LACKS = tuple((n, f) for n, f in _OWN_DEFAULTS.items() if n not in _DELTA)
# A shape from_wire took -> the fields of _OWN_DEFAULTS it lacks.
_shapes: dict[Shape, tuple[tuple[str, Callable[[], Any]], ...]] = {}
_KINDS = StreamEvent.KINDS
_new = object.__new__


def entry_payload(fields: list[Any]) -> bytes | None:
    """The event field's value of an entry's [field, value, ...] list (None: it has none)."""
    if len(fields) == 2 and fields[0] == STREAM_FIELD:  # what every writer of the pool writes
        return fields[1]  # type: ignore[no-any-return]
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == STREAM_FIELD:
            return fields[i + 1]  # type: ignore[no-any-return]
    return None


def entry_ms(entry_id: bytes | str) -> int:
    """The milliseconds of a stream entry's id (`<ms>-<seq>`): when Redis stored it."""
    head = entry_id.split(b"-", 1)[0] if isinstance(entry_id, bytes) else entry_id.split("-", 1)[0]
    try:
        return int(head)
    except ValueError:
        return 0


def decode_entry(fields: list[Any]) -> StreamEvent:
    """The entry's event, or the `error` event that says why it is unreadable."""
    data = entry_payload(fields)
    if data is None:
        return error_event(ErrorKind.JOB_FAILED, "a stream entry without the event field")
    return decode_event(data)


def decode_event(data: bytes) -> StreamEvent:
    """StreamEvent.from_wire(data), or the `error` event that says why it failed."""
    try:
        message = unpack(data)
    except Exception:  # not msgpack: from_wire says how
        return _checked(data)
    if type(message) is not dict:
        return _checked(data)
    if len(message) == 4:
        ids = message.get("token_ids")
        if (
            message.get("kind") == "delta"
            and type(message.get("seq")) is int
            and type(message.get("text")) is str
            and type(ids) is list
            and _ints(ids)
        ):  # exactly those four fields, of from_wire's types: a token's delta
            for name, make in _DELTA_LACKS:
                message[name] = make()
            return _event(message)
    shape = (tuple(message), tuple(map(type, message.values())))
    lacking = _shapes.get(shape)
    if (
        lacking is not None
        and message["kind"] in _KINDS
        and not message.get("logprobs")
        and not message.get("prompt_logprobs")
        and _ints(message.get("token_ids", ()))
    ):
        for name, make in lacking:
            message[name] = make()
        return _event(message)
    try:
        event = StreamEvent.from_wire(data)
    except (WireError, ValueError) as exc:
        return _unreadable(exc)
    if len(_shapes) < MAX_SHAPES:  # from_wire took it: its shape passes from_wire's checks
        _shapes[shape] = _lacking(message)
    return event


def _event(message: dict[str, Any]) -> StreamEvent:
    """The event whose fields are `message`'s (every field of _OWN_DEFAULTS among them)."""
    event = _new(StreamEvent)
    event.__dict__ = message
    return event  # type: ignore[no-any-return]


def _ints(values: Any) -> bool:
    # A loop, not all() over a generator: a delta holds a token or a few, and the generator's
    # setup cost more than the checks.
    for value in values:  # noqa: SIM110
        if type(value) is not int:
            return False
    return True


def _lacking(message: dict[str, Any]) -> tuple[tuple[str, Callable[[], Any]], ...]:
    return tuple((n, f) for n, f in _OWN_DEFAULTS.items() if n not in message)


def _checked(data: bytes) -> StreamEvent:
    try:
        return StreamEvent.from_wire(data)
    except (WireError, ValueError) as exc:
        return _unreadable(exc)


def _unreadable(exc: Exception) -> StreamEvent:
    return error_event(ErrorKind.JOB_FAILED, f"an unreadable stream entry: {exc}")


def error_event(error_type: str, message: str) -> StreamEvent:
    """An `error` event the router makes up (the worker never sends these)."""
    return StreamEvent(kind="error", error=message, error_type=str(error_type))

"""A request stream's entry, as the stream hub hands it over, and the StreamEvent it holds."""

from __future__ import annotations

from typing import Any

from shared.errors import ErrorKind
from shared.wire import STREAM_FIELD, StreamEvent, WireError


def entry_payload(fields: list[Any]) -> bytes | None:
    """The event field's value of an entry's [field, value, ...] list (None: it has none)."""
    if len(fields) == 2 and fields[0] == STREAM_FIELD:  # what every writer of the pool writes
        return fields[1]  # type: ignore[no-any-return]
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == STREAM_FIELD:
            return fields[i + 1]  # type: ignore[no-any-return]
    return None


def decode_entry(fields: list[Any]) -> StreamEvent:
    """The entry's event, or the `error` event that says why it is unreadable."""
    data = entry_payload(fields)
    if data is None:
        return error_event(ErrorKind.JOB_FAILED, "a stream entry without the event field")
    try:
        return StreamEvent.from_wire(data)
    except (WireError, ValueError) as exc:
        return error_event(ErrorKind.JOB_FAILED, f"an unreadable stream entry: {exc}")


def error_event(error_type: str, message: str) -> StreamEvent:
    """An `error` event the router makes up (the worker never sends these)."""
    return StreamEvent(kind="error", error=message, error_type=str(error_type))

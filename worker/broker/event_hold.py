"""A non-streamed request's tokens, held in the worker between its stream's writes.

A client that did not ask for a stream reads nothing before the request's end, so writing its
tokens step by step costs the step script a write of its stream (the cancel-flag check, the
TTL) and the router a read and a wake-up every step, for nobody. Such a request's `start`, its
first token (the router's time to first token), its last event and, every HOLD_S, whatever came
between go out as they come; the other deltas wait here, in order. Each token stays an entry of
its own with its own `seq`, so the router's duplicate and gap checks read what they always
read. Its inter-token figures stay true: they are timed by the first token's entry and the
last's, both written in the step that made them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from shared.wire import StreamEvent

# How long a non-streamed request's tokens wait at most: short beside the router's idle check
# (a second), so a request writing tokens never looks quiet to it, and a client's leaving is
# seen by the router (at its next read of the stream) within this.
HOLD_S = 0.25

_FINAL = frozenset({"done", "error"})


@dataclass
class _Held:
    events: list[StreamEvent]
    due: float  # when what is held goes out without waiting for the request's end (monotonic)


class EventHold:
    """The held deltas of every running non-streamed request whose first token went out; a
    request that never had one, or that streams, has no entry."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._held: dict[str, _Held] = {}

    def take(
        self, request_id: str, streamed: bool, events: list[StreamEvent], now: float
    ) -> list[StreamEvent]:
        """The events of one request's step to write now, in order, after what waited for them
        (empty: this step's wait with the rest)."""
        if streamed:
            return events
        held = self._held.get(request_id)
        if events and events[-1].kind in _FINAL:  # the request's end: everything goes
            if held is None:
                return events
            del self._held[request_id]
            return held.events + events
        if held is None:
            # Its first token goes out in the step that made it; what follows waits.
            if any(ev.kind == "delta" for ev in events):
                self._held[request_id] = _Held([], now + self.hold_s)
            return events
        held.events += events
        if now < held.due:
            return []
        out, held.events, held.due = held.events, [], now + self.hold_s
        return out

    def keep_only(self, running: Collection[str]) -> None:
        """Drop what is held for requests no longer running: they ended without a last event
        of their own (the pool dropped them, the worker lost Redis), so their streams go on no
        further."""
        if self._held:
            live = set(running)
            for request_id in [r for r in self._held if r not in live]:
                del self._held[request_id]

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)

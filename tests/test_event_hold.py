"""A non-streamed request's tokens wait in the worker between its stream's writes
(worker.broker.event_hold); a streamed request's go out in the step that made them."""

from __future__ import annotations

from shared.wire import StreamEvent
from worker.broker.event_hold import EventHold


def delta(seq: int) -> StreamEvent:
    return StreamEvent(kind="delta", seq=seq, text=f"t{seq}", token_ids=[seq])


def seqs(events: list[StreamEvent]) -> list[int]:
    return [ev.seq for ev in events]


def test_a_streamed_request_writes_every_step() -> None:
    hold = EventHold(hold_s=10.0)
    for seq in range(1, 5):
        assert seqs(hold.take("a", True, [delta(seq)], now=0.0)) == [seq]
    assert len(hold) == 0


def test_start_and_first_token_go_at_once_then_tokens_wait_until_due_or_the_end() -> None:
    hold = EventHold(hold_s=1.0)
    start = StreamEvent(kind="start", seq=0, worker_id="w1")
    assert hold.take("a", False, [start], now=0.0) == [start]  # prefill's step
    assert seqs(hold.take("a", False, [delta(1)], now=0.1)) == [1]  # the first token: now
    assert hold.take("a", False, [delta(2)], now=0.2) == []
    assert hold.take("a", False, [delta(3)], now=0.9) == []
    assert seqs(hold.take("a", False, [delta(4)], now=1.1)) == [2, 3, 4]  # due at 1.1
    assert hold.take("a", False, [delta(5)], now=1.2) == []  # due again at 2.1
    done = StreamEvent(kind="done", seq=7, finish_reason="length")
    assert seqs(hold.take("a", False, [delta(6), done], now=1.3)) == [5, 6, 7]
    assert len(hold) == 0  # nothing is kept for an ended request


def test_a_request_that_ends_in_its_first_step_writes_it_whole() -> None:
    hold = EventHold(hold_s=1.0)
    events = [StreamEvent(kind="start"), delta(1), StreamEvent(kind="done", seq=2)]
    assert hold.take("a", False, events, now=0.0) == events
    assert len(hold) == 0


def test_an_error_after_held_tokens_follows_them() -> None:
    hold = EventHold(hold_s=1.0)
    hold.take("a", False, [StreamEvent(kind="start"), delta(1)], now=0.0)
    assert hold.take("a", False, [delta(2)], now=0.1) == []
    error = StreamEvent(kind="error", seq=3, error="boom")
    assert seqs(hold.take("a", False, [error], now=0.2)) == [2, 3]


def test_requests_no_longer_running_lose_what_was_held() -> None:
    hold = EventHold(hold_s=1.0)
    for rid in ("a", "b"):
        hold.take(rid, False, [StreamEvent(kind="start"), delta(1)], now=0.0)
        hold.take(rid, False, [delta(2)], now=0.1)
    hold.keep_only(["b"])
    assert len(hold) == 1
    # "b" still holds its token; "a", were it to come back, starts afresh (first token now).
    assert seqs(hold.take("b", False, [delta(3)], now=2.0)) == [2, 3]
    assert seqs(hold.take("a", False, [delta(3)], now=2.0)) == [3]
    hold.clear()
    assert len(hold) == 0

"""An idle worker's gathering of a burst, on a real Redis: it waits for more jobs only while a
router has placed on it a request it does not hold yet (the placements' prefill hash), so a
lone request starts at once and a burst already placed prefills as one batch."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from shared import keys
from shared.wire import GenerationRequest
from tests.intake_rig import registered_intake
from tests.streams import enqueue, enqueue_raw
from worker.broker import intake as intake_module
from worker.broker.intake import RqIntake

WID = "w-gather"
# Long enough that a gather which waits is plain to see, short enough for a failing run.
GAP_S = 30.0


@pytest.fixture
def rig(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> tuple[redis.Redis, RqIntake]:
    monkeypatch.setattr(intake_module, "GATHER_GAP_S", GAP_S)
    r = redis.Redis.from_url(redis_url)
    return r, registered_intake(r, WID)


def _own() -> str:
    return keys.worker_queue_name(WID)


def test_nothing_placed_but_what_it_holds_means_no_wait(rig: Any) -> None:
    r, intake = rig
    first = enqueue(r, [1, 2, 3], queue=_own())
    (taken,) = intake.take(4, None)
    assert taken.id == first
    r.hset(keys.worker_prefill(WID), first, 3)  # its own placement, not started yet
    queued = enqueue(r, [4, 5, 6], queue=_own())  # already queued: taken without waiting
    started = time.monotonic()
    more = intake.gather(4, window_s=2 * GAP_S, held={first})
    assert [j.id for j in more] == [queued]
    assert time.monotonic() - started < GAP_S / 2  # it did not wait for a pause in arrivals


def test_a_placed_request_not_taken_yet_is_waited_for(rig: Any) -> None:
    r, intake = rig
    first = enqueue(r, [1, 2, 3], queue=_own())
    (taken,) = intake.take(4, None)
    coming = "c0ffee"  # placed by a router that has not enqueued it yet
    r.hset(keys.worker_prefill(WID), mapping={first: 3, coming: 3})
    late: list[str] = []

    def enqueue_later() -> None:
        time.sleep(0.3)
        late.append(enqueue(r, [7, 8, 9], queue=_own()))

    thread = threading.Thread(target=enqueue_later)
    thread.start()
    more = intake.gather(1, window_s=2 * GAP_S, held={taken.id})
    thread.join()
    assert [j.id for j in more] == late  # it waited, and took the job that came


def test_a_placed_request_taken_by_the_gathers_own_look_is_not_waited_for(rig: Any) -> None:
    """The placements are read in the look that takes what is queued: a placed request that
    look took is no burst still on its way."""
    r, intake = rig
    first = enqueue(r, [1, 2, 3], queue=_own())
    (taken,) = intake.take(4, None)
    queued = enqueue(r, [4, 5, 6], queue=_own())
    r.hset(keys.worker_prefill(WID), mapping={first: 3, queued: 3})
    started = time.monotonic()
    more = intake.gather(4, window_s=2 * GAP_S, held={taken.id})
    assert [j.id for j in more] == [queued]
    assert time.monotonic() - started < GAP_S / 2


def test_a_burst_ends_once_every_placed_request_is_in_hand(rig: Any) -> None:
    """It waited for the placed request that had not come; once that came, nothing placed is
    still on its way, so it starts at once instead of waiting for a pause in arrivals."""
    r, intake = rig
    first = enqueue(r, [1, 2, 3], queue=_own())
    (taken,) = intake.take(4, None)
    coming = "c0ffee"  # placed by a router that has not enqueued it yet
    r.hset(keys.worker_prefill(WID), mapping={first: 3, coming: 3})

    def enqueue_later() -> None:
        time.sleep(0.3)
        enqueue_raw(r, coming, {"request": _request(coming).to_wire()}, _own())

    thread = threading.Thread(target=enqueue_later)
    started = time.monotonic()
    thread.start()
    more = intake.gather(4, window_s=2 * GAP_S, held={taken.id})
    thread.join()
    assert [j.id for j in more] == [coming]  # taken when it came
    assert 0.3 <= time.monotonic() - started < GAP_S / 2  # it waited for it, and no longer


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt_tokens=[7, 8, 9], max_tokens=8)

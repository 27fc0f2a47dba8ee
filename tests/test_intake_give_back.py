"""A take that Redis cuts short (a failover between taking a job off its queue and marking it
started) leaves no job in limbo: on a real Redis, the worker gives back what it took and did
not start, to the front of its queue, once and only while Redis shows it queued and on no queue;
and so a running job whose start the new primary lacks."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus

from shared import keys
from shared.wire import MsgpackSerializer
from tests.intake_rig import registered_intake
from tests.streams import enqueue
from worker.broker.intake import RqIntake

WID = "w-give-back"


@pytest.fixture
def rig(redis_url: str) -> tuple[redis.Redis, RqIntake]:
    r = redis.Redis.from_url(redis_url)
    return r, registered_intake(r, WID)


def _own(intake: RqIntake) -> Queue:
    (own,) = [q for q in intake.queues if q.name == keys.worker_queue_name(WID)]
    return own


def _status(r: redis.Redis, job_id: str) -> JobStatus:
    job = Job.fetch(job_id, connection=r, serializer=MsgpackSerializer)
    return job.get_status(refresh=False)


def test_a_take_cut_short_gives_its_job_back_to_the_front_of_its_queue(rig: Any) -> None:
    r, intake = rig
    own = _own(intake)
    (shared,) = [q for q in intake.queues if q is not own]
    first = enqueue(r, [1, 2, 3], queue=own.name)
    # An idle worker's take: its blocking pop finds the job, then its look for more fails (a
    # real Redis error, as a failover's would): the shared queue's key is no list. The job it
    # took first is off its queue and not started.
    r.set(shared.key, "not a list")
    with pytest.raises(redis.ResponseError):
        intake.take(4, 1.0)
    assert r.lrange(own.key, 0, -1) == []
    assert _status(r, first) == JobStatus.QUEUED  # in no one's hands

    r.delete(shared.key)
    behind = enqueue(r, [4, 5, 6], queue=own.name)
    assert intake.give_back() == 1
    assert r.lrange(own.key, 0, -1) == [first.encode(), behind.encode()]  # first again
    assert intake.give_back() == 0  # given back once
    assert [t.id for t in intake.take(4, None)] == [first, behind]
    assert _status(r, first) == JobStatus.STARTED


def test_a_started_job_or_one_still_queued_is_not_given_back(rig: Any) -> None:
    r, intake = rig
    own = _own(intake)
    started = enqueue(r, [1, 2, 3], queue=own.name)
    (taken,) = intake.take(4, None)
    assert taken.id == started
    assert intake.give_back() == 0  # its start landed: nothing in hand

    # A take the lost primary saw but its successor did not: the job is on its queue again.
    again = enqueue(r, [4, 5, 6], queue=own.name)
    got = intake._dequeue(None)
    assert got is not None and got[0].id == again
    r.lpush(own.key, again)
    assert intake.give_back() == 0
    assert r.lrange(own.key, 0, -1) == [again.encode()]


def test_a_running_job_whose_start_redis_lost_goes_back_to_its_queue(rig: Any) -> None:
    """A replica that heard a take (popped outright: the worker dequeues from two queues) but
    not the start after it: the job is `queued` on no queue. The worker that dropped it with
    the lost connection gives it back, once."""
    r, intake = rig
    own = _own(intake)
    first = enqueue(r, [1, 2, 3], queue=own.name)
    (taken,) = intake.take(4, None)
    assert taken.id == first and r.lrange(own.key, 0, -1) == []
    r.hset(taken.job.key, "status", JobStatus.QUEUED.value)  # the start the new primary lacks
    assert intake.reclaim_unstarted([taken]) == [False]  # not failed: given back
    assert r.lrange(own.key, 0, -1) == [first.encode()]
    assert intake.reclaim_unstarted([taken]) == [False]
    assert r.lrange(own.key, 0, -1) == [first.encode()]  # once
    assert [t.id for t in intake.take(4, None)] == [first]

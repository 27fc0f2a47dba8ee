"""A worker's take of the jobs already queued (worker/broker/intake.py, TAKE_QUEUED_LUA), on a
real Redis: its own queue before its model's, at most as many as it has room for, the ids whose
hash is gone skipped and a job rq cannot load failed alone, and a queue key that is no list
failing the take before anything leaves a queue."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry

from shared import keys
from shared.config import RedisConfig
from shared.redis_clients import sync_client
from shared.wire import MsgpackSerializer
from tests.drivers.blackhole_proxy import BlackholeProxy
from tests.intake_rig import registered_intake
from tests.streams import enqueue
from worker.broker.intake import TAKE_QUEUED_LUA, RqIntake

WID = "w-take"


@pytest.fixture
def rig(redis_url: str) -> tuple[redis.Redis, RqIntake, Queue, Queue]:
    r = redis.Redis.from_url(redis_url)
    intake = registered_intake(r, WID)
    (own,) = [q for q in intake.queues if q.name == keys.worker_queue_name(WID)]
    (shared,) = [q for q in intake.queues if q is not own]
    return r, intake, own, shared


def _status(r: redis.Redis, job_id: str) -> JobStatus:
    job = Job.fetch(job_id, connection=r, serializer=MsgpackSerializer)
    return job.get_status(refresh=False)


def test_queued_jobs_are_taken_own_queue_first_up_to_the_room_left(rig: Any) -> None:
    r, intake, own, shared = rig
    theirs = enqueue(r, [7, 8, 9], queue=shared.name)
    mine = [enqueue(r, [1, 2, 3], queue=own.name), enqueue(r, [4, 5, 6], queue=own.name)]
    assert [t.id for t in intake.take(2, None)] == mine
    assert [t.id for t in intake.take(4, None)] == [theirs]
    assert intake.take(4, None) == []
    assert all(_status(r, rid) == JobStatus.STARTED for rid in [*mine, theirs])
    assert r.llen(own.key) == 0 and r.llen(shared.key) == 0


def test_a_gone_hash_is_skipped_and_an_unloadable_job_fails_alone(rig: Any) -> None:
    r, intake, own, shared = rig
    first = enqueue(r, [1, 2, 3], queue=own.name)
    r.rpush(own.key, uuid.uuid4().hex)  # an id whose hash is gone (rq skips it)
    broken = uuid.uuid4().hex  # a hash rq cannot load: no data
    r.hset(Job.key_for(broken), mapping={"status": JobStatus.QUEUED.value})
    r.rpush(own.key, broken)
    last = enqueue(r, [4, 5, 6], queue=shared.name)
    assert [t.id for t in intake.take(8, None)] == [first, last]
    assert r.hget(Job.key_for(broken), "status") == JobStatus.FAILED.value.encode()
    failed = FailedJobRegistry(own.name, connection=r, serializer=MsgpackSerializer)
    assert broken in failed.get_job_ids()
    assert intake.give_back() == 0  # every job it took is started or failed
    assert r.llen(own.key) == 0 and r.llen(shared.key) == 0


def test_a_queue_that_is_no_list_fails_the_take_before_any_job_leaves_its_queue(
    rig: Any,
) -> None:
    r, intake, own, shared = rig
    waiting = enqueue(r, [1, 2, 3], queue=own.name)
    r.set(shared.key, "not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        intake.take(4, None)
    assert r.lrange(own.key, 0, -1) == [waiting.encode()]  # still queued, on its queue
    assert intake.give_back() == 0  # nothing was in hand
    r.delete(shared.key)
    assert [t.id for t in intake.take(4, None)] == [waiting]


def test_an_idle_take_blocks_for_the_first_job_then_takes_the_rest_with_it(rig: Any) -> None:
    r, intake, own, shared = rig
    theirs = enqueue(r, [7, 8, 9], queue=shared.name)
    mine = enqueue(r, [1, 2, 3], queue=own.name)
    assert [t.id for t in intake.take(4, 1.0)] == [mine, theirs]
    gone = uuid.uuid4().hex  # popped by the blocking pop, its hash gone: nothing taken
    r.rpush(own.key, gone)
    assert intake.take(4, 1.0) == []
    assert intake.give_back() == 0 and r.llen(own.key) == 0
    assert intake.take(4, 1.0) == []  # nothing queued: the block runs out


def test_an_id_rq_refuses_or_a_key_that_holds_no_hash_fails_alone(rig: Any) -> None:
    """No router writes such ids or keys; a worker that meets them goes on taking the rest,
    whether the blocking pop or the look found them."""
    r, intake, own, shared = rig
    bad_id = "not an id!"  # rq refuses it: letters, digits, '-' and '_' only
    r.hset(Job.key_for(bad_id), mapping={"status": JobStatus.QUEUED.value})
    r.rpush(own.key, bad_id)
    assert intake.take(4, 1.0) == []  # the blocking pop's: failed, nothing taken
    assert r.hget(Job.key_for(bad_id), "status") == JobStatus.FAILED.value.encode()
    not_a_hash = uuid.uuid4().hex
    r.set(Job.key_for(not_a_hash), "no hash")
    r.rpush(own.key, bad_id, not_a_hash)
    good = enqueue(r, [1, 2, 3], queue=shared.name)
    assert [t.id for t in intake.take(4, None)] == [good]  # the look's: the rest taken
    assert intake.give_back() == 0 and r.llen(own.key) == 0 and r.llen(shared.key) == 0


def test_a_take_whose_reply_was_lost_takes_the_same_jobs_when_sent_again(redis_url: str) -> None:
    """The worker's client sends a command again on a fresh connection when its connection
    drops (shared.redis_clients). A take that Redis applied and whose reply was lost is sent
    again: it answers with the jobs it popped the first time, not with what is queued since,
    so no job is left off its queue in no worker's hands. It answers so once: the next take
    takes what is queued then."""
    r = redis.Redis.from_url(redis_url)
    upstream = urlsplit(redis_url)
    assert upstream.hostname is not None and upstream.port is not None
    with BlackholeProxy(upstream.hostname, upstream.port) as proxy:
        userinfo = upstream.netloc.rpartition("@")[0]
        netloc = (
            f"{userinfo}@{proxy.host}:{proxy.port}" if userinfo else f"{proxy.host}:{proxy.port}"
        )
        intake = registered_intake(
            sync_client(RedisConfig(url=urlunsplit(upstream._replace(netloc=netloc)))), WID
        )
        (own,) = [q for q in intake.queues if q.name == keys.worker_queue_name(WID)]
        first = [enqueue(r, [1, 2, 3], queue=own.name), enqueue(r, [4, 5, 6], queue=own.name)]
        later = enqueue(r, [7, 8, 9], queue=own.name)
        r.script_load(TAKE_QUEUED_LUA)  # the reply lost is the take's, not a NOSCRIPT
        proxy.drop_reply(intake._take_queued.sha.encode())
        assert [t.id for t in intake.take(2, None)] == first
        assert proxy.replies_dropped == 1  # the take's reply was lost, and the take sent again
        assert [t.id for t in intake.take(2, None)] == [later]
        assert intake.take(2, None) == []
        assert all(_status(r, rid) == JobStatus.STARTED for rid in [*first, later])

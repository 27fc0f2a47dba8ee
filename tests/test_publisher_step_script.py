"""The publisher's step script on a real Redis: one step's appends, counters and reads in one
EVALSHA do what the per-stream scripts, HINCRBYs, EXISTS, MGET, LPOP and LLENs did."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from shared import keys
from shared.wire import STREAM_FIELD, ControlCommand, StreamEvent
from tests.streams import SHARED_QUEUE, enqueue, worker_broker
from worker.broker.intake import JobEnd, JobOutcome, RqIntake, TakenJob
from worker.broker.publisher import STEP_SHA, Liveness, Publisher, StepWrites

WID = "w-step"


@pytest.fixture
def rig(redis_url: str) -> tuple[redis.Redis, Publisher, RqIntake]:
    r = redis.Redis.from_url(redis_url)
    return (r, *worker_broker(r, WID))


def _take(r: redis.Redis, intake: RqIntake, n: int) -> list[TakenJob]:
    for _ in range(n):
        enqueue(r, [1, 2, 3])
    taken = intake.take(n, None)
    assert len(taken) == n
    return taken


def _events(seq: int, n: int) -> list[bytes]:
    return [StreamEvent(kind="delta", seq=seq + i, text=f"t{seq + i}").to_wire() for i in range(n)]


def _stream(r: redis.Redis, rid: str) -> list[int]:
    entries = r.xrange(keys.request_stream(rid))
    return [StreamEvent.from_wire(fields[STREAM_FIELD]).seq for _, fields in entries]


def _counters(r: redis.Redis) -> dict[str, int]:
    raw = r.hgetall(keys.worker_cache_counters(WID))
    return {k.decode(): int(v) for k, v in raw.items() if not k.startswith(b"last_reject_")}


def test_one_step_is_one_script_and_the_stream_rule_holds(rig: Any) -> None:
    r, publisher, intake = rig
    started, late, cancelled = _take(r, intake, 3)
    r.set(keys.request_cancel(cancelled.id), "1", ex=60)
    writes = StepWrites(
        streams=[(started, _events(0, 2)), (late, _events(5, 1)), (cancelled, _events(0, 1))],
        ongoing={late.id},  # its router deleted it: a later step's events never bring it back
        counters={"hits": 2, "misses": 0, "tokens": 5},
        busy=True,
        watched=[started.id, late.id, cancelled.id],
    )
    res = publisher.publish(writes)

    # Only the events that start a stream create it, with its TTL; a cancel flag refuses all.
    assert _stream(r, started.id) == [0, 1]
    assert 0 < r.ttl(keys.request_stream(started.id)) <= keys.REQUEST_TTL_S
    assert not r.exists(keys.request_stream(late.id))
    assert not r.exists(keys.request_stream(cancelled.id))
    # A zero delta is not sent outside a beat.
    assert _counters(r) == {"hits": 2, "tokens": 5}
    assert res.cancelled == [cancelled.id] and not res.reaped and not res.index_lost
    assert res.commands == [] and res.queued == 0

    # The next step continues the stream; counters add, never count twice; the step is one
    # EVALSHA (the first one found the script cache empty and ran its body).
    before = {k: v["calls"] for k, v in r.info("commandstats").items()}
    writes = StepWrites(
        streams=[(started, _events(2, 1))],
        ongoing={started.id},
        counters={"hits": 1, "tokens": 1},
        busy=True,
        watched=[started.id],
    )
    res = publisher.publish(writes)
    calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
    assert calls["cmdstat_evalsha"] - before["cmdstat_evalsha"] == 1
    assert calls["cmdstat_eval"] == before["cmdstat_eval"]
    assert _stream(r, started.id) == [0, 1, 2]
    assert _counters(r) == {"hits": 3, "tokens": 6}
    assert res.cancelled == []


def test_the_reads_come_back_as_the_old_commands_read_them(rig: Any) -> None:
    r, publisher, intake = rig
    (running,) = _take(r, intake, 1)
    cmd = ControlCommand(kind="cache_reset", reply_id="rep-1")
    r.rpush(keys.worker_control(WID), cmd.to_wire(), b"not msgpack", cmd.to_wire())
    enqueue(r, [4], queue=keys.worker_queue_name(WID))
    enqueue(r, [5])
    enqueue(r, [6], queue=SHARED_QUEUE)
    r.set(keys.worker_reaped(WID), "w1 found it dead")

    res = publisher.publish(StepWrites(watched=[running.id], busy=True))
    assert res.reaped and res.cancelled == []
    assert res.commands == [cmd, cmd]  # the malformed one is dropped, never executed
    assert res.queued == 3
    assert r.llen(keys.worker_control(WID)) == 0

    # With no running request and nothing to write, the step is still the one script.
    res = publisher.publish(StepWrites())
    assert res.commands == [] and res.queued == 3 and res.cancelled == []


def test_a_heartbeat_sends_every_counter_and_a_job_end_follows_its_events(rig: Any) -> None:
    r, publisher, intake = rig
    (job,) = _take(r, intake, 1)
    beat = Liveness(gauges={"running": 1}, running=[job])
    writes = StepWrites(streams=[(job, _events(0, 1))], counters={"a": 1, "b": 0}, liveness=beat)
    res = publisher.publish(writes)
    assert _counters(r) == {"a": 1, "b": 0} and not res.index_lost
    done = StreamEvent(kind="done", seq=1, finish_reason="length").to_wire()
    end = JobEnd(job, JobOutcome.FINISHED, {"worker_id": WID})
    writes = StepWrites(
        streams=[(job, [done])],
        ongoing={job.id},
        ended=[end],
        counters={"a": 0, "c": 0},
        busy=False,
        last_reject={"reason": "too long", "tokens": None},
    )
    publisher.publish(writes)
    assert _stream(r, job.id) == [0, 1]
    assert r.hget(job.job.key, "status") == b"finished"
    assert _counters(r) == {"a": 1, "b": 0}  # zero deltas outside a beat
    assert r.hget(keys.worker_cache_counters(WID), "last_reject_reason") == b"too long"
    assert r.hget(keys.worker_cache_counters(WID), "last_reject_tokens") == b""
    assert all(r.ttl(k) > 0 for k in r.scan_iter("mlxcel:req:*"))


def test_a_lost_script_cache_runs_the_step_once(rig: Any, redis_server: Any) -> None:
    r, publisher, intake = rig
    (job,) = _take(r, intake, 1)
    redis.Redis.from_url(redis_server.admin_url).script_flush()
    assert r.script_exists(STEP_SHA) == [False]
    res = publisher.publish(StepWrites(streams=[(job, _events(0, 2))], counters={"a": 2}))
    assert _stream(r, job.id) == [0, 1]
    assert _counters(r) == {"a": 2}
    assert res.cancelled == [] and not res.reaped
    assert r.script_exists(STEP_SHA) == [True]  # the next step's EVALSHA finds it
    publisher.publish(StepWrites(streams=[(job, _events(2, 1))], ongoing={job.id}))
    assert _stream(r, job.id) == [0, 1, 2]


def test_a_steady_step_is_written_at_send_and_its_reply_read_later(rig: Any) -> None:
    r, publisher, intake = rig
    job, cancelled = _take(r, intake, 2)
    r.set(keys.request_cancel(cancelled.id), "1", ex=60)
    busy = publisher.presence.busy
    # Anything besides the script (a beat, a busy change, a job end) goes through publish whole.
    beat = Liveness(gauges={}, running=[job])
    assert publisher.send(StepWrites(liveness=beat, busy=busy)) is None
    assert publisher.send(StepWrites(busy=not busy)) is None

    sent = publisher.send(
        StepWrites(streams=[(job, _events(0, 2))], busy=busy, watched=[job.id, cancelled.id])
    )
    assert sent is not None
    # Redis has applied it before the caller reads anything back.
    deadline = time.monotonic() + 5
    while not r.exists(keys.request_stream(job.id)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _stream(r, job.id) == [0, 1]
    res = sent.result()
    assert res.cancelled == [cancelled.id] and not res.reaped


def test_a_dropped_step_leaves_no_reply_for_the_next_command(rig: Any) -> None:
    r, publisher, intake = rig
    (job,) = _take(r, intake, 1)
    busy = publisher.presence.busy
    sent = publisher.send(StepWrites(streams=[(job, _events(0, 1))], busy=busy))
    assert sent is not None
    sent.drop()  # as the loop does when it reconnects
    r.set(keys.request_cancel(job.id), "1", ex=60)
    res = publisher.publish(StepWrites(busy=busy, watched=[job.id]))
    assert res.cancelled == [job.id]
    assert publisher.r.get(keys.request_cancel(job.id)) == b"1"

"""The batching worker through rq's own bookkeeping: rq's API shows the truth at every moment."""

from __future__ import annotations

import inspect
import time

import pytest
import redis
from rq import Worker
from rq.job import Job
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)

from shared import keys
from shared.wire import MsgpackSerializer
from tests.streams import (
    SHARED_QUEUE,
    TINY_MODEL,
    enqueue,
    enqueue_raw,
    generated_tokens,
    read_events,
)

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`


def _registries(r: redis.Redis):
    kw = {"connection": r, "serializer": MsgpackSerializer}
    return (
        StartedJobRegistry(SHARED_QUEUE, **kw),
        FinishedJobRegistry(SHARED_QUEUE, **kw),
        FailedJobRegistry(SHARED_QUEUE, **kw),
        CanceledJobRegistry(SHARED_QUEUE, **kw),
    )


def test_rq_calls_the_worker_relies_on_keep_their_signatures() -> None:
    # The worker writes each job's end with rq's public job, result and registry calls into its
    # own per-step pipeline (rq's worker handlers run one job and execute their own pipelines):
    # an rq upgrade that changes these signatures must fail here.
    from rq.executions import Execution
    from rq.registry import BaseRegistry
    from rq.results import Result

    def params(fn: object) -> set[str]:
        return set(inspect.signature(fn).parameters)  # type: ignore[arg-type]

    stamps = {
        "worker_name",
        "pipeline",
        "execution_id",
        "execution_started_at",
        "execution_ended_at",
    }
    assert stamps | {"job", "type", "ttl", "return_value"} <= params(Result.create)
    assert stamps | {"job", "ttl", "exc_string"} <= params(Result.create_failure)
    assert {"pipeline", "include_meta", "include_result"} <= params(Job.save)
    assert {"status", "pipeline"} <= params(Job.set_status)
    assert {"ttl", "pipeline", "remove_from_queue"} <= params(Job.cleanup)
    assert {"job", "ttl", "pipeline"} <= params(BaseRegistry.add)
    assert {"job", "ttl", "pipeline", "exc_string"} <= params(FailedJobRegistry.add)
    assert {"job", "ttl", "pipeline", "worker_name"} <= params(Execution.create)
    assert {"job", "pipeline"} <= params(Execution.delete)
    assert "pipeline" in params(Job.prepare_for_execution)


def test_many_jobs_run_at_once_and_registries_tell_the_truth(redis_url, start_worker) -> None:
    r = redis.Redis.from_url(redis_url)
    w = start_worker(redis_url, "w1")
    assert [x.name for x in Worker.all(connection=r)] == ["mlxcel-w1"]
    started, finished, failed, _ = _registries(r)

    ids = [enqueue(r, list(range(10, 40 + i)), max_tokens=150) for i in range(4)]
    # All four are executing together (one process, one batch), not one after another.
    deadline = time.monotonic() + 30
    peak = 0
    while time.monotonic() < deadline and peak < 4:
        peak = max(peak, started.count)
        time.sleep(0.02)
    assert peak == 4
    assert Worker.all(connection=r)[0].get_state() == "busy"
    for rid in ids:
        events = read_events(r, rid)
        assert events[0].kind == "start" and events[0].worker_id == "w1"
        assert events[-1].kind == "done" and events[-1].finish_reason == "length"
        assert len(generated_tokens(events)) == 150 == events[-1].completion_tokens
        # Per-request keys expire: the TTL goes with the first event, not with every token.
        assert 0 < r.ttl(keys.request_stream(rid)) <= keys.REQUEST_TTL_S

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and finished.count < 4:
        time.sleep(0.05)
    assert finished.count == 4 and started.count == 0 and failed.count == 0
    job = Job.fetch(ids[0], connection=r, serializer=MsgpackSerializer)
    assert job.get_status() == "finished"
    assert job.return_value()["completion_tokens"] == 150
    assert w.proc.poll() is None


def test_failed_job_lands_in_failed_registry_with_error_and_client_gets_error(
    redis_url, start_worker
) -> None:
    r = redis.Redis.from_url(redis_url)
    start_worker(redis_url, "w1")
    _, finished, failed, _ = _registries(r)
    bad_token = enqueue(r, [5, 6, 10**6], max_tokens=4)  # id outside the model's vocabulary
    enqueue_raw(r, "malformed-1", {"request": {"prompt_tokens": "not a list"}})
    good = enqueue(r, [5, 6, 7], max_tokens=4)

    events = read_events(r, bad_token)
    assert events[-1].kind == "error" and "vocab" in events[-1].error
    events = read_events(r, "malformed-1")
    assert events[-1].kind == "error" and "malformed" in events[-1].error
    assert read_events(r, good)[-1].kind == "done"

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (failed.count < 2 or finished.count < 1):
        time.sleep(0.05)
    assert sorted(failed.get_job_ids()) == sorted([bad_token, "malformed-1"])
    job = Job.fetch(bad_token, connection=r, serializer=MsgpackSerializer)
    assert job.get_status() == "failed"
    assert "vocab" in (job.latest_result().exc_string or "")


def test_cancel_flag_drops_the_sequence_and_cancels_the_job(redis_url, start_worker) -> None:
    r = redis.Redis.from_url(redis_url)
    start_worker(redis_url, "w1")
    started, _, _, canceled = _registries(r)
    rid = enqueue(r, list(range(10, 30)), max_tokens=1500)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not r.xlen(keys.request_stream(rid)) > 3:
        time.sleep(0.02)
    r.set(keys.request_cancel(rid), "1", ex=keys.REQUEST_TTL_S)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and canceled.count == 0:
        time.sleep(0.02)
    assert canceled.get_job_ids() == [rid] and started.count == 0
    assert Job.fetch(rid, connection=r, serializer=MsgpackSerializer).get_status() == "canceled"
    # The worker is free again: a new request completes.
    assert read_events(r, enqueue(r, [5, 6, 7], max_tokens=3))[-1].kind == "done"


@pytest.mark.parametrize("sig", ["SIGTERM"])
def test_warm_stop_finishes_running_work_and_unregisters(redis_url, start_worker, sig) -> None:
    import signal

    r = redis.Redis.from_url(redis_url)
    w = start_worker(redis_url, "w1")
    rid = enqueue(r, list(range(10, 30)), max_tokens=200)
    while not r.exists(keys.request_stream(rid)):
        time.sleep(0.01)
    assert w.stop(getattr(signal, sig)) == 0
    assert read_events(r, rid, timeout=5)[-1].kind == "done"  # finished, not dropped
    assert Worker.all(connection=r) == []
    assert not r.exists(keys.worker_info("w1"))
    # Its counters outlive it: the pool's totals still include this worker.
    assert int(r.hget(keys.worker_cache_counters("w1"), "requests")) == 1
    # The model and libraries were frozen out of the cyclic GC's full collections at start.
    assert "gc: froze" in w.log_path.read_text()


def test_a_second_live_worker_with_the_same_id_is_refused(
    redis_url, start_worker, tiny_model_dir, tmp_path
) -> None:
    import os
    import subprocess
    import sys

    start_worker(redis_url, "w1")
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "MLXCEL_MODEL": str(tiny_model_dir),
        "MLXCEL_WORKER_ID": "w1",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcel_pool", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "worker id 'w1' is in use" in proc.stdout + proc.stderr
    assert [w.name for w in Worker.all(connection=redis.Redis.from_url(redis_url))] == ["mlxcel-w1"]


def test_rq_worker_record_counts_jobs_and_working_time(redis_url, start_worker) -> None:
    r = redis.Redis.from_url(redis_url)
    start_worker(redis_url, "w1")
    read_events(r, enqueue(r, [5, 6, 7], max_tokens=20))
    read_events(r, enqueue(r, [5, 6, 10**6], max_tokens=2))  # fails: id outside the vocab
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        (w,) = Worker.all(connection=r)
        if w.successful_job_count == 1 and w.failed_job_count == 1:
            break
        time.sleep(0.05)
    assert (w.successful_job_count, w.failed_job_count) == (1, 1)
    assert w.total_working_time > 0


def test_a_job_abandoned_by_a_killed_worker_moves_to_failed(redis_url, start_worker) -> None:
    """rq's registry maintenance runs in our workers too: once a dead worker's execution stops
    heartbeating (its TTL, presence.EXECUTION_TTL_S, is put in the past here, not waited for), the
    next worker moves the job from the StartedJobRegistry to the FailedJobRegistry."""
    import signal

    r = redis.Redis.from_url(redis_url)
    w1 = start_worker(redis_url, "w1")
    started, _, failed, _ = _registries(r)
    rid = enqueue(r, list(range(10, 30)), max_tokens=1500)
    while not r.exists(keys.request_stream(rid)):
        time.sleep(0.01)
    w1.stop(signal.SIGKILL)
    assert started.get_job_ids() == [rid]  # rq alone still calls it started
    for member in r.zrange(started.key, 0, -1):
        r.zadd(started.key, {member: time.time() - 1})
    start_worker(redis_url, "w2")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and failed.count == 0:
        time.sleep(0.05)
    assert failed.get_job_ids() == [rid] and started.count == 0
    assert Job.fetch(rid, connection=r, serializer=MsgpackSerializer).get_status() == "failed"


def test_a_worker_restarted_under_its_id_fails_what_its_last_process_left(
    redis_url, start_worker
) -> None:
    """Killed, then back faster than any peer could see the death: the new process fails the
    jobs the old one left started (a 'worker lost' result, so a router may run them again)."""
    import signal

    from shared.liveness import WORKER_LOST_MARK

    r = redis.Redis.from_url(redis_url)
    w1 = start_worker(redis_url, "w1")
    started, _, failed, _ = _registries(r)
    rid = enqueue(r, list(range(10, 30)), max_tokens=1500)
    while not r.exists(keys.request_stream(rid)):
        time.sleep(0.01)
    w1.stop(signal.SIGKILL)
    start_worker(redis_url, "w1")  # (the old process's liveness hash is still there)
    deadline = time.monotonic() + 30  # the new process loads the model, then reaps, then serves
    while time.monotonic() < deadline and failed.count == 0:
        time.sleep(0.05)
    assert failed.get_job_ids() == [rid] and started.count == 0
    job = Job.fetch(rid, connection=r, serializer=MsgpackSerializer)
    assert WORKER_LOST_MARK in job.latest_result().exc_string


def test_the_reaper_counts_a_death_only_on_passes_a_second_apart(redis_url) -> None:
    """After a Redis stall every heartbeat looks old until workers write again, and the passes
    queued behind the stall run back to back: those must not add up to a live peer's death."""
    from rq.registry import StartedJobRegistry

    from shared.liveness import WORKER_LOST_MARK, min_alive_pttl_ms
    from worker.broker.intake import RqIntake, own_queues
    from worker.broker.presence import WorkerPresence
    from worker.broker.reaper import REAP_INTERVAL_S, Reaper

    r = redis.Redis.from_url(redis_url)

    def worker_side(wid: str) -> tuple[WorkerPresence, RqIntake]:
        presence = WorkerPresence(
            r, wid, own_queues(r, wid, TINY_MODEL), {"worker_id": wid, "model": TINY_MODEL}
        )
        presence.arrive({})
        return presence, RqIntake(presence)

    _, peer_intake = worker_side("w9")
    rid = enqueue(r, [1, 2, 3])
    assert [t.id for t in peer_intake.take(1, None)] == [rid]  # w9 runs it
    r.pexpire(keys.worker_info("w9"), min_alive_pttl_ms() - 1000)  # then w9 stops beating
    now = [100.0]
    reaper = Reaper(*worker_side("w1"), clock=lambda: now[0])
    assert reaper.reap() == [] and reaper.reap() == [] and reaper.reap() == []
    started = StartedJobRegistry(SHARED_QUEUE, connection=r, serializer=MsgpackSerializer)
    assert started.get_job_ids() == [rid]
    now[0] += REAP_INTERVAL_S
    assert reaper.reap() == [rid]
    job = Job.fetch(rid, connection=r, serializer=MsgpackSerializer)
    assert job.get_status() == "failed" and WORKER_LOST_MARK in job.latest_result().exc_string
    assert "mlxcel-w9" not in [w.name for w in Worker.all(connection=r)]
    assert reaper.reap() == []  # reaped once: the claim holds


def test_a_job_whose_start_redis_lost_is_reclaimed_by_its_taker_only(redis_url) -> None:
    """A replica that heard a dequeue but not the start pipeline after it (a failover between
    the two) holds the job `queued` in its queue's intermediate list, where no worker and no
    router would ever move it: the worker that took it reclaims it (out of the list, to fail).
    A job another worker started, or one still waiting in its queue, is not its to reclaim."""
    from rq import Queue
    from rq.executions import Execution

    from worker.broker.intake import PoolJob, RqIntake, TakenJob, own_queues
    from worker.broker.presence import WorkerPresence

    r = redis.Redis.from_url(redis_url)
    presence = WorkerPresence(
        r, "w1", own_queues(r, "w1", TINY_MODEL), {"worker_id": "w1", "model": TINY_MODEL}
    )
    presence.arrive({})
    intake = RqIntake(presence)
    shared = Queue(SHARED_QUEUE, connection=r, serializer=MsgpackSerializer)

    lost_start = enqueue(r, [1, 2, 3])  # dequeued the way the worker dequeues, never started
    job, queue = Queue.dequeue_any(
        [shared], None, connection=r, job_class=PoolJob, serializer=MsgpackSerializer
    )
    assert job.id == lost_start and r.lrange(queue.intermediate_queue_key, 0, -1) == [
        lost_start.encode()
    ]
    enqueue(r, [7, 8, 9])
    started = intake.take(1, None)[0]  # started whole
    waiting = enqueue(r, [4, 5, 6])  # still in its queue: any worker's to take

    def ticket(job_id: str) -> TakenJob:
        loaded = Job.fetch(job_id, connection=r, serializer=MsgpackSerializer)
        return TakenJob(loaded, Execution("e", job_id, connection=r), None)

    tickets = [ticket(lost_start), started, ticket(waiting)]
    assert intake.reclaim_unstarted(tickets) == [True, False, False]
    assert r.lrange(queue.intermediate_queue_key, 0, -1) == []
    assert r.lrange(shared.key, 0, -1) == [waiting.encode()]
    assert intake.reclaim_unstarted(tickets) == [False, False, False]  # reclaimed once


@pytest.mark.parametrize("outcome", ["finished", "failed"])
def test_a_jobs_end_writes_back_its_data_as_it_was_read(redis_url, outcome: str) -> None:
    """rq's save at a job's end deflates the data again at its own level: the worker writes
    back the bytes it read (the router's, deflated at the fastest level), which rq still reads
    as the job's call."""
    import zlib

    from worker.broker.intake import JobEnd, JobOutcome, RqIntake, own_queues
    from worker.broker.presence import WorkerPresence

    r = redis.Redis.from_url(redis_url)
    presence = WorkerPresence(
        r, "w1", own_queues(r, "w1", TINY_MODEL), {"worker_id": "w1", "model": TINY_MODEL}
    )
    presence.arrive({})
    intake = RqIntake(presence)
    rid = enqueue(r, list(range(5, 900)))
    key = f"rq:job:{rid}"
    fastest = zlib.compress(zlib.decompress(r.hget(key, "data")), 1)
    r.hset(key, "data", fastest)  # as the router's job template writes it
    (taken,) = intake.take(1, None)
    assert taken.id == rid and taken.request is not None
    end = JobEnd(taken, JobOutcome(outcome), {"text": "x"}, "it failed")
    with r.pipeline(transaction=False) as pipe:
        intake.end(pipe, end)
        pipe.execute()
    assert r.hget(key, "data") == fastest  # not deflated again (rq's level differs in bytes)
    job = Job.fetch(rid, connection=r, serializer=MsgpackSerializer)
    assert job.get_status() == outcome
    assert job.kwargs["request"]["prompt_tokens"] == list(range(5, 900))

    # A job whose call was changed after it was read is written as rq writes it.
    taken.job.kwargs = {"request": {**taken.job.kwargs["request"], "max_tokens": 3}}
    taken.job.save()
    assert r.hget(key, "data") != fastest
    job = Job.fetch(rid, connection=r, serializer=MsgpackSerializer)
    assert job.kwargs["request"]["max_tokens"] == 3

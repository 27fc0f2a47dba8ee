"""Redis restarting under a running worker: the worker keeps its model loaded, waits for Redis,
registers again and serves. Real worker process, a private real redis-server stopped and
started again on the same port (empty, as the embedded one restarts)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import redis
from rq import Worker

from mlxcel_pool.redis_server import start_redis
from shared import keys
from tests.streams import SHARED_QUEUE, enqueue, read_events

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _snapshot(server, tmp_path) -> Path:
    """A copy of Redis's state now (SAVE is the admin's command, not the pool's)."""
    redis.Redis.from_url(server.admin_url).save()
    snapshot = tmp_path / "dump.rdb"
    shutil.copy(f"{server.workdir}/dump.rdb", snapshot)
    return snapshot


def test_worker_survives_a_redis_restart(start_worker) -> None:
    server = start_redis()
    try:
        r = redis.Redis.from_url(server.url)
        w = start_worker(server.url, "w1")
        assert read_events(r, enqueue(r, [5, 6, 7], max_tokens=4))[-1].kind == "done"
        running = enqueue(r, list(range(10, 30)), max_tokens=1500)
        _wait(lambda: r.exists(keys.request_stream(running)), 20, "the long request started")

        server.stop()  # mid-request
        time.sleep(1.5)
        server = start_redis(port=server.port, password=server.password)
        r = redis.Redis.from_url(server.url)

        _wait(lambda: r.exists(keys.worker_info("w1")), 20, "the worker registered again")
        # rq's record follows the liveness hash (WorkerPresence.arrive writes them in turn).
        _wait(
            lambda: [x.name for x in Worker.all(connection=r)] == ["mlxcel-w1"],
            5,
            "rq lists the worker again",
        )
        assert w.proc.poll() is None
        events = read_events(r, enqueue(r, [8, 9, 10], max_tokens=4))
        assert events[-1].kind == "done" and events[-1].completion_tokens == 4
        assert "lost Redis" in w.log_path.read_text()
    finally:
        server.stop()


def test_a_persistent_redis_restart_fails_the_running_request(start_worker, tmp_path) -> None:
    """Redis restarts from its snapshot, so the job the worker was running is still there: the
    worker fails it (an error event for its client, the FailedJobRegistry for rq) and serves on.
    (A connection merely cut is retried by redis-py itself and never reaches the worker.)"""
    from rq.registry import FailedJobRegistry

    from shared.wire import MsgpackSerializer

    server = start_redis()
    try:
        r = redis.Redis.from_url(server.url)
        w = start_worker(server.url, "w1")
        running = enqueue(r, list(range(10, 30)), max_tokens=1900)
        _wait(lambda: r.xlen(keys.request_stream(running)) > 3, 20, "the request is streaming")
        snapshot = _snapshot(server, tmp_path)
        server.stop()
        time.sleep(1.5)
        server = start_redis(port=server.port, rdb=snapshot, password=server.password)
        r = redis.Redis.from_url(server.url)

        events = read_events(r, running)
        assert events[-1].kind == "error" and "lost Redis" in events[-1].error
        failed = FailedJobRegistry(SHARED_QUEUE, connection=r, serializer=MsgpackSerializer)
        assert running in failed.get_job_ids()
        assert read_events(r, enqueue(r, [8, 9, 10], max_tokens=4))[-1].kind == "done"
        assert w.proc.poll() is None
    finally:
        server.stop()


def test_a_snapshot_that_missed_a_finished_jobs_end_brings_it_back_and_the_worker_fails_it(
    start_worker, tmp_path
) -> None:
    """Redis restarts from a snapshot taken while a job ran, and the job finished after it: the
    job comes back `started`, as a failover brings it back on a replica that had not heard its
    end. The worker, which runs nothing of it, fails it as lost, so rq shows the truth and a
    router still waiting on it (it had not read the end either) runs it again or ends it,
    instead of waiting for ever on a job nobody holds."""
    from rq.job import Job
    from rq.registry import FailedJobRegistry, StartedJobRegistry

    from shared.liveness import WORKER_LOST_MARK
    from shared.wire import MsgpackSerializer

    server = start_redis()
    try:
        r = redis.Redis.from_url(server.url)
        w = start_worker(server.url, "w1")
        job = enqueue(r, list(range(10, 30)), max_tokens=600)
        _wait(lambda: r.xlen(keys.request_stream(job)) > 3, 20, "the request is streaming")
        snapshot = _snapshot(server, tmp_path)
        assert read_events(r, job)[-1].kind == "done"  # its end reached Redis, after the copy

        probe = start_redis(rdb=snapshot, password=server.password)  # what the copy holds
        try:
            status = redis.Redis.from_url(probe.url).hget(Job.key_for(job), "status")
        finally:
            probe.stop()
        assert status == b"started", "the snapshot must hold the job running"

        server.stop()
        time.sleep(1.5)
        server = start_redis(port=server.port, rdb=snapshot, password=server.password)
        r = redis.Redis.from_url(server.url)
        _wait(
            lambda: r.hget(Job.key_for(job), "status") == b"failed",
            20,
            "the worker failed the job Redis brought back",
        )
        started = StartedJobRegistry(SHARED_QUEUE, connection=r, serializer=MsgpackSerializer)
        assert job not in started.get_job_ids(cleanup=False)
        failed = FailedJobRegistry(SHARED_QUEUE, connection=r, serializer=MsgpackSerializer)
        assert job in failed.get_job_ids()
        result = Job.fetch(job, connection=r, serializer=MsgpackSerializer).latest_result()
        assert result is not None and WORKER_LOST_MARK in (result.exc_string or "")
        assert read_events(r, enqueue(r, [8, 9, 10], max_tokens=4))[-1].kind == "done"
        assert w.proc.poll() is None
        assert "their ends were lost" in w.log_path.read_text()
    finally:
        server.stop()


def test_router_answers_503_while_redis_is_down_and_serves_after_it_returns(
    tiny_model_dir, tmp_path
) -> None:
    """The whole pool on a private Redis that goes down and comes back empty: while it is down
    a request gets an OpenAI-style 503 (not a 500, not a hang); once it is back the router's
    pooled connections and the worker recover on their own and requests succeed again."""
    import httpx

    from tests.pool_fixture import running_pool

    server = start_redis()
    try:
        overrides = {"redis": {"url": server.url}}
        with running_pool(tiny_model_dir, tmp_path, overrides=overrides) as pool:
            model = httpx.get(f"{pool.url}/v1/models", timeout=10).json()["data"][0]["id"]
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4}
            resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text

            # A request in flight, that has streamed nothing to its client (not streaming).
            r = redis.Redis.from_url(server.url)
            long = {**body, "prompt": "The quick brown fox", "max_tokens": 1900}
            box: dict[str, httpx.Response] = {}
            thread = threading.Thread(
                target=lambda: box.update(
                    resp=httpx.post(f"{pool.url}/v1/completions", json=long, timeout=60)
                )
            )
            thread.start()
            _wait(lambda: any(r.scan_iter("mlxcel:req:*:stream")), 20, "the long request runs")

            server.stop()
            resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=30)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "redis_unavailable"

            server = start_redis(port=server.port, password=server.password)
            thread.join(60)
            # Redis came back empty, its job with it: a 503 it may retry, not a 500.
            assert box["resp"].status_code == 503, box["resp"].text
            assert box["resp"].json()["error"]["code"] == "redis_unavailable"
            deadline = time.monotonic() + 30
            while True:  # the worker registers again within a few seconds
                resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=30)
                assert resp.status_code in (200, 503), resp.text
                if resp.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()

"""A worker killed for real (SIGKILL) while it holds a request.

- Before any token reached the client: the request runs again on a live worker and the client
  gets the model's exact answer, never seeing the death.
- After tokens reached it: the client gets an error naming the worker, within seconds.
Either way the router counts the worker dead within seconds (its heartbeat's age), a live worker
fails the dead one's jobs in rq (none shown as started), and `rq info` stops listing it.
Real pool: embedded Redis, router, three worker processes.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rq import Worker
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry

from shared import keys, liveness
from shared.wire import STREAM_FIELD, MsgpackSerializer, StreamEvent
from tests.pool_fixture import running_pool, wait_for
from tests.streams import pool_queues

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

KW = {"serializer": MsgpackSerializer}
# Small prefill chunks make a long prompt's prefill last about a second on the tiny model: the
# window in which a worker holds a request that has streamed nothing yet.
PREFILL_STEP = "16"
LONG_PROMPT = [5 + i % 1000 for i in range(1895)]


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    env = {"MLXCEL_PREFILL_STEP_SIZE": PREFILL_STEP}
    with running_pool(tiny_model_dir, tmp_path_factory.mktemp("death"), workers=3, env=env) as p:
        yield p


def _started_job(r: redis.Redis, seen: set[str]) -> tuple[str, str]:
    """(job id, worker id) of a job a worker has just started, from its stream's start event."""

    def find() -> tuple[str, str] | None:
        started = [StartedJobRegistry(q, connection=r, **KW) for q in pool_queues()]
        for job_id in [j for reg in started for j in reg.get_job_ids(cleanup=False)]:
            if job_id in seen:
                continue
            for _, fields in r.xrange(keys.request_stream(job_id), count=1):
                event = StreamEvent.from_wire(fields[STREAM_FIELD])
                if event.kind == "start":
                    return job_id, event.worker_id
        return None

    return wait_for(find, 30, "a started job")


def _wait_reaped(r: redis.Redis, job_id: str, wid: str) -> None:
    """A live worker failed the dead one's job in rq, and rq no longer lists the dead worker."""
    failed = [FailedJobRegistry(q, connection=r, **KW) for q in pool_queues()]
    wait_for(
        lambda: any(job_id in f.get_job_ids() for f in failed),
        20,
        "the dead worker's job failed in rq",
    )
    job = Job.fetch(job_id, connection=r, **KW)
    assert liveness.WORKER_LOST_MARK in (job.latest_result().exc_string or "")
    for q in pool_queues():
        assert job_id not in StartedJobRegistry(q, connection=r, **KW).get_job_ids()
    assert keys.rq_worker_name(wid) not in [w.name for w in Worker.all(connection=r)]


def _alive_count(pool: Any) -> int:
    return httpx.get(f"{pool.url}/health", timeout=10).json()["workers_alive"]


def test_a_request_whose_worker_dies_before_its_first_token_is_answered_by_another(
    pool: Any, mlx_reference: Any
) -> None:
    r = redis.Redis.from_url(pool.redis_url)
    alive = _alive_count(pool)
    model = httpx.get(f"{pool.url}/health", timeout=10).json()["model"]
    body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    box: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: box.update(
            resp=httpx.post(f"{pool.url}/v1/completions", json=body, timeout=120)
        )
    )
    thread.start()
    job_id, wid = _started_job(r, set())
    assert not any(  # it holds the request, and no token has come out yet
        StreamEvent.from_wire(f[STREAM_FIELD]).kind == "delta"
        for _, f in r.xrange(keys.request_stream(job_id))
    )
    killed_at = time.monotonic()
    pool.kill_worker(wid)
    wait_for(lambda: _alive_count(pool) == alive - 1, 15, "/health to stop counting it")
    noticed_after = time.monotonic() - killed_at
    thread.join(120)
    resp = box["resp"]
    assert resp.status_code == 200, resp.text
    want_text, want_n = mlx_reference.run(LONG_PROMPT, 8)
    assert resp.json()["choices"][0]["text"] == want_text
    assert resp.json()["usage"]["completion_tokens"] == want_n
    assert noticed_after < liveness.DEAD_AFTER_S + 4
    _wait_reaped(r, job_id, wid)
    # The second attempt ran once and finished; nothing is left started.
    again = Job.fetch(f"{job_id}-1", connection=r, **KW)
    assert again.get_status() == "finished"


def test_a_killed_worker_fails_its_streams_within_seconds(pool: Any) -> None:
    r = redis.Redis.from_url(pool.redis_url)
    health = httpx.get(f"{pool.url}/health", timeout=10).json()
    # ignore_eos: the tiny model ends this prompt at its 55th token, a few hundred ms, which a
    # loaded machine can spend before the kill; the stream must still be running then.
    body = {
        "model": health["model"],
        "prompt": "Once upon a time",
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    chunks: list[dict] = []
    seen = {
        j for q in pool_queues() for j in StartedJobRegistry(q, connection=r, **KW).get_job_ids()
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{pool.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                break
        job_id, wid = _started_job(r, seen)
        killed_at = time.monotonic()
        pool.kill_worker(wid)
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
        ended_after = time.monotonic() - killed_at
    error = chunks[-1].get("error")
    assert error is not None, chunks[-1]
    assert error["type"] == "server_error"
    assert f"worker {wid} stopped" in error["message"]
    # Noticed from the heartbeat's age (two checks a second apart), not a TTL or a timeout.
    assert ended_after < liveness.DEAD_AFTER_S + 4
    assert not any("error" in c for c in chunks[:-1])
    _wait_reaped(r, job_id, wid)

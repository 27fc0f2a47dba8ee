"""`mlxcel-pool dashboard` (rq-dashboard): bound to loopback, it shows the pool's msgpack jobs and
names pool workers by host, pid and model, and a pickle payload written into Redis is never
unpickled. A real dashboard process, a real Redis."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
from rq import Queue, Worker
from rq.job import Job
from rq.results import Result

from mlxcel_pool.dashboard import worker_label
from mlxcel_pool.redis_server import free_port
from shared import keys
from shared.redis_auth import MASK
from shared.wire import JOB_FUNC, MsgpackSerializer
from tests.streams import SHARED_QUEUE, TINY_MODEL, enqueue
from worker.broker.presence import WorkerPresence

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent


class MakesDir:
    """Unpickling it creates `path`: the harmless stand-in for a payload that runs a command."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


@pytest.fixture
def dashboard(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url}
    with open(tmp_path / "dashboard.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcel_pool", "dashboard", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail((tmp_path / "dashboard.log").read_text()[-4000:])
        time.sleep(0.1)
    yield base, proc
    proc.terminate()
    proc.wait(10)


def _pickle_job(r: redis.Redis, job_id: str, marker: Path) -> None:
    """A job rq's default (pickle) serializer wrote, with the payload in its data, its result
    and its meta: everything rq-dashboard may deserialize."""
    Queue(SHARED_QUEUE, connection=r).enqueue_call(
        func=JOB_FUNC, args=(MakesDir(marker / "data"),), job_id=job_id
    )
    r.hset(
        Job.key_for(job_id),
        mapping={
            "result": pickle.dumps(MakesDir(marker / "result")),
            "meta": pickle.dumps(MakesDir(marker / "meta")),
        },
    )


def _busy_worker(r: redis.Redis, job_id: str) -> None:
    worker = Worker([SHARED_QUEUE], connection=r, name="dash-test", serializer=MsgpackSerializer)
    if not r.exists(worker.key):
        worker.register_birth()
    r.hset(worker.key, mapping={"current_job": job_id, "state": "busy"})


def test_dashboard_listens_on_loopback_only(dashboard: tuple[str, subprocess.Popen[bytes]]) -> None:
    _, proc = dashboard
    listening = [
        c.laddr
        for c in psutil.Process(proc.pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


def test_dashboard_shows_msgpack_jobs_and_never_unpickles(
    dashboard: tuple[str, subprocess.Popen[bytes]], redis_url: str, tmp_path: Path
) -> None:
    base, _ = dashboard
    r = redis.Redis.from_url(redis_url)
    good = enqueue(r, [5, 6, 7], max_tokens=3)
    done = Job.fetch(good, connection=r, serializer=MsgpackSerializer)
    Result.create(done, Result.Type.SUCCESSFUL, ttl=60, return_value={"finish_reason": "length"})
    marker = tmp_path / "unpickled"
    marker.mkdir()
    _pickle_job(r, "evil", marker)

    job = httpx.get(f"{base}/0/data/job/{good}.json", timeout=10)
    assert job.status_code == 200, job.text
    info = job.json()
    assert (info["id"], info["origin"], info["status"]) == (good, SHARED_QUEUE, "queued")
    assert info["description"].startswith(f"{JOB_FUNC}(")
    assert info["result"] == {"finish_reason": "length"}
    listed = httpx.get(f"{base}/0/data/jobs/{SHARED_QUEUE}/queued/8/asc/1.json", timeout=10)
    assert listed.status_code == 200, listed.text
    assert {j["id"] for j in listed.json()["jobs"]} == {good, "evil"}
    assert httpx.get(f"{base}/0/view/job/{good}", timeout=10).status_code == 200
    # A worker's current job is shown from the job's data (func, args, kwargs): read as msgpack.
    _busy_worker(r, good)
    workers = httpx.get(f"{base}/0/data/workers.json", timeout=10)
    assert workers.status_code == 200, workers.text
    (current,) = [w["current_job"] for w in workers.json()["workers"] if w["name"] == "dash-test"]
    assert current["call_string"].startswith(f"{JOB_FUNC}(request={{")

    # Every view that touches the pickle job's data, result or meta; a 500 is fine, code is not.
    _busy_worker(r, "evil")
    for method, path in [
        ("GET", "/0/data/job/evil.json"),
        ("GET", "/0/view/job/evil"),
        ("GET", "/0/data/workers.json"),
        ("GET", f"/0/data/jobs/{SHARED_QUEUE}/queued/8/asc/1.json"),
        ("POST", "/job/evil/requeue"),
    ]:
        httpx.request(method, f"{base}{path}", timeout=10)
    assert sorted(p.name for p in marker.iterdir()) == []

    # The payload is live: unpickled, it does create its directory.
    pickle.loads(zlib.decompress(r.hget(Job.key_for("evil"), "data")))  # noqa: S301
    assert sorted(p.name for p in marker.iterdir()) == ["data"]


def test_dashboard_names_pool_workers_by_host_pid_and_model(
    dashboard: tuple[str, subprocess.Popen[bytes]], redis_url: str
) -> None:
    base, _ = dashboard
    r = redis.Redis.from_url(redis_url)
    queue = Queue(keys.worker_queue_name("w7"), connection=r, serializer=MsgpackSerializer)
    WorkerPresence(r, "w7", [queue], {"worker_id": "w7", "model": TINY_MODEL}).arrive({})
    Worker([SHARED_QUEUE], connection=r, name="someone-else").register_birth()

    # The page lists each worker by the JSON's `name` (its pid is in the JSON, not on the page).
    page = httpx.get(f"{base}/0/view/workers", timeout=10)
    assert page.status_code == 200 and "<%= d.name %>" in page.text
    assert "d.pid" not in page.text
    listed = httpx.get(f"{base}/0/data/workers.json", timeout=10)
    assert listed.status_code == 200, listed.text
    workers = {w.get("rq_name", w["name"]): w for w in listed.json()["workers"]}
    assert set(workers) == {"mlxcel-w7", "someone-else"}
    pool, foreign = workers["mlxcel-w7"], workers["someone-else"]
    assert pool["name"] == f"w7 · {socket.gethostname()}:{os.getpid()} · {TINY_MODEL}"
    assert (pool["pid"], pool["queues"], pool["state"]) == (os.getpid(), [queue.name], "idle")
    assert foreign["name"] == "someone-else" and "rq_name" not in foreign
    assert foreign["pid"] == os.getpid() and foreign["queues"] == [SHARED_QUEUE]
    # Only the page's label changes: rq still knows the worker by the name the pool parses back.
    assert {w.name for w in Worker.all(connection=r)} == {"mlxcel-w7", "someone-else"}


def test_worker_label_marks_what_redis_lost_and_escapes_html() -> None:
    assert worker_label("w1", "mac-1", 42, "org/model") == "w1 · mac-1:42 · org/model"
    assert worker_label("w1", None, None, None) == "w1 · ?:? · ?"
    assert worker_label("w1", "h", 1, "<b>m</b>") == "w1 · h:1 · &lt;b&gt;m&lt;/b&gt;"


def test_dashboard_pages_mask_the_redis_password(
    dashboard: tuple[str, subprocess.Popen[bytes]], redis_url: str, tmp_path: Path
) -> None:
    base, _ = dashboard
    password = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["password"]
    assert password
    page = httpx.get(f"{base}/", timeout=10)
    assert page.status_code == 200
    assert password not in page.text and MASK in page.text
    assert password not in (tmp_path / "dashboard.log").read_text()


def test_the_procfile_runs_this_dashboard_and_holds_no_password() -> None:
    text = (REPO / "Procfile").read_text()
    lines = dict(line.split(": ", 1) for line in text.splitlines() if line[:1].isalpha())
    assert lines["dashboard"].endswith("exec mlxcel-pool dashboard --port 9181")
    assert "rq-dashboard" not in lines["dashboard"] and "0.0.0.0" not in text
    for name in ("router", "worker", "dashboard"):
        assert lines[name].startswith("export REDIS_URL=$(mlxcel-pool redis-url --port 6390);")

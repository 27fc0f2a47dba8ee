"""A child of the pool that exits is started again, with backoff, until one keeps dying.

First the restart policy on an injected clock, then a real pool (embedded Redis, router, two
workers) whose children are killed for real (SIGKILL, SIGTERM) while `Pool.supervise` runs on a
thread, and which must serve a request once the child is back; each worker's restart is counted
in the pool's Redis.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rq.job import Job
from rq.registry import StartedJobRegistry

from mlxcel_pool.restarts import RestartLedger, RestartPolicy
from mlxcel_pool.supervisor import REDIS, ROUTER, Pool, PoolConfigError, PoolError, describe_exit
from shared import keys
from shared.config import SupervisorConfig, load_settings
from shared.redis_auth import embedded_password
from tests.pool_fixture import running_pool, wait_for
from tests.streams import SHARED_QUEUE
from tests.test_routing_e2e import PREFIX, complete, holds, tail

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

# --- the policy, on an injected clock ---------------------------------------------------------


def test_backoff_doubles_from_the_first_delay_up_to_the_cap() -> None:
    ledger = RestartLedger(RestartPolicy(limit=10, window_s=60, backoff_s=0.5, backoff_max_s=10))
    delays = [ledger.decide("w1", now=float(t)).delay_s for t in range(7)]
    assert delays == [0.5, 1, 2, 4, 8, 10, 10]


def test_the_exit_after_limit_restarts_in_the_window_is_a_crash_loop() -> None:
    ledger = RestartLedger(RestartPolicy(limit=5, window_s=60))
    decisions = [ledger.decide("w1", now=10.0 * t) for t in range(6)]  # t = 0 .. 50 s
    assert [d.restart for d in decisions] == [True] * 5 + [False]
    assert [d.recent for d in decisions] == [1, 2, 3, 4, 5, 5]
    assert ledger.decide("w2", now=50.0).restart  # counted per child


def test_restarts_older_than_the_window_are_forgotten_and_the_backoff_resets() -> None:
    ledger = RestartLedger(RestartPolicy(limit=2, window_s=60, backoff_s=0.5))
    assert ledger.decide("router", now=0.0).delay_s == 0.5
    assert ledger.decide("router", now=30.0).delay_s == 1.0
    assert not ledger.decide("router", now=59.9).restart
    assert ledger.recent("router", now=60.0) == 1  # the restart at 0 s has left the window
    again = ledger.decide("router", now=60.0)
    assert (again.restart, again.delay_s, again.recent) == (True, 1.0, 2)
    late = ledger.decide("router", now=200.0)
    assert (late.restart, late.delay_s, late.recent) == (True, 0.5, 1)


def test_limit_zero_stops_at_the_first_exit() -> None:
    assert not RestartLedger(RestartPolicy(limit=0)).decide("redis", now=0.0).restart


def test_the_default_policy_is_the_configured_one() -> None:
    assert RestartPolicy.from_config(SupervisorConfig()) == RestartPolicy()
    assert RestartPolicy() == RestartPolicy(limit=5, window_s=60, backoff_s=0.5, backoff_max_s=10)


def test_messages_name_the_child_its_exit_and_the_count() -> None:
    ledger = RestartLedger(RestartPolicy(limit=1, window_s=60, backoff_s=0.5))
    first = ledger.decide("w1", now=0.0).message(describe_exit(-signal.SIGKILL))
    assert first == (
        "w1 exited with code -9 (signal SIGKILL); restarting in 0.5 s (restart 1 in the last 60 s)"
    )
    last = ledger.decide("w1", now=1.0).message(describe_exit(2))
    assert last == (
        "w1 exited with code 2 after 1 restart(s) in the last 60 s: crash loop, stopping the pool"
    )
    assert describe_exit(0) == "code 0"


# --- a real pool, supervised on a thread --------------------------------------------------------

# Quick restarts, and a crash loop after 2 restarts, so a test spends seconds, not a minute.
FAST_RESTARTS = {"restart_limit": 2, "restart_backoff_s": 0.1, "restart_backoff_max_s": 0.4}
BACK_WITHIN_S = 90  # a worker loads its model again before it registers


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    work = tmp_path_factory.mktemp("supervised")
    with running_pool(
        tiny_model_dir, work, workers=2, overrides={"supervisor": FAST_RESTARTS}
    ) as p:
        yield p


@pytest.fixture
def supervised(pool: Pool) -> Iterator[list[str]]:
    """`pool.supervise` on a thread for one test; yields the lines it logs."""
    lines: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def run() -> None:
        try:
            pool.supervise(stop, log=lines.append, poll_s=0.05)
        except BaseException as exc:  # handed to the test below, which fails with it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield lines
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert errors == []


def _complete(pool: Pool, prompt: str = "Once upon a time", max_tokens: int = 8) -> dict[str, Any]:
    model = httpx.get(f"{pool.url}/health", timeout=10).json()["model"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _registered_pid(pool: Pool, worker_id: str) -> int | None:
    raw = redis.Redis.from_url(pool.redis_url).hget(keys.worker_info(worker_id), "pid")
    return int(raw) if raw else None


def _running_on(pool: Pool, worker_id: str) -> list[str]:
    """Ids of the jobs rq records as running on `worker_id` (its own queue's and the shared)."""
    conn = redis.Redis.from_url(pool.redis_url)
    name = keys.rq_worker_name(worker_id).encode()
    return [
        job_id
        for queue in (SHARED_QUEUE, keys.worker_queue_name(worker_id))
        for job_id in StartedJobRegistry(queue, connection=conn).get_job_ids()
        if conn.hget(Job.key_for(job_id), "worker_name") == name
    ]


def _wait_back(pool: Pool, name: str, old_pid: int) -> int:
    """Wait until `name` runs as a new process (and, for a worker, has registered); its pid."""
    new = wait_for(lambda: pool.pid(name) != old_pid and pool.pid(name), 15, f"{name} restarted")
    if name not in (ROUTER, REDIS):
        wait_for(lambda: _registered_pid(pool, name) == new, BACK_WITHIN_S, f"{name} registered")
    wait_for(lambda: pool.health_status() == 200, BACK_WITHIN_S, "pool healthy")
    return new


def _restarts(pool: Pool, worker_id: str) -> int:
    raw = redis.Redis.from_url(pool.redis_url).hget(keys.supervisor_restarts(), worker_id)
    return int(raw or 0)


def test_a_killed_worker_is_started_again_counted_and_the_pool_serves(
    pool: Pool, supervised: list[str]
) -> None:
    old, before = pool.pid("w1"), _restarts(pool, "w1")
    os.kill(old, signal.SIGKILL)
    _wait_back(pool, "w1", old)
    assert supervised[0].startswith("w1 exited with code -9 (signal SIGKILL); restarting in 0.1 s")
    assert _restarts(pool, "w1") == before + 1
    assert _complete(pool)["usage"]["completion_tokens"] >= 1


def test_a_sigterm_drains_the_worker_and_it_comes_back_losing_no_request(
    pool: Pool, supervised: list[str]
) -> None:
    old, before = pool.pid("w2"), _restarts(pool, "w2")
    prompts = [f"Request number {i} says" for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        running = [ex.submit(_complete, pool, p, 200) for p in prompts[:4]]
        drained = wait_for(lambda: _running_on(pool, "w2"), 30, "a request running on w2")
        os.kill(old, signal.SIGTERM)
        during = [ex.submit(_complete, pool, p, 8) for p in prompts[4:]]  # w1 is still up
        results = [f.result(timeout=180) for f in running + during]
    assert drained and all(r["usage"]["completion_tokens"] >= 1 for r in results)
    _wait_back(pool, "w2", old)
    assert supervised[0].startswith("w2 exited with code 0; restarting in 0.1 s")
    assert _restarts(pool, "w2") == before + 1  # a drain's restart is one too
    assert "w2" in pool.logs("w2").split("--- mlxcel-pool: starting w2")[-1]  # its new log part
    _complete(pool)


def test_the_embedded_redis_comes_back_on_the_same_url(pool: Pool, supervised: list[str]) -> None:
    old, url = pool.pid(REDIS), pool.redis_url
    # The cache dir's password: the URL every child holds stays valid across the restart.
    assert url.startswith(f"redis://mlxcel:{embedded_password(pool.settings.cache_dir)}@127.0.0.1:")
    r = redis.Redis.from_url(url)
    holder, _ = complete(pool, PREFIX + tail(1))
    wait_for(lambda: holds(r, holder, PREFIX) == 6, 10, "the holder's index lists the prefix")
    os.kill(old, signal.SIGKILL)
    _wait_back(pool, REDIS, old)
    assert pool.redis_url == url
    assert r.ping()
    assert supervised[0].startswith("redis exited with code -9 (signal SIGKILL); restarting")
    _complete(pool)
    # The new Redis started empty: the holder wrote its index again, and requests follow a
    # worker that holds the prefix (the other may hold it too, from earlier tests).
    wait_for(lambda: holds(r, holder, PREFIX) == 6, 20, "the index written again")
    served, reused = complete(pool, PREFIX + tail(2))
    assert holds(r, served, PREFIX) == 6 and reused == 96


def test_the_router_comes_back_on_the_same_port(pool: Pool, supervised: list[str]) -> None:
    old = pool.pid(ROUTER)
    holder, _ = complete(pool, PREFIX + tail(3))
    os.kill(old, signal.SIGKILL)  # its uvicorn processes are left behind, holding the port
    _wait_back(pool, ROUTER, old)
    assert supervised[0].startswith("router exited with code -9 (signal SIGKILL); restarting")
    assert _restarts(pool, ROUTER) == 0  # the counter is the workers'
    _complete(pool)
    # Nothing to rebuild: the new router reads the same index, and follows a holder.
    r = redis.Redis.from_url(pool.redis_url)
    assert holds(r, holder, PREFIX) == 6
    served, reused = complete(pool, PREFIX + tail(4))
    assert holds(r, served, PREFIX) == 6 and reused == 96


def test_a_worker_stopped_on_purpose_is_not_restarted(pool: Pool, supervised: list[str]) -> None:
    old = pool.pid("w2")
    assert pool.kill_worker("w2") == -signal.SIGKILL  # w1 serves the tests after this one
    time.sleep(1.0)  # several supervision polls and more than the backoff
    assert pool.pid("w2") == old
    assert supervised == []


def _supervise_until_it_stops(pool: Pool, lines: list[str]) -> PoolError:
    stop = threading.Event()
    timer = threading.Timer(60, stop.set)  # bounds the test should the stop go unnoticed
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(PoolError) as caught:
            pool.supervise(stop, log=lines.append, poll_s=0.05)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 60
    return caught.value


def test_a_child_that_keeps_dying_stops_the_pool_naming_it(pool: Pool) -> None:
    # Python itself cannot start (exit 1), every time: a crash, not a configuration error.
    pool.start_worker("wbad", env={"PYTHONHOME": "/nonexistent"})
    lines: list[str] = []
    try:
        error = _supervise_until_it_stops(pool, lines)
    finally:
        pool.stop_worker("wbad")
    assert [line.split(";")[0] for line in lines] == ["wbad exited with code 1"] * 2
    assert str(error).startswith(
        "wbad exited with code 1 after 2 restart(s) in the last 60 s: crash"
    )
    assert pool.health_status() == 200  # the caller stops the pool; the others are still up


def test_a_configuration_error_stops_the_pool_without_restarts(pool: Pool) -> None:
    # An invalid worker setting: the worker exits 2 before it loads anything; a restart would
    # only say so again.
    pool.start_worker("wconf", env={"MLXCEL_BATCH_SIZE": "0"})
    lines: list[str] = []
    try:
        error = _supervise_until_it_stops(pool, lines)
    finally:
        pool.stop_worker("wconf")
    assert lines == []  # not restarted once
    message = str(error)
    assert isinstance(error, PoolConfigError) and "\n" not in message
    assert message.startswith(
        "wconf exited with code 2 (a configuration error): mlxcel-pool worker: invalid "
    )
    assert "worker.batch_size: Input should be greater than or equal to 1" in message  # its line
    assert message.endswith(f"stopping the pool (its log: {pool.log_path('wconf')})")
    assert pool.health_status() == 200


def test_a_worker_that_cannot_start_again_is_left_down_while_the_rest_serves(
    pool: Pool, supervised: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Its model directory goes away while it serves (a host's broken upgrade): started again,
    # it exits 2 naming the directory, and nothing else of the pool stops for it.
    copy = tmp_path / "upgrade" / tiny_model_dir.name  # the same model id as the pool's
    shutil.copytree(tiny_model_dir, copy)
    pool.start_worker("wgone", model=copy)
    pid = wait_for(lambda: _registered_pid(pool, "wgone"), BACK_WITHIN_S, "wgone registered")
    shutil.rmtree(copy)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(supervised) >= 2, 30, "wgone restarted and given up")
    assert supervised[0].startswith("wgone exited with code -9 (signal SIGKILL); restarting")
    assert supervised[1] == (
        f"wgone exited with code 2 when started again: mlxcel-pool worker: model directory "
        f"{copy} does not exist on this host (MLXCEL_MODEL / --model): copy the model's whole "
        "directory (config.json, tokenizer files, weights) there, or set MLXCEL_MODEL to where "
        "it is; not restarting it, the rest of this host's pool serves on"
    )
    time.sleep(0.5)  # supervision polls on without restarting it again
    assert len(supervised) == 2 and pool.failures() == []
    assert _complete(pool)["usage"]["completion_tokens"] >= 1


def test_a_restart_the_pools_redis_cannot_count_is_logged_and_supervision_goes_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A host that only adds workers, its Redis gone: the worker (which cannot even start
    # Python) is restarted all the same, each restart saying it went uncounted.
    settings = load_settings(
        overrides={
            "redis": {"url": "redis://:pw@127.0.0.1:1/0"},  # nothing listens there
            "model": {"path": str(tiny_model_dir), "cache_dir": str(tmp_path)},
            "metrics": {"multiproc_dir": str(tmp_path / "prom")},
            "supervisor": FAST_RESTARTS,
        },
        environ={},
    )
    with Pool(settings, workers=0, router=False, log_dir=tmp_path / "logs") as bare:
        bare.start_worker("wbad", env={"PYTHONHOME": "/nonexistent"})
        lines: list[str] = []
        error = _supervise_until_it_stops(bare, lines)
    uncounted = [line for line in lines if "restart is not counted" in line]
    assert len(uncounted) == 2, lines
    assert uncounted[0].startswith("wbad's restart is not counted in Redis: Error 111 connecting")
    assert str(error).startswith("wbad exited with code 1 after 2 restart(s)")

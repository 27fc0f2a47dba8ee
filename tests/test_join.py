"""`mlxcel-pool up --join`: a host that adds workers to a pool whose Redis (and routers) are
elsewhere. It starts no router and no Redis, supervises its workers (a killed one comes back,
and its restart is counted in the pool's Redis), and a second host that would take the same ids
is refused in one line, before it starts anything, while the first serves on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from shared import keys
from shared.config import ENV_VARS
from shared.redis_auth import masked_url
from tests.pool_fixture import wait_for
from tests.test_cli import READY_PREFIX, _lines, _wait_line, _wait_text
from tests.test_operator_errors import mlxcel, one_line_exit_2

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
BACK_WITHIN_S = 120  # a restarted worker loads its model again before it registers


def _registered_pid(conn: redis.Redis, worker_id: str) -> int | None:
    raw = conn.hget(keys.worker_info(worker_id), "pid")
    return int(raw) if raw else None


def test_a_joined_host_supervises_its_workers_and_a_second_with_its_ids_is_refused(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    conn = redis.Redis.from_url(redis_url)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ENV_VARS},
        "REDIS_URL": redis_url,
        "MLXCEL_MODEL": str(tiny_model_dir),
        "MLXCEL_CACHE_DIR": str(tmp_path / "cache"),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
        "MLXCEL_RESTART_BACKOFF_S": "0.1",
    }
    argv = [sys.executable, "-m", "mlxcel_pool", "up", "--join", "--worker-prefix", "hosta-"]
    argv += ["--log-dir", str(tmp_path / "logs"), "--quiet"]
    with open(tmp_path / "up.stderr", "w") as err:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        stdout = _lines(proc.stdout)  # type: ignore[arg-type]
        try:
            ready = _wait_line(stdout, READY_PREFIX, 300)
        except AssertionError:
            pytest.fail((tmp_path / "up.stderr").read_text()[-4000:])
        assert ready == f"{READY_PREFIX}hosta-1 joined {masked_url(redis_url)}"
        children = psutil.Process(proc.pid).children()
        assert [c.cmdline()[3:5] for c in children] == [["worker", "--worker-id"]]  # no router
        first = _registered_pid(conn, "hosta-1")
        assert first == children[0].pid

        # Killed, it is started again, and the restart is counted where the pool's routers
        # read it; the counter was not there before.
        assert conn.hget(keys.supervisor_restarts(), "hosta-1") is None
        os.kill(first, signal.SIGKILL)
        second = wait_for(
            lambda: (pid := _registered_pid(conn, "hosta-1")) != first and pid,
            BACK_WITHIN_S,
            "hosta-1 registered again",
        )
        _wait_text(
            tmp_path / "up.stderr", "hosta-1 exited with code -9 (signal SIGKILL); restarting", 5
        )
        assert conn.hget(keys.supervisor_restarts(), "hosta-1") == b"1"

        # Another host with the same ids: one line, exit 2, before it loads anything; the
        # first host's worker is the same process, still registered.
        other = {**env, "MLXCEL_CACHE_DIR": str(tmp_path / "other")}
        started = time.monotonic()
        done = mlxcel("up", "--join", "--worker-prefix", "hosta-", env=other)
        line = one_line_exit_2(done, "up")
        assert time.monotonic() - started < 30
        assert line.startswith(f"worker id 'hosta-1' is in use by pid {second} on ")
        assert _registered_pid(conn, "hosta-1") == second and proc.poll() is None

        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, (tmp_path / "up.stderr").read_text()[-4000:]
        assert "mlxcel-pool up: SIGINT: stopping" in (tmp_path / "up.stderr").read_text()
        # The worker left the pool on its way out (its liveness hash gone); the count stays.
        assert not conn.exists(keys.worker_info("hosta-1"))
        assert conn.hget(keys.supervisor_restarts(), "hosta-1") == b"1"
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()

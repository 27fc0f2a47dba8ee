"""What an operator's mistake looks like from the commands that join a pool (`up`, `router`,
`worker`, `wait-redis`): one line on stderr naming what is wrong and the fix, exit 2, and nothing
started or disturbed. Real processes against the session's real redis-server and shared pool.
(The TLS mismatches are in tests/test_redis_private.py, beside the TLS server they need.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from mlxcel_pool.redis_server import EmbeddedRedis, free_port
from shared import keys
from shared.config import ENV_VARS

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent


def mlxcel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The pool's own variables from the caller's shell must not leak into these runs.
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    argv = [sys.executable, "-m", "mlxcel_pool", *args]
    return subprocess.run(
        argv, cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=120
    )


def one_line_exit_2(done: subprocess.CompletedProcess[str], command: str) -> str:
    """The single stderr line of a run that exited 2, without its `mlxcel-pool <command>: `."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"mlxcel-pool {command}: "), lines[0]
    return lines[0].removeprefix(f"mlxcel-pool {command}: ")


def test_a_url_that_is_no_redis_url(tmp_path: Path) -> None:
    env = {"REDIS_URL": "http://:secret-pw@127.0.0.1:6379/0", "MLXCEL_CACHE_DIR": str(tmp_path)}
    line = one_line_exit_2(mlxcel("router", env=env), "router")
    assert "redis.url: must start with redis://, rediss://, unix:// or redis+sentinel://" in line
    assert "secret-pw" not in line
    port_typo = {**env, "REDIS_URL": "redis://:secret-pw@127.0.0.1:63z9/0"}
    line = one_line_exit_2(mlxcel("wait-redis", env=port_typo), "wait-redis")
    assert line.startswith("REDIS_URL redis://:***@127.0.0.1:63z9/0 is not a usable Redis URL")


def test_a_redis_that_does_not_answer_is_waited_for_then_named(tmp_path: Path) -> None:
    url = f"redis://:secret-pw@127.0.0.1:{free_port()}/0"  # nothing listens there
    env = {"REDIS_URL": url, "MLXCEL_CACHE_DIR": str(tmp_path)}
    started = time.monotonic()
    done = mlxcel("worker", "--worker-id", "x1", "--redis-timeout", "1", env=env)
    line = one_line_exit_2(done, "worker")
    assert time.monotonic() - started < 60
    assert line.startswith(f"cannot reach Redis at {url.replace('secret-pw', '***')} within 1 s")
    assert "Connection refused" in line and "check REDIS_URL's host and port" in line
    # Nothing was built or loaded on the way: the check comes first.
    assert not (tmp_path / "models").exists()
    line = one_line_exit_2(mlxcel("up", "--redis-timeout", "0", env=env), "up")
    assert line.startswith("cannot reach Redis at redis://:***@127.0.0.1:")


def test_a_wrong_password_fails_at_once(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    wrong = redis_server.url.replace(redis_server.password, "not-the-password")
    env = {"REDIS_URL": wrong, "MLXCEL_CACHE_DIR": str(tmp_path)}
    for command in (["up", "--join"], ["router"], ["wait-redis", "--timeout", "30"]):
        started = time.monotonic()
        line = one_line_exit_2(mlxcel(*command, env=env), command[0])
        assert time.monotonic() - started < 20, command  # not waited out
        assert line.startswith(
            f"Redis at redis://mlxcel:***@127.0.0.1:{redis_server.port}/0 refused the login: "
        )
        assert "REDIS_URL's user or password is wrong" in line and "redis-url" in line
        assert "not-the-password" not in line
    no_password = f"redis://127.0.0.1:{redis_server.port}/0"
    line = one_line_exit_2(mlxcel("worker", env={**env, "REDIS_URL": no_password}), "worker")
    assert "it asks for a password and REDIS_URL has none" in line


def test_a_model_directory_missing_on_this_host(redis_url: str, tmp_path: Path) -> None:
    missing = tmp_path / "models" / "llama"
    env = {"REDIS_URL": redis_url, "MLXCEL_CACHE_DIR": str(tmp_path), "MLXCEL_MODEL": str(missing)}
    line = one_line_exit_2(mlxcel("router", env=env), "router")
    assert line == (
        f"model directory {missing} does not exist on this host (MLXCEL_MODEL / --model): copy "
        "the model's config.json and tokenizer files (the weights are not needed) there, or set "
        "MLXCEL_MODEL to where it is"
    )
    for command in (["worker", "--worker-id", "m1"], ["up", "--join", "--worker-prefix", "m"]):
        line = one_line_exit_2(mlxcel(*command, env=env), command[0])
        assert line.startswith(f"model directory {missing} does not exist on this host")
        assert "the model's whole directory (config.json, tokenizer files, weights)" in line
    assert redis.Redis.from_url(redis_url).smembers(keys.workers_roster()) == set()


def test_up_join_needs_the_pools_redis_and_no_router_flags(tmp_path: Path) -> None:
    env = {"MLXCEL_CACHE_DIR": str(tmp_path)}
    line = one_line_exit_2(mlxcel("up", "--join", env=env), "up")
    assert line.startswith("`mlxcel-pool up --join` adds this host's workers to the pool at ")
    assert "REDIS_URL, which is not set: export REDIS_URL=" in line
    env["REDIS_URL"] = "redis://127.0.0.1:1/0"
    line = one_line_exit_2(mlxcel("up", "--join", "--port", "8001", env=env), "up")
    assert line == "`up --join` starts no router: drop --port"
    line = one_line_exit_2(mlxcel("up", "--join", "--worker-prefix", "a:b", env=env), "up")
    assert line.startswith("--worker-prefix 'a:b': use letters, digits, '-' and '_' only")


def test_a_worker_id_held_by_a_serving_pool_is_refused_and_the_pool_serves_on(
    shared_pool, tmp_path: Path
) -> None:
    """The shared pool stands for another host's: a worker, and a second `up --join`, that
    would take its w1 are refused before they load anything, and its w1 serves on."""
    conn = redis.Redis.from_url(shared_pool.redis_url)
    pid = int(conn.hget(keys.worker_info("w1"), "pid"))
    env = {
        "REDIS_URL": shared_pool.redis_url,
        "MLXCEL_CACHE_DIR": str(tmp_path),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
    }
    held = f"worker id 'w1' is in use by pid {pid} on {socket.gethostname()}, last heartbeat "
    line = one_line_exit_2(mlxcel("worker", "--worker-id", "w1", env=env), "worker")
    assert line.startswith(held), line
    assert line.endswith(": give this worker another id (--worker-id / MLXCEL_WORKER_ID)")
    started = time.monotonic()
    done = mlxcel("up", "--join", "--worker-prefix", "w", "--log-dir", str(tmp_path), env=env)
    line = one_line_exit_2(done, "up")
    assert time.monotonic() - started < 30  # found before any model load or build
    assert line.startswith(held) and line.endswith(
        ": give this host's workers other ids (--worker-prefix)"
    )
    assert not (tmp_path / "models").exists() and list(tmp_path.glob("*.log")) == []
    assert int(conn.hget(keys.worker_info("w1"), "pid")) == pid
    body = {"model": "mlxcel-tiny-s0", "prompt": "Once upon a time", "max_tokens": 4}
    resp = httpx.post(f"{shared_pool.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text

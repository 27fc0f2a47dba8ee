"""The `mlxcel-pool` command as a user runs it: real subprocesses, real Redis, real HTTP."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mlxcel_pool.redis_server import free_port
from shared.config import ENV_VARS

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
READY_PREFIX = "mlxcel-pool ready: "


def _env(**extra: str) -> dict[str, str]:
    # The pool's own variables from the caller's shell must not leak into these tests.
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS and k != "MLXCEL_APC_TRACE"}
    return {**base, **extra}


def _lines(stream: IO[str]) -> queue.Queue[str]:
    """Read a pipe on a thread so a test can wait for a line with a timeout."""
    out: queue.Queue[str] = queue.Queue()
    out.seen = []  # type: ignore[attr-defined]  # every line, also those a wait skipped

    def pump() -> None:
        for line in stream:
            out.seen.append(line)  # type: ignore[attr-defined]
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _wait_line(lines: queue.Queue[str], prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no line starting with {prefix!r} within {timeout}s")


def _wait_json(url: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test started; killed (with their descendants) if the test failed early."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def _mlxcel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "mlxcel_pool", *args]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def _start_redis_command(
    port: int, env: dict[str, str], stderr: IO[str], spawned: list[subprocess.Popen[str]]
) -> str:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel_pool", "redis", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    spawned.append(proc)
    return _wait_line(_lines(proc.stdout), "redis://", 30)  # type: ignore[arg-type]


def test_redis_command_needs_its_password_and_stops_on_sigint(
    spawned: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    port = free_port()
    env = _env(MLXCEL_CACHE_DIR=str(tmp_path / "cache"))
    with open(tmp_path / "redis.stderr", "w") as err:
        shown = _start_redis_command(port, env, err, spawned)
    assert shown == f"redis://mlxcel:***@127.0.0.1:{port}/0"  # a process manager logs this line
    password_file = tmp_path / "cache" / "redis.password"
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    password = password_file.read_text().strip()
    url = _mlxcel("redis-url", "--port", str(port), env=env).stdout.strip()
    assert url == f"redis://mlxcel:{password}@127.0.0.1:{port}/0"
    assert redis.Redis.from_url(url).ping()
    with pytest.raises(redis.AuthenticationError):  # asked once: no retry's backoff
        redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()

    assert _mlxcel("wait-redis", "--timeout", "5", env={**env, "REDIS_URL": url}).returncode == 0
    wrong = f"redis://mlxcel:not-{password}@127.0.0.1:{port}/0"
    started = time.monotonic()
    failed = _mlxcel("wait-redis", "--timeout", "30", env={**env, "REDIS_URL": wrong})
    assert failed.returncode == 2 and time.monotonic() - started < 20  # no waiting it out
    assert failed.stderr.startswith(
        f"mlxcel-pool wait-redis: Redis at redis://mlxcel:***@127.0.0.1:{port}/0 refused the "
        "login: REDIS_URL's user or password is wrong"
    )
    assert len(failed.stderr.splitlines()) == 1 and password not in failed.stderr

    proc = spawned[-1]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert not _port_open(port)
    assert password not in (tmp_path / "redis.stderr").read_text()
    # Started again, it takes the same password: the URL clients hold still works.
    with open(tmp_path / "redis.stderr", "a") as err:
        _start_redis_command(port, env, err, spawned)
    assert redis.Redis.from_url(url).ping()


def _wait_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {path} within {timeout}s")
        time.sleep(0.1)


def _get(url: str) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, json.loads(resp.read() or b"null")


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.status, json.loads(resp.read())


def test_up_serves_a_completion_and_stops_cleanly(
    tiny_model_dir: Path, cache_dir: Path, tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    env = _env(
        MLXCEL_CACHE_DIR=str(cache_dir),  # the default model is already built there
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"),  # not shared with other pools
    )
    dash_port = free_port()
    while dash_port == port:  # each port is free when asked for: two asks can get the same one
        dash_port = free_port()
    argv = [
        sys.executable,
        "-m",
        "mlxcel_pool",
        "up",
        "--port",
        str(port),
        "--workers",
        "1",
        "--router-processes",
        "1",
        "--log-dir",
        str(tmp_path / "logs"),
        "--dashboard",
        str(dash_port),
    ]
    with open(tmp_path / "up.stderr", "w") as err:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )
    spawned.append(proc)
    stdout = _lines(proc.stdout)  # type: ignore[arg-type]
    try:
        ready = _wait_line(stdout, READY_PREFIX, 300)
    except AssertionError:
        pytest.fail((tmp_path / "up.stderr").read_text()[-4000:])
    base = ready.removeprefix(READY_PREFIX)
    assert base == f"http://127.0.0.1:{port}/v1"
    root = base.removesuffix("/v1")
    # The embedded Redis needs the password kept in the cache dir; `up` shows the usable URL.
    password = (cache_dir / "redis.password").read_text().strip()
    redis_url = _wait_line(stdout, "REDIS_URL=", 10).removeprefix("REDIS_URL=")
    assert redis_url.startswith(f"redis://mlxcel:{password}@127.0.0.1:")
    assert redis.Redis.from_url(redis_url).ping()

    assert _get(f"{root}/health")[0] == 200
    _, models = _get(f"{base}/models")
    status, body = _post(
        f"{base}/completions",
        {"model": models["data"][0]["id"], "prompt": "Once upon a time", "max_tokens": 8},
    )
    assert status == 200
    assert isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] >= 1

    # rq-dashboard (`up --dashboard`, loopback) lists the job under w1's own queue, described
    # in words rather than as the call with every prompt token in it.
    dash = f"http://127.0.0.1:{dash_port}/0/data/jobs/mlxcel.worker.w1/finished/8/asc/1.json"
    jobs = _wait_json(dash, 30)["jobs"]
    assert any(
        j["description"].startswith("mlxcel-tiny-s0: ")
        and j["description"].endswith("prompt tokens, max_tokens 8, placed on w1")
        for j in jobs
    ), jobs

    # `up` supervises: a killed worker is started again and serves.
    (worker,) = [c for c in psutil.Process(proc.pid).children() if "worker" in c.cmdline()]
    worker.kill()
    _wait_text(tmp_path / "up.stderr", "w1 exited with code -9 (signal SIGKILL); restarting", 30)
    completion = {"model": models["data"][0]["id"], "prompt": "Again", "max_tokens": 4}
    assert _post(f"{base}/completions", completion)[0] == 200

    children = psutil.Process(proc.pid).children(recursive=True)
    redis_ports = [  # redis-server rewrites its title, so ask for its listening socket
        conn.laddr.port
        for c in children
        if "redis-server" in c.name()
        for conn in c.net_connections("tcp")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert len(redis_ports) == 1, [c.cmdline() for c in children]
    # The terminal shows every child's lines under its name, one "ready" line each saying what
    # it runs; the same lines are in the child's log file.
    seen = "".join(stdout.seen)  # type: ignore[attr-defined]
    router_ready = [ln for ln in stdout.seen if ln.startswith("router | ") and "router ready" in ln]
    assert router_ready and "routing cache_aware" in router_ready[0], seen[-3000:]
    assert "redis redis://mlxcel:***@127.0.0.1:" in router_ready[0]
    w1_ready = [ln for ln in stdout.seen if ln.startswith("w1     | ") and "ready:" in ln]
    assert w1_ready and "BLAS" in w1_ready[0] and "GFLOPS" in w1_ready[0], seen[-3000:]
    assert "prompt cache" in w1_ready[0] and "model mlxcel-tiny-s0" in w1_ready[0]
    w1_log = (tmp_path / "logs" / "w1.log").read_text()
    assert w1_ready[0].removeprefix("w1     | ").strip() in w1_log
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, (tmp_path / "up.stderr").read_text()[-4000:]
    assert "mlxcel-pool up: SIGINT: stopping" in (tmp_path / "up.stderr").read_text()
    assert "redis redis://mlxcel:***@127.0.0.1:" in (tmp_path / "up.stderr").read_text()
    logged = [tmp_path / "up.stderr", *(tmp_path / "logs").iterdir()]
    assert [p.name for p in logged if password in p.read_text(errors="replace")] == []
    # On the terminal, only the one REDIS_URL line for the operator carries the password.
    shown = [ln for ln in stdout.seen if password in ln]  # type: ignore[attr-defined]
    assert shown == [f"REDIS_URL={redis_url}\n"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(c.pid) for c in children):
        time.sleep(0.1)
    assert [c.pid for c in children if not _gone(c.pid)] == []
    assert not _port_open(redis_ports[0])
    assert not _port_open(port)

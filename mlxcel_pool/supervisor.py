"""Start, supervise and stop the pool's processes on one machine: embedded Redis (unless the pool
has one elsewhere), a router (unless this host only adds workers), N workers.

Used by `mlxcel-pool up` and by the end-to-end test fixtures. Each child is `python -m mlxcel_pool
<part>` in its own process group (so a signal reaches uvicorn's subprocesses too), with its output
in a rotated log file (and, under `up`, on the terminal, prefixed with its name).
`Pool.supervise` restarts a child that exits (mlxcel_pool/restarts.py decides when) and counts
each worker's restart in Redis (`keys.supervisor_restarts`); only `up` and tests that ask for it
run it. This module never imports mlx: the model is built in a subprocess.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

import redis
from pydantic import SecretStr

from mlxcel_pool.child_output import ChildOutput
from mlxcel_pool.model_setup import ModelBuildError, ensure_model
from mlxcel_pool.redis_server import EmbeddedRedis, RedisServerError, free_port, start_redis
from mlxcel_pool.restarts import RestartLedger, RestartPolicy, count_restart
from mlxcel_pool.worker_ids import EMBEDDED_PREFIX, worker_ids
from shared import keys
from shared.config import ENV_VARS, EXIT_CONFIG, TRACE_ENV, Settings
from shared.redis_auth import embedded_password
from shared.redis_clients import sync_client

REPO_ROOT = Path(__file__).resolve().parent.parent
ROUTER = "router"
DASHBOARD = "dashboard"
REDIS = "redis"  # the embedded redis-server's name in supervision messages and `Pool.pid`
LOG_TAIL_LINES = 30
SUPERVISE_POLL_S = 0.2
# A log line's `2026-01-01 12:00:00,000 ERROR mlxcel.worker: ` (the worker's logging format).
_LOG_HEAD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ [\w.]+: ")


class PoolError(RuntimeError):
    """A child failed to start, died, or the pool did not become healthy in time."""


class PoolConfigError(PoolError):
    """A child exited with EXIT_CONFIG: the message is its one line saying what is wrong."""


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str]  # after `python -m mlxcel_pool`, kept so a restart starts the same child
    env: dict[str, str] = field(default_factory=dict)  # this child's own additions
    expected: bool = True  # False once we stopped it on purpose
    output: threading.Thread | None = None  # copies its output; ends when the pipe closes
    starts: int = 1  # this one included

    @property
    def is_worker(self) -> bool:
        return self.args[:1] == ["worker"]


class StopFlag(Protocol):
    """What `Pool.supervise` polls: a threading.Event, or the CLI's signal flag."""

    def wait(self, timeout: float) -> bool: ...


def describe_exit(returncode: int) -> str:
    """`code 2`, or `code -9 (signal SIGKILL)` for a child a signal ended."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"code {returncode} (signal {signal.Signals(-returncode).name})"
    return f"code {returncode}"


def _say(message: str) -> None:
    print(f"mlxcel-pool: {message}", file=sys.stderr, flush=True)


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as environment variables, so every child sees exactly the pool's config
    (including values a caller passed as overrides rather than through the environment)."""
    env: dict[str, str] = {}
    for var, (section, key) in ENV_VARS.items():
        value: Any = getattr(getattr(settings, section), key)
        if isinstance(value, SecretStr):  # str() of one is its mask; the child needs the value
            value = value.get_secret_value()
        if isinstance(value, bool):
            env[var] = "true" if value else "false"
        elif value != "":
            env[var] = str(value)
    if settings.prompt_cache.trace:
        env[TRACE_ENV] = "1"
    return env


def _model(settings: Settings, env: dict[str, str], output: IO[Any] | None) -> Path:
    try:
        return ensure_model(settings, env, output)
    except ModelBuildError as exc:
        raise PoolError(str(exc)) from exc


def clean_multiproc_dir(path: Path) -> None:
    """Drop Prometheus multiprocess files left by an earlier run (they would be summed in).
    Only `*.db` files are removed, so a misconfigured path cannot wipe unrelated data."""
    path.mkdir(parents=True, exist_ok=True)
    for db in path.glob("*.db"):
        db.unlink(missing_ok=True)


def _connect_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Pool:
    """One router (`router=False`: none, this host adds workers to a pool whose routers run
    elsewhere) and `workers` workers (ids `<worker_prefix>1..N`, default w1..wN) against one
    Redis.

    `settings.redis.url` empty: an embedded redis-server is started, on loopback, with the
    password kept in `<cache_dir>/redis.password`; `redis_url`, its ACL user `mlxcel` without the
    dangerous commands (never the server's admin user), carries it, so never log it unmasked
    (`shared.redis_auth.masked_url`). `settings.router.port` 0:
    a free port is chosen. `extra_env` is added to every child's environment. `restart_policy`
    (default: `settings.supervisor`) governs `supervise`. Each child's output goes to its rotated
    log file (`log_path`) and, with `echo`, to that stream too, prefixed with the child's name.
    """

    def __init__(
        self,
        settings: Settings,
        workers: int = 1,
        extra_env: dict[str, str] | None = None,
        log_dir: str | Path | None = None,
        grace_s: float = 10.0,
        restart_policy: RestartPolicy | None = None,
        echo: IO[str] | None = None,
        dashboard_port: int | None = None,
        worker_prefix: str = EMBEDDED_PREFIX,
        router: bool = True,
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.worker_ids = worker_ids(worker_prefix, workers)
        self.router = router
        self.extra_env = dict(extra_env or {})
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mlxcel-logs-"))
        self.grace_s = grace_s
        # Where the children's lines also go, each prefixed with its name (`up`; None: files only).
        self.echo = echo
        self.dashboard_port = dashboard_port  # rq-dashboard on 127.0.0.1 (None: not started)
        self._colours: dict[str, int] = {}
        port = settings.router.port or free_port()
        self.url = f"http://{_connect_host(settings.router.host)}:{port}"
        self.port = port
        self.redis_url = settings.redis.url
        self.model_path: Path | None = None
        self._redis: EmbeddedRedis | None = None
        self.restart_policy = restart_policy or RestartPolicy.from_config(settings.supervisor)
        self._children: dict[str, _Child] = {}
        self._env: dict[str, str] = {}
        # Held while deciding whether a child exited on its own and while (re)starting one, so a
        # supervising thread never restarts a child that `stop_worker` or `stop` is taking down.
        self._lock = threading.RLock()
        self._stopping = False

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> Pool:
        """Redis, metrics dir, model, router, workers. On failure everything started is stopped."""
        atexit.register(self.stop)
        self._stopping = False
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if not self.redis_url:
                # The cache dir's password: the URL stays valid across restarts of the server.
                self._redis = start_redis(password=embedded_password(self.settings.cache_dir))
                self.redis_url = self._redis.url
            if self.router:  # the router's metric files: a host without one leaves them alone
                clean_multiproc_dir(self.settings.multiproc_dir)
            self._env = self._child_env()
            if self.model_path is None:
                with open(self.log_dir / "build-model.log", "a") as log:
                    self.model_path = _model(self.settings, self._env, log)
            self._env["MLXCEL_MODEL"] = str(self.model_path)
            if self.router:
                self._spawn(
                    ROUTER,
                    [
                        ROUTER,
                        "--host",
                        self.settings.router.host,
                        "--port",
                        str(self.port),
                        "--processes",
                        str(self.settings.router.processes),
                        "--supervised",
                    ],
                )
            for worker_id in self.worker_ids:
                self.start_worker(worker_id)
            if self.dashboard_port is not None:
                self._spawn(DASHBOARD, [DASHBOARD, "--port", str(self.dashboard_port)])
        except BaseException:
            self.stop()
            raise
        return self

    def prepare_model(self, output: IO[Any] | None = None) -> Path:
        """Resolve (and build if needed) the model before `start`, showing progress on `output`."""
        self.model_path = _model(self.settings, self._child_env(), output)
        return self.model_path

    def stop(self) -> None:
        """SIGTERM every child's process group, SIGKILL what is left after the grace period,
        then stop the embedded Redis. Safe to call twice."""
        atexit.unregister(self.stop)
        with self._lock:
            self._stopping = True
            live = [c for c in self._children.values() if c.process.poll() is None]
            for child in live:
                child.expected = False
                _killpg(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
        crashed = [c for c in self._children.values() if c.expected and c not in live]
        for child in live + crashed:
            # Also reaches group members the leader left behind (e.g. uvicorn processes).
            _killpg(child.process.pid, signal.SIGKILL)
            child.process.wait()
            child.expected = False
        if self._redis is not None:
            self._redis.stop()
            self._redis = None

    def __enter__(self) -> Pool:
        return self if self._children else self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- workers ---------------------------------------------------------------------------

    def start_worker(
        self, worker_id: str, env: dict[str, str] | None = None, model: Path | None = None
    ) -> None:
        """Start worker `worker_id`; `env` is added to its environment (and kept for restarts).
        `model`: the model directory it serves (default: the pool's; another one adds that
        model to the pool, as its routers discover it)."""
        if self.model_path is None:
            raise PoolError("start the pool before adding workers")
        child = self._children.get(worker_id)
        if child is not None and child.process.poll() is None:
            raise PoolError(f"worker {worker_id} is already running")
        self._spawn(
            worker_id,
            [
                "worker",
                "--worker-id",
                worker_id,
                "--model",
                str(model or self.model_path),
                "--supervised",
            ],
            env,
        )

    def stop_worker(self, worker_id: str, sig: int = signal.SIGTERM) -> int:
        """Send `sig` to the worker's process group and wait (SIGKILL after the grace period).
        Returns its exit code; the pool does not count this as a failure."""
        child = self._children[worker_id]
        with self._lock:
            child.expected = False
            _killpg(child.process.pid, sig)
        try:
            child.process.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            _killpg(child.process.pid, signal.SIGKILL)
            child.process.wait()
        _killpg(child.process.pid, signal.SIGKILL)
        return child.process.returncode

    def kill_worker(self, worker_id: str) -> int:
        return self.stop_worker(worker_id, signal.SIGKILL)

    def pid(self, name: str) -> int:
        """The process id of child `name` (a worker id, `router`, or `redis` when embedded)."""
        if name == REDIS and self._redis is not None:
            return self._redis.process.pid
        return self._children[name].process.pid

    # --- supervision -----------------------------------------------------------------------

    def supervise(
        self,
        stop: StopFlag,
        log: Callable[[str], None] = _say,
        poll_s: float = SUPERVISE_POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Restart every child (and the embedded Redis) that exits unless we stopped it, after
        the policy's backoff, until `stop` is set; each worker's restart is counted in Redis.
        A crash loop raises PoolError naming the child; the caller then stops the pool. A
        worker's clean exit after SIGTERM (a drain) is restarted too, which makes `kill -TERM
        <worker>` a rolling restart.

        A child that exits with EXIT_CONFIG is never restarted: a restart would only say again
        what in its settings or files it cannot use. At its first start that stops the pool
        (PoolConfigError, its line); started again after it served (its id taken meanwhile by
        another host's worker, a broken upgrade), it is left down while the rest serves on."""
        ledger = RestartLedger(self.restart_policy)
        due: dict[str, float] = {}  # child -> when to start it again
        while not stop.wait(poll_s):
            now = clock()
            for name, rc in self._exited(skip=due):
                if rc == EXIT_CONFIG and name != REDIS:
                    self._config_exit(name, log)
                    continue
                decision = ledger.decide(name, now)
                if not decision.restart:
                    raise PoolError(self._report(decision.message(describe_exit(rc)), [name]))
                log(decision.message(describe_exit(rc)))
                due[name] = now + decision.delay_s
            for name in [n for n, at in due.items() if at <= now]:
                del due[name]
                if self._restart(name, log):
                    self._count_restart(name, log)

    def _config_exit(self, name: str, log: Callable[[str], None]) -> None:
        """A child that exited with EXIT_CONFIG: left down, or the pool stopped (see supervise)."""
        child = self._children[name]
        child.expected = False
        why = self.last_line(name)
        others = [
            c
            for c in self._children.values()
            if c.name != DASHBOARD and c.expected and c.process.poll() is None
        ]
        if child.starts > 1 and others:
            log(
                f"{name} exited with code {EXIT_CONFIG} when started again: {why}; not "
                f"restarting it, the rest of this host's pool serves on"
            )
            return
        raise PoolConfigError(
            f"{name} exited with code {EXIT_CONFIG} (a configuration error): {why}; not "
            f"restarting it, stopping the pool (its log: {self.log_path(name)})"
        )

    def _count_restart(self, name: str, log: Callable[[str], None]) -> None:
        child = self._children.get(name)
        if child is None or not child.is_worker:
            return
        failed = count_restart(self.settings.redis.model_copy(update={"url": self.redis_url}), name)
        if failed is not None:
            log(f"{name}'s restart is not counted in Redis: {failed}")

    def _exited(self, skip: dict[str, float]) -> list[tuple[str, int]]:
        """Children that exited on their own and are not already waiting in `skip`, with their
        exit codes; what a dead child's process group left behind is killed, freeing its port."""
        out: list[tuple[str, int]] = []
        with self._lock:
            if self._stopping:
                return out
            for child in list(self._children.values()):
                rc = child.process.poll()
                if child.expected and rc is not None and child.name not in skip:
                    _killpg(child.process.pid, signal.SIGKILL)
                    out.append((child.name, rc))
            if self._redis is not None and REDIS not in skip:
                rc = self._redis.process.poll()
                if rc is not None:
                    out.append((REDIS, rc))
        return out

    def _restart(self, name: str, log: Callable[[str], None]) -> bool:
        """Start `name` again; False when it was not (stopping, stopped on purpose, ...)."""
        with self._lock:
            if self._stopping:
                return False
            if name == REDIS:
                if self._redis is None:
                    return False
                try:
                    self._redis = self._redis.restarted()
                except RedisServerError as exc:
                    # The dead server stays in place, so the next poll counts this as one more exit.
                    log(f"{REDIS} did not restart: {exc}")
                    return False
                return True
            child = self._children.get(name)
            if child is None or not child.expected or child.process.poll() is None:
                return False  # stopped on purpose (or already started again) while it waited
            self._spawn(name, child.args, child.env, starts=child.starts + 1)
            return True

    # --- health ----------------------------------------------------------------------------

    def failures(self) -> list[str]:
        """Children (and the embedded Redis) that exited without being asked to."""
        out = [
            f"{c.name} (pid {c.process.pid}) exited with code {c.process.returncode}"
            for c in self._children.values()
            if c.expected and c.process.poll() is not None
        ]
        if self._redis is not None and self._redis.process.poll() is not None:
            out.append(f"embedded redis-server exited with code {self._redis.process.returncode}")
        return out

    def health_status(self, timeout: float = 2.0) -> int | None:
        """HTTP status of GET /health, or None when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except (OSError, ValueError):
            return None

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Wait until /health answers 200 (the router is up and sees a live worker)."""
        deadline = time.monotonic() + timeout
        status: int | None = None
        while time.monotonic() < deadline:
            self._raise_on_failures()
            status = self.health_status()
            if status == 200:
                return
            time.sleep(0.25)
        raise PoolError(self._report(f"not healthy after {timeout}s (last /health: {status})"))

    def wait_registered(self, timeout: float = 120.0) -> None:
        """Wait until each of this pool's workers has registered in Redis (its liveness hash
        names its process): a pool without a router of its own is ready then."""
        deadline = time.monotonic() + timeout
        client = sync_client(self.settings.redis.model_copy(update={"url": self.redis_url}))
        waiting: list[str] = list(self.worker_ids)
        try:
            while time.monotonic() < deadline:
                self._raise_on_failures()
                with contextlib.suppress(redis.RedisError):  # a blip: asked again next round
                    waiting = [w for w in self.worker_ids if not self._registered(client, w)]
                if not waiting:
                    return
                time.sleep(0.25)
        finally:
            client.close()
        raise PoolError(self._report(f"not registered after {timeout}s: {', '.join(waiting)}"))

    def _registered(self, client: redis.Redis, worker_id: str) -> bool:
        pid = client.hget(keys.worker_info(worker_id), "pid")
        return pid is not None and int(pid) == self.pid(worker_id)

    def _raise_on_failures(self) -> None:
        """Before the pool is ready, any child's exit stops it: EXIT_CONFIG with that child's
        one line (PoolConfigError), anything else with the exits and their log tails."""
        for child in self._children.values():
            if child.expected and child.process.poll() == EXIT_CONFIG:
                child.expected = False
                raise PoolConfigError(
                    f"{child.name} exited with code {EXIT_CONFIG} (a configuration error): "
                    f"{self.last_line(child.name)} (its log: {self.log_path(child.name)})"
                )
        if failed := self.failures():
            raise PoolError(self._report("; ".join(failed)))

    # --- logs ------------------------------------------------------------------------------

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def logs(self, name: str) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def last_line(self, name: str) -> str:
        """The last line the child's latest run wrote (its timestamp and logger name dropped),
        once its output has been copied to the end."""
        child = self._children.get(name)
        if child is not None and child.output is not None:
            child.output.join(5.0)
        run = self.logs(name).rsplit(f"--- mlxcel-pool: starting {name}:", 1)[-1]
        lines = [ln.strip() for ln in run.splitlines()[1:] if ln.strip()]
        return _LOG_HEAD.sub("", lines[-1]) if lines else "(it wrote nothing)"

    def _report(self, headline: str, names: list[str] | None = None) -> str:
        """`headline`, then the last lines of each child's log (of `names` only, when given)."""
        parts = [headline]
        for name in [n for n in self._children if names is None or n in names]:
            tail = self.logs(name).splitlines()[-LOG_TAIL_LINES:]
            parts.append(f"--- last lines of {self.log_path(name)} ---\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- internals -------------------------------------------------------------------------

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, **settings_env(self.settings)}
        if not self.settings.prompt_cache.trace:
            env.pop(TRACE_ENV, None)  # the settings decide, not a stray variable in our env
        env.update(self.extra_env)
        # `python -m mlxcel_pool` must work whether or not the package is installed.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["REDIS_URL"] = self.redis_url
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self.settings.multiproc_dir)
        env["PYTHONUNBUFFERED"] = "1"  # log files show progress as it happens
        return env

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None, starts: int = 1
    ) -> None:
        argv = [sys.executable, "-m", "mlxcel_pool", *args]
        path = self.log_path(name)
        colour = self._colours.setdefault(name, len(self._colours))
        width = max(len(n) for n in (*self._colours, "router"))
        output = ChildOutput(name, path, self.echo, width, colour)
        output.line(f"--- mlxcel-pool: starting {name}: {' '.join(argv)}")
        process = subprocess.Popen(
            argv,
            env={**self._env, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert process.stdout is not None
        thread = output.follow(process.stdout)
        self._children[name] = _Child(
            name, process, path, args, dict(env or {}), output=thread, starts=starts
        )

"""`mlxcel-pool`: start the whole pool (`up`) or one part of it (`router`, `worker`, `redis`).

Subcommands import their part lazily, so `mlxcel-pool router` never imports mlx and a bad
configuration is reported (exit 2) before anything heavy loads.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mlxcel_pool.supervisor import Pool, PoolError, ensure_model
from shared.config import EXIT_CONFIG, ConfigError, Settings, load_settings, positive_int
from shared.redis_auth import PASSWORD_FILE, embedded_password, masked_url


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxcel-pool", description="OpenAI-compatible LLM serving pool (router, Redis, MLX)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start Redis (unless REDIS_URL), the router and N workers")
    up.add_argument("--host", help="router bind address (router.host)")
    up.add_argument("--port", type=int, help="router port (router.port)")
    up.add_argument("--workers", type=positive_int, default=1, help="worker processes (default 1)")
    up.add_argument("--model", help="model directory (model.path; default: the built-in model)")
    up.add_argument("--router-processes", type=positive_int, help="uvicorn processes")
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds until /health")
    up.add_argument("--log-dir", type=Path, help="child logs (default <cache_dir>/logs)")
    up.add_argument("--quiet", action="store_true", help="children's output in log files only")
    up.add_argument(
        "--dashboard",
        nargs="?",
        type=int,
        const=9181,
        metavar="PORT",
        help="also run rq-dashboard on 127.0.0.1:PORT (default 9181)",
    )

    router = sub.add_parser("router", help="run the HTTP router against REDIS_URL")
    router.add_argument("--host")
    router.add_argument("--port", type=int)
    router.add_argument("--processes", type=positive_int)

    worker = sub.add_parser("worker", help="run one MLX worker against REDIS_URL")
    worker.add_argument("--model", help="model directory (default: the built-in model)")
    worker.add_argument("--worker-id", help="worker id (worker.id)")
    worker.add_argument("--batch-size", type=positive_int, help="max sequences decoded together")

    # Parsed by devmodel.builder itself; listed here for --help.
    sub.add_parser("build-model", help="build the built-in model (see build-model --help)")

    redis = sub.add_parser(
        "redis", help="run an embedded redis-server in the foreground (password in the cache dir)"
    )
    redis.add_argument("--port", type=int, default=6379)
    redis.add_argument("--host", default="127.0.0.1", help="a loopback address")

    redis_url = sub.add_parser(
        "redis-url", help="print the URL, password included, of `mlxcel-pool redis` on this port"
    )
    redis_url.add_argument("--port", type=int, default=6379)
    redis_url.add_argument("--host", default="127.0.0.1")

    dashboard = sub.add_parser(
        "dashboard", help="rq-dashboard on 127.0.0.1 against REDIS_URL, reading jobs as msgpack"
    )
    dashboard.add_argument("--port", type=int, default=9181)

    stats = sub.add_parser("stats", help="the pool's cache, worker and routing statistics")
    stats.add_argument("--url", help="the router (default http://<router.host>:<router.port>)")
    stats.add_argument("--watch", type=float, metavar="S", help="refresh every S seconds")
    stats.add_argument("--json", action="store_true", help="print the JSON as the router sends it")
    stats.add_argument("--api-key", help="bearer key (default: $MLXCEL_API_KEY, $OPENAI_API_KEY)")

    wait = sub.add_parser("wait-redis", help="wait until REDIS_URL answers PING")
    wait.add_argument("--timeout", type=float, default=30.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["build-model"]:
        from worker.mlx_cpu import blas

        blas.preload_openblas()  # the builder imports mlx
        from devmodel.builder import main as build_main

        return build_main(args_list[1:])
    args = build_parser().parse_args(args_list)
    command: Callable[[argparse.Namespace], int] = COMMANDS[args.command]
    try:
        return command(args)
    except ConfigError as exc:
        print(f"mlxcel-pool {args.command}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except PoolError as exc:
        print(f"mlxcel-pool {args.command}: {exc}", file=sys.stderr)
        return 1


# --- signals ---------------------------------------------------------------------------------


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C inside the block; both are ignored during the cleanup after
    it, so a second signal cannot cut the shutdown of the children short. SIGINT is set
    explicitly: a process started in the background by a shell inherits it as ignored."""
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _SignalStop:
    """`Pool.supervise`'s stop flag, set by SIGINT/SIGTERM: the handler only stores the signal's
    name (no lock it could deadlock on, unlike threading.Event), so a signal never raises in the
    middle of a child's restart."""

    def __init__(self) -> None:
        self.signal_name = ""

    def wait(self, timeout: float) -> bool:
        if not self.signal_name:
            time.sleep(timeout)  # a signal's handler runs, then the sleep finishes
        return bool(self.signal_name)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[_SignalStop]:
        previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# --- subcommands -----------------------------------------------------------------------------


def _settings(overrides: dict[str, dict[str, Any]]) -> Settings:
    return load_settings(overrides=overrides)


def _require_redis(settings: Settings, command: str) -> None:
    if not settings.redis.url:
        raise ConfigError(
            f"REDIS_URL is not set: `mlxcel-pool {command}` joins an existing pool "
            "(e.g. REDIS_URL=redis://127.0.0.1:6379/0); `mlxcel-pool up` starts one"
        )


def cmd_up(args: argparse.Namespace) -> int:
    settings = _settings(
        {
            "router": {"host": args.host, "port": args.port, "processes": args.router_processes},
            "model": {"path": args.model},
        }
    )
    from router.edge.auth import load_access

    load_access(settings.auth)  # a bad key file stops `up` here (exit 2), not in the router child
    pool = Pool(
        settings,
        workers=args.workers,
        log_dir=args.log_dir or settings.cache_dir / "logs",
        echo=None if args.quiet else sys.stdout,
        dashboard_port=args.dashboard,
    )
    say = _stderr_printer("up")
    try:
        with _stop_on_signals():
            try:
                pool.prepare_model(sys.stderr)  # progress on the terminal
                pool.start()
                shown = masked_url(pool.redis_url)
                say(f"redis {shown}, {args.workers} worker(s), logs in {pool.log_dir}")
                if args.dashboard is not None:
                    say(f"rq-dashboard on http://127.0.0.1:{args.dashboard}")
                pool.wait_healthy(args.ready_timeout)
                print(f"mlxcel-pool ready: {pool.url}/v1", flush=True)
                # The one line that shows the embedded Redis's password: on stdout, for the
                # operator; stderr and the child logs only ever carry the URL masked.
                print(f"REDIS_URL={shown if settings.redis.url else pool.redis_url}", flush=True)
                with _SignalStop().installed() as stop:
                    pool.supervise(stop, log=say)  # returns on a signal, raises on a crash loop
                say(f"{stop.signal_name}: stopping")
                return 0
            except KeyboardInterrupt as exc:
                say(f"{exc.args[0] if exc.args else 'interrupted'}: stopping")
                return 0
            except PoolError as exc:
                say(str(exc))
                return 1
    finally:
        pool.stop()


def cmd_router(args: argparse.Namespace) -> int:
    settings = _settings(
        {"router": {"host": args.host, "port": args.port, "processes": args.processes}}
    )
    _require_redis(settings, "router")
    from router.serve import main as serve_main

    return serve_main(settings) or 0


def cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings(
        {
            "model": {"path": args.model},
            "worker": {"id": args.worker_id, "batch_size": args.batch_size},
        }
    )
    _require_redis(settings, "worker")
    if not settings.model.path:
        # Build (in a subprocess, progress on stderr) before this process imports mlx.
        path = ensure_model(settings)
        settings = settings.model_copy(
            update={"model": settings.model.model_copy(update={"path": str(path)})}
        )
    from worker.main import run

    return run(settings)


def cmd_redis(args: argparse.Namespace) -> int:
    from mlxcel_pool.redis_server import RedisServerError, start_redis

    settings = _settings({})
    password = embedded_password(settings.cache_dir)
    with _stop_on_signals():
        try:
            server = start_redis(port=args.port, host=args.host, password=password)
        except RedisServerError as exc:
            print(f"mlxcel-pool redis: {exc}", file=sys.stderr)
            return 1
        try:
            # Masked: a process manager (honcho) logs this line. Clients get the full URL from
            # `mlxcel-pool redis-url`, which reads the same password file.
            print(server.masked_url, flush=True)
            print(
                f"mlxcel-pool redis: password in {settings.cache_dir / PASSWORD_FILE}; "
                f"REDIS_URL=$(mlxcel-pool redis-url --port {server.port})",
                file=sys.stderr,
                flush=True,
            )
            rc = server.process.wait()
            print(f"mlxcel-pool redis: redis-server exited with {rc}", file=sys.stderr)
            return rc or 1
        except KeyboardInterrupt:
            return 0
        finally:
            server.stop()


def cmd_redis_url(args: argparse.Namespace) -> int:
    from mlxcel_pool.redis_server import embedded_url

    # Made here if `mlxcel-pool redis` has not made it yet: both end up with the same password.
    password = embedded_password(_settings({}).cache_dir)
    print(embedded_url(args.host, args.port, password), flush=True)
    return 0


def cmd_wait_redis(args: argparse.Namespace) -> int:
    settings = _settings({})
    _require_redis(settings, "wait-redis")
    import redis

    from shared.redis_clients import sync_client

    # The pool's own client (a Sentinel URL asks the sentinels), each try bounded by a second.
    client = sync_client(settings.redis.model_copy(update={"stall_timeout_s": 1.0}))
    shown = masked_url(settings.redis.url)
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            client.ping()
            return 0
        except redis.AuthenticationError as exc:  # a wrong or missing password: waiting won't help
            print(f"mlxcel-pool wait-redis: {shown}: {exc}", file=sys.stderr)
            return 1
        except redis.RedisError as exc:
            if time.monotonic() > deadline:
                print(f"mlxcel-pool wait-redis: {shown}: {exc}", file=sys.stderr)
                return 1
            time.sleep(0.2)


def cmd_dashboard(args: argparse.Namespace) -> int:
    settings = _settings({})
    _require_redis(settings, "dashboard")
    from mlxcel_pool.dashboard import serve

    return serve(settings.redis.url, args.port)


def cmd_stats(args: argparse.Namespace) -> int:
    import json
    import os

    import httpx
    from rich.console import Console
    from rich.live import Live

    from mlxcel_pool.stats_view import render

    settings = _settings({})
    host = settings.router.host if settings.router.host not in ("0.0.0.0", "::") else "127.0.0.1"
    url = (args.url or f"http://{host}:{settings.router.port}").rstrip("/")
    key = args.api_key or os.environ.get("MLXCEL_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def fetch() -> dict[str, Any]:
        resp = httpx.get(f"{url}/v1/cache/stats", headers=headers, timeout=10)
        if resp.status_code != 200:
            raise PoolError(f"{url}/v1/cache/stats answered {resp.status_code}: {resp.text[:200]}")
        return resp.json()

    try:
        if args.json:
            print(json.dumps(fetch(), indent=2))
            return 0
        console = Console()
        if not args.watch:
            console.print(render(fetch(), time.time()))
            return 0
        with _stop_on_signals(), Live(render(fetch(), time.time()), console=console) as live:
            while True:
                time.sleep(args.watch)
                live.update(render(fetch(), time.time()))
    except KeyboardInterrupt:
        return 0
    except httpx.HTTPError as exc:
        print(f"mlxcel-pool stats: cannot reach {url}: {exc}", file=sys.stderr)
        return 1


def _stderr_printer(command: str) -> Callable[[str], None]:
    def say(message: str) -> None:
        print(f"mlxcel-pool {command}: {message}", file=sys.stderr, flush=True)

    return say


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": cmd_up,
    "router": cmd_router,
    "worker": cmd_worker,
    "redis": cmd_redis,
    "redis-url": cmd_redis_url,
    "dashboard": cmd_dashboard,
    "wait-redis": cmd_wait_redis,
    "stats": cmd_stats,
}

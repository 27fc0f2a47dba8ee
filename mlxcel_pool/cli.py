"""`mlxcel-pool`: start the whole pool (`up`), a host's share of one (`up --join`), or one part of
it (`router`, `worker`, `redis`).

Subcommands import their part lazily, so `mlxcel-pool router` never imports mlx and a bad
configuration is reported (exit 2) before anything heavy loads: the commands that join a pool
check REDIS_URL (mlxcel_pool/redis_check.py), the worker ids (mlxcel_pool/worker_ids.py) and the
model directory first, each failure one line naming what is wrong and the fix.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlxcel_pool import preflight, redis_command
from mlxcel_pool.model_setup import ROUTER_MODEL_FILES, ModelBuildError, ensure_model
from mlxcel_pool.stop_signals import SignalStop, stop_on_signals
from mlxcel_pool.supervisor import Pool, PoolConfigError, PoolError
from mlxcel_pool.worker_ids import EMBEDDED_PREFIX, check_prefix, host_prefix, worker_ids
from shared.config import EXIT_CONFIG, ConfigError, Settings, load_settings, positive_int
from shared.redis_auth import masked_url

# How long `up`, `router` and `worker` wait for a REDIS_URL that does not answer yet (a Redis
# host still booting) before they give up with exit 2.
REDIS_WAIT_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxcel-pool", description="OpenAI-compatible LLM serving pool (router, Redis, MLX)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up",
        help="start Redis (unless REDIS_URL), the router and N workers; --join: only the workers",
    )
    up.add_argument("--host", help="router bind address (router.host)")
    up.add_argument("--port", type=int, help="router port (router.port)")
    up.add_argument("--workers", type=positive_int, default=1, help="worker processes (default 1)")
    up.add_argument(
        "--join",
        action="store_true",
        help="add this host's workers to the pool at REDIS_URL: no router, no Redis of its own",
    )
    up.add_argument(
        "--worker-prefix",
        help="worker ids PREFIX1..PREFIXN (default: w with the embedded Redis, <host>-w with "
        "REDIS_URL)",
    )
    _redis_timeout_option(up, child=False)
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
    _redis_timeout_option(router)

    worker = sub.add_parser("worker", help="run one MLX worker against REDIS_URL")
    worker.add_argument("--model", help="model directory (default: the built-in model)")
    worker.add_argument("--worker-id", help="worker id (worker.id)")
    worker.add_argument("--batch-size", type=positive_int, help="max sequences decoded together")
    _redis_timeout_option(worker)

    # Parsed by devmodel.builder itself; listed here for --help.
    sub.add_parser("build-model", help="build the built-in model (see build-model --help)")

    redis_command.add_parsers(sub)

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


def _redis_timeout_option(parser: argparse.ArgumentParser, child: bool = True) -> None:
    parser.add_argument(
        "--redis-timeout",
        type=float,
        default=REDIS_WAIT_S,
        metavar="S",
        help=f"seconds to wait for REDIS_URL to answer before giving up (default {REDIS_WAIT_S:g})",
    )
    if child:
        # Set by `mlxcel-pool up` for its children: it checked Redis and the ids itself, and a
        # child that cannot reach Redis exits 1 to be restarted, not 2, which stops the pool.
        parser.add_argument("--supervised", action="store_true", help=argparse.SUPPRESS)


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
        print(f"mlxcel-pool {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except (PoolError, ModelBuildError) as exc:
        print(f"mlxcel-pool {args.command}: {exc}", file=sys.stderr)
        return 1


def one_line(message: str) -> str:
    """A configuration error's message on one line (the settings' validation lists each bad
    value on a line of its own: they are joined with '; ')."""
    head, *items = [line.strip() for line in message.splitlines() if line.strip()]
    items = [item.replace("Value error, ", "") for item in items]
    if not items:
        return head
    return f"{head} {'; '.join(items)}" if head.endswith(":") else "; ".join([head, *items])


# --- subcommands -----------------------------------------------------------------------------


def _settings(overrides: dict[str, dict[str, Any]]) -> Settings:
    return load_settings(overrides=overrides)


def _up_plan(args: argparse.Namespace, settings: Settings) -> tuple[str, bool]:
    """The worker id prefix and whether this host runs a router, for `up`'s flags."""
    external = bool(settings.redis.url)
    if args.join:
        if not external:
            raise ConfigError(
                "`mlxcel-pool up --join` adds this host's workers to the pool at REDIS_URL, "
                "which is not set: export REDIS_URL=<the pool's URL> (on the Redis host "
                "`mlxcel-pool redis-url` prints it)"
            )
        given = [f for f, v in (("--host", args.host), ("--port", args.port)) if v is not None]
        if args.router_processes is not None:
            given.append("--router-processes")
        if given:
            raise ConfigError(f"`up --join` starts no router: drop {', '.join(given)}")
    default = host_prefix() if external else EMBEDDED_PREFIX
    return check_prefix(args.worker_prefix or default), not args.join


def cmd_up(args: argparse.Namespace) -> int:
    settings = _settings(
        {
            "router": {"host": args.host, "port": args.port, "processes": args.router_processes},
            "model": {"path": args.model},
        }
    )
    prefix, with_router = _up_plan(args, settings)
    ids = worker_ids(prefix, args.workers)
    if with_router:
        from router.edge.auth import load_access

        load_access(settings.auth)  # a bad key file stops `up` here (exit 2), not in the router
    if settings.redis.url:
        # Another host's pool may be serving on this Redis: everything that could be wrong
        # here is found before this host starts anything, and only read.
        preflight.check_redis(settings, args.redis_timeout)
        preflight.check_ids_free(
            settings, ids, "give this host's workers other ids (--worker-prefix)"
        )
    pool = Pool(
        settings,
        workers=args.workers,
        log_dir=args.log_dir or settings.cache_dir / "logs",
        echo=None if args.quiet else sys.stdout,
        dashboard_port=args.dashboard,
        worker_prefix=prefix,
        router=with_router,
    )
    say = _stderr_printer("up")
    try:
        with stop_on_signals():
            try:
                return _run_up(pool, args, settings, say)
            except KeyboardInterrupt as exc:
                say(f"{exc.args[0] if exc.args else 'interrupted'}: stopping")
                return 0
            except PoolConfigError as exc:
                say(str(exc))
                return EXIT_CONFIG
            except PoolError as exc:
                say(str(exc))
                return 1
    finally:
        pool.stop()


def _run_up(
    pool: Pool, args: argparse.Namespace, settings: Settings, say: Callable[[str], None]
) -> int:
    pool.prepare_model(sys.stderr)  # progress on the terminal
    pool.start()
    shown = masked_url(pool.redis_url)
    say(f"redis {shown}, workers {', '.join(pool.worker_ids)}, logs in {pool.log_dir}")
    if args.dashboard is not None:
        say(f"rq-dashboard on http://127.0.0.1:{args.dashboard}")
    if pool.router:
        pool.wait_healthy(args.ready_timeout)
        print(f"mlxcel-pool ready: {pool.url}/v1", flush=True)
        # The one line that shows the embedded Redis's password: on stdout, for the
        # operator; stderr and the child logs only ever carry the URL masked.
        print(f"REDIS_URL={shown if settings.redis.url else pool.redis_url}", flush=True)
    else:
        pool.wait_registered(args.ready_timeout)
        print(f"mlxcel-pool ready: {', '.join(pool.worker_ids)} joined {shown}", flush=True)
    with SignalStop().installed() as stop:
        pool.supervise(stop, log=say)  # returns on a signal, raises on a crash loop
    say(f"{stop.signal_name}: stopping")
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    settings = _settings(
        {"router": {"host": args.host, "port": args.port, "processes": args.processes}}
    )
    preflight.require_redis(settings, "router")
    from router.edge.auth import load_access

    # This host's own files first (no waiting): a missing key file is said at once, not after
    # the wait for an unreachable Redis.
    load_access(settings.auth)
    if not args.supervised:
        preflight.check_redis(settings, args.redis_timeout)
    # The tokenizer's files, here too: the built-in model is built (in a subprocess: this
    # process never imports mlx) before uvicorn starts processes that would each fail on it.
    ensure_model(settings, needs=ROUTER_MODEL_FILES)
    from router.serve import main as serve_main

    return serve_main(settings) or 0


def cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings(
        {
            "model": {"path": args.model},
            "worker": {"id": args.worker_id, "batch_size": args.batch_size},
        }
    )
    preflight.require_redis(settings, "worker")
    if not args.supervised:
        preflight.check_redis(settings, args.redis_timeout)
        if settings.worker.id:  # before the model loads; the worker's own claim still decides
            fix = "give this worker another id (--worker-id / MLXCEL_WORKER_ID)"
            preflight.check_ids_free(settings, [settings.worker.id], fix)
    # Build (in a subprocess, progress on stderr) before this process imports mlx.
    path = ensure_model(settings)
    if not settings.model.path:
        settings = settings.model_copy(
            update={"model": settings.model.model_copy(update={"path": str(path)})}
        )
    from worker.main import run

    return run(settings)


def cmd_wait_redis(args: argparse.Namespace) -> int:
    settings = _settings({})
    preflight.require_redis(settings, "wait-redis")
    # A wrong password or a TLS mismatch is reported at once: waiting won't help.
    preflight.check_redis(settings, args.timeout)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    settings = _settings({})
    preflight.require_redis(settings, "dashboard")
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
        with stop_on_signals(), Live(render(fetch(), time.time()), console=console) as live:
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
    "redis": redis_command.cmd_redis,
    "redis-url": redis_command.cmd_redis_url,
    "dashboard": cmd_dashboard,
    "wait-redis": cmd_wait_redis,
    "stats": cmd_stats,
}

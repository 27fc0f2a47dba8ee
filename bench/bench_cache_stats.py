"""`GET /v1/cache/stats` latency with 64 workers' hashes present (goal: p50 under 5 ms, one Redis
round trip per request).

Starts a private redis-server and one router process (`python -m router`), writes 64 workers'
counters, gauges, last-reject and info hashes as workers would, then times sequential requests
through real HTTP. It also times the router's Lua read alone, and counts the Redis commands each
request sends (from INFO commandstats) to show it is one EVALSHA.

usage: python bench/bench_cache_stats.py [--workers 64] [--requests 300] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mlxcel_pool.redis_server import free_port, start_redis  # noqa: E402
from shared import keys  # noqa: E402
from shared.cache_stats import COUNTER_FIELDS, GAUGE_FIELDS  # noqa: E402
from shared.reject import REJECT_REASONS  # noqa: E402


def fill_workers(r: redis.Redis, n: int) -> None:
    """Each worker's two hashes as a worker writes them (counters + last reject; info + gauges)."""
    with r.pipeline(transaction=False) as p:
        for i in range(n):
            wid = f"w{i}"
            reason = REJECT_REASONS[i % len(REJECT_REASONS)].value
            counters = {f: (i + 1) * (j + 3) for j, f in enumerate(COUNTER_FIELDS)}
            counters.update(
                last_reject_reason=reason,
                last_reject_seq_id=f"seq-{i}",
                last_reject_context_len=100 + i,
                last_reject_at_unix_ms=1_700_000_000_000 + i,
            )
            p.sadd(keys.workers_roster(), wid)
            p.hset(keys.worker_cache_counters(wid), mapping=counters)
            info = {f: 1000 + i + j for j, f in enumerate(GAUGE_FIELDS)}
            info.update(
                enabled=1,
                apc_enabled=1,
                block_size=16,
                hash="sha256",
                paged_block_size=32,
                storage_mode="paged",
                cacheability="trimmable",
                worker_id=wid,
                pid=1,
                host="h",
                model="m",
            )
            p.hset(keys.worker_info(wid), mapping=info)
            p.expire(keys.worker_info(wid), 3600)
        p.execute()


def start_router(redis_url: str, model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "MLXCEL_MODEL": str(model_dir),
        "MLXCEL_PORT": str(port),
        "MLXCEL_ROUTER_PROCESSES": "1",
        "PROMETHEUS_MULTIPROC_DIR": str(log.parent / "prom"),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "router"],
        env=env,
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def evalsha_calls(r: redis.Redis) -> tuple[int, int, float]:
    """(script calls, all commands incl. the script's own, server microseconds in scripts)."""
    stats = r.info("commandstats")
    scripts = [v for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")]
    total = sum(v["calls"] for v in stats.values())
    return sum(v["calls"] for v in scripts), total, sum(v["usec"] for v in scripts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_req = 60 if args.quick else args.requests

    from worker.mlx_cpu import blas

    blas.preload_openblas()  # before the model build imports mlx
    from devmodel.builder import ensure_model

    model_dir = ensure_model(REPO / ".cache" / "test", "tiny")
    server = start_redis()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"mlxcel-bench-stats-{os.getpid()}"
    (work / "prom").mkdir(parents=True, exist_ok=True)
    port = free_port()
    router = start_router(server.url, model_dir, port, work / "router.log")
    try:
        r = redis.Redis.from_url(server.url)
        fill_workers(r, args.workers)
        url = f"http://127.0.0.1:{port}/v1/cache/stats"
        with httpx.Client(timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get(url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or router.poll() is not None:
                    print((work / "router.log").read_text()[-3000:])
                    return 1
                time.sleep(0.2)
            body = client.get(url).json()
            assert len(body["workers"]) == args.workers
            for _ in range(20):
                client.get(url)  # warm up
            s0, t0, u0 = evalsha_calls(r)
            http_ms = []
            for _ in range(n_req):
                t = time.perf_counter()
                resp = client.get(url)
                http_ms.append((time.perf_counter() - t) * 1000)
                assert resp.status_code == 200
            s1, t1, u1 = evalsha_calls(r)
            floor_ms = []
            for _ in range(n_req):  # the HTTP round trip itself, on a route that reads nothing
                t = time.perf_counter()
                client.get(url.replace("/v1/cache/stats", "/v1/models"))
                floor_ms.append((time.perf_counter() - t) * 1000)
        from router.pool_view.cache_stats import _ARGS, READ_POOL_LUA

        lua = r.register_script(READ_POOL_LUA)
        lua_ms = []
        for _ in range(n_req):
            t = time.perf_counter()
            lua(keys=[keys.workers_roster()], args=_ARGS)
            lua_ms.append((time.perf_counter() - t) * 1000)
    finally:
        router.terminate()
        router.wait(10)
        server.stop()

    p50 = statistics.median(http_ms)
    print(f"workers with hashes present: {args.workers}; requests: {n_req}")
    print(
        f"GET /v1/cache/stats  p50 {p50:.2f} ms  p95 {percentile(http_ms, 0.95):.2f} ms  "
        f"max {max(http_ms):.2f} ms"
    )
    print(f"GET /v1/models       p50 {statistics.median(floor_ms):.2f} ms  (HTTP floor: no Redis)")
    print(
        f"Lua pool read alone  p50 {statistics.median(lua_ms):.2f} ms  "
        f"p95 {percentile(lua_ms, 0.95):.2f} ms"
    )
    print(f"server time in the script: {(u1 - u0) / max(1, s1 - s0) / 1000:.2f} ms per request")
    print(
        f"Redis scripts per request: {(s1 - s0) / n_req:.2f}  "
        f"(client commands incl. the script's HGETALLs: {(t1 - t0) / n_req:.1f})"
    )
    print(f"goal p50 < 5 ms: {'met' if p50 < 5 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The router processes' own Prometheus metrics, declared once with their labels.

Names follow the spec (docs: prompt-cache.md, "Prometheus names"). prometheus_client appends
`_total` to counters itself, so `Counter("mlxcel_requests", ...)` is exposed as
`mlxcel_requests_total`.

Multiprocess mode: each process writes its own files under PROMETHEUS_MULTIPROC_DIR, which must be
set *before* prometheus_client is first imported (router.serve does it). Only the router
exposes metrics: workers publish theirs to Redis, and router.pool_view.pool_metrics serves them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

# The workers' series (prompt cache, requests, tokens, batches, queue depth) are not declared
# here: workers publish those numbers to Redis and the router serves them from there for the
# whole pool (router/pool_view/pool_metrics.py), so one scrape covers workers on every host.

# --- router ----------------------------------------------------------------------------------
REQUEST_TTFT_MS = Histogram(
    "mlxcel_request_ttft_ms",
    "Time from enqueue to the first generated token, in milliseconds.",
    buckets=(5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000),
)
REQUEST_DECODE_TOK_S = Histogram(
    "mlxcel_request_decode_tok_s",
    "Per-request decode speed after the first token, in tokens per second.",
    buckets=(1, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
)


# Admission refusals (429s), by the bound that refused: inflight or tokens.
ADMISSION_REFUSED = Counter(
    "mlxcel_admission_refused", "Requests refused at a pool bound (429).", ["reason"]
)
ADMISSION_REASONS = ("inflight", "tokens")

# Routing (router side; outcomes as router/placement/placement.lua names them).
ROUTING_OUTCOMES = ("cache", "spill", "load", "round_robin", "no_worker")
ROUTING_DECISIONS = Counter(
    "mlxcel_routing_decisions", "Routing decisions by outcome.", ["outcome"]
)
ROUTING_PREDICTED_TOKENS = Histogram(
    "mlxcel_routing_predicted_cached_tokens",
    "Prompt tokens the router predicted the chosen worker holds.",
    buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
)
ROUTING_PREDICTED_TOTAL = Counter(
    "mlxcel_routing_predicted_tokens", "Cached prompt tokens predicted at routing.", ["worker"]
)
ROUTING_REUSED_TOTAL = Counter(
    "mlxcel_routing_reused_tokens",
    "Cached prompt tokens the worker actually reused, for requests routed to it.",
    ["worker"],
)


def init_labels() -> None:
    """Create every labelled series at 0 so dashboards see each outcome from the start."""
    for outcome in ROUTING_OUTCOMES:
        ROUTING_DECISIONS.labels(outcome).inc(0)
    for reason in ADMISSION_REASONS:
        ADMISSION_REFUSED.labels(reason).inc(0)


def multiprocess_active() -> bool:
    """True when prometheus_client was imported with PROMETHEUS_MULTIPROC_DIR set."""
    return values.ValueClass is not values.MutexValue


_DB_FILE = re.compile(r"_(\d+)\.db$")


def _pids_in(path: Path) -> set[int]:
    if not path.is_dir():
        return set()
    return {int(m.group(1)) for f in path.iterdir() if (m := _DB_FILE.search(f.name))}


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def mark_dead_processes(path: Path | str) -> list[int]:
    """Drop live-mode gauge files of processes that no longer run (their gauges stop counting)."""
    dead = [pid for pid in sorted(_pids_in(Path(path))) if not _running(pid)]
    for pid in dead:
        multiprocess.mark_process_dead(pid, str(path))
    return dead


def clean_multiproc_dir(path: Path | str) -> None:
    """Wipe a previous run's files (at pool start, before any process writes)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    for f in p.glob("*.db"):
        f.unlink(missing_ok=True)


def scrape(path: Path | str, extra: Collector | None = None) -> bytes:
    """The exposition text for `/metrics`: all router processes' files in multiprocess mode
    (else this process's registry: one that imported prometheus_client before the dir was set),
    plus `extra` (the pool's worker series)."""
    registry = CollectorRegistry()
    if multiprocess_active():
        mark_dead_processes(path)
        multiprocess.MultiProcessCollector(registry, path=str(path))
    else:
        registry.register(_Forward(REGISTRY))
    if extra is not None:
        registry.register(extra)
    return generate_latest(registry)


class _Forward(Collector):
    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from self.source.collect()

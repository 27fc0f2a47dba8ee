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
    "Per-request decode speed after the first token (as Redis stored them), in tokens per second.",
    buckets=(1, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
)
# The spec's two names with abbreviated units (promtool's lint names them), which
# MLXCEL_METRICS_LEGACY_UNITS=false leaves out of /metrics: their equivalents in seconds are
# mlxcel_time_to_first_token_seconds and mlxcel_request_inter_token_latency_seconds.
LEGACY_UNIT_NAMES = frozenset({"mlxcel_request_ttft_ms", "mlxcel_request_decode_tok_s"})

# vLLM's latency histograms, in seconds, by model (vLLM's bucket edges, from 1 ms to minutes).
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_GAP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TTFT_SECONDS = Histogram(
    "mlxcel_time_to_first_token_seconds",
    "Time from the router's admission to the first generated token.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
QUEUE_SECONDS = Histogram(
    "mlxcel_request_queue_time_seconds",
    "Time from the router's admission to a worker starting the request.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
PREFILL_SECONDS = Histogram(
    "mlxcel_request_prefill_time_seconds",
    "Time from a worker starting the request to its first generated token.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_SECONDS = Histogram(
    "mlxcel_request_inter_token_latency_seconds",
    "A request's mean time between generated tokens after the first, as Redis stored them.",
    ["model_name"],
    buckets=_TOKEN_GAP_BUCKETS,
)
E2E_SECONDS = Histogram(
    "mlxcel_e2e_request_latency_seconds",
    "Time from the router's admission to the request's last event.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
# Requests that finished, once each (n choices count one), by how: stop, length, tool_calls.
FINISH_REASONS = ("stop", "length", "tool_calls")
REQUEST_SUCCESS = Counter(
    "mlxcel_request_success",
    "Requests that finished, by the first choice's finish reason.",
    ["model_name", "finished_reason"],
)
LATENCY_HISTOGRAMS = (
    TTFT_SECONDS,
    QUEUE_SECONDS,
    PREFILL_SECONDS,
    INTER_TOKEN_SECONDS,
    E2E_SECONDS,
)

# Every HTTP response, by route (its path template) and status class (2xx, 4xx, 5xx).
HTTP_RESPONSES = Counter(
    "mlxcel_http_responses",
    "HTTP responses by route and status class.",
    ["route", "status_class"],
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


def init_labels(model: str) -> None:
    """Create every labelled series at 0 so dashboards see each outcome from the start (the
    latency series of the router's own model; another model's appear with its first request)."""
    for hist in LATENCY_HISTOGRAMS:
        hist.labels(model)
    for reason in FINISH_REASONS:
        REQUEST_SUCCESS.labels(model, reason).inc(0)
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


def scrape(path: Path | str, extra: Collector | None = None, *, legacy_units: bool = True) -> bytes:
    """The exposition text for `/metrics`: all router processes' files in multiprocess mode
    (else this process's registry: one that imported prometheus_client before the dir was set),
    plus `extra` (the pool's worker series); without `legacy_units`, less LEGACY_UNIT_NAMES."""
    registry = CollectorRegistry()
    source: Collector = REGISTRY
    if multiprocess_active():
        mark_dead_processes(path)
        source = multiprocess.MultiProcessCollector(None, path=str(path))
    registry.register(_Forward(source, frozenset() if legacy_units else LEGACY_UNIT_NAMES))
    if extra is not None:
        registry.register(extra)
    return generate_latest(registry)


class _Forward(Collector):
    """Another collector's families, less the ones named in `drop`."""

    def __init__(self, source: Collector, drop: frozenset[str]) -> None:
        self.source = source
        self.drop = drop

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name not in self.drop:
                yield family

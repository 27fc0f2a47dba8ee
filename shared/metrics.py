"""Every Prometheus metric of the pool, router and workers alike, declared once with its labels.

Names follow the spec (docs: prompt-cache.md, "Prometheus names"). prometheus_client appends
`_total` to counters itself, so `Counter("mlxcel_requests", ...)` is exposed as
`mlxcel_requests_total`.

Multiprocess mode: each process writes its own files under PROMETHEUS_MULTIPROC_DIR, which must be
set *before* prometheus_client is first imported (router.serve and the worker entry point do it).
This module imports neither mlx nor fastapi: both sides import it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)

from shared.reject import REJECT_REASONS

# --- prompt cache (worker) -----------------------------------------------------------------------
PROMPT_CACHE_HITS = Counter("mlxcel_prompt_cache_hits", "Prompt-cache lookups that matched.")
PROMPT_CACHE_MISSES = Counter("mlxcel_prompt_cache_misses", "Prompt-cache lookups that missed.")
PROMPT_CACHE_PREFIX_TOKENS_REUSED = Counter(
    "mlxcel_prompt_cache_prefix_tokens_reused", "Prompt tokens served from cached KV."
)
PROMPT_CACHE_EVICTIONS = Counter(
    "mlxcel_prompt_cache_evictions", "Prompt-cache entries evicted.", ["reason"]
)
# Gauges sum over live processes: a dead worker's cache no longer exists.
PROMPT_CACHE_BYTES = Gauge(
    "mlxcel_prompt_cache_bytes", "Bytes held by prompt-cache entries.", multiprocess_mode="livesum"
)
PROMPT_CACHE_ENTRIES = Gauge(
    "mlxcel_prompt_cache_entries", "Prompt-cache entries held.", multiprocess_mode="livesum"
)
PROMPT_CACHE_SNAPSHOT_HITS = Counter(
    "mlxcel_prompt_cache_snapshot_hits", "Snapshot lookups that matched."
)
PROMPT_CACHE_SNAPSHOT_MISSES = Counter(
    "mlxcel_prompt_cache_snapshot_misses", "Snapshot lookups that missed."
)
PROMPT_CACHE_SNAPSHOT_TOKENS_REUSED = Counter(
    "mlxcel_prompt_cache_snapshot_tokens_reused", "Prompt tokens served from restored snapshots."
)
PROMPT_CACHE_SNAPSHOT_EVICTIONS = Counter(
    "mlxcel_prompt_cache_snapshot_evictions", "Snapshots evicted.", ["reason"]
)
PROMPT_CACHE_REJECTS = Counter(
    "mlxcel_prompt_cache_reject", "Prompt-cache store/adopt rejects by reason.", ["reason"]
)

# --- server and batch ----------------------------------------------------------------------------
REQUESTS = Counter("mlxcel_requests", "Generation requests finished by workers.")
PROMPT_TOKENS = Counter("mlxcel_prompt_tokens", "Prompt tokens processed.")
COMPLETION_TOKENS = Counter("mlxcel_completion_tokens", "Completion tokens generated.")
# Set by a router process at scrape time; the most recent write wins across processes.
QUEUE_DEPTH = Gauge(
    "mlxcel_queue_depth", "Jobs waiting in the shared rq queue.", multiprocess_mode="mostrecent"
)
BATCH_CURRENT_SIZE = Gauge(
    "mlxcel_batch_current_size", "Sequences in running batches.", multiprocess_mode="livesum"
)
BATCH_PREFILL_TOKENS = Counter("mlxcel_batch_prefill_tokens", "Tokens prefilled in batches.")
BATCH_DECODE_TOKENS = Counter("mlxcel_batch_decode_tokens", "Tokens decoded in batches.")
BATCH_DECODE_STEPS = Counter("mlxcel_batch_decode_steps", "Batched decode steps run.")
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


# Routing (router side; outcomes as router/placement.lua names them).
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


def init_reject_labels() -> None:
    """Create every reject series at 0 so dashboards see all seven reasons from the start."""
    for reason in REJECT_REASONS:
        PROMPT_CACHE_REJECTS.labels(reason.value).inc(0)
    for outcome in ROUTING_OUTCOMES:
        ROUTING_DECISIONS.labels(outcome).inc(0)


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


def scrape(path: Path | str) -> bytes:
    """The exposition text for `/metrics`: all processes' files in multiprocess mode, else this
    process's registry (a process that imported prometheus_client before the dir was set)."""
    if not multiprocess_active():
        return generate_latest(REGISTRY)
    mark_dead_processes(path)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(path))
    return generate_latest(registry)

"""The workers' Prometheus series, served by the router from what every worker publishes to Redis.

Workers on any host write their counters (deltas, HINCRBY: they never go backwards, and a dead
worker's still count) and gauges into their Redis hashes each step; the router reads them all in
one script (router.pool_view.cache_stats.read_pool) at scrape time and exposes them under the spec's
names (../shared/spec/prompt-cache.md), summed over the pool, and a few per worker, labelled
`worker` (liveness, restarts, KV usage). So one scrape of any router covers a multi-host pool,
and no worker needs a port of its own. Every router serves the same pool-wide values: scrape one
router per pool, or aggregate across routers with `max`, not `sum`."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.cache_stats import COUNTER_FIELDS, GAUGE_FIELDS, WorkerCacheSnapshot, kv_usage
from shared.reject import REJECT_REASONS

_EVICTIONS = "Prompt-cache evictions."
# Counter field in the worker's counters hash -> (metric name without _total, help, label).
COUNTERS: dict[str, tuple[str, str, tuple[str, str] | None]] = {
    "hits": ("mlxcel_prompt_cache_hits", "Prompt-cache lookups that matched.", None),
    "misses": ("mlxcel_prompt_cache_misses", "Prompt-cache lookups that missed.", None),
    "prefix_tokens_reused": ("mlxcel_prompt_cache_prefix_tokens_reused",
                             "Prompt tokens served from the prompt cache.", None),
    "evictions_lru": ("mlxcel_prompt_cache_evictions", _EVICTIONS, ("reason", "lru")),
    "evictions_ttl": ("mlxcel_prompt_cache_evictions", _EVICTIONS, ("reason", "ttl")),
    "snapshot_hits": ("mlxcel_prompt_cache_snapshot_hits", "Snapshot lookups that matched.", None),
    "snapshot_misses": ("mlxcel_prompt_cache_snapshot_misses", "Snapshot lookups that missed.",
                        None),
    "snapshot_tokens_reused": ("mlxcel_prompt_cache_snapshot_tokens_reused",
                               "Prompt tokens restored from snapshots.", None),
    "snapshot_evictions_lru": ("mlxcel_prompt_cache_snapshot_evictions", "Snapshot evictions.",
                               ("reason", "lru")),
    "snapshot_evictions_ttl": ("mlxcel_prompt_cache_snapshot_evictions", "Snapshot evictions.",
                               ("reason", "ttl")),
    "checkpoint_lookups": ("mlxcel_prompt_cache_checkpoint_lookups",
                           "Snapshot-mode lookups (each may resume at a checkpoint).", None),
    "checkpoint_hits": ("mlxcel_prompt_cache_checkpoint_hits",
                        "Lookups that resumed at a prefill checkpoint.", None),
    "checkpoint_tokens_reused": ("mlxcel_prompt_cache_checkpoint_tokens_reused",
                                 "Prompt tokens restored from prefill checkpoints.", None),
    "checkpoint_inserts": ("mlxcel_prompt_cache_checkpoint_inserts",
                           "Prefill checkpoints kept.", None),
    "requests": ("mlxcel_requests", "Generation requests finished by workers.", None),
    "prompt_tokens": ("mlxcel_prompt_tokens", "Prompt tokens processed.", None),
    "completion_tokens": ("mlxcel_completion_tokens", "Completion tokens generated.", None),
    "batch_prefill_tokens": ("mlxcel_batch_prefill_tokens", "Tokens prefilled in batches.", None),
    "batch_decode_tokens": ("mlxcel_batch_decode_tokens", "Tokens decoded in batches.", None),
    "batch_decode_steps": ("mlxcel_batch_decode_steps", "Batched decode steps run.", None),
    **{
        r.stats_field: ("mlxcel_prompt_cache_reject", "Prompt-cache rejects by reason.",
                        ("reason", r.value))
        for r in REJECT_REASONS
    },
}  # fmt: skip
# vLLM's prefix-cache pair, in prompt tokens (their ratio is the token hit rate): counter field
# -> (metric name without _total, help). A prompt counts once however many choices share it.
PREFIX_CACHE: dict[str, tuple[str, str]] = {
    "prompt_tokens": (
        "mlxcel_prefix_cache_queries",
        "Prompt tokens looked up in the prompt cache (every prompt started, once per prompt).",
    ),
    "prompt_tokens_cached": (
        "mlxcel_prefix_cache_hits",
        "Prompt tokens served from the prompt cache (blocks, snapshots or checkpoints), of"
        " mlxcel_prefix_cache_queries_total.",
    ),
}
# Gauge field in the worker's info hash -> (metric name, help); summed over live workers.
GAUGES: dict[str, tuple[str, str]] = {
    "bytes": ("mlxcel_prompt_cache_bytes", "Bytes the prompt caches of live workers hold."),
    "entries": ("mlxcel_prompt_cache_entries", "Entries in the prompt caches of live workers."),
    "batch_current_size": ("mlxcel_batch_current_size", "Sequences decoding now, pool-wide."),
    "checkpoint_bytes": (
        "mlxcel_prompt_cache_checkpoint_bytes",
        "Bytes of prefill checkpoints in live workers' snapshot shelves.",
    ),
    "checkpoint_entries": (
        "mlxcel_prompt_cache_checkpoint_entries",
        "Prefill checkpoints in live workers' snapshot shelves.",
    ),
    "batch_kv_bytes": (
        "mlxcel_batch_kv_bytes",
        "Bytes of KV cache the running batches of live workers hold.",
    ),
}
WORKERS_ALIVE = "mlxcel_workers_alive"
# The KV usage (shared.cache_stats.kv_usage), pool-wide and per live worker with a budget.
KV_USAGE = "mlxcel_kv_cache_usage_perc"
WORKER_KV_USAGE = "mlxcel_worker_kv_cache_usage_perc"
_WORKER_KV_USAGE_HELP = (
    "KV-cache usage of a live worker, 0..1 (1 = full): the KV bytes it holds (its prompt cache's,"
    " plus its running batch's caches) over its prompt cache's byte budget"
    " (MLXCEL_PROMPT_CACHE_CAPACITY_BYTES, paged: at most the block budget; snapshot mode:"
    " MLXCEL_PROMPT_CACHE_SNAPSHOT_CAPACITY_BYTES), capped at 1."
)
_KV_USAGE_HELP = (
    "KV-cache usage of the pool, 0..1 (1 = full): its live workers' KV bytes, each capped at its"
    f" budget, over their budgets summed (a worker's terms as in {WORKER_KV_USAGE})."
)
# Per roster worker (dead ones too), labelled `worker`.
WORKER_UP = "mlxcel_worker_up"
WORKER_RESTARTS = "mlxcel_worker_restarts"  # _total
# Every family name this module exposes (the Grafana dashboard test reads it).
FAMILY_NAMES = frozenset(
    {n for n, _, _ in COUNTERS.values()}
    | {n for n, _ in PREFIX_CACHE.values()}
    | {n for n, _ in GAUGES.values()}
    | {WORKERS_ALIVE, KV_USAGE, WORKER_KV_USAGE, WORKER_UP, WORKER_RESTARTS}
)

_COUNTER_INDEX = {f: COUNTER_FIELDS.index(f) for f in (*COUNTERS, *PREFIX_CACHE)}
_GAUGE_INDEX = {f: len(COUNTER_FIELDS) + GAUGE_FIELDS.index(f) for f in GAUGES}


def pool_families(workers: list[WorkerCacheSnapshot]) -> list[Metric]:
    """The pool-wide families: counters over every worker ever seen, gauges over live ones."""
    families: dict[str, CounterMetricFamily] = {}
    for field, (name, doc, label) in COUNTERS.items():
        fam = families.get(name)
        if fam is None:
            labels = [label[0]] if label else []
            fam = families[name] = CounterMetricFamily(name, doc, labels=labels)
        total = sum(w.numbers[_COUNTER_INDEX[field]] for w in workers)
        fam.add_metric([label[1]] if label else [], total)
    out: list[Metric] = list(families.values())
    for field, (name, doc) in PREFIX_CACHE.items():
        total = sum(w.numbers[_COUNTER_INDEX[field]] for w in workers)
        out.append(CounterMetricFamily(name, doc, value=total))
    live = [w for w in workers if w.alive]
    for field, (name, doc) in GAUGES.items():
        out.append(
            GaugeMetricFamily(name, doc, value=sum(w.numbers[_GAUGE_INDEX[field]] for w in live))
        )
    out.append(GaugeMetricFamily(WORKERS_ALIVE, "Workers with a fresh heartbeat.", value=len(live)))
    out.extend(_kv_usage(live))
    out.extend(_per_worker(workers))
    return out


def _kv_usage(live: list[WorkerCacheSnapshot]) -> list[Metric]:
    """Each live worker's KV usage, and the pool's: their budgets' weighted mean (each worker's
    bytes capped at its budget, so one full worker reads as full, not as spare room elsewhere
    used up). A worker with no budget (prompt cache off, embeddings) is in neither."""
    terms = [(w.worker_id, *w.kv_held_and_budget) for w in live]
    terms = [(wid, min(held, budget), budget) for wid, held, budget in terms if budget > 0]
    pool = GaugeMetricFamily(
        KV_USAGE, _KV_USAGE_HELP, value=kv_usage(sum(t[1] for t in terms), sum(t[2] for t in terms))
    )
    each = GaugeMetricFamily(WORKER_KV_USAGE, _WORKER_KV_USAGE_HELP, labels=["worker"])
    for wid, held, budget in terms:
        each.add_metric([wid], kv_usage(held, budget))
    return [pool, each]


def _per_worker(workers: list[WorkerCacheSnapshot]) -> list[Metric]:
    """Every roster worker's liveness and restart count, labelled by worker id: a worker killed
    and restarted between two scrapes leaves mlxcel_workers_alive as it was (and its up series
    too, unless its heartbeat lapsed in between, shared.liveness); its restart count shows it."""
    up = GaugeMetricFamily(
        WORKER_UP,
        "1 while the worker's heartbeat is fresh, else 0 (every worker that has registered).",
        labels=["worker"],
    )
    restarts = CounterMetricFamily(
        WORKER_RESTARTS,
        "Times a supervisor started the worker again after it exited.",
        labels=["worker"],
    )
    for w in workers:
        up.add_metric([w.worker_id], 1 if w.alive else 0)
        restarts.add_metric([w.worker_id], w.restarts)
    return [up, restarts]


class PoolCollector(Collector):
    """A one-scrape collector over families computed beforehand (the read is async)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families

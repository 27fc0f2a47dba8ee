"""Applies the drained counter deltas and the gauges to Prometheus (multiprocess files).

Called by the loop once per step with the same deltas it ships to Redis, so the two agree and the
decode path itself never touches Prometheus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared import metrics as m
from shared.reject import REJECT_REASONS


def _counter_table() -> dict[str, Callable[[int], None]]:
    table: dict[str, Callable[[int], None]] = {
        "hits": m.PROMPT_CACHE_HITS.inc,
        "misses": m.PROMPT_CACHE_MISSES.inc,
        "prefix_tokens_reused": m.PROMPT_CACHE_PREFIX_TOKENS_REUSED.inc,
        "evictions_lru": m.PROMPT_CACHE_EVICTIONS.labels("lru").inc,
        "evictions_ttl": m.PROMPT_CACHE_EVICTIONS.labels("ttl").inc,
        "snapshot_hits": m.PROMPT_CACHE_SNAPSHOT_HITS.inc,
        "snapshot_misses": m.PROMPT_CACHE_SNAPSHOT_MISSES.inc,
        "snapshot_tokens_reused": m.PROMPT_CACHE_SNAPSHOT_TOKENS_REUSED.inc,
        "snapshot_evictions_lru": m.PROMPT_CACHE_SNAPSHOT_EVICTIONS.labels("lru").inc,
        "snapshot_evictions_ttl": m.PROMPT_CACHE_SNAPSHOT_EVICTIONS.labels("ttl").inc,
        "requests": m.REQUESTS.inc,
        "prompt_tokens": m.PROMPT_TOKENS.inc,
        "completion_tokens": m.COMPLETION_TOKENS.inc,
        "batch_prefill_tokens": m.BATCH_PREFILL_TOKENS.inc,
        "batch_decode_tokens": m.BATCH_DECODE_TOKENS.inc,
        "batch_decode_steps": m.BATCH_DECODE_STEPS.inc,
    }
    for reason in REJECT_REASONS:
        table[reason.stats_field] = m.PROMPT_CACHE_REJECTS.labels(reason.value).inc
    return table


class MetricsSink:
    def __init__(self) -> None:
        m.init_reject_labels()
        for reason in ("lru", "ttl"):
            m.PROMPT_CACHE_EVICTIONS.labels(reason).inc(0)
            m.PROMPT_CACHE_SNAPSHOT_EVICTIONS.labels(reason).inc(0)
        self._table = _counter_table()
        self._batch_size = -1

    def apply(self, deltas: dict[str, int], batch_size: int) -> None:
        for name, delta in deltas.items():
            inc = self._table.get(name)
            if inc is not None and delta > 0:
                inc(delta)
        if batch_size != self._batch_size:
            self._batch_size = batch_size
            m.BATCH_CURRENT_SIZE.set(batch_size)

    def set_gauges(self, gauges: dict[str, Any]) -> None:
        m.PROMPT_CACHE_BYTES.set(int(gauges.get("bytes", 0) or 0))
        m.PROMPT_CACHE_ENTRIES.set(int(gauges.get("entries", 0) or 0))

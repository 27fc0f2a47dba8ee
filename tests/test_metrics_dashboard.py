"""The Grafana dashboard reads right with one router scraped or many: a worker series (the same
pool-wide or per-worker value from every router) is aggregated with `max`, a router's own series
(each process counts its own) with `sum`, and every range is `$__rate_interval` (a fixed range
shorter than four scrape intervals draws nothing). Static: the JSON against the code's names."""

from __future__ import annotations

import json
import re

from router import metrics as router_metrics
from router.pool_view.pool_metrics import FAMILY_NAMES
from router.routes.metrics import QUEUE_DEPTH
from tests.test_metrics_from_start import DASHBOARD, exprs, queried_names

# Served from Redis, the same from every router: aggregated with max.
WORKER_FAMILIES = FAMILY_NAMES | {QUEUE_DEPTH}
# Declared in router/metrics.py, counted per router process: aggregated with sum.
ROUTER_FAMILIES = frozenset(
    m._name for m in vars(router_metrics).values() if hasattr(m, "_name") and hasattr(m, "_type")
)
AGGREGATIONS = frozenset({"sum", "max", "min", "avg", "count", "topk", "bottomk", "quantile"})
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
_OPEN = re.compile(r"(?:([A-Za-z_]\w*)\s*(?:(?:by|without)\s*\([^()]*\)\s*)?)?\($")


def family(sample: str) -> str:
    for suffix in _SUFFIXES:
        if sample.endswith(suffix) and sample.removesuffix(suffix) in (
            WORKER_FAMILIES | ROUTER_FAMILIES
        ):
            return sample.removesuffix(suffix)
    return sample


def aggregations(expr: str) -> list[tuple[str, str]]:
    """Each series name in `expr`, in order, with the innermost aggregation operator around it
    ("" for none): `max by (worker) (increase(mlxcel_x_total[5m]))` -> [("mlxcel_x_total",
    "max")]."""
    out: list[tuple[str, str]] = []
    stack: list[str] = []
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == "(":
            m = _OPEN.search(expr[: i + 1])
            before = expr[:i].rstrip()
            if before.endswith(("by", "without")) and not before.endswith("_by"):
                stack.append("")  # a grouping clause's own parentheses
            else:
                stack.append(m.group(1) or "" if m else "")
        elif ch == ")":
            stack.pop()
        elif m := re.match(r"mlxcel_[A-Za-z0-9_:]*", expr[i:]):
            if i == 0 or not re.match(r"[A-Za-z0-9_:]", expr[i - 1]):
                aggs = [f for f in reversed(stack) if f in AGGREGATIONS]
                out.append((m.group(0), aggs[0] if aggs else ""))
            i += len(m.group(0))
            continue
        i += 1
    return out


def test_aggregations_reads_promql() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le, model_name) (rate(mlxcel_a_bucket[$__rate_interval])))"
        " / clamp_min(max(rate(mlxcel_b_total[$__rate_interval])), 1e-9)"
        " + max by (worker) (increase(mlxcel_c_total[$__rate_interval])) + mlxcel_d"
    )
    assert aggregations(expr) == [
        ("mlxcel_a_bucket", "sum"),
        ("mlxcel_b_total", "max"),
        ("mlxcel_c_total", "max"),
        ("mlxcel_d", ""),
    ]


def test_worker_series_take_max_and_router_series_sum_over_rate_interval() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert {"mlxcel_kv_cache_usage_perc", "mlxcel_worker_up", "mlxcel_batch_current_size"} <= (
        WORKER_FAMILIES
    )
    assert {"mlxcel_time_to_first_token_seconds", "mlxcel_http_responses"} <= ROUTER_FAMILIES
    seen: set[str] = set()
    for expr in exprs(dashboard):
        for rng in re.findall(r"\[([^\]]*)\]", expr):
            assert rng == "$__rate_interval", expr
        found = aggregations(expr)
        for sample, agg in found:
            fam = family(sample)
            seen.add(fam)
            if fam in WORKER_FAMILIES:
                assert agg == "max", (expr, sample)
            else:
                assert fam in ROUTER_FAMILIES, (expr, sample)
                assert agg == "sum", (expr, sample)
        assert queried_names(expr) == {sample for sample, _ in found}, expr
    # A panel for each series an operator asked for.
    assert {
        "mlxcel_kv_cache_usage_perc",
        "mlxcel_worker_kv_cache_usage_perc",
        "mlxcel_prefix_cache_hits",
        "mlxcel_prefix_cache_queries",
        "mlxcel_worker_restarts",
        "mlxcel_worker_up",
        "mlxcel_batch_kv_bytes",
        "mlxcel_request_success",
        *(h._name for h in router_metrics.LATENCY_HISTOGRAMS),
    } <= seen
    # Every panel at its own place on the grid.
    cells = [
        (x, y)
        for p in dashboard["panels"]
        for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
        for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))

"""Every series the Grafana dashboard reads exists from the first scrape of a fresh pool (real
Redis, real worker, real router processes), before any request: each label set at 0, per-worker
series as soon as the worker is registered. A series that appears only with traffic shows "No
data", and `rate()` over it misses its first increments."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import ADMISSION_REASONS, FINISH_REASONS, LATENCY_HISTOGRAMS, ROUTING_OUTCOMES
from shared import keys
from shared.reject import REJECT_REASONS
from tests.pool_fixture import running_pool
from tests.streams import TINY_MODEL

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "docs" / "grafana-dashboard.json"
PLACEMENT = REPO / "router" / "placement" / "placement.lua"

# PromQL string literals (a label value may spell a metric-like name: it is not one).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=~?\s*"(mlxcel_[A-Za-z0-9_:]*)"')
_NAME = re.compile(r"(?<![A-Za-z0-9_:])mlxcel_[A-Za-z0-9_:]*")


def queried_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers starting with `mlxcel_` outside
    string literals, and `{__name__="mlxcel_..."}` matchers."""
    return set(_NAME_MATCHER.findall(expr)) | set(_NAME.findall(_STRING.sub('""', expr)))


def exprs(node: Any) -> Iterator[str]:
    """Every `expr` in the dashboard JSON, however deep (rows nest panels)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from exprs(item)


def test_queried_names_parses_promql() -> None:
    expr = (
        'sum by (le) (rate(mlxcel_a_bucket{job="mlxcel_pool"}[5m])) / foo_mlxcel_b '
        '+ on(worker) mlxcel_c:ratio + {__name__="mlxcel_d_total"} - max(mlxcel_e)'
    )
    assert queried_names(expr) == {
        "mlxcel_a_bucket",
        "mlxcel_c:ratio",
        "mlxcel_d_total",
        "mlxcel_e",
    }


def _placement_words(pattern: str) -> set[str]:
    code = "\n".join(line.split("--", 1)[0] for line in PLACEMENT.read_text().splitlines())
    return set(re.findall(pattern, code))


def test_every_dashboard_series_exists_at_zero_before_any_request(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    queried = set().union(*map(queried_names, exprs(json.loads(DASHBOARD.read_text()))))
    assert {"mlxcel_routing_predicted_tokens_total", "mlxcel_request_ttft_ms_bucket"} <= queried

    with running_pool(tiny_model_dir, tmp_path) as pool:
        text = httpx.get(f"{pool.url}/metrics", timeout=10).text  # before any generation request
        roster = {
            m.decode() for m in redis.Redis.from_url(pool.redis_url).smembers(keys.workers_roster())
        }
    assert roster == {"w1"}

    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name for f in families.values() for s in f.samples}
    assert sorted(queried - samples) == []
    # A histogram is there whole: buckets, sum and count.
    for fam in families.values():
        if fam.type == "histogram" and any(n.startswith(fam.name + "_") for n in queried):
            assert {fam.name + s for s in ("_bucket", "_sum", "_count")} <= samples, fam.name

    def labelled(sample: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in families.values():
            for s in fam.samples:
                if s.name == sample:
                    out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out

    # Each label set the dashboard sums by, at 0: reject reasons, routing outcomes (as
    # placement.lua names them), admission refusal reasons (as it returns them), evictions.
    outcomes = _placement_words(r"outcome(?:, cost)? = [^\n]*?'(\w+)'")
    refusals = _placement_words(r"return \{0, '(\w+)'")
    assert outcomes == set(ROUTING_OUTCOMES) and refusals == set(ADMISSION_REASONS)
    expected = {
        ("mlxcel_prompt_cache_reject_total", "reason"): {r.value for r in REJECT_REASONS},
        ("mlxcel_routing_decisions_total", "outcome"): outcomes,
        ("mlxcel_admission_refused_total", "reason"): refusals,
        ("mlxcel_prompt_cache_evictions_total", "reason"): {"lru", "ttl"},
        ("mlxcel_routing_predicted_tokens_total", "worker"): roster,
        ("mlxcel_routing_reused_tokens_total", "worker"): roster,
    }
    assert len(expected[("mlxcel_prompt_cache_reject_total", "reason")]) == 7
    for (sample, label), values in expected.items():
        assert labelled(sample, label) == dict.fromkeys(values, 0.0), sample
    for hist in ("mlxcel_request_ttft_ms", "mlxcel_request_decode_tok_s"):
        (count,) = [s.value for s in families[hist].samples if s.name == f"{hist}_count"]
        assert count == 0.0, hist
    # vLLM's latency histograms, in seconds, and the finish-reason split: the router's own
    # model's series exist at 0 before its first request.
    model = {"model_name": TINY_MODEL}
    for hist in LATENCY_HISTOGRAMS:
        name = hist._name
        (count,) = [
            s.value
            for s in families[name].samples
            if s.name == f"{name}_count" and s.labels == model
        ]
        assert count == 0.0, name
    assert labelled("mlxcel_request_success_total", "finished_reason") == dict.fromkeys(
        FINISH_REASONS, 0.0
    )
    (alive,) = [s.value for s in families["mlxcel_workers_alive"].samples]
    assert alive == 1.0
    # Per worker from its registration: up, no restart yet, its KV usage (a cache, no request).
    assert labelled("mlxcel_worker_up", "worker") == dict.fromkeys(roster, 1.0)
    assert labelled("mlxcel_worker_restarts_total", "worker") == dict.fromkeys(roster, 0.0)
    assert labelled("mlxcel_worker_kv_cache_usage_perc", "worker") == dict.fromkeys(roster, 0.0)
    for name in ("mlxcel_prefix_cache_queries_total", "mlxcel_prefix_cache_hits_total"):
        assert [s.value for s in families[name.removesuffix("_total")].samples] == [0.0], name


def _samples(pool: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{pool.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_latency_histograms_observe_each_choice_and_count_each_request_once(
    shared_pool: Any,
) -> None:
    """A two-choice completion: every latency histogram of its model observes both choices in
    seconds (queue, prefill, first token, end to end, the mean gap between tokens), and the
    request counts once, under its first choice's finish reason."""
    before = _samples(shared_pool)
    body = {"model": TINY_MODEL, "prompt": "Once upon", "max_tokens": 4, "n": 2, "temperature": 0}
    resp = httpx.post(f"{shared_pool.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    reasons = [c["finish_reason"] for c in resp.json()["choices"]]
    after = _samples(shared_pool)

    model = {"model_name": TINY_MODEL}

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": TINY_MODEL, **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    for hist in LATENCY_HISTOGRAMS:
        assert delta(f"{hist._name}_count") == 2, hist._name
        assert delta(f"{hist._name}_sum") > 0, hist._name
        # In seconds, from 1 ms up (vLLM's edges): the all-inclusive bucket holds both.
        assert delta(f"{hist._name}_bucket", le="+Inf") == 2, hist._name
        assert (f"{hist._name}_bucket", tuple(sorted({"le": "0.001", **model}.items()))) in after
    assert delta("mlxcel_request_success_total", finished_reason=reasons[0]) == 1
    assert (
        sum(delta("mlxcel_request_success_total", finished_reason=r) for r in FINISH_REASONS) == 1
    )


def test_every_response_is_counted_by_route_and_status_class(shared_pool: Any) -> None:
    """A 200, a 400 and a 404 on a served route, and an unknown path: each under its route's
    path template (or `other`) and its status class."""
    before = _samples(shared_pool)
    url = shared_pool.url
    ok = {"model": TINY_MODEL, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=ok, timeout=60).status_code == 200
    bad = {**ok, "max_tokens": -1}
    assert httpx.post(f"{url}/v1/completions", json=bad, timeout=60).status_code == 400
    assert httpx.get(f"{url}/v1/models/no-such-model", timeout=10).status_code == 404
    assert httpx.get(f"{url}/no/such/path", timeout=10).status_code == 404
    after = _samples(shared_pool)

    def delta(route: str, status_class: str) -> float:
        key = (
            "mlxcel_http_responses_total",
            (("route", route), ("status_class", status_class)),
        )
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("/v1/completions", "2xx") == 1
    assert delta("/v1/completions", "4xx") == 1
    assert delta("/v1/models/{model_id:path}", "4xx") == 1
    assert delta("other", "4xx") == 1

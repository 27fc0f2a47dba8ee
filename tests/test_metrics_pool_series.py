"""The worker series a vLLM operator reads, over real HTTP from a real router and a real Redis:
liveness and restarts per worker (the supervisors' restart counts read in the same scrape-time
script as the rest), KV-cache usage per worker and pool-wide, and the prefix-cache pair in prompt
tokens, counted once per prompt and per request however many choices it has."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue

from shared import keys
from tests.pool_fixture import wait_for
from tests.streams import TINY_MODEL
from tests.test_router_validation import RouterServer, router_settings
from worker.broker.presence import WorkerPresence

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def by_worker(samples: Samples, name: str) -> dict[str, float]:
    return {dict(labels)["worker"]: v for (n, labels), v in samples.items() if n == name}


@pytest.fixture(scope="module")
def router(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_server
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("router-series")
    server = RouterServer(router_settings(redis_server.url, tiny_model_dir, tmp)).start()
    yield server.url
    server.stop()


def arrive(r: redis.Redis, wid: str, gauges: dict[str, Any]) -> WorkerPresence:
    """Register a worker as a worker process does (its liveness hash, the roster, rq's record)."""
    queue = Queue(keys.worker_queue_name(wid), connection=r)
    presence = WorkerPresence(r, wid, [queue], {"worker_id": wid, "model": TINY_MODEL})
    presence.arrive(gauges)
    return presence


def test_each_worker_has_its_liveness_restarts_and_kv_usage(router: str, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    # w1 holds 300 cached bytes and 100 in its batch of a 1000-byte budget; w2 has outgrown
    # its budget (its batch alone would); w3 has gone; e1 has no KV budget (no prompt cache).
    arrive(r, "w1", {"bytes": 300, "batch_kv_bytes": 100, "kv_budget_bytes": 1000})
    arrive(r, "w2", {"snapshot_bytes": 900, "batch_kv_bytes": 400, "kv_budget_bytes": 1000})
    arrive(r, "w3", {"bytes": 50, "kv_budget_bytes": 1000}).leave()
    arrive(r, "e1", {"enabled": "0", "storage_mode": "none"})
    # What each host's supervisor does when it starts a worker again after an exit.
    r.hincrby(keys.supervisor_restarts(), "w3", 2)
    r.hincrby(keys.supervisor_restarts(), "w1", 1)

    first = scrape(router)
    assert by_worker(first, "mlxcel_worker_up") == {"w1": 1, "w2": 1, "w3": 0, "e1": 1}
    assert by_worker(first, "mlxcel_worker_restarts_total") == {"w1": 1, "w2": 0, "w3": 2, "e1": 0}
    assert first[("mlxcel_workers_alive", ())] == 3
    assert by_worker(first, "mlxcel_worker_kv_cache_usage_perc") == {"w1": 0.4, "w2": 1.0}
    # The budgets' weighted mean, each worker's bytes capped at its budget: (400 + 1000) / 2000.
    assert first[("mlxcel_kv_cache_usage_perc", ())] == pytest.approx(0.7)
    assert first[("mlxcel_batch_kv_bytes", ())] == 500  # live workers only

    r.hincrby(keys.supervisor_restarts(), "w3", 1)
    assert by_worker(scrape(router), "mlxcel_worker_restarts_total")["w3"] == 3


def test_no_live_worker_with_a_budget_reads_an_empty_pool(router: str, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    arrive(r, "e1", {"enabled": "0", "storage_mode": "none"})
    samples = scrape(router)
    assert samples[("mlxcel_kv_cache_usage_perc", ())] == 0
    assert by_worker(samples, "mlxcel_worker_kv_cache_usage_perc") == {}
    assert by_worker(samples, "mlxcel_worker_up") == {"e1": 1}
    assert by_worker(samples, "mlxcel_worker_restarts_total") == {"e1": 0}


def test_prefix_cache_tokens_count_once_per_prompt(shared_pool: Any) -> None:
    """Two two-choice completions of one prompt: the second's cached prefix is a hit. Each
    request counts once, its prompt's tokens once, and its hits are what its usage says."""
    prompt = [(29 + i * 7) % 700 + 11 for i in range(70)]
    body = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": 3, "n": 2, "temperature": 0}
    before = scrape(shared_pool.url)
    usage = []
    for _ in range(2):
        resp = httpx.post(f"{shared_pool.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        usage.append(resp.json()["usage"])
    cached = usage[1]["prompt_tokens_details"]["cached_tokens"]
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0 and cached > 0

    def delta(after: Samples, name: str) -> float:
        return after[(name, ())] - before[(name, ())]

    def landed() -> Samples | None:
        s = scrape(shared_pool.url)
        done = delta(s, "mlxcel_requests_total") >= 2
        return s if done and s[("mlxcel_kv_cache_usage_perc", ())] > 0 else None

    # Counters go out with each step, gauges with the loop's once-a-second beat: wait for both
    # requests' counters and for a beat since the cache took their KV.
    after = wait_for(landed, 10, "the counters of two requests and the cache's bytes")
    assert delta(after, "mlxcel_requests_total") == 2
    assert delta(after, "mlxcel_prefix_cache_queries_total") == 2 * len(prompt)
    assert delta(after, "mlxcel_prompt_tokens_total") == 2 * len(prompt)
    assert delta(after, "mlxcel_prefix_cache_hits_total") == cached
    assert after[("mlxcel_kv_cache_usage_perc", ())] <= 1
    assert set(by_worker(after, "mlxcel_worker_kv_cache_usage_perc")) == {"w1"}
    # Workers another module added to the shared pool and stopped stay listed: down (0), with
    # their restart counts.
    up = {w: v for w, v in by_worker(after, "mlxcel_worker_up").items() if v}
    assert up == {"w1": 1}
    assert by_worker(after, "mlxcel_worker_restarts_total")["w1"] == 0

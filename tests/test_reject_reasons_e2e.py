"""Each of the seven prompt-cache reject reasons, made to happen for real in a worker, and seen
everywhere an operator looks: the worker's trace line, its Redis hashes, the router's merged
`/v1/cache/stats` and the Prometheus exposition on `/metrics`.

Five reasons come from ordinary requests through the router, with the worker configured to
provoke them. Two cannot come from any request (a worker's storage mode is fixed at start, and a
healthy store never holds KV that cannot be cut back): for `mode_mismatch` and
`layout_constraints` a driver (tests/drivers/inject_worker.py) builds the real worker, hands its
prompt cache one such entry, and a real request then meets it in the scheduler's adopt path.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from mlxcel_pool.supervisor import Pool
from shared import keys
from shared.reject import REJECT_REASONS
from tests.conftest import WorkerProcess
from tests.pool_fixture import TINY_MODEL, complete_tokens, running_pool, wait_for
from tests.streams import enqueue, read_events

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

MODEL = TINY_MODEL
TRACE = {"MLXCEL_APC_TRACE": "1"}


@pytest.fixture(scope="module")
def routers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """Redis and the routers, with no worker: every reject reason is a worker's setting, so each
    test starts its own worker, configured to provoke its reasons, against the same routers."""
    with running_pool(tiny_model_dir, tmp_path_factory.mktemp("reject-pool"), workers=0) as pool:
        yield pool


@pytest.fixture(scope="module")
def started_keys(routers: Pool) -> frozenset[bytes]:
    """The keys the routers wrote at their start, before any worker or request."""
    return frozenset(redis.Redis.from_url(routers.redis_url).scan_iter())


@pytest.fixture
def pool(routers: Pool, started_keys: frozenset[bytes]) -> Pool:
    """The routers' pool as it was just after it started: every key an earlier test's workers
    and requests left (rosters, counters, queues, routing state) is dropped, so counts start at
    zero whatever ran before."""
    r = redis.Redis.from_url(routers.redis_url)
    left = [k for k in r.scan_iter() if k not in started_keys]
    if left:
        r.delete(*left)
    return routers


def start_w1(
    pool: Pool,
    start_worker: Callable[..., WorkerProcess],
    env: dict[str, str],
    argv: list[str] | None = None,
) -> WorkerProcess:
    """Worker `w1` of the tiny model, tracing its cache events, with `env` on top."""
    env = {**TRACE, "PROMETHEUS_MULTIPROC_DIR": str(pool.settings.multiproc_dir), **env}
    return start_worker(pool.redis_url, "w1", env=env, argv=argv)


def full_log(worker: WorkerProcess) -> str:
    """The worker's whole log (WorkerProcess.log is its tail): every trace line is counted."""
    return worker.log_path.read_text(errors="replace")


def toks(n: int, start: int = 10) -> list[int]:
    return [start + (i * 7) % 900 for i in range(n)]


def complete(pool, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    return complete_tokens(pool, prompt, max_tokens, MODEL).json()


def reject_samples(pool) -> dict[str, float]:
    text = httpx.get(f"{pool.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "mlxcel_prompt_cache_reject":
            for s in fam.samples:
                if s.name == "mlxcel_prompt_cache_reject_total":
                    out[s.labels["reason"]] = out.get(s.labels["reason"], 0) + s.value
    return out


def stats(pool) -> dict[str, Any]:
    resp = httpx.get(f"{pool.url}/v1/cache/stats", timeout=10)
    assert resp.status_code == 200
    return resp.json()


def assert_rejects_everywhere(
    pool, worker_log: str, worker_id: str, expected: dict[str, int], last: str
) -> None:
    """The counts in every view an operator has, and the last reject."""
    want = {r.value: expected.get(r.value, 0) for r in REJECT_REASONS}
    r = redis.Redis.from_url(pool.redis_url, decode_responses=True)

    def redis_counts() -> dict[str, int]:
        h = r.hgetall(keys.worker_cache_counters(worker_id))
        return {x.value: int(h.get(x.stats_field, 0)) for x in REJECT_REASONS}

    wait_for(lambda: redis_counts() == want, 10, f"Redis counters {want}")
    counters = r.hgetall(keys.worker_cache_counters(worker_id))
    assert counters["last_reject_reason"] == last and int(counters["last_reject_at_unix_ms"]) > 0

    merged = stats(pool)
    assert {x.value: merged[x.stats_field] for x in REJECT_REASONS} == want
    assert merged["last_reject_reason"] == last
    assert merged["last_reject_worker_id"] == worker_id
    assert merged["workers"][worker_id][f"reject_{last}"] == want[last]

    samples = wait_for(
        lambda: (s := reject_samples(pool)) and s == want and s, 10, f"Prometheus samples {want}"
    )
    assert set(samples) == {x.value for x in REJECT_REASONS}  # all seven labels present

    for reason, n in want.items():
        lines = [ln for ln in worker_log.splitlines() if f"apc_event=reject reason={reason} " in ln]
        assert len(lines) == n, (reason, lines)
        assert all(f"worker={worker_id}" in ln for ln in lines)


def test_disabled(pool: Pool, start_worker) -> None:
    w = start_w1(pool, start_worker, {"MLXCEL_PROMPT_CACHE_ENABLED": "false"})
    out = complete(pool, toks(40))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for(lambda: "reason=disabled" in full_log(w), 10, "trace line")
    assert_rejects_everywhere(pool, full_log(w), "w1", {"disabled": 1}, "disabled")
    s = stats(pool)  # same shape when disabled: zeros and limits
    assert s["enabled"] is False and s["entries"] == 0 and s["hits"] == 0
    assert s["capacity_bytes"] == 2 * 1024**3 and s["max_entries"] == 1024


def test_prefix_too_short_then_oversized(pool: Pool, start_worker) -> None:
    env = {
        "MLXCEL_SERVER_DECODE_STORAGE": "dense",
        "MLXCEL_PROMPT_CACHE_CAPACITY_BYTES": "4096",
        "MLXCEL_PROMPT_CACHE_MIN_PREFIX": "32",
    }
    w = start_w1(pool, start_worker, env)
    complete(pool, toks(10))  # 14 tokens < 32: declined before any KV is detached
    complete(pool, toks(60))  # 64 tokens of KV is far over a 4 KiB budget
    wait_for(lambda: "reason=oversized" in full_log(w), 10, "trace line")
    assert_rejects_everywhere(
        pool, full_log(w), "w1", {"prefix_too_short": 1, "oversized": 1}, "oversized"
    )
    assert stats(pool)["rejections_oversized"] == 1
    assert stats(pool)["entries"] == 0


def test_paged_empty_set_and_block_boundary_floor(pool: Pool, start_worker) -> None:
    env = {"MLXCEL_SERVER_DECODE_STORAGE": "paged", "MLXCEL_PROMPT_CACHE_MIN_PREFIX": "16"}
    w = start_w1(pool, start_worker, env)
    complete(pool, toks(10), max_tokens=10)  # 20 tokens: no whole 32-token block to keep
    wait_for(lambda: "reason=empty_set" in full_log(w), 10, "empty_set")
    base = toks(64, start=100)
    complete(pool, base)  # stored: two whole blocks
    # Shares 20 tokens: APC keeps one 16-token block (>= 16), paged flooring leaves 0 < 16.
    out = complete(pool, base[:20] + toks(12, start=500))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for(lambda: "reason=block_boundary_floor" in full_log(w), 10, "floor")
    assert_rejects_everywhere(
        pool,
        full_log(w),
        "w1",
        {"empty_set": 1, "block_boundary_floor": 1},
        "block_boundary_floor",
    )


@pytest.mark.parametrize(
    ("scenario", "storage", "reason"),
    [
        ("dense_in_paged", "paged", "mode_mismatch"),
        ("corrupt_dense", "dense", "layout_constraints"),
    ],
)
def test_injected_entry_rejects(
    pool: Pool, start_worker, scenario: str, storage: str, reason: str
) -> None:
    prompt = toks(64, start=200)
    w = start_w1(
        pool,
        start_worker,
        {"MLXCEL_SERVER_DECODE_STORAGE": storage},
        argv=["tests.drivers.inject_worker", scenario, json.dumps(prompt)],
    )
    out = complete(pool, prompt + [7])  # the adopt path meets the injected entry
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for(lambda: f"reason={reason}" in full_log(w), 10, "trace line")
    assert_rejects_everywhere(pool, full_log(w), "w1", {reason: 1}, reason)


@pytest.fixture
def spawn_worker(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Any]:
    """Like start_worker, but it returns before the worker is ready: workers spawned together
    load the model at the same time. Each is stopped when the test ends."""
    spawned: list[WorkerProcess] = []

    def _spawn(redis_url: str, worker_id: str, env: dict[str, str]) -> WorkerProcess:
        w = WorkerProcess(redis_url, tiny_model_dir, worker_id, tmp_path, env)
        spawned.append(w)
        return w

    yield _spawn
    for w in spawned:
        w.stop()


def test_two_workers_sum_and_survive_kill_and_restart(
    tiny_model_dir: Path, tmp_path: Path, start_worker, spawn_worker
) -> None:
    env = {
        **TRACE,
        "MLXCEL_SERVER_DECODE_STORAGE": "dense",
        "MLXCEL_PROMPT_CACHE_CAPACITY_BYTES": "4096",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
    }
    with running_pool(tiny_model_dir, tmp_path, workers=0) as pool:
        r = redis.Redis.from_url(pool.redis_url)
        w1 = spawn_worker(pool.redis_url, "w1", env)
        w2 = spawn_worker(pool.redis_url, "w2", env)
        w1.wait_ready()
        w2.wait_ready()
        # Each worker's own queue, so we know who records what.
        for _ in range(2):
            read_events(r, enqueue(r, toks(8), queue=keys.worker_queue_name("w1")))
        for _ in range(3):
            read_events(r, enqueue(r, toks(60), queue=keys.worker_queue_name("w2")))

        def totals() -> tuple[int, int]:
            s = stats(pool)
            return s["reject_prefix_too_short"], s["reject_oversized"]

        wait_for(lambda: totals() == (2, 3), 10, "merged sums")
        s = stats(pool)
        assert s["workers"]["w1"]["reject_prefix_too_short"] == 2
        assert s["workers"]["w2"]["reject_oversized"] == 3
        assert s["workers"]["w1"]["reject_oversized"] == 0

        w1.stop(signal.SIGKILL)  # dies without a goodbye: its counts must stay
        wait_for(lambda: not stats(pool)["workers"]["w1"]["alive"], 30, "w1 marked dead")
        assert totals() == (2, 3)
        assert reject_samples(pool)["prefix_too_short"] == 2  # its metrics files stay counted

        w1b = start_worker(pool.redis_url, "w1", env=env)  # same id comes back
        read_events(r, enqueue(r, toks(8), queue=keys.worker_queue_name("w1")))
        wait_for(lambda: totals() == (3, 3), 10, "totals after restart")
        assert stats(pool)["workers"]["w1"]["alive"] is True
        w1b.stop()
        w2.stop()
        assert totals() == (3, 3)

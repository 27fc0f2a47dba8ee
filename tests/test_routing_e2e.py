"""Cache-aware routing through a real pool of two workers and two router processes: requests that
share a prefix follow the worker holding it, and go elsewhere (still answered) once it evicts
the prefix, is saturated, loses its index, or dies. The decisions alone, on Redis, are in
tests/test_routing_ledger.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from router.relay.streams import WORKER_HEADER
from shared import keys
from shared.block_hash import BlockHasher, CacheNamespace, index_members
from tests.pool_fixture import TINY_MODEL, complete_tokens, running_pool, wait_for

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

MODEL = TINY_MODEL
WORKERS = ("w1", "w2")
# Three per worker: a burst of six the same prefix spreads over both.
PER_WORKER = 3


def toks(n: int, start: int) -> list[int]:
    return [start + (i * 7) % 300 for i in range(n)]


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    env = {"MLXCEL_MAX_INFLIGHT_PER_WORKER": str(PER_WORKER), "MLXCEL_STEAL_AFTER_MS": "300"}
    with running_pool(tiny_model_dir, tmp_path_factory.mktemp("routing"), workers=2, env=env) as p:
        p.r = redis.Redis.from_url(p.redis_url)
        wait_for(lambda: all(_alive(p, w) for w in WORKERS), 60, "both workers live")
        yield p


def _alive(pool, wid: str) -> bool:
    return pool.r.pttl(keys.worker_info(wid)) > (keys.LIVENESS_TTL_S - 5) * 1000


def complete(pool, prompt: list[int], max_tokens: int = 4) -> tuple[str, int]:
    """(the worker that served it, the prompt tokens it reused)."""
    resp = complete_tokens(pool, prompt, max_tokens, MODEL)
    return resp.headers[WORKER_HEADER], resp.json()["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def holds(r: redis.Redis, wid: str, prompt: list[int]) -> int:
    """How many of the prompt's leading blocks the worker's index in Redis lists."""
    epoch = r.hget(keys.worker_info(wid), "epoch")
    if epoch is None:  # not registered (yet, or again): it lists nothing
        return 0
    members = index_members(BlockHasher(16).chain(prompt, CacheNamespace(MODEL).seed()))
    held = r.smismember(keys.worker_blocks(wid, epoch.decode()), members)
    return next((i for i, h in enumerate(held) if not h), len(held))


def listed(r: redis.Redis, prompt: list[int]) -> set[str]:
    """The workers listed as holding the prompt's first block (the pool's holders set)."""
    first = index_members(BlockHasher(16).chain(prompt, CacheNamespace(MODEL).seed()))[0]
    return {w.decode() for w in r.smembers(keys.routing_holders(first.hex()))}


def _stats(pool) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in pool.r.hgetall(keys.routing_stats()).items()}


def _other(wid: str) -> str:
    return WORKERS[1 - WORKERS.index(wid)]


PREFIX = toks(96, 200)  # six blocks


def tail(k: int) -> list[int]:
    """A request's own 8 tokens after the prefix (k apart: every request differs)."""
    return [600 + (k * 11 + i) % 400 for i in range(8)]


def test_requests_sharing_a_prefix_follow_the_worker_that_holds_it(pool) -> None:
    holder, reused = complete(pool, PREFIX + tail(600))
    assert reused == 0
    # The finished sequence is in the holder's cache, and its index says so.
    wait_for(lambda: holds(pool.r, holder, PREFIX) == 6, 10, "the holder's index lists the prefix")
    assert holds(pool.r, _other(holder), PREFIX) == 0
    # It is listed under the prefix's first block, the one set a decision reads for it.
    assert listed(pool.r, PREFIX) == {holder}
    before = _stats(pool).get("decisions:cache", 0)
    for k in range(6):  # two router processes answer these in turn: both follow the index
        served, reused = complete(pool, PREFIX + tail(610 + 9 * k))
        assert served == holder
        assert reused >= 64, reused
    stats = _stats(pool)
    assert stats["decisions:cache"] - before == 6
    # What the router predicted and what the worker reused, side by side per worker.
    assert stats[f"predicted_tokens:{holder}"] > 0 and stats[f"reused_tokens:{holder}"] > 0


def test_a_hot_prefix_spreads_to_the_second_worker_under_load(pool) -> None:
    holder, _ = complete(pool, PREFIX + tail(700))

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=pool.url, timeout=60) as client:

            async def one(k: int) -> str:
                resp = await client.post(
                    "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": PREFIX + tail(710 + 9 * k),
                        "max_tokens": 24,
                        "temperature": 0,
                    },
                )
                assert resp.status_code == 200, resp.text
                return resp.headers[WORKER_HEADER]

            return await asyncio.gather(*(one(k) for k in range(2 * PER_WORKER)))

    served = asyncio.run(burst())
    assert served.count(holder) == PER_WORKER and served.count(_other(holder)) == PER_WORKER
    assert _stats(pool).get("decisions:spill", 0) >= 1


def test_a_lost_index_is_written_again_whole(pool) -> None:
    holder, _ = complete(pool, PREFIX + tail(800))
    wait_for(lambda: holds(pool.r, holder, PREFIX) == 6, 10, "indexed")
    epoch = pool.r.hget(keys.worker_info(holder), "epoch").decode()
    size = pool.r.scard(keys.worker_blocks(holder, epoch))
    first = index_members(BlockHasher(16).chain(PREFIX, CacheNamespace(MODEL).seed()))[0]
    # As a Redis flush or restart would: the block set and the holders set go together.
    pool.r.delete(keys.worker_blocks(holder, epoch), keys.routing_holders(first.hex()))
    wait_for(lambda: pool.r.scard(keys.worker_blocks(holder, epoch)) >= size, 10, "rewritten")
    wait_for(lambda: listed(pool.r, PREFIX) == {holder}, 10, "listed again")
    assert complete(pool, PREFIX + tail(810))[0] == holder


def test_after_the_holder_evicts_the_prefix_requests_go_by_load(pool) -> None:
    holder, _ = complete(pool, PREFIX + tail(900))
    resp = httpx.post(f"{pool.url}/v1/cache/reset", timeout=30)
    assert resp.status_code == 200
    for wid in WORKERS:  # only the marker is left in each index
        wait_for(lambda w=wid: holds(pool.r, w, PREFIX) == 0, 10, f"{wid}'s index emptied")
    assert listed(pool.r, PREFIX) == set()  # and no worker is listed as holding its first block
    before = _stats(pool).get("decisions:load", 0)
    served, reused = complete(pool, PREFIX + tail(910))
    assert reused == 0 and served in WORKERS
    assert _stats(pool)["decisions:load"] == before + 1


def _counters(pool, wid: str) -> dict[str, int]:
    return {
        k.decode(): int(v)
        for k, v in pool.r.hgetall(keys.worker_cache_counters(wid)).items()
        if v.isdigit()
    }


def test_the_choices_of_one_prompt_run_on_one_worker_that_computes_it_once(pool) -> None:
    """n = 4 over a prompt no worker holds: the four choices are placed together, started on
    one worker, which prefills the prompt once; the three siblings report what they reused."""
    prompt = toks(200, 401)
    before = {w: _counters(pool, w) for w in WORKERS}
    stats_before = _stats(pool)
    resp = httpx.post(
        f"{pool.url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "n": 4},
    )
    assert resp.status_code == 200, resp.text
    wid = resp.headers[WORKER_HEADER]
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert len({c["text"] for c in body["choices"]}) == 1  # greedy: four equal choices
    # The prompt counted once, and its one computation found nothing cached.
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = _stats(pool)

    def delta(name: str) -> int:
        return stats.get(name, 0) - stats_before.get(name, 0)

    assert delta(f"started:{wid}") == 4 and delta(f"started:{_other(wid)}") == 0
    assert delta(f"routed:{wid}") == 4
    assert delta(f"reused_tokens:{wid}") == 3 * (len(prompt) - 1)  # the siblings' shared prompt

    def worker_delta(w: str, name: str) -> int:
        return _counters(pool, w).get(name, 0) - before[w].get(name, 0)

    # One request with its prompt, counted once however many choices.
    wait_for(lambda: worker_delta(wid, "requests") == 1, 10, "the worker's counters published")
    assert worker_delta(wid, "prompt_tokens") == len(prompt)
    # One prefill of the prompt (all but its last token, as for one request alone).
    assert worker_delta(wid, "batch_prefill_tokens") == len(prompt) - 1
    assert worker_delta(_other(wid), "requests") == 0
    routes = [line for line in pool.logs("router").splitlines() if "choices=4" in line]
    assert len(routes) == 1 and f"worker={wid}" in routes[0]


def test_mlxcel_pool_stats_shows_workers_rejects_and_routing(pool) -> None:
    """The operator's terminal view of the same JSON: one row per worker with its heartbeat's
    age, the seven reject reasons, and routing outcomes; --json passes the JSON through."""
    run = [sys.executable, "-m", "mlxcel_pool", "stats", "--url", pool.url]
    env = {**os.environ, "COLUMNS": "220"}
    shown = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    for word in (
        "w1",
        "w2",
        "heartbeat",
        "block_boundary_floor",
        "layout_constraints",
        "routing (policy cache_aware)",
        "cache",
        "spill",
        MODEL,
    ):
        assert word in shown.stdout, (word, shown.stdout)
    assert "ago" in shown.stdout  # the heartbeat's age
    raw = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60)
    stats = json.loads(raw.stdout)
    assert stats["routing"]["decisions"]["cache"] >= 6
    assert stats["workers"]["w1"]["model"] == MODEL and stats["workers"]["w1"]["last_seen"]


def test_metrics_cover_every_worker_from_redis_whatever_its_host(pool) -> None:
    """/metrics serves the workers' series from what they publish to Redis, not from files on
    the router's host: the totals equal the counters in Redis, and no worker writes a file."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{pool.url}/metrics", timeout=10).text
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels
    }
    in_redis = sum(
        int(pool.r.hget(keys.worker_cache_counters(w), "requests") or 0) for w in WORKERS
    )
    assert samples["mlxcel_requests_total"] == in_redis > 0
    assert samples["mlxcel_workers_alive"] == 2
    cache = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "mlxcel_routing_decisions_total" and s.labels == {"outcome": "cache"}
    ]
    assert cache and cache[0] >= 6  # every router process's decisions, summed
    worker_pids = {str(pool.pid(w)) for w in WORKERS}
    files = list(Path(pool.settings.multiproc_dir).glob("*.db"))
    assert files and not [f for f in files if any(f.stem.endswith(f"_{p}") for p in worker_pids)]


def test_every_series_the_grafana_dashboard_queries_is_exported(pool) -> None:
    """docs/grafana-dashboard.json queries only series this pool's /metrics serves (sample names,
    `_bucket`/`_total` included), with the labels its legends use."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    path = Path(__file__).parent.parent / "docs" / "grafana-dashboard.json"
    dashboard = json.loads(path.read_text())
    text = httpx.get(f"{pool.url}/metrics", timeout=10).text
    exported: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    queried = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"mlxcel_[a-z0-9_]+", target["expr"]):
                assert name in exported, (panel["title"], name)
                queried += 1
            for label in re.findall(r"by \(([a-z_, ]+)\)", target["expr"]):
                for lab in (x.strip() for x in label.split(",")):
                    names = re.findall(r"mlxcel_[a-z0-9_]+", target["expr"])
                    assert lab == "le" or any(lab in exported[n] for n in names), (
                        panel["title"],
                        lab,
                    )
    assert queried >= 20


def test_a_job_waiting_behind_a_busy_worker_is_taken_by_an_idle_peer(pool) -> None:
    """A job in w1's own queue while w1 cannot take it (mid-request, then stopped for 2 s: well
    under the 5 s that would make it dead) is taken by w2 once it has waited steal_after_ms
    (300 ms here). Stopped while idle, w1 would have popped it already: an idle worker blocks
    on its queue, a busy one only looks between steps."""
    from tests.streams import enqueue, read_events

    q1 = keys.worker_queue_name("w1")
    busy = enqueue(pool.r, PREFIX + tail(60), max_tokens=1500, queue=q1)
    wait_for(lambda: pool.r.xlen(keys.request_stream(busy)) > 2, 30, "w1 busy decoding")
    os.kill(pool.pid("w1"), signal.SIGSTOP)
    try:
        rid = enqueue(pool.r, PREFIX + tail(50), max_tokens=4, queue=q1)
        events = read_events(pool.r, rid, timeout=10)
    finally:
        os.kill(pool.pid("w1"), signal.SIGCONT)
    assert events[0].kind == "start" and events[0].worker_id == "w2"
    assert events[-1].kind == "done"
    pool.r.set(keys.request_cancel(busy), "1", ex=60)  # let w1's long request go
    wait_for(lambda: _alive(pool, "w1"), 10, "w1 beating again")


def test_when_the_holder_dies_its_requests_are_served_elsewhere(pool) -> None:
    holder, _ = complete(pool, PREFIX + tail(1000 - 300))
    wait_for(lambda: holds(pool.r, holder, PREFIX) == 6, 10, "indexed")
    os.kill(pool.pid(holder), signal.SIGKILL)
    # Routed at once, while the dead worker still looks alive: its queue is taken over by the
    # live one, which answers (the client never sees the death).
    served, _ = complete(pool, PREFIX + tail(720))
    assert served == _other(holder)
    served, _ = complete(pool, PREFIX + tail(730))
    assert served == _other(holder)
    # Once the peer has reaped it, its routing entries are gone, not just ignored. Its claim is
    # written first and the entries deleted after it, so the test waits for the deletes too.
    old_epoch = pool.r.hget(keys.worker_info(holder), "epoch")
    wait_for(lambda: pool.r.exists(keys.worker_reaped(holder)), 20, "the holder reaped")
    entries = [keys.worker_routed(holder), keys.worker_load(holder), keys.worker_prefill(holder)]
    if old_epoch is not None:  # read before its info hash expired
        entries.append(keys.worker_blocks(holder, old_epoch.decode()))
    # Well inside the block set's own lease (15 s from the last heartbeat): the reaper's delete.
    wait_for(lambda: not pool.r.exists(*entries), 5, "the holder's routing entries deleted")
    # It comes back under a new epoch: its last life's blocks never count again.
    pool.start_worker(holder)
    wait_for(
        lambda: pool.r.hget(keys.worker_info(holder), "epoch") not in (None, old_epoch),
        120,
        "the holder restarted",
    )
    wait_for(lambda: _alive(pool, holder), 30, "live again")
    assert holds(pool.r, holder, PREFIX) == 0
    assert complete(pool, PREFIX + tail(740))[0] == _other(holder)


def test_two_models_in_one_pool_each_request_runs_on_a_worker_of_its_model(
    pool, cache_dir: Path
) -> None:
    from devmodel.builder import ensure_model

    other_dir = ensure_model(cache_dir, "tiny", seed=1)
    other = other_dir.name  # the model id its worker registers
    pool.start_worker("b1", model=other_dir)
    wait_for(lambda: _alive(pool, "b1"), 120, "the second model's worker")

    def listed() -> list[str]:
        return [m["id"] for m in httpx.get(f"{pool.url}/v1/models", timeout=10).json()["data"]]

    wait_for(lambda: other in listed(), 10, "the second model listed")
    assert listed()[0] == MODEL
    assert httpx.get(f"{pool.url}/v1/models/{other}", timeout=10).json()["id"] == other

    def run(model: str) -> tuple[str, str]:
        resp = httpx.post(
            f"{pool.url}/v1/completions",
            timeout=60,
            json={"model": model, "prompt": PREFIX, "max_tokens": 6, "temperature": 0},
        )
        assert resp.status_code == 200, resp.text
        return resp.headers[WORKER_HEADER], resp.json()["choices"][0]["text"]

    served = [run(other) for _ in range(3)]
    assert {w for w, _ in served} == {"b1"}
    mine = [run(MODEL) for _ in range(3)]
    assert {w for w, _ in mine} <= set(WORKERS)
    assert served[0][1] != mine[0][1]  # other weights: the other model really ran it

    unknown = httpx.post(
        f"{pool.url}/v1/completions",
        timeout=30,
        json={"model": "no-such-model", "prompt": "hi", "max_tokens": 2},
    )
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert (
        MODEL in unknown.json()["error"]["message"] and other in unknown.json()["error"]["message"]
    )

    # Its only worker stops: the model leaves the list, and its requests get a clear 503.
    pool.stop_worker("b1")
    wait_for(lambda: other not in listed(), 30, "the second model unlisted")
    gone = httpx.post(
        f"{pool.url}/v1/completions",
        timeout=30,
        json={"model": other, "prompt": PREFIX, "max_tokens": 2},
    )
    assert gone.status_code in (404, 503), gone.text
    assert gone.json()["error"]["code"] in ("model_not_found", "no_live_worker")

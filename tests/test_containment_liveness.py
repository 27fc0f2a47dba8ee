"""Containment (issue 19), for real: two worker processes, the embedded Redis, the router.

- One long pass in a worker's loop (the loop's fault-injection hook: one iteration sleeps, as a
  long scoring pass or a grammar build would) is not a death: the heartbeat comes from a thread
  of its own, no stream ends `worker_lost`, nothing runs twice, the reaper fails nothing.
- A loop stuck past `worker.stuck_after_s` stops its heartbeat: only then are its jobs lost.
- A worker stopped (SIGSTOP) past the dead threshold is found dead once (the reaper's verdict, the
  one the router reads), its requests get their cancel flags, and when it goes on (SIGCONT) it
  drops them and registers again.
- After every way a request can end, no key of a request is left without a TTL.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry

from shared import keys
from shared.wire import JOB_FUNC, GenerationRequest, MsgpackSerializer
from tests.pool_fixture import TINY_MODEL, running_pool, sse_events, wait_for
from tests.streams import SHARED_QUEUE, enqueue_raw, pool_queues, read_events, started_holders
from worker.loop import FAULT_LOOP_STALL_ENV

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

KW = {"serializer": MsgpackSerializer}
STUCK_AFTER_S = 15  # the pool's stuck threshold here: longer than a long pass, short for a test
LONG_PASS_S = 10.0  # past the dead threshold (5 s, and the reaper's two passes): once a death
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4, 5,", "import numpy as np\n"]
WORKERS = ("w1", "w2")

# Keys the pool keeps without a TTL on purpose (docs/redis-keys.md): the roster, counters,
# ledgers, routing state, and rq's own sets, lists and registries (their members lapse by score).
LONG_LIVED = (
    "mlxcel:workers",
    "mlxcel:admission:inflight",
    "mlxcel:admission:queued",
    "mlxcel:routing:stats",
    "mlxcel:routing:canary",
    "mlxcel:routing:rr",
    "mlxcel:routing:placed",
    "mlxcel:routing:load",
    "mlxcel:routing:facts",
    "rq:queues",
    "rq:workers",
)
LONG_LIVED_PATTERNS = (
    ("mlxcel:worker:", ":cache:counters"),
    ("rq:workers:", ""),
    ("rq:queue:", ""),
    ("rq:wip:", ""),
    ("rq:finished:", ""),
    ("rq:failed:", ""),
    ("rq:canceled:", ""),
    ("rq:deferred:", ""),
    ("rq:scheduled:", ""),
)


def _without_ttl(r: redis.Redis) -> list[str]:
    out = []
    for raw in r.scan_iter(count=1000):
        key = raw.decode()
        if key in LONG_LIVED or any(
            key.startswith(a) and key.endswith(b) for a, b in LONG_LIVED_PATTERNS
        ):
            continue
        if r.ttl(key) == -1:
            out.append(key)
    return out


@pytest.fixture(scope="module")
def stall_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stall")


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, stall_dir: Path):
    env = {
        FAULT_LOOP_STALL_ENV: str(stall_dir / "stall-{worker_id}"),
        "MLXCEL_WORKER_STUCK_AFTER_S": str(STUCK_AFTER_S),
    }
    work = tmp_path_factory.mktemp("containment")
    with running_pool(tiny_model_dir, work, workers=len(WORKERS), env=env) as p:
        yield p


def _stall(stall_dir: Path, wid: str, seconds: float) -> None:
    """The fault-injection hook: the worker's next iteration sleeps `seconds` in its loop."""
    path = stall_dir / f"stall-{wid}"
    path.with_suffix(".tmp").write_text(str(seconds))
    path.with_suffix(".tmp").rename(path)


def _stream(pool: Any, prompt: str, max_tokens: int, out: dict[str, Any], ignore_eos: bool) -> None:
    body = {
        "model": TINY_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=180)
    out["status"] = resp.status_code
    chunks = sse_events(resp) if resp.status_code == 200 else []
    out["text"] = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    out["errors"] = [c["error"] for c in chunks if "error" in c]


def _in_threads(
    pool: Any, prompts: list[str], max_tokens: int, ignore_eos: bool = False
) -> tuple[list, list]:
    """Streams in threads; `ignore_eos`: each runs to max_tokens (the tiny model ends "Once upon
    a time" at its 55th token), so a stop or a kill meant for a running stream finds it so."""
    results: list[dict[str, Any]] = [{} for _ in prompts]
    threads = [
        threading.Thread(target=_stream, args=(pool, p, max_tokens, res, ignore_eos))
        for p, res in zip(prompts, results, strict=True)
    ]
    for t in threads:
        t.start()
    return threads, results


def _holders(r: redis.Redis) -> dict[str, str]:
    return started_holders(r, WORKERS)


def _wait_tokens_relayed(r: redis.Redis, job_ids: list[str]) -> None:
    """Until each stream holds a token or two and the router had time to relay them (a
    request whose client saw no token yet is run again elsewhere on a death, with no
    `worker_lost`), and no longer: the tiny model writes 2,000 tokens in about a second."""
    wait_for(lambda: all(r.xlen(keys.request_stream(j)) >= 3 for j in job_ids), 30, "tokens")
    time.sleep(0.05)


def _ended(r: redis.Redis, job_id: str) -> bool:
    """Whether rq has the job ended already (its worker wrote its last event and its end in
    one pipeline; the router may have deleted its stream since)."""
    return Job.fetch(job_id, connection=r, serializer=MsgpackSerializer).get_status() != "started"


def _stopped_mid_stream(pool: Any, r: redis.Redis) -> tuple[str, list[str], list, list]:
    """Two streams of 2,000 tokens, and the worker of the first SIGSTOPped while its streams
    run: (that worker, its jobs, the client threads, their results). A stop that came after one
    of its jobs had written its last event (the tiny model is fast) is undone, and the streams
    run again, so every job it holds is stopped mid-stream."""
    for _ in range(3):
        threads, results = _in_threads(pool, PROMPTS[:2], 2000, ignore_eos=True)
        holders = wait_for(lambda: _holders(r), 60, "streams running")
        victim = sorted(holders.values())[0]
        lost = [j for j, w in holders.items() if w == victim]
        _wait_tokens_relayed(r, lost)
        os.kill(pool.pid(victim), signal.SIGSTOP)
        if not any(_ended(r, j) for j in lost):
            return victim, lost, threads, results
        os.kill(pool.pid(victim), signal.SIGCONT)
        for t in threads:
            t.join(180)
        wait_for(lambda: not _holders(r), 30, "the streams that ended first ended")
    raise AssertionError("every stop came after a stream had ended")


def _failed(r: redis.Redis) -> set[str]:
    return {
        j
        for q in pool_queues(WORKERS)
        for j in FailedJobRegistry(q, connection=r, **KW).get_job_ids()
    }


def _health(pool: Any) -> dict[str, Any]:
    return httpx.get(f"{pool.url}/health", timeout=10).json()


@pytest.fixture
def r(pool: Any) -> Iterator[redis.Redis]:
    yield redis.Redis.from_url(pool.redis_url)


def test_a_long_pass_is_not_taken_for_a_death(
    pool: Any, r: redis.Redis, stall_dir: Path, mlx_reference: Any
) -> None:
    tok = mlx_reference.tokenizer
    failed_before = _failed(r)
    threads, results = _in_threads(pool, PROMPTS, 160)
    holders = wait_for(lambda: (h := _holders(r)) and len(h) >= 2 and h, 60, "streams running")
    stalled = sorted(holders.values())[0]
    _stall(stall_dir, stalled, LONG_PASS_S)
    started = time.monotonic()
    # Mid-pass, past the dead threshold: the worker is alive to the pool and says its loop waits.
    time.sleep(7.0)
    health = _health(pool)
    assert health["workers_alive"] == len(WORKERS), health
    (info,) = [w for w in health["workers"] if w["worker_id"] == stalled]
    assert float(info["loop_age_s"]) >= 4.0, info
    for t in threads:
        t.join(180)
    assert time.monotonic() - started > LONG_PASS_S  # the pass did hold the streams
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res["status"] == 200 and res["errors"] == [], res
        assert res["text"] == mlx_reference.run(tok.encode(prompt), 160)[0], prompt
    # No attempt ran twice, the reaper failed nothing, nobody was reaped.
    assert not [k for k in r.scan_iter("rq:job:*-1")]
    assert _failed(r) == failed_before
    assert not any(r.exists(keys.worker_reaped(w)) for w in WORKERS)
    assert "one pass has held its loop" in pool.logs(stalled)


def test_a_loop_stuck_past_its_threshold_loses_its_jobs_then_rejoins(
    pool: Any, r: redis.Redis, stall_dir: Path, mlx_reference: Any
) -> None:
    tok = mlx_reference.tokenizer
    prompt = PROMPTS[0]
    # A non-streamed request: nothing reached its client, so another worker answers it.
    body = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0}
    box: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: box.update(
            resp=httpx.post(f"{pool.url}/v1/completions", json=body, timeout=180)
        )
    )
    thread.start()
    holders = wait_for(lambda: _holders(r), 60, "the request started")
    ((job_id, stuck),) = holders.items()
    _stall(stall_dir, stuck, STUCK_AFTER_S + 12)
    stalled_at = time.monotonic()
    wait_for(lambda: r.exists(keys.worker_reaped(stuck)), STUCK_AFTER_S + 20, "reaped")
    assert time.monotonic() - stalled_at >= STUCK_AFTER_S  # never before the stuck threshold
    thread.join(180)
    resp = box["resp"]
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == mlx_reference.run(tok.encode(prompt), 400)[0]
    assert r.get(keys.request_cancel(job_id)) == b"1"  # the lost attempt is told to stop
    logs = pool.logs(stuck)
    assert "heartbeat stopped" in logs
    # When the pass ends it drops what the pool gave away and registers again.
    wait_for(lambda: "found dead by a peer" in pool.logs(stuck), 30, "the worker rejoins")
    wait_for(lambda: _health(pool)["workers_alive"] == len(WORKERS), 20, "both alive again")
    assert not r.exists(keys.worker_reaped(stuck))


def _end_every_way(pool: Any, r: redis.Redis) -> None:
    """A request ended each way but by a worker's death, one after the other."""
    # length, and stop (a stop string taken from the model's own text).
    body = {"model": TINY_MODEL, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    full = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=60).json()
    assert full["choices"][0]["finish_reason"] == "length"
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 :][:2]
    stopped = httpx.post(f"{pool.url}/v1/completions", json={**body, "stop": [stop]}, timeout=60)
    assert stopped.json()["choices"][0]["finish_reason"] == "stop", stopped.text
    # a client that goes away mid-stream
    streamed = {**body, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{pool.url}/v1/completions", json=streamed) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    # an error from the worker (a payload it refuses), and a deadline (its job's timeout)
    bad = uuid.uuid4().hex
    enqueue_raw(
        r,
        bad,
        {
            "request": {
                "request_id": bad,
                "model": "m",
                "prompt_tokens": [1],
                "max_tokens": 4,
                "temperature": "hot",
            }
        },
    )
    assert read_events(r, bad)[-1].kind == "error"
    late = uuid.uuid4().hex
    req = GenerationRequest(request_id=late, model="m", prompt_tokens=[5, 6, 7], max_tokens=2000)
    Queue(SHARED_QUEUE, connection=r, **KW).enqueue_call(
        func=JOB_FUNC,
        kwargs={"request": req.to_wire()},
        job_id=late,
        timeout=1,
        result_ttl=600,
        ttl=600,
    )
    (error,) = [e for e in read_events(r, late) if e.kind == "error"]
    assert "timed out" in error.error


def test_every_ending_leaves_no_request_key_without_a_ttl(pool: Any, r: redis.Redis) -> None:
    _end_every_way(pool, r)
    # Only this phase's jobs count as holders: the disconnected stream's job may still be
    # recorded as started for a moment while its worker drops it.
    wait_for(lambda: not _holders(r), 30, "the earlier requests ended")
    # worker_lost, false: a worker stopped past the dead threshold, then going on.
    victim, lost, threads, results = _stopped_mid_stream(pool, r)
    try:
        wait_for(lambda: r.exists(keys.worker_reaped(victim)), 20, "the stopped worker reaped")
        wait_for(lambda: all(r.exists(keys.request_cancel(j)) for j in lost), 30, "cancel flags")
    finally:
        os.kill(pool.pid(victim), signal.SIGCONT)
    wait_for(lambda: "found dead by a peer" in pool.logs(victim), 30, "the worker rejoins")
    for t in threads:
        t.join(180)
    codes = {e["code"] for res in results for e in res["errors"]}
    assert "worker_lost" in codes, results
    # The stopped worker stops generating what it lost: its streams stop growing.
    lengths = [r.xlen(keys.request_stream(j)) for j in lost]
    time.sleep(2.0)
    assert [r.xlen(keys.request_stream(j)) for j in lost] == lengths
    # worker_lost, true: a worker killed while it streams.
    wait_for(lambda: not _holders(r), 30, "the earlier requests ended")
    threads, results = _in_threads(pool, PROMPTS[2:3], 2000, ignore_eos=True)
    holders = wait_for(lambda: _holders(r), 60, "a stream running")
    _wait_tokens_relayed(r, list(holders))
    pool.kill_worker(next(iter(holders.values())))
    for t in threads:
        t.join(120)
    assert results[0]["errors"] and results[0]["errors"][0]["code"] == "worker_lost", results
    time.sleep(2.0)  # the live worker's last publish lands
    assert _without_ttl(r) == []
    # And what was garbage or lost is kept a bounded while, never rq's year.
    for key in r.scan_iter("rq:job:*"):
        assert 0 < r.ttl(key) <= 3600, (key, r.ttl(key))
    for key in r.scan_iter("mlxcel:req:*"):
        assert 0 < r.ttl(key) <= keys.REQUEST_TTL_S, key
    assert json.dumps(_health(pool))  # the router still answers
    assert Job  # (rq's Job is what the scans above read)

"""A worker whose network goes away and comes back, for real: two workers of one pool reach Redis
through a proxy whose link is pulled like a cable (tests/drivers/blackhole_proxy.py: packets
vanish, no socket closes), one with the default stall timeout (its calls just wait) and one with
a short one (its calls time out and it reconnects); the first worker reaches Redis directly.

- Every worker is listed by the real `rq info` from its first second, before any job.
- A cut shorter than the dead threshold is no death: the requests running there finish right.
- A cut long enough for the live peer to find both dead: each client gets a worker-lost error
  or the exact answer run again elsewhere, never wrong text; each cut-off worker says in one
  line what happened (cut off, found dead by w1, the requests it dropped), never that Redis
  restarted or was flushed; it leaves the pool's failures alone (rq still says worker lost),
  writes nothing to those requests' streams, leaves no key without a TTL, is listed by `rq info`
  again and serves.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
from rq.job import Job

from mlxcel_pool.supervisor import Pool
from shared import keys
from shared.liveness import WORKER_LOST_MARK
from shared.wire import MsgpackSerializer, StreamEvent
from tests.drivers.blackhole_proxy import BlackholeProxy
from tests.pool_fixture import TINY_MODEL, running_pool, sse_events, wait_for
from tests.streams import enqueue, read_events, started_holders

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
WAITS, TIMES_OUT = "w2", "w3"  # behind the proxy: default stall timeout, and a short one
WORKERS = ("w1", WAITS, TIMES_OUT)
SHORT_STALL_S = "4"  # the short stall timeout: a brief cut stays under it, a long one not
BRIEF_CUT_S = 1.5  # well under the dead threshold (5 s and two reaper passes)
LONG_CUT_S = 10.0  # past it: the live peer finds both cut-off workers dead
PROMPTS = ["Once upon a time", "The quick brown fox", "1, 2, 3, 4, 5,", "import numpy as np\n"]
MAX_TOKENS = 300  # long enough to be running through a cut, short enough to finish soon
KW = {"serializer": MsgpackSerializer}


@dataclass
class CutPool:
    pool: Pool
    proxy: BlackholeProxy
    r: redis.Redis


def _via(url: str, proxy: BlackholeProxy) -> str:
    """The pool's Redis URL (its user and password kept) pointed at the proxy."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{proxy.host}:{proxy.port}" if userinfo else f"{proxy.host}:{proxy.port}"
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture(scope="module")
def cut_pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CutPool]:
    # Round robin: concurrent requests spread over every worker, so each cut-off one holds some.
    overrides = {"routing": {"policy": "round_robin"}}
    work = tmp_path_factory.mktemp("network-loss")
    with running_pool(tiny_model_dir, work, workers=1, overrides=overrides) as pool:
        upstream = urlsplit(pool.redis_url)
        assert upstream.hostname is not None and upstream.port is not None
        with BlackholeProxy(upstream.hostname, upstream.port) as proxy:
            url = _via(pool.redis_url, proxy)
            pool.start_worker(WAITS, env={"REDIS_URL": url})
            short = {"REDIS_URL": url, "MLXCEL_REDIS_STALL_TIMEOUT_S": SHORT_STALL_S}
            pool.start_worker(TIMES_OUT, env=short)
            r = redis.Redis.from_url(pool.redis_url)
            for wid in WORKERS:
                wait_for(lambda w=wid: r.exists(keys.worker_info(w)), 60, f"{wid} registered")
            yield CutPool(pool, proxy, r)
            for wid in (WAITS, TIMES_OUT):  # while they still reach Redis: a clean stop
                pool.stop_worker(wid)


def rq_info(redis_url: str) -> tuple[set[str], set[str]]:
    """(worker names, queue names) as the real `rq info` CLI lists them."""
    env = {**os.environ, "RQ_REDIS_URL": redis_url, "PYTHONPATH": str(REPO)}
    rq = Path(sys.executable).parent / "rq"
    argv = [str(rq), "info", "--raw", "--serializer", "shared.wire.MsgpackSerializer"]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    workers = set(re.findall(r"^worker (\S+) \(", done.stdout, re.MULTILINE))
    queues = set(re.findall(r"^queue (\S+) \d+,", done.stdout, re.MULTILINE))
    return workers, queues


def _listed(redis_url: str) -> set[str]:
    return rq_info(redis_url)[0]


def _stream(pool: Pool, prompt: str, stream: bool, out: dict[str, Any]) -> None:
    body = {
        "model": TINY_MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=180)
    out["status"] = resp.status_code
    if resp.status_code != 200:
        out["text"], out["errors"] = "", [resp.json().get("error", {})]
    elif stream:
        chunks = sse_events(resp)
        out["text"] = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        out["errors"] = [c["error"] for c in chunks if "error" in c]
    else:
        out["text"], out["errors"] = resp.json()["choices"][0]["text"], []


def _run_requests(pool: Pool, prompts: list[str]) -> tuple[list[threading.Thread], list[dict]]:
    """Each prompt as a request, streamed and not in turn, each in its own thread."""
    results: list[dict[str, Any]] = [
        {"prompt": p, "stream": i % 2 == 0} for i, p in enumerate(prompts)
    ]
    threads = [
        threading.Thread(target=_stream, args=(pool, res["prompt"], res["stream"], res))
        for res in results
    ]
    for t in threads:
        t.start()
    return threads, results


def _holders(r: redis.Redis) -> dict[str, str]:
    return started_holders(r, WORKERS)


def _running_on(r: redis.Redis, wids: tuple[str, ...]) -> dict[str, str]:
    """Wait until each of `wids` runs requests that are all past their first token (a `start`
    and a token in each stream: a non-streamed request's next tokens are written a few at a
    time, so its stream grows no further for a while); their jobs."""

    def ready() -> dict[str, str] | None:
        held = {j: w for j, w in _holders(r).items() if w in wids}
        if set(held.values()) != set(wids):
            return None
        if not all(r.xlen(keys.request_stream(j)) >= 2 for j in held):
            return None
        return held

    return wait_for(ready, 60, f"{wids} running requests")


_ANSWERS: dict[str, str] = {}


def _answer(mlx_reference: Any, prompt: str) -> str:
    """mlx-lm's own greedy answer to `prompt` (computed once per prompt)."""
    if prompt not in _ANSWERS:
        tokens = mlx_reference.tokenizer.encode(prompt)
        _ANSWERS[prompt] = mlx_reference.run(tokens, MAX_TOKENS)[0]
    return _ANSWERS[prompt]


def _check_answers(results: list[dict[str, Any]], mlx_reference: Any) -> None:
    """Each client got the model's exact answer, or a worker-lost error after a true start."""
    for res in results:
        want = _answer(mlx_reference, res["prompt"])
        if not res["errors"]:
            assert res["status"] == 200 and res["text"] == want, res
        else:
            assert [e.get("code") for e in res["errors"]] == ["worker_lost"], res
            assert want.startswith(res["text"]), res


def _no_key_without_ttl(r: redis.Redis) -> list[str]:
    return [k.decode() for k in r.scan_iter("mlxcel:req:*", count=1000) if r.ttl(k) == -1]


def test_every_worker_is_listed_by_rq_info_before_any_job(cut_pool: CutPool) -> None:
    url = cut_pool.pool.redis_url
    workers, queues = rq_info(url)
    assert workers == {keys.rq_worker_name(w) for w in WORKERS}
    # Each worker's queues are rq's known queues from its birth: `rq info` lists the workers of
    # those queues only, once any is known.
    assert {keys.worker_queue_name(w) for w in WORKERS} <= queues
    assert keys.model_queue_name(TINY_MODEL) in queues
    # A job on one worker's own queue (rq registers that queue) leaves the others listed.
    rid = enqueue(cut_pool.r, [5, 6, 7], max_tokens=4, queue=keys.worker_queue_name("w1"))
    assert read_events(cut_pool.r, rid)[-1].kind == "done"
    assert _listed(url) == {keys.rq_worker_name(w) for w in WORKERS}


def test_a_brief_cut_is_no_death_and_its_requests_finish_right(
    cut_pool: CutPool, mlx_reference: Any
) -> None:
    pool, proxy, r = cut_pool.pool, cut_pool.proxy, cut_pool.r
    threads, results = _run_requests(pool, PROMPTS[:3])
    _running_on(r, (WAITS,))
    proxy.cut()
    time.sleep(BRIEF_CUT_S)
    proxy.restore()
    for t in threads:
        t.join(180)
    for res in results:
        assert res["errors"] == [], res
    _check_answers(results, mlx_reference)
    assert not any(r.exists(keys.worker_reaped(w)) for w in WORKERS)
    assert "found dead" not in pool.logs(WAITS)


def test_a_worker_cut_off_past_its_death_tells_the_truth_and_serves_again(
    cut_pool: CutPool, mlx_reference: Any
) -> None:
    pool, proxy, r = cut_pool.pool, cut_pool.proxy, cut_pool.r
    threads, results = _run_requests(pool, PROMPTS * 2)
    lost = _running_on(r, (WAITS, TIMES_OUT))
    proxy.cut()
    cut_at = time.monotonic()
    try:
        for wid in (WAITS, TIMES_OUT):
            wait_for(lambda w=wid: r.exists(keys.worker_reaped(w)), 30, f"{wid} found dead")
        time.sleep(max(0.0, cut_at + LONG_CUT_S - time.monotonic()))
    finally:
        proxy.restore()
    for t in threads:
        t.join(180)
    _check_answers(results, mlx_reference)

    # One truthful line each: what cut it off, who found it dead, what it dropped.
    for wid in (WAITS, TIMES_OUT):
        wait_for(lambda w=wid: "found dead by a peer, w1" in pool.logs(w), 30, f"{wid} rejoined")
        log = pool.logs(wid)
        (line,) = [ln for ln in log.splitlines() if "found dead by a peer" in ln]
        assert "cut off from Redis for" in line, line
        dropped = re.search(r"dropped (\d+) request\(s\) the pool had failed", line)
        assert dropped and int(dropped.group(1)) >= 1, line
        assert "Redis restart or flush" not in log
    assert "lost Redis" in pool.logs(TIMES_OUT)  # its calls timed out: it reconnected
    assert "lost Redis" not in pool.logs(WAITS)  # its calls only waited

    # The pool's verdict stands: the lost jobs stay failed as lost, their streams unwritten.
    for job_id in lost:
        job = Job.fetch(job_id, connection=r, **KW)
        assert job.get_status() == "failed", job_id
        assert WORKER_LOST_MARK in (job.latest_result().exc_string or ""), job_id
    lengths = {j: r.xlen(keys.request_stream(j)) for j in lost}
    time.sleep(1.5)
    assert {j: r.xlen(keys.request_stream(j)) for j in lost} == lengths
    assert _no_key_without_ttl(r) == []

    # Listed by `rq info` again, and serving from their own queues.
    names = {keys.rq_worker_name(w) for w in WORKERS}
    wait_for(lambda: _listed(pool.redis_url) == names, 30, "rq info lists every worker")
    for wid in (WAITS, TIMES_OUT):
        rid = enqueue(r, [5, 6, 7], max_tokens=4, queue=keys.worker_queue_name(wid))
        events = read_events(r, rid)
        assert events[0].kind == "start" and events[0].worker_id == wid, events
        assert events[-1].kind == "done", events
    assert _no_key_without_ttl(r) == []
    assert not any(r.exists(keys.worker_reaped(w)) for w in WORKERS)


def test_a_worker_reads_what_happened_to_its_registration(
    redis_server: Any, redis_url: str
) -> None:
    """What a returning worker reads before it registers again (which deletes the reaped
    claim), on a real Redis: a peer's verdict, a flush, a lapsed rq record; its heartbeat
    thread flags each."""
    from shared.liveness import reaped_value
    from worker.broker.intake import own_queues
    from worker.broker.presence import Heartbeat, WorkerPresence

    r = redis.Redis.from_url(redis_url)
    wid = "w8"
    queues = own_queues(r, wid, TINY_MODEL)
    info = {
        "worker_id": wid,
        "model": TINY_MODEL,
        "pid": str(os.getpid()),
        "host": socket.gethostname(),
    }
    presence = WorkerPresence(r, wid, queues, info)
    presence.arrive({})
    assert presence.standing().whole
    assert {q.key.encode() for q in queues} <= r.smembers("rq:queues")
    beat = Heartbeat(presence, interval_s=0.05)
    presence.heartbeat_thread = beat
    beat.start()
    try:
        # rq's record lapsed (a cut past its TTL) and `rq info` dropped it from rq's set.
        r.delete(presence.key)
        r.srem(presence.redis_workers_keys, presence.key)
        wait_for(presence.needs_check, 10, "the beat flags an unlisted worker")
        standing = presence.standing()
        assert not standing.whole and not standing.data_lost and not presence.reaped()
        assert standing.what_happened().startswith("rq no longer listed it")
        presence.arrive({})
        assert presence.standing().whole and not presence.needs_check()

        # A live peer found it dead.
        r.set(keys.worker_reaped(wid), reaped_value("w1", "no heartbeat for 6s"))
        wait_for(presence.reaped, 10, "the beat sees the verdict")
        standing = presence.standing()
        assert standing.what_happened() == "found dead by a peer, w1 (no heartbeat for 6s)"
        assert not standing.data_lost
        presence.arrive({})
        assert not r.exists(keys.worker_reaped(wid)) and presence.standing().whole

        # Redis was flushed: the one case (with a restart) where Redis lost the block index.
        redis.Redis.from_url(redis_server.admin_url).flushall()
        wait_for(presence.needs_check, 10, "the beat flags a flushed registration")
        standing = presence.standing()
        assert standing.data_lost and "flushed" in standing.what_happened()
        presence.arrive({})
        assert presence.standing().whole
    finally:
        presence.stop_heartbeat()


def test_a_stream_write_never_brings_a_deleted_stream_back(redis_url: str) -> None:
    """Only the events that start a stream create it (with its TTL, in the same script); a
    later step's events after its router deleted it write nothing; a cancel flag refuses all."""
    from worker.broker.intake import append_events

    r = redis.Redis.from_url(redis_url)
    event = StreamEvent(kind="delta", seq=3, text="x").to_wire()

    def write(rid: str, starts: bool) -> None:
        with r.pipeline(transaction=False) as pipe:
            append_events(pipe, rid, [event], starts_stream=starts)
            pipe.execute()

    write("late", starts=False)  # the router deleted it: nothing comes back
    assert not r.exists(keys.request_stream("late"))
    write("new", starts=True)
    assert r.xlen(keys.request_stream("new")) == 1
    assert 0 < r.ttl(keys.request_stream("new")) <= keys.REQUEST_TTL_S
    write("new", starts=False)
    assert r.xlen(keys.request_stream("new")) == 2
    r.set(keys.request_cancel("new"), "1", ex=60)
    write("new", starts=False)
    assert r.xlen(keys.request_stream("new")) == 2
    assert _no_key_without_ttl(r) == []

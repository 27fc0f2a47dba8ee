"""Forged jobs written by hand into Redis (issue 19, containment): each fails with a reason that
names what is wrong, in the job's own failure record, logged; it keeps the pool's short failure
TTL, not rq's year; and rq-dashboard lists it as malformed instead of answering 500. A real
worker process, a real dashboard process, a real Redis."""

from __future__ import annotations

import time
import uuid

import httpx
import redis
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.results import Result

from shared import keys
from shared.wire import MsgpackSerializer
from tests.streams import SHARED_QUEUE, enqueue, enqueue_raw, read_events
from tests.test_dashboard import dashboard  # noqa: F401  (the fixture)

KW = {"serializer": MsgpackSerializer}
PROMPT = list(range(10, 30))
# What each forged job's failure reason must name.
WANTS = {
    "not msgpack": "data is not msgpack: FormatError",
    "bad created_at": "yesterday-ish",
    "bad status": "exploded",
    "no data": "no data field",
}


def _valid(r: redis.Redis) -> str:
    rid = uuid.uuid4().hex
    req = {"request_id": rid, "model": "m", "prompt_tokens": PROMPT, "max_tokens": 4}
    enqueue_raw(r, rid, {"request": req})
    return rid


def _failure(r: redis.Redis, job_id: str) -> str:
    """The failure text rq records for the job, read without loading the job itself."""
    stub = Job(id=job_id, connection=r, **KW)
    latest = Result.fetch_latest(stub, **KW)
    return latest.exc_string if latest is not None else ""


def _forge(r: redis.Redis) -> dict[str, str]:
    """Queued before the worker listens, so each hash is edited before any worker can take it."""
    forged = {}
    forged["not msgpack"] = rid = _valid(r)
    r.hset(Job.key_for(rid), "data", b"\xc1\xff not msgpack")
    forged["bad created_at"] = rid = _valid(r)
    r.hset(Job.key_for(rid), "created_at", "yesterday-ish")
    forged["bad status"] = rid = _valid(r)
    r.hset(Job.key_for(rid), "status", "exploded")
    forged["no data"] = rid = _valid(r)
    r.hdel(Job.key_for(rid), "data")
    return forged


def test_forged_jobs_fail_naming_what_is_wrong_with_a_short_ttl(
    redis_url: str, start_worker
) -> None:
    r = redis.Redis.from_url(redis_url)
    forged = _forge(r)
    good = enqueue(r, PROMPT, max_tokens=5)
    w = start_worker(redis_url, "w1")
    assert read_events(r, good)[-1].kind == "done"
    failed = FailedJobRegistry(SHARED_QUEUE, connection=r, **KW)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not set(forged.values()) <= set(failed.get_job_ids()):
        time.sleep(0.1)
    assert set(forged.values()) <= set(failed.get_job_ids()), w.log()
    for what, rid in forged.items():
        reason = _failure(r, rid)
        assert WANTS[what] in reason, (what, reason)
        # The client side hears the same reason in the job's stream.
        (error,) = [e for e in read_events(r, rid, timeout=5) if e.kind == "error"]
        assert WANTS[what] in error.error, (what, error.error)
        assert r.hget(Job.key_for(rid), "status") == b"failed", what
        # Garbage is kept the pool's short while, not rq's year, and nothing of it lives forever.
        for key in (Job.key_for(rid), Result.get_key(rid), keys.request_stream(rid)):
            assert 0 < r.ttl(key) <= keys.MALFORMED_JOB_TTL_S, (what, key, r.ttl(key))
        assert failed.get_expiration_time(Job(id=rid, connection=r, **KW)) is not None
    score = dict(r.zrange(failed.key, 0, -1, withscores=True))
    assert all(
        score[rid.encode()] <= time.time() + keys.MALFORMED_JOB_TTL_S + 5 for rid in forged.values()
    )
    # Each is logged, the hash without data too (rq alone would skip it without a word).
    log = w.log_path.read_text()
    for rid in forged.values():
        assert rid in log, rid
    assert w.proc.poll() is None


def test_the_dashboard_lists_a_forged_job_as_malformed(
    redis_url: str,
    start_worker,
    dashboard: tuple[str, object],  # noqa: F811
) -> None:
    base, _ = dashboard
    r = redis.Redis.from_url(redis_url)
    forged = _forge(r)
    start_worker(redis_url, "w1")
    failed = FailedJobRegistry(SHARED_QUEUE, connection=r, **KW)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not set(forged.values()) <= set(failed.get_job_ids()):
        time.sleep(0.1)
    listed = httpx.get(f"{base}/0/data/jobs/{SHARED_QUEUE}/failed/20/asc/1.json", timeout=10)
    assert listed.status_code == 200, listed.text
    jobs = {j["id"]: j for j in listed.json()["jobs"]}
    # rq cannot load a hash with a bad date at all: it is listed as malformed, with its reason.
    job = jobs[forged["bad created_at"]]
    assert job["description"].startswith("malformed job: ") and "yesterday-ish" in job["exc_info"]
    for what in ("not msgpack", "bad status"):  # loadable once failed: rq's row, our reason
        assert WANTS[what] in jobs[forged[what]]["exc_info"], jobs[forged[what]]
    one = httpx.get(f"{base}/0/data/job/{forged['bad created_at']}.json", timeout=10)
    assert one.status_code == 200 and one.json()["status"] == "malformed", one.text
    assert httpx.get(f"{base}/0/view/job/{forged['bad status']}", timeout=10).status_code == 200

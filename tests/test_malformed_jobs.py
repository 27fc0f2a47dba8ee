"""Jobs no router would write, pushed into the queue by hand: each fails alone, logged, and the
worker that took it goes on serving. Real worker process, real Redis."""

from __future__ import annotations

import time
import uuid
from typing import Any

import redis
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry

from shared.wire import MsgpackSerializer
from tests.streams import SHARED_QUEUE, enqueue, enqueue_raw, generated_tokens, read_events

PROMPT = list(range(10, 30))
KW = {"serializer": MsgpackSerializer}


def _request(**fields: Any) -> dict[str, Any]:
    return {"request_id": "", "model": "m", "prompt_tokens": PROMPT, "max_tokens": 4, **fields}


def _bad_payload(r: redis.Redis, kwargs: dict[str, Any]) -> str:
    """A job whose payload is wrong in one field; a request keeps its job's own id, so that
    field is what the worker refuses, not a missing id."""
    rid = uuid.uuid4().hex
    request = kwargs.get("request")
    if isinstance(request, dict) and request.get("request_id") == "":
        kwargs = {**kwargs, "request": {**request, "request_id": rid}}
    enqueue_raw(r, rid, kwargs)
    return rid


def _bad_hash(r: redis.Redis, **fields: bytes | str) -> str:
    """A valid job whose rq hash is edited by hand after it was queued."""
    rid = uuid.uuid4().hex
    enqueue_raw(r, rid, {"request": _request(request_id=rid)})
    r.hset(Job.key_for(rid), mapping=fields)
    return rid


def _failed_ids(r: redis.Redis) -> set[str]:
    return set(FailedJobRegistry(SHARED_QUEUE, connection=r, **KW).get_job_ids())


def test_malformed_jobs_fail_alone_and_the_worker_serves_on(redis_url: str, start_worker) -> None:
    r = redis.Redis.from_url(redis_url)
    queue = Queue(SHARED_QUEUE, connection=r, **KW)
    # Written before the worker listens: a job hash edited after its enqueue could otherwise be
    # taken, whole and valid, in between.
    bad = {
        "garbage data": _bad_hash(r, data=b"\xc1\xff not msgpack"),
        "bad created_at": _bad_hash(r, created_at="yesterday-ish"),
        "bad status": _bad_hash(r, status="exploded"),
        "temperature hot": _bad_payload(r, {"request": _request(temperature="hot")}),
        "stop 5": _bad_payload(r, {"request": _request(stop=5)}),
        "request not a map": _bad_payload(r, {"request": "hello"}),
        "no request": _bad_payload(r, {}),
        "empty prompt": _bad_payload(r, {"request": _request(prompt_tokens=[])}),
        "negative seed": _bad_payload(r, {"request": _request(seed=-1, temperature=1.0)}),
        "token id past the vocab": _bad_payload(r, {"request": _request(prompt_tokens=[10**9])}),
        "grammar not a str": _bad_payload(r, {"request": _request(grammar=["start: /a/"])}),
        "grammar that does not compile": _bad_payload(
            r, {"request": _request(grammar="start: undefined_rule")}
        ),
        "group not a str": _bad_payload(r, {"request": _request(group=["g"])}),
        "group too long": _bad_payload(r, {"request": _request(group="g" * 1000)}),
    }
    # What each payload's error must name (the decoder's or the engine's words): the field
    # that is wrong, never a missing request id.
    names = {
        "temperature hot": "temperature",
        "stop 5": "stop",
        "empty prompt": "prompt",
        "negative seed": "seed",
        "token id past the vocab": "vocab",
        "grammar not a str": "grammar",
        "grammar that does not compile": "grammar",
        "group not a str": "group",
        "group too long": "group",
    }
    r.rpush(queue.key, uuid.uuid4().hex)  # an id whose job hash does not exist at all
    good = enqueue(r, PROMPT, max_tokens=6)
    w = start_worker(redis_url, "w1")

    events = read_events(r, good, timeout=60)
    assert events[-1].kind == "done" and len(generated_tokens(events)) == 6
    assert w.proc.poll() is None, w.log()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not set(bad.values()) <= _failed_ids(r):
        time.sleep(0.1)
    failed = _failed_ids(r)
    for what, job_id in bad.items():
        assert job_id in failed, what
        assert r.hget(Job.key_for(job_id), "status") == b"failed", what
        # A router waiting on it hears why, in the job's own stream.
        (error,) = [e for e in read_events(r, job_id, timeout=5) if e.kind == "error"]
        assert error.error, what
        if what in names:
            assert names[what] in error.error and "request_id" not in error.error, (what, error)
    # Nothing is left half-taken: no job shown as started, none left in the intermediate queue.
    assert StartedJobRegistry(SHARED_QUEUE, connection=r, **KW).count == 0
    assert r.llen(queue.intermediate_queue_key) == 0
    again = enqueue(r, PROMPT, max_tokens=3)
    assert read_events(r, again)[-1].kind == "done"
    assert w.proc.poll() is None, w.log()

"""A job a worker took from its own queue but had not started when it was lost (rq's
intermediate list holds it between the dequeue and the start pipeline: a burst's gathering
window) is failed as lost by the worker restarted under its id, so the router runs the request
again instead of waiting on a job nobody holds. Real worker process, real Redis."""

from __future__ import annotations

import time
import uuid

import redis
from rq import Queue
from rq.job import Job, JobStatus

from shared import keys
from shared.liveness import WORKER_LOST_MARK
from shared.wire import MsgpackSerializer
from tests.streams import enqueue_raw


def test_a_job_taken_but_not_started_by_a_lost_process_is_failed_as_lost(
    redis_url: str, start_worker
) -> None:
    r = redis.Redis.from_url(redis_url)
    own = keys.worker_queue_name("w1")
    rid = uuid.uuid4().hex
    request = {"request_id": rid, "model": "m", "prompt_tokens": [5, 6, 7], "max_tokens": 4}
    enqueue_raw(r, rid, {"request": request}, queue=own)
    queue = Queue(own, connection=r, serializer=MsgpackSerializer)
    # What rq's dequeue does before our start pipeline: the id moves to the intermediate list.
    assert r.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT") == rid.encode()
    start_worker(redis_url, "w1")  # the process "restarted" under the same id
    deadline = time.monotonic() + 20
    job = Job.fetch(rid, connection=r, serializer=MsgpackSerializer)
    while job.get_status(refresh=True) != JobStatus.FAILED and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.get_status() == JobStatus.FAILED
    result = job.latest_result()
    assert result is not None and result.exc_string.startswith(WORKER_LOST_MARK)
    assert r.llen(queue.intermediate_queue_key) == 0

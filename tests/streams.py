"""Test helpers that play the router's part directly against Redis (enqueue, read a stream)."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import redis
from rq import Queue

from shared import keys
from shared.wire import (
    JOB_FUNC,
    STREAM_FIELD,
    GenerationRequest,
    MsgpackSerializer,
    StreamEvent,
)
from worker.broker.intake import RqIntake, own_queues
from worker.broker.presence import WorkerPresence
from worker.broker.publisher import Publisher

# The tests' workers serve the tiny model: its shared queue is where a test plays the router.
TINY_MODEL = "mlxcel-tiny-s0"  # the tiny dev model's id: the one place the tests spell it
SHARED_QUEUE = keys.model_queue_name(TINY_MODEL)


def worker_broker(r: redis.Redis, worker_id: str) -> tuple[Publisher, RqIntake]:
    """A registered worker's Redis side, no engine: its publisher and its intake."""
    info = {"worker_id": worker_id, "model": TINY_MODEL, "pid": str(os.getpid()), "host": "h"}
    presence = WorkerPresence(r, worker_id, own_queues(r, worker_id, TINY_MODEL), info)
    presence.arrive({})
    intake = RqIntake(presence)
    return Publisher(presence, intake), intake


def enqueue(
    r: redis.Redis,
    prompt_tokens: list[int],
    max_tokens: int = 8,
    queue: str = SHARED_QUEUE,
    **fields: Any,
) -> str:
    rid = uuid.uuid4().hex
    req = GenerationRequest(
        request_id=rid, model="m", prompt_tokens=prompt_tokens, max_tokens=max_tokens, **fields
    )
    enqueue_raw(r, rid, {"request": req.to_wire()}, queue)
    return rid


def enqueue_raw(
    r: redis.Redis, job_id: str, kwargs: dict[str, Any], queue: str = SHARED_QUEUE
) -> None:
    q = Queue(queue, connection=r, serializer=MsgpackSerializer)
    q.enqueue_call(func=JOB_FUNC, kwargs=kwargs, job_id=job_id, result_ttl=600, ttl=600)


def read_events(r: redis.Redis, rid: str, timeout: float = 60.0) -> list[StreamEvent]:
    """Every event of a request's stream up to and including `done` or `error`."""
    events: list[StreamEvent] = []
    last = "0-0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, entries in r.xread({keys.request_stream(rid): last}, block=500) or []:
            for eid, fields in entries:
                last = eid
                ev = StreamEvent.from_wire(fields[STREAM_FIELD])
                events.append(ev)
                if ev.kind in ("done", "error"):
                    return events
    raise TimeoutError(f"request {rid} did not finish; events so far: {events}")


def generated_tokens(events: list[StreamEvent]) -> list[int]:
    return [t for e in events if e.kind == "delta" for t in e.token_ids]


def pool_queues(worker_ids: list[str] | tuple[str, ...] = ("w1", "w2", "w3")) -> list[str]:
    """The queues a pool's jobs may sit or run in: the tiny model's shared one and each worker's
    own (routing places requests on a worker's own queue)."""
    return [SHARED_QUEUE, *(keys.worker_queue_name(w) for w in worker_ids)]


def started_holders(r: redis.Redis, worker_ids: list[str] | tuple[str, ...]) -> dict[str, str]:
    """job id -> the worker whose start event its stream holds, for every job rq has started
    now in the pool's queues."""
    from rq.registry import StartedJobRegistry

    out = {}
    for q in pool_queues(worker_ids):
        registry = StartedJobRegistry(q, connection=r, serializer=MsgpackSerializer)
        for job_id in registry.get_job_ids(cleanup=False):
            for _, fields in r.xrange(keys.request_stream(job_id), count=1):
                event = StreamEvent.from_wire(fields[STREAM_FIELD])
                if event.kind == "start":
                    out[job_id] = event.worker_id
    return out

"""The router's job template: rq's enqueue, made once per queue by rq and filled in per job."""

from __future__ import annotations

import hashlib
import random
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.utils import get_version

from router.relay.dispatch import Dispatcher, describe
from router.relay.job_template import CLOCK_FIELDS, DATA_LEVEL, JobTemplate
from shared import keys
from shared.wire import JOB_FUNC, GenerationRequest, MsgpackSerializer


@pytest.fixture
def dispatcher(redis_url: str) -> Dispatcher:
    """A dispatcher's enqueue side alone: rq's queues on a real Redis."""
    r = redis.Redis.from_url(redis_url)
    get_version(r)  # what Dispatcher.warm_rq reads at startup
    d = Dispatcher.__new__(Dispatcher)
    d.sync_redis, d.job_timeout_s, d._queues, d._templates = r, 900, {}, {}
    return d


def request(n_tokens: int = 300) -> GenerationRequest:
    prompt = [random.randrange(5, 1024) for _ in range(n_tokens)]
    model = f"m-{uuid.uuid4().hex}"  # queues of their own: the test's Redis is shared
    return GenerationRequest(uuid.uuid4().hex, model, prompt, max_tokens=16, temperature=0.5)


def clock_values(commands: list[tuple[Any, ...]]) -> set[str]:
    return {
        c[i]
        for c in commands
        if c[0] == "HSET"
        for i in range(3, len(c), 2)
        if c[i - 1] in CLOCK_FIELDS
    }


def hash_values(
    commands: list[tuple[Any, ...]], change: Callable[[str, Any], Any]
) -> list[tuple[Any, ...]]:
    """The commands with each HSET value v of field f as change(f, v)."""
    return [
        tuple(
            change(c[i - 1], a) if c[0] == "HSET" and i > 2 and i % 2 else a
            for i, a in enumerate(c)
        )
        for c in commands
    ]


def data_as(change: Callable[[bytes], Any]) -> Callable[[str, Any], Any]:
    """For hash_values: the `data` value changed, the others as they are."""
    return lambda field, value: change(value) if field == "data" else value


def job_data(commands: list[tuple[Any, ...]]) -> bytes:
    """The job hash's `data` value, as written."""
    (data,) = [
        c[i] for c in commands if c[0] == "HSET" for i in range(3, len(c), 2) if c[i - 1] == "data"
    ]
    return data


def comparable(commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The commands with the clock values as one placeholder and the job's data inflated."""
    inflated = data_as(zlib.decompress)
    return hash_values(
        commands, lambda field, v: "<clock>" if field in CLOCK_FIELDS else inflated(field, v)
    )


def rq_writing_data(
    dispatcher: Dispatcher, change: Callable[[bytes], Any], from_call: int = 1
) -> Any:
    """rq's commands as rq makes them, with the job's data as change(data) from the
    `from_call`-th call on (the template's first sentinel is the first call, its self-check's
    the second)."""
    rq_commands = dispatcher._rq_commands
    calls: list[str] = []

    def commands(queue: Queue, job_id: str, kwargs: dict[str, object], description: str) -> Any:
        made = rq_commands(queue, job_id, kwargs, description)
        calls.append(job_id)
        return made if len(calls) < from_call else hash_values(made, data_as(change))

    return commands


@pytest.mark.parametrize(("own_queue", "attempt"), [(True, ""), (False, ""), (False, "-2")])
def test_a_job_from_the_template_is_the_job_rq_makes(
    dispatcher: Dispatcher, own_queue: bool, attempt: str
) -> None:
    req = request()
    worker_id = f"w-{uuid.uuid4().hex}" if own_queue else ""  # a worker's queue, or the model's
    req.request_id += attempt  # a retry's job id (router.relay.dispatch._requeue)
    ours = dispatcher._job_commands(req, worker_id)
    queue = dispatcher.queue_for(worker_id, req.model)
    assert isinstance(dispatcher._templates[queue.name], JobTemplate)
    kwargs: dict[str, object] = {"request": req.to_wire()}
    theirs = dispatcher._rq_commands(queue, req.request_id, kwargs, describe(req, worker_id))
    assert comparable(ours) == comparable(theirs)
    assert len(clock_values(ours)) == 1  # one time for created_at and enqueued_at
    # The same data, deflated at the fastest level where rq uses zlib's default.
    raw = zlib.decompress(job_data(theirs))
    assert job_data(ours) == zlib.compress(raw, DATA_LEVEL) != job_data(theirs)


def test_rq_reads_a_job_from_the_template_as_its_own(dispatcher: Dispatcher) -> None:
    req = request()
    with dispatcher.sync_redis.pipeline(transaction=True) as pipe:
        for command in dispatcher._job_commands(req, req.model):
            pipe.execute_command(*command)
        pipe.execute()
    queue = dispatcher.queue_for(req.model, req.model)  # the worker's queue (any id will do)
    assert queue.job_ids == [req.request_id]
    job = Job.fetch(req.request_id, connection=dispatcher.sync_redis, serializer=MsgpackSerializer)
    assert job.get_status() == JobStatus.QUEUED
    assert job.func_name == JOB_FUNC and job.origin == queue.name
    assert GenerationRequest.from_wire(job.kwargs["request"]) == req
    assert job.description == describe(req, req.model) and job.timeout == 900
    assert job.enqueued_at is not None and job.created_at is not None
    ttl = dispatcher.sync_redis.ttl(f"rq:job:{req.request_id}")
    assert 0 < ttl <= keys.JOB_QUEUED_TTL_S


def test_jobs_go_through_rq_where_the_template_does_not_give_its_commands(
    dispatcher: Dispatcher,
) -> None:
    """An rq that writes a job's id in a form the template does not know (here, hashed)."""

    rq_commands = dispatcher._rq_commands

    def hashed(queue: Queue, job_id: str, kwargs: dict[str, object], description: str) -> Any:
        commands = rq_commands(queue, job_id, kwargs, description)
        return [*commands, ("SET", hashlib.sha1(job_id.encode()).hexdigest(), "1")]

    req = request()
    queue = dispatcher.queue_for("", req.model)
    assert JobTemplate.made_by(hashed, queue, JOB_FUNC) is None
    dispatcher._rq_commands = hashed  # type: ignore[method-assign]  # this rq, for the dispatcher
    commands = dispatcher._job_commands(req, "")
    assert queue.name in dispatcher._templates and dispatcher._templates[queue.name] is None
    assert commands[-1][0] == "SET"  # this rq's own commands
    assert len(clock_values(commands)) == 2  # rq's: it reads the clock for each field
    later = request()
    later.model = req.model  # the queue's next job: the verdict stands, rq's commands again
    assert dispatcher._job_commands(later, "")[-1][0] == "SET"
    assert dispatcher._templates[queue.name] is None


def test_a_redis_error_while_a_template_is_made_leaves_no_verdict(dispatcher: Dispatcher) -> None:
    """Redis unreachable at a queue's first job (rq reads the server's version): the enqueue
    fails as rq's own would, and the queue's next job makes its template again."""

    def unreachable(*args: Any) -> Any:
        raise redis.ConnectionError("Redis is restarting")

    req = request()
    queue = dispatcher.queue_for("", req.model)
    with pytest.raises(redis.ConnectionError):
        JobTemplate.made_by(unreachable, queue, JOB_FUNC)
    rq_commands = dispatcher._rq_commands
    dispatcher._rq_commands = unreachable  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        dispatcher._job_commands(req, "")
    assert queue.name not in dispatcher._templates
    dispatcher._rq_commands = rq_commands  # type: ignore[method-assign]  # Redis is back
    dispatcher._job_commands(req, "")
    assert isinstance(dispatcher._templates[queue.name], JobTemplate)


def test_jobs_go_through_rq_where_its_data_is_not_where_the_template_puts_it(
    dispatcher: Dispatcher,
) -> None:
    """An rq that writes the data undeflated: the template finds no place for it."""
    undeflated = rq_writing_data(dispatcher, zlib.decompress)
    queue = dispatcher.queue_for("", request().model)
    assert JobTemplate.made_by(undeflated, queue, JOB_FUNC) is None


@pytest.mark.parametrize(
    "second",
    [
        lambda data: zlib.compress(zlib.decompress(data) + b"x"),  # other data, deflated
        lambda data: b"not deflated at all",
        lambda data: "a str",
    ],
    ids=["other data", "not deflated", "a str"],
)
def test_the_self_check_compares_the_data_it_holds(dispatcher: Dispatcher, second: Any) -> None:
    queue = dispatcher.queue_for("", request().model)
    second_only = rq_writing_data(dispatcher, second, from_call=2)
    assert JobTemplate.made_by(second_only, queue, JOB_FUNC) is None


def test_a_template_finds_data_rq_deflated_at_another_level(dispatcher: Dispatcher) -> None:
    """The data's place is found by what it inflates to, not by rq's bytes."""
    level_9 = rq_writing_data(dispatcher, lambda data: zlib.compress(zlib.decompress(data), 9))
    queue = dispatcher.queue_for("", request().model)
    assert isinstance(JobTemplate.made_by(level_9, queue, JOB_FUNC), JobTemplate)


def test_a_template_rq_commands_it_cannot_read_are_refused(dispatcher: Dispatcher) -> None:
    """An exception while the template is made leaves the queue on rq's own enqueue."""

    def with_unhashable_field(queue: Queue, *args: Any) -> Any:
        return [*dispatcher._rq_commands(queue, *args), ("HSET", "k", ["a list"], "v")]

    queue = dispatcher.queue_for("", request().model)
    assert JobTemplate.made_by(with_unhashable_field, queue, JOB_FUNC) is None


def test_a_template_takes_only_what_rq_would_write_the_same(dispatcher: Dispatcher) -> None:
    req = request()
    dispatcher._job_commands(req, "")
    template = dispatcher._templates[dispatcher.queue_for("", req.model).name]
    assert template is not None
    with pytest.raises(ValueError, match="Job ID"):
        template.commands("a:b", {"request": req.to_wire()}, "d")
    with pytest.raises(ValueError, match="description"):
        template.commands(req.request_id, {"request": req.to_wire()}, "")


def test_a_requests_choices_are_enqueued_all_or_none(
    dispatcher: Dispatcher, redis_url: str
) -> None:
    """enqueue_all sends every choice's job in one transaction: a worker finds them all queued
    together, and a choice whose job cannot be made leaves none of the others queued."""
    import asyncio

    import redis.asyncio as aioredis

    from router.redis_batch import RedisBatch

    model = request().model
    choices = [request() for _ in range(3)]
    for gen in choices:
        gen.model = model

    async def enqueue(jobs: list[tuple[GenerationRequest, str]]) -> None:
        aredis = aioredis.Redis.from_url(redis_url)
        dispatcher.batch = RedisBatch(aredis)
        try:
            await dispatcher.enqueue_all(jobs)
        finally:
            await dispatcher.batch.stop()
            await aredis.aclose()

    bad = request()
    bad.model, bad.request_id = model, "not:an:id"  # rq refuses it
    with pytest.raises(ValueError, match="Job ID"):
        asyncio.run(enqueue([(choices[0], ""), (bad, ""), (choices[1], "")]))
    queue = dispatcher.queue_for("", model)
    assert queue.job_ids == []
    assert not dispatcher.sync_redis.exists(f"rq:job:{choices[0].request_id}")

    asyncio.run(enqueue([(gen, "") for gen in choices]))
    assert queue.job_ids == [gen.request_id for gen in choices]

"""The router's request path end to end with the test playing the worker: the rq job it enqueues,
the stream events it relays (JSON and SSE), failures, timeouts, disconnects and cache reset."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.results import Result
from transformers import AutoTokenizer

from mlxcel_pool.redis_server import EmbeddedRedis
from router.admission.tokenization import template_signature
from router.relay.dispatch import CANCELLED_STREAM_TTL_S
from shared import keys, liveness
from shared.wire import (
    JOB_FUNC,
    STREAM_FIELD,
    ControlCommand,
    ControlReply,
    GenerationRequest,
    MsgpackSerializer,
    StreamEvent,
)
from tests.streams import SHARED_QUEUE
from tests.test_router_validation import RouterServer, router_settings

REQUEST_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def router_url(
    redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("relay")
    settings = router_settings(redis_server.url, tiny_model_dir, tmp, REQUEST_TIMEOUT_S)
    # The relay tests send their own chat templates: this router's operator allows them.
    trusting = settings.router.model_copy(update={"trust_request_chat_template": True})
    server = RouterServer(settings.model_copy(update={"router": trusting})).start()
    yield server.url
    server.stop()


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as ex:
        yield ex


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


@pytest.fixture(scope="module")
def model_id(tiny_model_dir: Path) -> str:
    return tiny_model_dir.resolve().name


def take_jobs(r: redis.Redis, n: int, timeout: float = 5.0) -> list[tuple[Job, GenerationRequest]]:
    """Wait for the router's first n jobs in the shared queue (a request's choices, in its
    order) and decode them the way a worker would."""
    queue = Queue(SHARED_QUEUE, connection=r, serializer=MsgpackSerializer)
    deadline = time.monotonic() + timeout
    while len(queue.job_ids) < n:
        assert time.monotonic() < deadline, f"{len(queue.job_ids)} of {n} jobs were enqueued"
        time.sleep(0.02)
    taken = []
    for job_id in queue.job_ids[:n]:
        job = Job.fetch(job_id, connection=r, serializer=MsgpackSerializer)
        assert job.func_name == JOB_FUNC
        req = GenerationRequest.from_wire(job.kwargs["request"])
        assert req.request_id == job.id
        taken.append((job, req))
    return taken


def take_job(r: redis.Redis, timeout: float = 5.0) -> tuple[Job, GenerationRequest]:
    """Wait for the router's job in the shared queue and decode it the way a worker would."""
    return take_jobs(r, 1, timeout)[0]


_played: dict[str, int] = {}  # request id -> the seq of its next event, as a worker numbers them


def play(r: redis.Redis, req: GenerationRequest, *events: StreamEvent) -> None:
    """Write events as the worker would: into the request's stream, numbered 0, 1, 2, ..."""
    for ev in events:
        ev.seq = _played.get(req.request_id, 0)
        _played[req.request_id] = ev.seq + 1
        r.xadd(keys.request_stream(req.request_id), {STREAM_FIELD: ev.to_wire()})


def happy_events(prompt_len: int) -> list[StreamEvent]:
    return [
        StreamEvent(kind="start", worker_id="w1", cached_tokens=3, prompt_tokens=prompt_len),
        StreamEvent(kind="delta", text="Hel", token_ids=[1]),
        StreamEvent(kind="delta", text="lo", token_ids=[2]),
        StreamEvent(
            kind="done",
            finish_reason="length",
            prompt_tokens=prompt_len,
            completion_tokens=2,
            cached_tokens=3,
        ),
    ]


def sse_lines(url: str, path: str, body: dict[str, Any]) -> list[str]:
    with (
        httpx.Client(base_url=url, timeout=15) as c,
        c.stream("POST", path, json=body) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [line for line in resp.iter_lines() if line]


def sse_error(lines: list[str]) -> tuple[list[str | None], dict[str, Any]]:
    """A streamed response that ended with an error: its chunks' texts, and the error object
    (the event before `[DONE]`)."""
    texts = [json.loads(x[6:]).get("choices", [{}])[0].get("text") for x in lines[:-2]]
    return texts, json.loads(lines[-2].removeprefix("data: "))["error"]


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=15) as c:
        return c.post(path, json=body)


def test_completion_job_and_json_body(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, hf: Any, model_id: str
) -> None:
    body = {
        "model": model_id,
        "prompt": "hello world",
        "max_tokens": 5,
        "user": "alice",
        "temperature": 0.5,
        "stop": "x",
        "seed": 7,
        "unknown_field": True,
    }
    fut = pool.submit(post, router_url, "/v1/completions", body)
    job, req = take_job(r)
    assert req.prompt_tokens == hf.encode("hello world")
    assert (req.max_tokens, req.temperature, req.seed, req.stop) == (5, 0.5, 7, ["x"])
    assert req.session_key == "alice" and req.template_signature == ""
    assert job.timeout == 900
    play(r, req, *happy_events(len(req.prompt_tokens)))
    resp = fut.result(15)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert out["model"] == model_id
    assert out["choices"][0]["text"] == "Hello" and out["choices"][0]["finish_reason"] == "length"
    n = len(req.prompt_tokens)
    assert out["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 2,
        "total_tokens": n + 2,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert not r.exists(keys.request_stream(req.request_id))


def test_chat_streaming_with_usage(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, hf: Any, model_id: str
) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
    ]
    body = {
        "model": model_id,
        "messages": messages,
        "stream": True,
        "prompt_cache_key": "s1",
        "user": "bob",
        "stream_options": {"include_usage": True},
    }
    fut: Future[list[str]] = pool.submit(sse_lines, router_url, "/v1/chat/completions", body)
    _, req = take_job(r)
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    text = hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert req.prompt_tokens == hf.encode(text, add_special_tokens=False)
    assert req.session_key == "s1"
    assert req.template_signature == template_signature(hf.chat_template)
    play(r, req, *happy_events(len(req.prompt_tokens)))
    lines = fut.result(15)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text_out = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text_out == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert chunks[-1]["usage"]["total_tokens"] == len(req.prompt_tokens) + 2


def test_chat_template_override_changes_signature(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "abc"}],
        "chat_template": template,
        "max_tokens": 1,
    }
    fut = pool.submit(post, router_url, "/v1/chat/completions", body)
    _, req = take_job(r)
    assert req.template_signature == template_signature(template)
    play(r, req, StreamEvent(kind="done", finish_reason="stop", completion_tokens=0))
    out = fut.result(15).json()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert out["usage"]["prompt_tokens"] == len(req.prompt_tokens)


def test_completion_streaming_chunks(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    body = {"model": model_id, "prompt": [[5, 6, 7]], "stream": True}
    fut: Future[list[str]] = pool.submit(sse_lines, router_url, "/v1/completions", body)
    _, req = take_job(r)
    assert req.prompt_tokens == [5, 6, 7]
    play(r, req, *happy_events(3))
    lines = fut.result(15)
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


def test_worker_error_event_is_a_server_error(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    fut = pool.submit(post, router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    _, req = take_job(r)
    play(r, req, StreamEvent(kind="error", error="out of memory", error_type="MemoryError"))
    resp = fut.result(15)
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "server_error"
    assert "out of memory" in resp.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failing", [0, 2])
def test_a_choice_that_fails_first_lets_every_other_choice_go(
    router_url: str,
    r: redis.Redis,
    pool: ThreadPoolExecutor,
    model_id: str,
    stream: bool,
    failing: int,
) -> None:
    """n choices, one of which fails before any event of the others: the answer is its error,
    and by then no other choice is left running for nobody or holding its place in the pool."""
    body = {"model": model_id, "prompt": "x", "n": 3, "stream": stream}
    fut = pool.submit(post, router_url, "/v1/completions", body)
    reqs = [req for _, req in take_jobs(r, 3)]
    assert reqs[0].request_id == reqs[0].group  # enqueued in the choices' order
    assert r.zcard(keys.admission_inflight()) == 3
    play(r, reqs[failing], StreamEvent(kind="error", error="out of memory", error_type="OOM"))
    resp = fut.result(15)
    assert resp.status_code == 500, resp.text
    assert "out of memory" in resp.json()["error"]["message"]
    # Settled before the answer (each relay's cleanup runs before the error is raised), well
    # within the request timeout that would end a relay left waiting.
    assert r.zcard(keys.admission_inflight()) == 0
    others = [q for i, q in enumerate(reqs) if i != failing]
    assert all(r.get(keys.request_cancel(q.request_id)) == b"1" for q in others)


def _fail(r: redis.Redis, job: Job) -> None:
    Result.create_failure(job, ttl=60, exc_string="Traceback...\nRuntimeError: boom")
    job.set_status(JobStatus.FAILED)


@pytest.mark.parametrize("stream", [False, True])
def test_failed_job_answers_instead_of_hanging(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str, stream: bool
) -> None:
    body = {"model": model_id, "prompt": "x", "stream": stream}
    fut = pool.submit(post, router_url, "/v1/completions", body)
    job, _ = take_job(r)
    _fail(r, job)
    resp = fut.result(10)
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "server_error"
    assert "RuntimeError: boom" in resp.json()["error"]["message"]


def test_failed_job_after_streaming_started_is_an_sse_error(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    body = {"model": model_id, "prompt": "x", "stream": True}
    fut: Future[list[str]] = pool.submit(sse_lines, router_url, "/v1/completions", body)
    job, req = take_job(r)
    play(r, req, StreamEvent(kind="start", worker_id="w1"), StreamEvent(kind="delta", text="a"))
    _fail(r, job)
    lines = fut.result(10)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["type"] == "server_error"


def test_no_event_in_time_is_504(router_url: str, r: redis.Redis, model_id: str) -> None:
    started = time.monotonic()
    resp = post(router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "timeout"
    assert REQUEST_TIMEOUT_S <= time.monotonic() - started < REQUEST_TIMEOUT_S + 3


def wait_for(cond: Callable[[], bool], timeout: float = 6.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_client_disconnect_sets_the_cancel_key(
    router_url: str, r: redis.Redis, model_id: str
) -> None:
    body = {"model": model_id, "prompt": "x", "stream": True}
    with httpx.Client(base_url=router_url, timeout=10) as c:
        box: dict[str, GenerationRequest] = {}

        def worker() -> None:
            box["req"] = take_job(r)[1]
            play(r, box["req"], StreamEvent(kind="start"), StreamEvent(kind="delta", text="a"))

        t = threading.Thread(target=worker)
        t.start()
        with c.stream("POST", "/v1/completions", json=body) as resp:
            next(resp.iter_lines())  # the first chunk arrived; now hang up
        t.join()
    req = box["req"]
    wait_for(lambda: r.get(keys.request_cancel(req.request_id)) == b"1")
    assert 0 < r.ttl(keys.request_cancel(req.request_id)) <= keys.REQUEST_TTL_S
    # The worker may write a step more before it reads the flag: the stream still expires.
    play(r, req, StreamEvent(kind="delta", text="b"))
    assert 0 < r.ttl(keys.request_stream(req.request_id)) <= CANCELLED_STREAM_TTL_S


def test_cache_reset_asks_every_live_worker(router_url: str, r: redis.Redis) -> None:
    for wid, freed in (("w1", 100), ("w2", 50)):
        r.sadd(keys.workers_roster(), wid)
        r.hset(keys.worker_info(wid), "pid", "1")
        r.expire(keys.worker_info(wid), keys.LIVENESS_TTL_S)

        def answer(wid: str = wid, freed: int = freed) -> None:
            _, raw = r.blpop([keys.worker_control(wid)], timeout=5)
            cmd = ControlCommand.from_wire(raw)
            reply = ControlReply(
                worker_id=wid,
                kind=cmd.kind,
                result={"cleared": True, "freed_bytes": freed, "freed_entries": 1},
            )
            r.rpush(keys.control_reply(cmd.reply_id), reply.to_wire())

        threading.Thread(target=answer, daemon=True).start()
    r.sadd(keys.workers_roster(), "dead")  # no info hash: not asked
    out = post(router_url, "/v1/cache/reset", {}).json()
    assert (out["cleared"], out["freed_bytes"], out["freed_entries"]) == (True, 150, 2)
    assert set(out["workers"]) == {"w1", "w2"}


def test_cache_reset_with_no_workers(router_url: str, r: redis.Redis) -> None:
    out = post(router_url, "/v1/cache/reset", {}).json()
    assert out == {"cleared": False, "freed_bytes": 0, "freed_entries": 0, "workers": {}}


# --- exactly once: sequence numbers, a worker that stops beating --------------------------------


def test_an_event_written_twice_is_relayed_once(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    fut = pool.submit(post, router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    _, req = take_job(r)
    start, delta, done = (
        StreamEvent(kind="start", worker_id="w1"),
        StreamEvent(kind="delta", text="once", token_ids=[1]),
        StreamEvent(kind="done", finish_reason="length", completion_tokens=1),
    )
    play(r, req, start, delta)
    # A pipeline Redis applied twice (a retry after a timeout) writes the same event again.
    r.xadd(keys.request_stream(req.request_id), {STREAM_FIELD: delta.to_wire()})
    play(r, req, done)
    resp = fut.result(15)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "once"


def test_a_gap_in_the_stream_ends_the_request_instead_of_wrong_text(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    body = {"model": model_id, "prompt": "x", "stream": True}
    fut: Future[list[str]] = pool.submit(sse_lines, router_url, "/v1/completions", body)
    _, req = take_job(r)
    play(r, req, StreamEvent(kind="start", worker_id="w1"), StreamEvent(kind="delta", text="a"))
    lost = StreamEvent(kind="delta", text="c", seq=3)  # seq 2 never arrived
    r.xadd(keys.request_stream(req.request_id), {STREAM_FIELD: lost.to_wire()})
    lines = fut.result(15)
    texts, error = sse_error(lines)
    assert "c" not in texts
    assert "lost events 2..2" in error["message"]
    assert error["code"] == "redis_unavailable"  # Redis lost writes: a 503 the client may retry


def _run_again(r: redis.Redis, req: GenerationRequest, *events: StreamEvent) -> None:
    """The job run again from its start, into the same stream (a failover's new primary lost
    its dequeue and another take ran it): its events numbered from 0 again."""
    _played[req.request_id] = 0
    play(r, req, *events)


def test_a_job_run_again_with_the_same_text_so_far_goes_on_as_one_answer(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    fut = pool.submit(post, router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    _, req = take_job(r)
    a, b = (StreamEvent(kind="delta", text=t, token_ids=[i]) for i, t in ((1, "a"), (2, "b")))
    play(r, req, StreamEvent(kind="start", worker_id="w1"), a, b)
    done = StreamEvent(kind="done", finish_reason="length", completion_tokens=3)
    # A warmer cache the second time: its start says so, which tells the client nothing.
    _run_again(r, req, StreamEvent(kind="start", worker_id="w1", cached_tokens=1), a, b)
    play(r, req, StreamEvent(kind="delta", text="c", token_ids=[3]), done)
    resp = fut.result(15)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "abc"


def test_a_job_run_again_whose_text_went_another_way_ends_instead_of_joining_two_answers(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    body = {"model": model_id, "prompt": "x", "stream": True}
    fut: Future[list[str]] = pool.submit(sse_lines, router_url, "/v1/completions", body)
    _, req = take_job(r)
    a = StreamEvent(kind="delta", text="a", token_ids=[1])
    play(r, req, StreamEvent(kind="start", worker_id="w1"), a, StreamEvent(kind="delta", text="b"))
    # Sampled: the second run drew another token at seq 2, then went on past what was relayed.
    _run_again(r, req, StreamEvent(kind="start", worker_id="w2"), a)
    play(r, req, StreamEvent(kind="delta", text="X"), StreamEvent(kind="delta", text="Y"))
    lines = fut.result(15)
    texts, error = sse_error(lines)
    assert texts.count("a") == 1 and "b" in texts
    assert "X" not in texts and "Y" not in texts
    assert "ran again" in error["message"] and "at event 2" in error["message"]
    assert error["code"] == "redis_unavailable"  # Redis lost the job's progress: retryable


def _beating(r: redis.Redis, wid: str, age_s: float) -> None:
    """A worker's info hash as its last heartbeat `age_s` ago left it, and, past the dead
    threshold, the verdict a live peer's reaper writes (what the router reads)."""
    r.hset(keys.worker_info(wid), "pid", "1")
    r.pexpire(keys.worker_info(wid), int((keys.LIVENESS_TTL_S - age_s) * 1000))
    if age_s > liveness.DEAD_AFTER_S:
        verdict = liveness.reaped_value("w0", f"no heartbeat for {age_s:.0f}s")
        r.set(keys.worker_reaped(wid), verdict, ex=60)


def _answer(r: redis.Redis, req: GenerationRequest, fut: Future[httpx.Response], text: str) -> None:
    """The next attempt's worker (w2) answers `text`: the client gets it, whole, as a 200."""
    play(
        r,
        req,
        StreamEvent(kind="start", worker_id="w2"),
        StreamEvent(kind="delta", text=text, token_ids=[1]),
        StreamEvent(kind="done", finish_reason="length", completion_tokens=1),
    )
    resp = fut.result(15)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == text


def test_a_request_whose_worker_died_before_any_token_runs_again_elsewhere(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    fut = pool.submit(post, router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    job, req = take_job(r)
    job.set_status(JobStatus.STARTED)
    _beating(r, "w1", age_s=liveness.DEAD_AFTER_S + 1)  # w1 took it, then stopped beating
    play(r, req, StreamEvent(kind="start", worker_id="w1"))
    r.lrem(Queue(SHARED_QUEUE, connection=r).key, 0, job.id)  # w1 had taken it
    again, req2 = take_job(r, timeout=15)
    assert req2.request_id == f"{req.request_id}-1" and req2.prompt_tokens == req.prompt_tokens
    # The lost attempt is fenced: a worker that was only slow drops it.
    assert r.get(keys.request_cancel(req.request_id)) == b"1"
    _answer(r, req2, fut, "fine")


def test_a_job_whose_take_was_lost_before_its_start_runs_again(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    """A failover lost a worker's take between its pop and its start: rq still says queued,
    no queue holds the job and no worker runs it. Two job checks in a row find it so, and the
    request runs again under a new job id, the stranded one fenced."""
    fut = pool.submit(post, router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    job, req = take_job(r)
    r.lrem(Queue(SHARED_QUEUE, connection=r).key, 0, job.id)  # popped; the start never landed
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    _, req2 = take_job(r, timeout=REQUEST_TIMEOUT_S)  # before the request's own timeout
    assert req2.request_id == f"{req.request_id}-1"
    assert r.get(keys.request_cancel(req.request_id)) == b"1"
    _answer(r, req2, fut, "again")


def test_a_job_on_its_queues_taken_list_is_a_take_in_progress_not_a_lost_one(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    """rq's dequeue of one queue moves the job to the queue's taken list before its start: the
    worker holds it (or, restarted under its id, fails it as lost), so the router waits."""
    fut = pool.submit(post, router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    job, req = take_job(r)
    queue = Queue(SHARED_QUEUE, connection=r)
    assert r.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT") == job.id.encode()
    time.sleep(3.0)  # three job checks
    assert queue.count == 0 and r.get(keys.request_cancel(req.request_id)) is None
    r.lrem(queue.intermediate_queue_key, 0, job.id)
    job.set_status(JobStatus.STARTED)
    play(r, req, *happy_events(len(req.prompt_tokens)))
    resp = fut.result(15)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "Hello"


def test_a_request_whose_worker_died_after_tokens_ends_with_an_error(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    body = {"model": model_id, "prompt": "x", "stream": True}
    fut: Future[list[str]] = pool.submit(sse_lines, router_url, "/v1/completions", body)
    job, req = take_job(r)
    job.set_status(JobStatus.STARTED)
    r.lrem(Queue(SHARED_QUEUE, connection=r).key, 0, job.id)  # w3 had taken it
    play(r, req, StreamEvent(kind="start", worker_id="w3"), StreamEvent(kind="delta", text="a"))
    _beating(r, "w3", age_s=liveness.DEAD_AFTER_S + 1)
    started = time.monotonic()
    lines = fut.result(15)
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "worker w3 stopped" in error["message"] and "no heartbeat" in error["message"]
    assert time.monotonic() - started < 5  # the next job check, not the request timeout
    assert Queue(SHARED_QUEUE, connection=r).count == 0  # not run again: text was out


def test_a_stream_whose_tokens_went_out_by_its_lane_is_not_run_again_when_its_worker_dies(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    """A stream's token deltas after its first read go out by its direct lane, not through the
    dispatcher's loop: they count as relayed all the same, so a lost worker ends the stream
    with an error instead of a second attempt whose text would follow the first's."""
    lines: queue.Queue[str] = queue.Queue()

    def stream() -> None:
        body = {"model": model_id, "prompt": "x", "stream": True}
        with (
            httpx.Client(base_url=router_url, timeout=15) as c,
            c.stream("POST", "/v1/completions", json=body) as resp,
        ):
            lines.put(f"status {resp.status_code}")
            for line in resp.iter_lines():
                if line:
                    lines.put(line)
        lines.put("end")

    fut = pool.submit(stream)
    job, req = take_job(r)
    job.set_status(JobStatus.STARTED)
    r.lrem(Queue(SHARED_QUEUE, connection=r).key, 0, job.id)  # w6 had taken it
    play(r, req, StreamEvent(kind="start", worker_id="w6"))
    assert lines.get(timeout=15) == "status 200"  # the start read: the body waits for more
    play(r, req, StreamEvent(kind="delta", text="lane", token_ids=[1]))
    first = json.loads(lines.get(timeout=15).removeprefix("data: "))
    assert first["choices"][0]["text"] == "lane"
    _beating(r, "w6", age_s=liveness.DEAD_AFTER_S + 1)
    rest = [lines.get(timeout=15) for _ in range(3)]
    fut.result(15)
    error = json.loads(rest[0].removeprefix("data: "))["error"]
    assert "worker w6 stopped" in error["message"] and rest[1:] == ["data: [DONE]", "end"]
    assert Queue(SHARED_QUEUE, connection=r).count == 0  # not run again: text was out


def test_a_non_streamed_request_whose_worker_died_after_tokens_runs_again(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    """Nothing reached its client yet: the lost attempt's text is dropped, the next one's kept."""
    fut = pool.submit(post, router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    job, req = take_job(r)
    job.set_status(JobStatus.STARTED)
    r.lrem(Queue(SHARED_QUEUE, connection=r).key, 0, job.id)  # w4 had taken it
    play(
        r,
        req,
        StreamEvent(kind="start", worker_id="w4"),
        StreamEvent(kind="delta", text="lost ", token_ids=[1]),
    )
    _beating(r, "w4", age_s=liveness.DEAD_AFTER_S + 1)
    _, req2 = take_job(r, timeout=15)
    assert req2.request_id == f"{req.request_id}-1"
    play(
        r,
        req2,
        StreamEvent(kind="start", worker_id="w5"),
        StreamEvent(kind="delta", text="kept", token_ids=[1]),
        StreamEvent(kind="done", finish_reason="length", completion_tokens=1),
    )
    resp = fut.result(15)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "kept"


def test_a_job_failed_as_worker_lost_is_a_retryable_503_once_attempts_run_out(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    fut = pool.submit(post, router_url, "/v1/completions", {"model": model_id, "prompt": "x"})
    for attempt in range(2):  # the reaper fails each attempt's job: its worker died
        job, _ = take_job(r, timeout=15)
        r.lrem(Queue(SHARED_QUEUE, connection=r).key, 0, job.id)
        Result.create_failure(job, ttl=60, exc_string=f"{liveness.WORKER_LOST_MARK} w{attempt}")
        job.set_status(JobStatus.FAILED)
    resp = fut.result(15)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "worker_lost"

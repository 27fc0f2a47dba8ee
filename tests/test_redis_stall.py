"""Redis paused for real (SIGSTOP, then SIGCONT): no write is applied twice, every answer is
the model's, and every key written during the stall still expires.

First the clients alone (a stall shorter than the bound waits; a longer one fails the command
and does not send it again), then a whole pool with requests in flight and sent mid-stall."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis
from rq.registry import StartedJobRegistry
from transformers import AutoTokenizer

from mlxcel_pool.redis_server import EmbeddedRedis, start_redis
from router.relay import stream_hub
from router.relay.event_decode import decode_entry
from router.relay.stream_hub import StreamHub
from shared import keys
from shared.config import RedisConfig
from shared.redis_clients import sync_client
from shared.wire import STREAM_FIELD, StreamEvent
from tests.pool_fixture import running_pool, sse_events
from tests.streams import SHARED_QUEUE, enqueue, worker_broker
from worker.broker.intake import TakenJob
from worker.broker.publisher import StepWrites

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

STREAM = "mlxcel:req:stall-test:stream"


@contextmanager
def paused(pid: int, seconds: float) -> Iterator[None]:
    """SIGSTOP the process now and SIGCONT it `seconds` later, from a thread."""
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    timer.start()
    try:
        yield
    finally:
        timer.join()
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    server = start_redis()  # its own server: pausing it stalls no other test
    yield server
    server.stop()


def test_a_stall_shorter_than_the_bound_is_waited_out_once(own_redis: EmbeddedRedis) -> None:
    client = sync_client(RedisConfig(url=own_redis.url, stall_timeout_s=4.0))
    client.ping()
    with paused(own_redis.process.pid, 1.5):
        started = time.monotonic()
        with client.pipeline(transaction=False) as pipe:
            pipe.xadd(STREAM, {"m": "1"})
            pipe.expire(STREAM, 60)
            pipe.execute()
        waited = time.monotonic() - started
    assert 1.0 < waited < 4.0
    assert client.xlen(STREAM) == 1 and 0 < client.ttl(STREAM) <= 60


def test_a_stall_past_the_bound_fails_the_command_and_never_resends_it(
    own_redis: EmbeddedRedis,
) -> None:
    client = sync_client(RedisConfig(url=own_redis.url, stall_timeout_s=1.0))
    client.ping()
    with (
        paused(own_redis.process.pid, 3.0),
        pytest.raises(redis.TimeoutError),
        client.pipeline(transaction=False) as pipe,
    ):
        pipe.xadd(STREAM, {"m": "1"})
        pipe.expire(STREAM, 60)
        pipe.execute()
    # Whether Redis applied what it had read before the client gave up, it got it once only.
    reader = redis.Redis.from_url(own_redis.url)
    time.sleep(1.0)
    assert reader.xlen(STREAM) <= 1
    assert reader.xlen(STREAM) == 0 or 0 < reader.ttl(STREAM) <= 60
    assert client.ping()  # the client reconnects once Redis answers again


def test_the_stream_hub_gives_up_a_read_stalled_past_the_bound_and_reads_on(
    own_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The hub's blocking read is timed by no timer of its own: its watch finds a read overdue
    past the block and the stall bound, drops that connection and reads on through a new one,
    from where it was (every entry once)."""
    monkeypatch.setattr(stream_hub, "BLOCK_MS", 200)
    monkeypatch.setattr(stream_hub, "STALL_CHECK_S", 0.2)
    stream = keys.request_stream("hub-stall")
    r = redis.Redis.from_url(own_redis.url)

    def write(seqs: range) -> None:
        for seq in seqs:
            event = StreamEvent(kind="delta", seq=seq, text=f"t{seq}", token_ids=[seq])
            r.xadd(stream, {STREAM_FIELD: event.to_wire()})

    async def run() -> list[int]:
        hub = StreamHub(RedisConfig(url=own_redis.url, stall_timeout_s=1.0))
        await hub.start()
        try:
            feed = await hub.subscribe(stream)
            await asyncio.to_thread(write, range(0, 2))
            got: list[int] = []
            while len(got) < 2:
                assert await feed.wait(30.0)
                got += [decode_entry(f).seq for _, f in feed.take()]
            await asyncio.to_thread(_pause, own_redis.process.pid, 3.0)
            await asyncio.to_thread(write, range(2, 4))
            while len(got) < 4:
                assert await feed.wait(30.0)
                got += [decode_entry(f).seq for _, f in feed.take()]
            return got
        finally:
            await hub.stop()

    with caplog.at_level("WARNING", logger="router.relay.stream_hub"):
        assert asyncio.run(asyncio.wait_for(run(), 60)) == [0, 1, 2, 3]
    assert any("no reply to XREAD" in rec.getMessage() for rec in caplog.records)


def test_the_stream_hub_replaces_a_push_channel_stalled_past_the_bound_and_pushes_on(
    own_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The push connection is PINGed as the reads are watched: one Redis leaves unanswered past
    the stall bound is dropped (a host gone without a word would leave the hub subscribed to
    nothing) and the hub subscribes again; the stream, pushed before and after, arrives whole."""
    monkeypatch.setattr(stream_hub, "STALL_CHECK_S", 0.2)
    r = redis.Redis.from_url(own_redis.url)
    publisher, intake = worker_broker(r, "w-push-stall")

    def step(taken: TakenJob, seq: int) -> None:
        event = StreamEvent(kind="delta", seq=seq, text=f"t{seq}").to_wire()
        publisher.publish(
            StepWrites(streams=[(taken, [event])], ongoing={taken.id} if seq else set())
        )

    async def subscribed(hub: StreamHub) -> None:
        while not hub.pushing:
            await asyncio.sleep(0.01)

    async def run() -> tuple[list[int], bool]:
        hub = StreamHub(RedisConfig(url=own_redis.url, stall_timeout_s=1.0))
        await hub.start()
        try:
            await asyncio.wait_for(subscribed(hub), 10)
            queue = keys.worker_queue_name("w-push-stall")
            enqueue(r, [1, 2, 3], queue=queue, relay_channel=hub.channel)
            (taken,) = await asyncio.to_thread(intake.take, 1, None)
            stream = keys.request_stream(taken.id)
            feed = await hub.subscribe(stream)
            got: list[int] = []
            for seq in range(4):
                if seq == 2:
                    await asyncio.to_thread(_pause, own_redis.process.pid, 3.0)
                    await asyncio.wait_for(subscribed(hub), 20)
                await asyncio.to_thread(step, taken, seq)
                while len(got) < seq + 1:
                    assert await feed.wait(30.0)
                    got += [decode_entry(f).seq for _, f in feed.take()]
            return got, hub._subs[stream.encode()].pushed
        finally:
            await hub.stop()

    with caplog.at_level("WARNING", logger="router.relay.stream_hub"):
        got, pushed = asyncio.run(asyncio.wait_for(run(), 60))
    assert (got, pushed) == ([0, 1, 2, 3], True)
    assert any("answered nothing" in rec.getMessage() for rec in caplog.records)


def _pause(pid: int, seconds: float) -> None:
    with paused(pid, seconds):
        pass


# --- a whole pool through a stall -----------------------------------------------------------------

MAX_TOKENS = 48
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "Redis is an in-memory",
    "Dear diary,",
    "The capital of France is",
    "In the beginning",
]


async def _complete(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int = MAX_TOKENS
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await client.post("/v1/completions", json=body)
    if resp.status_code != 200:
        return {"status": resp.status_code, "body": resp.text}
    chunks = sse_events(resp)
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    errors = [c["error"] for c in chunks if "error" in c]
    usage = chunks[-1].get("usage") if chunks else None
    return {
        "status": 200,
        "text": text,
        "errors": errors,
        "usage": usage,
        "text_chunks": sum(1 for c in chunks if c.get("choices") and c["choices"][0]["text"]),
    }


def test_a_pool_rides_out_a_redis_stall_with_every_answer_the_models(
    tiny_model_dir: Path, tmp_path: Path, mlx_reference
) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    # The stall is longer than redis-py's default socket timeout (5 s), which the old clients
    # then retried: the pipeline was applied twice and text came out doubled.
    stall_s = 7.0
    with running_pool(tiny_model_dir, tmp_path) as pool:
        model = httpx.get(f"{pool.url}/health", timeout=10).json()["model"]
        r = redis.Redis.from_url(pool.redis_url)

        async def scenario() -> list[dict]:
            async with httpx.AsyncClient(base_url=pool.url, timeout=120) as client:
                before = [asyncio.create_task(_complete(client, model, p)) for p in PROMPTS[:3]]
                await asyncio.sleep(0.3)  # these are mid-stream when Redis stops
                pid = pool.pid("redis")
                os.kill(pid, signal.SIGSTOP)
                try:
                    during = [asyncio.create_task(_complete(client, model, p)) for p in PROMPTS[3:]]
                    await asyncio.sleep(stall_s)
                finally:
                    os.kill(pid, signal.SIGCONT)
                return await asyncio.gather(*before, *during)

        results = asyncio.run(scenario())
        for prompt, res in zip(PROMPTS, results, strict=True):
            assert res["status"] == 200, res
            assert res["errors"] == [], res
            want_text, want_n = mlx_reference.run(tok.encode(prompt), MAX_TOKENS)
            assert res["text"] == want_text, prompt
            assert res["usage"]["completion_tokens"] == want_n
            assert res["text_chunks"] <= want_n  # no chunk relayed twice
        time.sleep(1.0)  # the worker's last publish (job endings) lands
        # Every request key written during the stall still expires.
        assert [k for k in r.scan_iter("mlxcel:req:*") if r.ttl(k) == -1] == []
        # rq tells the truth: every job finished, none failed or left started by the stall.
        statuses = [r.hget(k, "status") for k in r.scan_iter("rq:job:*")]
        assert statuses and set(statuses) == {b"finished"}
        assert StartedJobRegistry(SHARED_QUEUE, connection=r).count == 0


# Prompts the tiny model never ends early (no EOS), long enough to be mid-stream at the stall.
LONG_PROMPTS = ["The quick brown fox", "1, 2, 3, 4, 5,", "import numpy as np\n"]
LONG = 800


def test_a_stall_past_the_bound_ends_requests_with_a_clear_error_never_wrong_text(
    tiny_model_dir: Path, tmp_path: Path, mlx_reference
) -> None:
    """Redis silent for longer than redis.stall_timeout_s: each request in flight either
    finishes with the model's exact text or ends with a 503-style `redis_unavailable` error
    after a correct prefix; nothing else, and the pool serves again once Redis answers."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    env = {"MLXCEL_REDIS_STALL_TIMEOUT_S": "2"}
    with running_pool(tiny_model_dir, tmp_path, env=env) as pool:
        model = httpx.get(f"{pool.url}/health", timeout=10).json()["model"]

        async def scenario() -> list[dict]:
            async with httpx.AsyncClient(base_url=pool.url, timeout=120) as client:
                running = [
                    asyncio.create_task(_complete(client, model, p, LONG)) for p in LONG_PROMPTS
                ]
                await asyncio.sleep(0.5)
                pid = pool.pid("redis")
                os.kill(pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(5.0)
                finally:
                    os.kill(pid, signal.SIGCONT)
                return await asyncio.gather(*running)

        outcomes = []
        for prompt, res in zip(LONG_PROMPTS, asyncio.run(scenario()), strict=True):
            want_text, _ = mlx_reference.run(tok.encode(prompt), LONG)
            if res["status"] == 503:
                assert "redis_unavailable" in res["body"]
                outcomes.append("503")
                continue
            assert res["status"] == 200, res
            if res["errors"]:
                (error,) = res["errors"]
                assert error["code"] == "redis_unavailable", error
                assert want_text.startswith(res["text"])  # what came out is the model's
                outcomes.append("error")
            else:
                assert res["text"] == want_text
                outcomes.append("done")
        assert len(outcomes) == 3 and "done" not in outcomes  # all were cut by the stall
        deadline = time.monotonic() + 30
        while True:  # the worker registers again after its reconnect backoff
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4}
            resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=30)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            assert resp.status_code == 503, resp.text
            time.sleep(0.5)
        assert resp.status_code == 200, resp.text


def test_a_router_starting_while_redis_stalls_waits_it_out(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """uvicorn stops every process of a router when one fails its startup, so a process that
    starts during a Redis stall must wait for Redis, not give up on its first timeout."""
    from mlxcel_pool.redis_server import start_redis
    from shared.config import RedisConfig
    from tests.test_router_validation import RouterServer, router_settings

    server = start_redis()
    try:
        base = router_settings(server.url, tiny_model_dir, tmp_path)
        settings = base.model_copy(update={"redis": RedisConfig(url=server.url, stall_timeout_s=1)})
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            router = RouterServer(settings)
            router.thread.start()
            time.sleep(3.0)  # its startup's Redis calls time out meanwhile
            assert router.thread.is_alive() and not router.server.started
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not router.server.started and time.monotonic() < deadline:
            assert router.thread.is_alive(), "the router gave up on Redis"
            time.sleep(0.1)
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503  # no worker yet
        router.stop()
    finally:
        server.stop()

"""Admission bounds and size limits: the pool-wide ledger on a real Redis, a real pool flooded
past its bound (429s decided before anything is enqueued, shared by two router processes), and
the router's refusals of bodies, prompts and templates too costly to take."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from rq import Queue

from router.admission.admit import MAX_CHARS_PER_TOKEN, AdmissionContext, admit_chat
from router.admission.tokenization import load_tokenizer
from router.edge.openai_types import ChatCompletionRequest
from router.placement.ledger import AdmissionLedger
from router.placement.place_call import Refusal
from shared import keys
from shared.config import (
    AdmissionConfig,
    PromptCacheConfig,
    RouterConfig,
    RoutingConfig,
    Settings,
)
from shared.liveness import min_alive_pttl_ms
from shared.wire import MsgpackSerializer
from tests.pool_fixture import running_pool, wait_for
from tests.streams import SHARED_QUEUE
from tests.test_router_validation import RouterServer, router_settings
from tests.test_routing_ledger import _started

# --- the ledger alone, on a real Redis ------------------------------------------------------------


class _Ledger:
    """The ledger as the admission tests read it: reserve answers None (admitted) or a Refusal."""

    def __init__(self, ledger: AdmissionLedger) -> None:
        self.ledger = ledger

    def reserve(self, rid: str, tokens: int) -> Refusal | None:
        placed = self.ledger.reserve(rid, tokens, MODEL, [])
        return placed if isinstance(placed, Refusal) else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)


MODEL = "m"


def _ledger(redis_url: str, **bounds: Any) -> _Ledger:
    config = AdmissionConfig(
        **{"max_inflight": 0, "max_inflight_per_worker": 0, "max_queued_prompt_tokens": 0, **bounds}
    )
    return _Ledger(
        AdmissionLedger(
            config,
            RoutingConfig(),
            PromptCacheConfig(),
            redis.Redis.from_url(redis_url),
            aioredis.Redis.from_url(redis_url),
        )
    )


def _worker(r: redis.Redis, wid: str, fresh: bool) -> None:
    r.sadd(keys.workers_roster(), wid)
    r.hset(keys.worker_info(wid), mapping={"pid": "1", "model": MODEL, "epoch": "e"})
    ttl_ms = keys.LIVENESS_TTL_S * 1000 if fresh else min_alive_pttl_ms() - 1000
    r.pexpire(keys.worker_info(wid), ttl_ms)


def test_the_ledger_bounds_requests_in_flight_and_frees_them(redis_url: str) -> None:
    ledger = _ledger(redis_url, max_inflight=3)
    assert [ledger.reserve(f"r{i}", 10) for i in range(3)] == [None, None, None]
    refused = ledger.reserve("r3", 10)
    assert refused is not None and (refused.reason, refused.current, refused.bound) == (
        "inflight",
        3,
        3,
    )
    assert "3 requests in flight" in refused.message()
    asyncio.run(ledger.release("r1"))
    assert ledger.reserve("r3", 10) is None
    assert redis.Redis.from_url(redis_url).zcard(keys.admission_inflight()) == 3


def test_the_bound_follows_the_live_workers(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    ledger = _ledger(redis_url, max_inflight=100, max_inflight_per_worker=2)
    # No live worker: only the pool bound applies (requests wait for a worker to come).
    assert all(ledger.reserve(f"a{i}", 1) is None for i in range(5))
    asyncio.run(_release_all(ledger, [f"a{i}" for i in range(5)]))
    _worker(r, "w1", fresh=True)
    _worker(r, "w2", fresh=True)
    _worker(r, "dead", fresh=False)  # its heartbeat is too old to count
    assert all(ledger.reserve(f"b{i}", 1) is None for i in range(4))
    refused = ledger.reserve("b4", 1)
    assert refused is not None and refused.bound == 4


async def _release_all(ledger: _Ledger, ids: list[str]) -> None:
    for rid in ids:
        await ledger.release(rid)


def test_queued_prompt_tokens_are_bounded_until_a_worker_starts_them(redis_url: str) -> None:
    ledger = _ledger(redis_url, max_queued_prompt_tokens=150)
    assert ledger.reserve("big", 1000) is None  # alone in the queue: always admitted
    refused = ledger.reserve("next", 10)
    assert refused is not None and (refused.reason, refused.current) == ("tokens", 1000)
    # A worker took it: its tokens no longer wait.
    asyncio.run(_started(ledger, "big", "w1"))
    assert ledger.reserve("next", 100) is None
    assert ledger.reserve("more", 60) is not None  # 100 + 60 > 150


def test_a_crashed_routers_reservations_lapse(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    ledger = _ledger(redis_url, max_inflight=2)
    # A router that crashed left two reservations, lapsed a while ago, and their tokens.
    r.zadd(keys.admission_inflight(), {"gone1": 1, "gone2": 1})
    r.hset(keys.admission_queued_tokens(), mapping={"gone1": 5, "gone2": 5})
    assert ledger.reserve("new", 3) is None
    assert r.zrange(keys.admission_inflight(), 0, -1) == [b"new"]
    assert r.hgetall(keys.admission_queued_tokens()) == {b"new": b"3"}


def test_a_live_router_keeps_its_reservations(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    ledger = _ledger(redis_url, max_inflight=5, reservation_ttl_s=1.5)

    async def hold() -> None:
        await ledger.start()
        assert ledger.reserve("kept", 1) is None
        r.zadd(keys.admission_inflight(), {"orphan": r.zscore(keys.admission_inflight(), "kept")})
        await asyncio.sleep(2.2)  # past the TTL: only the refreshed one is still there
        await ledger.stop()

    asyncio.run(hold())
    assert ledger.reserve("probe", 1) is None
    assert set(r.zrange(keys.admission_inflight(), 0, -1)) == {b"kept", b"probe"}


# --- a real pool past its bound -------------------------------------------------------------------

BOUND = 3


@pytest.fixture(scope="module")
def bounded_pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    env = {"MLXCEL_MAX_INFLIGHT": str(BOUND), "MLXCEL_RETRY_AFTER_S": "2"}
    with running_pool(tiny_model_dir, tmp_path_factory.mktemp("bounded"), env=env) as pool:
        yield pool


@pytest.mark.pool
def test_past_the_bound_a_request_gets_a_429_before_anything_is_enqueued(
    bounded_pool: Any,
) -> None:
    pool = bounded_pool
    r = redis.Redis.from_url(pool.redis_url)
    model = httpx.get(f"{pool.url}/health", timeout=10).json()["model"]
    body = {
        "model": model,
        "prompt": "The quick brown fox",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }

    async def flood() -> list[httpx.Response]:
        # Two router processes behind one port: both count into the same ledger.
        async with httpx.AsyncClient(base_url=pool.url, timeout=60) as client:
            first = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(BOUND)
            ]
            await asyncio.to_thread(
                wait_for,
                lambda: r.zcard(keys.admission_inflight()) == BOUND,
                10,
                "the first requests admitted",
            )
            rest = [await client.post("/v1/completions", json=body) for _ in range(5)]
            return [*await asyncio.gather(*first), *rest]

    responses = asyncio.run(flood())
    statuses = [resp.status_code for resp in responses]
    assert statuses == [200] * BOUND + [429] * 5, statuses
    refused = responses[-1]
    assert refused.headers["Retry-After"] == "2"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    # Refused before the enqueue: only the admitted requests ever became jobs.
    assert len(list(r.scan_iter("rq:job:*"))) == BOUND
    assert Queue(SHARED_QUEUE, connection=r, serializer=MsgpackSerializer).count == 0
    # Every reservation is released when its request ends.
    wait_for(lambda: r.zcard(keys.admission_inflight()) == 0, 10, "reservations released")
    assert r.hlen(keys.admission_queued_tokens()) == 0
    again = httpx.post(
        f"{pool.url}/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60
    )
    assert again.status_code == 200, again.text


@pytest.mark.pool
def test_a_request_of_several_choices_is_admitted_whole_or_refused_whole(bounded_pool: Any) -> None:
    """n choices are n places in the ledger: past the bound the whole request is a 429, with no
    choice enqueued and no reservation left behind; at the bound it runs every choice."""
    pool = bounded_pool
    r = redis.Redis.from_url(pool.redis_url)
    jobs_before = len(list(r.scan_iter("rq:job:*")))
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    refused = httpx.post(f"{pool.url}/v1/completions", json={**body, "n": BOUND + 1}, timeout=60)
    assert refused.status_code == 429, refused.text
    assert len(list(r.scan_iter("rq:job:*"))) == jobs_before
    assert r.zcard(keys.admission_inflight()) == 0 and r.hlen(keys.admission_queued_tokens()) == 0
    whole = httpx.post(f"{pool.url}/v1/completions", json={**body, "n": BOUND}, timeout=60)
    assert whole.status_code == 200, whole.text
    assert [c["index"] for c in whole.json()["choices"]] == list(range(BOUND))


# --- size and cost limits at the router -----------------------------------------------------------


@pytest.fixture(scope="module")
def small_router(
    redis_server: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    base = router_settings(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("small"))
    settings = Settings(**{**base.model_dump(), "router": RouterConfig(max_body_bytes=64 * 1024)})
    server = RouterServer(settings).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def router_url(
    redis_server: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    settings = router_settings(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("r"))
    server = RouterServer(settings).start()
    yield server.url
    server.stop()


def test_a_body_past_the_limit_is_a_413_declared_or_chunked(small_router: str) -> None:
    big = {"model": "x", "prompt": "a" * 100_000}
    resp = httpx.post(f"{small_router}/v1/completions", json=big, timeout=10)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "x", "prompt": "'
        for _ in range(100):
            yield b"a" * 1024
        yield b'"}'

    resp = httpx.post(
        f"{small_router}/v1/completions",
        content=chunks(),
        timeout=10,
        headers={"Content-Type": "application/json"},
    )
    assert resp.status_code == 413
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(
    router_url: str, tiny_model_dir: Path
) -> None:
    context = load_tokenizer(tiny_model_dir).context_length
    model = tiny_model_dir.resolve().name
    text = "ab " * (context * MAX_CHARS_PER_TOKEN // 3 + 1)
    resp = httpx.post(
        f"{router_url}/v1/completions", timeout=30, json={"model": model, "prompt": text}
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "characters" in err["message"]
    chat = {"model": model, "messages": [{"role": "user", "content": text}]}
    resp = httpx.post(f"{router_url}/v1/chat/completions", json=chat, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_a_requests_own_chat_template_is_refused_unless_trusted(
    router_url: str, tiny_model_dir: Path
) -> None:
    model = tiny_model_dir.resolve().name
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    resp = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "chat_template"
    assert "MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE" in resp.json()["error"]["message"]
    tok = load_tokenizer(tiny_model_dir)
    trusted = AdmissionContext(model, tok, 16, trust_request_chat_template=True)
    admission = admit_chat(ChatCompletionRequest.model_validate(body), trusted)
    assert admission.request is not None
    assert admission.request.prompt_tokens == tok.hf.encode("hi", add_special_tokens=False)


def test_too_many_messages_are_refused(router_url: str, tiny_model_dir: Path) -> None:
    from router.admission.admit import MAX_MESSAGES

    body = {
        "model": tiny_model_dir.resolve().name,
        "messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1),
    }
    resp = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_one_long_tokenization_leaves_the_other_copies_free(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir, copies=2)
    held = threading.Event()
    release = threading.Event()

    def long_tokenization() -> None:
        with tok.pool.borrow():  # one copy busy, as with a huge prompt
            held.set()
            release.wait(10)

    busy = threading.Thread(target=long_tokenization)
    busy.start()
    held.wait(5)
    assert tok.encode("hello world") == tok.hf.encode("hello world")  # the other copy serves
    with tok.pool.borrow():  # both copies busy now: a third caller waits its turn
        waiter = threading.Thread(target=tok.encode, args=("again",))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()
        release.set()
        busy.join(5)
        waiter.join(5)
        assert not waiter.is_alive()

"""Load shedding at the door (router/edge/busy_gate.py): after the ledger refuses a request at the
bound of requests in flight, the router process answers 429 without reading the next requests,
until its hold lapses or one of its own requests ends. The gate alone on an injected clock, then
the real router app on a real Redis, its only slot held by another router's reservation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from pydantic import SecretStr

from mlxcel_pool.redis_server import EmbeddedRedis
from router.edge.busy_gate import BusyGate
from router.placement.ledger import AdmissionLedger
from router.placement.place_call import Placement
from shared import keys
from shared.config import AdmissionConfig, AuthConfig, PromptCacheConfig, RoutingConfig
from shared.model_facts import model_id_for
from tests.pool_fixture import wait_for
from tests.test_router_validation import RouterServer, router_settings

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_shuts_the_gate_until_its_hold_lapses() -> None:
    clock = _Clock()
    gate = BusyGate(0.025, clock)
    assert gate.refusal() is None and gate.refusal("m") is None
    gate.close("m", "full", pool_wide=True)
    shut = gate.refusal()
    assert shut is not None and shut.message == "full"
    assert gate.refusal("other model") is shut  # the pool-wide bound holds for every model
    clock.now += 0.024
    assert gate.refusal() is shut
    clock.now += 0.002
    assert gate.refusal() is None and gate.refusal("m") is None


def test_a_models_own_bound_shuts_only_that_model_and_an_end_opens_everything() -> None:
    clock = _Clock()
    gate = BusyGate(1.0, clock)
    gate.close("a", "a is full", pool_wide=False)
    assert gate.refusal() is None  # the door (no model known yet) stays open
    assert gate.refusal("b") is None
    shut = gate.refusal("a")
    assert shut is not None and shut.message == "a is full"
    gate.close("b", "pool full", pool_wide=True)
    assert gate.refusal() is not None
    gate.open()  # a request of this process ended: its slot is free
    assert gate.refusal() is None and gate.refusal("a") is None


def test_a_zero_hold_never_shuts() -> None:
    gate = BusyGate(0.0)
    gate.close("m", "full", pool_wide=True)
    assert gate.refusal() is None


def _other_router(redis_url: str) -> AdmissionLedger:
    config = AdmissionConfig(max_inflight=1, max_inflight_per_worker=0)
    return AdmissionLedger(
        config,
        RoutingConfig(),
        PromptCacheConfig(),
        redis.Redis.from_url(redis_url),
        aioredis.Redis.from_url(redis_url),
    )


KEY = "sk-gate-test"


@pytest.fixture
def gated_router(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[str, AdmissionLedger]]:
    """One router process with a pool bound of 1 and a hold (30 s) far longer than any test step, so
    what it answers while shut is the gate's, not a race with the clock; auth on."""
    settings = router_settings(redis_url, tiny_model_dir, tmp_path)
    settings.admission = AdmissionConfig(max_inflight=1, busy_hold_ms=30_000, retry_after_s=3)
    settings.auth = AuthConfig(api_keys=SecretStr(KEY))
    server = RouterServer(settings).start()
    other = _other_router(redis_url)
    try:
        yield server.url, other
    finally:
        other.release_sync("other", redis.Redis.from_url(redis_url))
        server.stop()


def test_while_shut_the_router_refuses_at_its_door_and_a_local_end_opens_it(
    gated_router: tuple[str, AdmissionLedger], redis_url: str, tiny_model_dir: Path
) -> None:
    url, other = gated_router
    r = redis.Redis.from_url(redis_url)
    model = model_id_for(tiny_model_dir, "")
    auth = {"Authorization": f"Bearer {KEY}"}
    good = {"model": model, "prompt": "The quick brown fox", "max_tokens": 4}
    malformed = {"prompt": 5}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
        # Open: a body the router cannot take is its 400, whatever the load.
        assert client.post("/v1/completions", json=malformed).status_code == 400

        # No worker runs here: an admitted request waits in the shared queue, holding the only
        # slot, until its client leaves (after 2 s).
        def hold_the_slot() -> None:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json={**good, "stream": True}, timeout=2)

        holder = threading.Thread(target=hold_the_slot)
        holder.start()
        wait_for(lambda: r.zcard(keys.admission_inflight()) == 1, 10, "the first admitted")
        refused = client.post("/v1/completions", json=good)  # the ledger's refusal shuts it
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "3"
        # Shut: refused before the body is read (a malformed one too, on every generation
        # route) with the ledger's words; other routes and an unauthenticated caller are
        # answered as ever.
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            shut = client.post(path, content=b"{not json")
            assert shut.status_code == 429, shut.text
            error = shut.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            assert "bound of 1 requests in flight" in error["message"]
            assert shut.headers["Retry-After"] == "3"
        shut = client.post("/v1/messages", content=b"{not json")  # in Anthropic's error shape
        assert shut.status_code == 429 and shut.headers["Retry-After"] == "3", shut.text
        body = shut.json()
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "bound of 1 requests in flight" in body["error"]["message"]
        assert client.get("/v1/models").status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=good).status_code == 401
        # The holder's client leaves: its release opens the gate at once (the hold is 30 s).
        holder.join()
        wait_for(lambda: r.zcard(keys.admission_inflight()) == 0, 15, "the release")
        assert client.post("/v1/completions", json=malformed).status_code == 400

        # A slot another router frees is seen within the hold, not at once.
        assert isinstance(other.reserve("other", 4, model, []), Placement)
        assert client.post("/v1/completions", json=good).status_code == 429
        other.release_sync("other", r)
        assert client.post("/v1/completions", json=malformed).status_code == 429


# -- what the ledger shuts, on a real Redis ----------------------------------------------------


def _live_worker(r: redis.Redis, wid: str, model: str) -> None:
    r.sadd(keys.workers_roster(), wid)
    r.hset(keys.worker_info(wid), mapping={"pid": "1", "model": model, "epoch": "e"})
    r.pexpire(keys.worker_info(wid), keys.LIVENESS_TTL_S * 1000)


def test_a_busy_model_shuts_only_its_own_door_and_never_refuses_another(redis_url: str) -> None:
    """Model A's two workers at their bound refuse A's requests (and shut the gate for A only);
    model B's idle worker still takes B's, whatever A has in flight."""
    r = redis.Redis.from_url(redis_url)
    config = AdmissionConfig(max_inflight=100, max_inflight_per_worker=2, busy_hold_ms=60_000)
    ledger = AdmissionLedger(
        config, RoutingConfig(), PromptCacheConfig(), r, aioredis.Redis.from_url(redis_url)
    )
    for wid, model in (("a1", "A"), ("a2", "A"), ("b1", "B")):
        _live_worker(r, wid, model)
    held = [f"a{i}" for i in range(4)]
    try:
        assert all(isinstance(ledger.reserve(rid, 4, "A", []), Placement) for rid in held)
        refused = ledger.reserve("a-more", 4, "A", [])
        assert not isinstance(refused, Placement)
        assert (refused.reason, refused.scope, refused.current, refused.bound) == (
            "inflight",
            "model",
            4,
            4,
        )
        assert ledger.gate.refusal("A") is not None
        assert ledger.gate.refusal() is None and ledger.gate.refusal("B") is None
        b = ledger.reserve("b0", 4, "B", [])
        assert isinstance(b, Placement) and b.worker_id == "b1"
        held.append("b0")
    finally:
        for rid in held:
            ledger.release_sync(rid, r)
        r.delete(keys.workers_roster(), *(keys.worker_info(w) for w in ("a1", "a2", "b1")))


def test_too_many_choices_or_a_stale_count_shut_nothing(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    config = AdmissionConfig(max_inflight=3, max_inflight_per_worker=0, busy_hold_ms=60_000)
    ledger = AdmissionLedger(
        config, RoutingConfig(), PromptCacheConfig(), r, aioredis.Redis.from_url(redis_url)
    )
    try:
        assert isinstance(ledger.reserve("one", 4, "m", []), Placement)
        # Three more choices do not fit in the two places left, but a lone request would.
        group = ledger.reserve("g0", 4, "m", [], siblings=["g1", "g2"])
        assert not isinstance(group, Placement) and group.scope == "pool"
        assert ledger.gate.refusal() is None
        # A refusal read before a release of this process is stale: it shuts nothing.
        assert all(isinstance(ledger.reserve(rid, 4, "m", []), Placement) for rid in ("x", "y"))
        opened = ledger.gate.opened
        ledger.release_sync("x", r)
        ledger.gate.close("m", "full", pool_wide=True, opened=opened)
        assert ledger.gate.refusal() is None
        # ...while a fresh one does: the pool is full again.
        assert isinstance(ledger.reserve("z", 4, "m", []), Placement)
        assert not isinstance(ledger.reserve("w", 4, "m", []), Placement)
        assert ledger.gate.refusal() is not None
    finally:
        for rid in ("one", "y", "z"):
            ledger.release_sync(rid, r)


def test_a_release_opens_the_gate_before_redis_has_answered_it(
    redis_server: EmbeddedRedis, redis_url: str
) -> None:
    """A request this process reads once Redis has applied a release may be read before the
    release's reply: the gate is open from the moment the release is sent, not only once it is
    answered. Redis is paused (CLIENT PAUSE) so the reply is held while the gate is looked at."""
    r = redis.Redis.from_url(redis_url)
    config = AdmissionConfig(max_inflight=1, max_inflight_per_worker=0, busy_hold_ms=60_000)

    async def scenario() -> None:
        ledger = AdmissionLedger(
            config, RoutingConfig(), PromptCacheConfig(), r, aioredis.Redis.from_url(redis_url)
        )
        assert isinstance(ledger.reserve("held", 4, "m", []), Placement)
        assert not isinstance(ledger.reserve("more", 4, "m", []), Placement)
        assert ledger.gate.refusal() is not None
        # Every client's commands wait 0.6 s (the pool's user may not pause Redis: the admin does).
        redis.Redis.from_url(redis_server.admin_url).client_pause(600)
        release = asyncio.create_task(ledger.release("held"))
        await asyncio.sleep(0.2)
        assert not release.done()  # Redis has not answered the release yet
        assert ledger.gate.refusal() is None
        await release
        assert r.zcard(keys.admission_inflight()) == 0
        assert ledger.gate.refusal() is None
        # The slot is free: the next request is placed, not refused by a stale shut.
        assert isinstance(ledger.reserve("next", 4, "m", []), Placement)
        ledger.release_sync("next", r)

    asyncio.run(scenario())

"""A worker's steps pushed to its router's stream hub (the publisher's step script publishes the
events it appends to the channel the request names), on a real Redis: each stream's entries reach
its feed once and in order, by push where the push follows what the hub has and by its reads
otherwise (a gap, an entry written without a push)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from mlxcel_pool.redis_server import POOL_COMMANDS, POOL_COMMANDS_7, EmbeddedRedis
from router.redis_batch import RedisBatch
from router.relay.dispatch import Dispatcher
from router.relay.event_decode import decode_entry
from router.relay.stream_hub import PUSH_CHECK_S, Feed, StreamHub, _bulk
from shared import keys
from shared.config import RedisConfig
from shared.redis_clients import async_client
from shared.wire import STREAM_FIELD, GenerationRequest, StreamEvent
from tests.streams import TINY_MODEL, enqueue, enqueue_raw, worker_broker
from worker.broker.intake import RqIntake, TakenJob, own_queues
from worker.broker.presence import WorkerPresence
from worker.broker.publisher import Publisher, StepWrites

WID = "w-push"


@pytest.fixture
def rig(redis_url: str) -> tuple[redis.Redis, Publisher, RqIntake]:
    r = redis.Redis.from_url(redis_url)
    return (r, *worker_broker(r, WID))


def _events(seq: int, n: int) -> list[bytes]:
    return [StreamEvent(kind="delta", seq=seq + i, text=f"t{seq + i}").to_wire() for i in range(n)]


def _xreads(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))


async def _pushing(hub: StreamHub) -> None:
    """Until the hub's push channel is subscribed (a router names it to workers only then)."""
    deadline = time.monotonic() + 10
    while not hub.pushing:
        assert time.monotonic() < deadline, "the push channel was never subscribed"
        await asyncio.sleep(0.01)


async def _collect(feed: Feed, want: int, got: list[int]) -> None:
    while len(got) < want:
        assert await feed.wait(10.0), f"only {got} arrived"
        got += [decode_entry(fields).seq for _, fields in feed.take()]


def _run(rig: Any, redis_url: str, body: Any) -> Any:
    r, publisher, intake = rig

    async def run() -> Any:
        hub = StreamHub(RedisConfig(url=redis_url))
        await hub.start()
        try:
            # Subscribed first, as a router names its channel only then (a push published
            # before the subscription reaches Redis goes to no one).
            await _pushing(hub)
            enqueue(r, [1, 2, 3], queue=keys.worker_queue_name(WID), relay_channel=hub.channel)
            (taken,) = await asyncio.to_thread(intake.take, 1, None)
            assert taken.request is not None and taken.request.relay_channel == hub.channel
            feed = await hub.subscribe(keys.request_stream(taken.id))
            return await body(hub, feed, taken)
        finally:
            await hub.stop()

    return asyncio.run(asyncio.wait_for(run(), 60))


def _step(publisher: Publisher, taken: TakenJob, seq: int, n: int, first: bool) -> None:
    publisher.publish(
        StepWrites(streams=[(taken, _events(seq, n))], ongoing=set() if first else {taken.id})
    )


def test_a_pushing_workers_steps_arrive_by_push_with_no_read_a_step(
    rig: Any, redis_url: str
) -> None:
    r, publisher, _ = rig

    async def body(hub: StreamHub, feed: Feed, taken: TakenJob) -> tuple[list[int], int, bool]:
        got: list[int] = []
        await asyncio.to_thread(_step, publisher, taken, 0, 2, True)
        await _collect(feed, 2, got)
        await asyncio.sleep(0.1)  # the read in flight when the push came ends with the next step
        await asyncio.to_thread(_step, publisher, taken, 2, 1, False)
        await _collect(feed, 3, got)
        reads = _xreads(r)
        for seq in range(3, 23):
            await asyncio.to_thread(_step, publisher, taken, seq, 1, False)
            await _collect(feed, seq + 1, got)
        sub = hub._subs[keys.request_stream(taken.id).encode()]
        return got, _xreads(r) - reads, sub.pushed

    got, reads, pushed = _run(rig, redis_url, body)
    assert got == list(range(23))
    assert pushed
    # Twenty steps, each relayed without a read (the pushed streams' check may read once).
    assert reads <= 1


def test_a_stream_expected_before_its_job_exists_is_pushed_from_its_first_entry(
    rig: Any, redis_url: str
) -> None:
    """A stream subscribed by `expect_push` before its job is enqueued (the router's enqueue of
    a job placed on a worker that pushes): every step arrives by push, the first included; no
    read names it, and the relay's own subscribe, while a read for another stream blocks, sends
    no wake-up to bring that read back for it."""
    r, publisher, intake = rig

    async def run() -> tuple[list[int], int, int, bool]:
        hub = StreamHub(RedisConfig(url=redis_url))
        rid = uuid.uuid4().hex
        stream = keys.request_stream(rid)
        naming = 0  # reads sent that name the expected stream
        command = hub._command

        def counted(subs: list[Any]) -> bytes:
            nonlocal naming
            naming += any(sub.key_arg == _bulk(stream.encode()) for sub in subs)
            return command(subs)

        hub._command = counted  # type: ignore[method-assign]
        await hub.start()
        try:
            await _pushing(hub)
            await hub.subscribe(keys.request_stream("read-" + rid))  # a read blocks for it
            hub.expect_push(stream)
            req = GenerationRequest(
                request_id=rid,
                model="m",
                prompt_tokens=[1, 2, 3],
                max_tokens=8,
                relay_channel=hub.channel,
            )
            enqueue_raw(r, rid, {"request": req.to_wire()}, keys.worker_queue_name(WID))
            (taken,) = await asyncio.to_thread(intake.take, 1, None)
            feed = await hub.subscribe(stream)
            got: list[int] = []
            for seq in range(0, 10, 2):
                await asyncio.to_thread(_step, publisher, taken, seq, 2, seq == 0)
                await _collect(feed, seq + 2, got)
            woken = int(r.exists(hub._wake_key))
            return got, naming, woken, hub._subs[stream.encode()].pushed
        finally:
            await hub.stop()

    got, naming, woken, pushed = asyncio.run(asyncio.wait_for(run(), 60))
    assert got == list(range(10))
    assert (naming, woken, pushed) == (0, 0, True)


def test_a_job_whose_enqueue_fails_lets_its_expected_stream_go(redis_url: str) -> None:
    """The dispatcher expects a push for a job placed on a worker that pushes, before the job's
    transaction; a transaction Redis refuses (the worker's queue is not a list) leaves no
    subscription behind, and one that lands keeps it for the relay."""
    r = redis.Redis.from_url(redis_url)
    config = RedisConfig(url=redis_url)

    def job(relay_channel: str) -> GenerationRequest:
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            model="m",
            prompt_tokens=[1, 2, 3],
            max_tokens=8,
            relay_channel=relay_channel,
        )

    async def run() -> tuple[bool, bool]:
        aredis = async_client(config)
        batch = RedisBatch(aredis)
        hub = StreamHub(config, batch)
        await hub.start()
        dispatcher = Dispatcher(
            sync_redis=r,
            aredis=aredis,
            hub=hub,
            job_timeout_s=60,
            request_timeout_s=60,
            ledger=None,  # type: ignore[arg-type]  # only the relay uses it
            batch=batch,
        )
        try:
            await _pushing(hub)
            queue = keys.rq_queue_key(keys.worker_queue_name(WID))
            r.set(queue, "not a list")
            refused = job(hub.channel)
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                await dispatcher.enqueue_all([(refused, WID)])
            r.delete(queue)
            landed = job(hub.channel)
            await dispatcher.enqueue_all([(landed, WID)])
            subs = hub._subs
            gone = keys.request_stream(refused.request_id).encode() not in subs
            kept = subs.get(keys.request_stream(landed.request_id).encode())
            return gone, kept is not None and kept.pushed
        finally:
            await hub.stop()
            await batch.stop()
            await aredis.aclose()

    assert asyncio.run(asyncio.wait_for(run(), 60)) == (True, True)


def test_a_push_after_a_gap_falls_back_to_reads_and_each_entry_arrives_once(
    rig: Any, redis_url: str
) -> None:
    """An entry written without a push (another writer) leaves the next push with a gap before
    it: the stream goes back to the reads, which bring the entry and the push's own, once each
    and in order; a later push that follows them is taken again."""
    r, publisher, _ = rig

    async def body(hub: StreamHub, feed: Feed, taken: TakenJob) -> tuple[list[int], bool]:
        got: list[int] = []
        await asyncio.to_thread(_step, publisher, taken, 0, 2, True)
        await _collect(feed, 2, got)
        stream = keys.request_stream(taken.id)
        r.xadd(stream, {STREAM_FIELD: _events(2, 1)[0]})  # no push
        await asyncio.to_thread(_step, publisher, taken, 3, 2, False)
        await _collect(feed, 5, got)
        await asyncio.to_thread(_step, publisher, taken, 5, 1, False)
        await _collect(feed, 6, got)
        await asyncio.to_thread(_step, publisher, taken, 6, 1, False)
        await _collect(feed, 7, got)
        return got, hub._subs[stream.encode()].pushed

    got, pushed = _run(rig, redis_url, body)
    assert got == list(range(7))
    assert pushed


def test_an_entry_no_push_brings_is_found_by_the_pushed_streams_check(
    rig: Any, redis_url: str
) -> None:
    r, publisher, _ = rig

    async def body(hub: StreamHub, feed: Feed, taken: TakenJob) -> tuple[list[int], float]:
        got: list[int] = []
        await asyncio.to_thread(_step, publisher, taken, 0, 1, True)
        await _collect(feed, 1, got)
        await asyncio.to_thread(_step, publisher, taken, 1, 1, False)
        await _collect(feed, 2, got)
        assert hub._subs[keys.request_stream(taken.id).encode()].pushed
        r.xadd(keys.request_stream(taken.id), {STREAM_FIELD: _events(2, 1)[0]})  # no push
        began = time.monotonic()
        await _collect(feed, 3, got)
        return got, time.monotonic() - began

    got, waited = _run(rig, redis_url, body)
    assert got == [0, 1, 2]
    assert waited <= PUSH_CHECK_S + 2.0


def test_a_worker_says_it_pushes_and_a_request_without_a_channel_is_not_pushed(
    rig: Any, redis_url: str
) -> None:
    """Routers name a channel only for a worker whose info hash says `relay_push`; a request
    without one is appended as before and published nowhere."""
    r, publisher, intake = rig
    assert r.hget(keys.worker_info(WID), "relay_push") == b"1"
    enqueue(r, [1, 2, 3], queue=keys.worker_queue_name(WID))
    (taken,) = intake.take(1, None)
    assert taken.request is not None and taken.request.relay_channel == ""
    pubsub = r.pubsub()
    pubsub.psubscribe(keys.router_push("*"))
    pubsub.get_message(timeout=1.0)  # the subscribe's own reply
    _step(publisher, taken, 0, 2, True)
    assert r.xlen(keys.request_stream(taken.id)) == 2
    assert pubsub.get_message(timeout=0.5) is None
    pubsub.close()


def test_a_read_that_repeats_pushed_entries_brings_only_the_new_ones(
    rig: Any, redis_url: str
) -> None:
    """A read sent before a push came (the one in flight, the pushed streams' check) answers
    with entries the push brought too: only those after the last one taken reach the feed."""
    r, publisher, _ = rig

    async def body(hub: StreamHub, feed: Feed, taken: TakenJob) -> list[int]:
        got: list[int] = []
        for seq in range(3):
            await asyncio.to_thread(_step, publisher, taken, seq, 1, seq == 0)
            await _collect(feed, seq + 1, got)
        stream = keys.request_stream(taken.id)
        assert hub._subs[stream.encode()].pushed
        r.xadd(stream, {STREAM_FIELD: _events(3, 1)[0]})  # no push
        entries = [[eid, [STREAM_FIELD, f[STREAM_FIELD]]] for eid, f in r.xrange(stream)]
        hub._dispatch([[stream.encode(), entries]])  # every entry, as a read from 0-0 answers
        await _collect(feed, 4, got)
        return got

    assert _run(rig, redis_url, body) == [0, 1, 2, 3]


@pytest.fixture
def no_channels(redis_server: EmbeddedRedis) -> Iterator[str]:
    """A URL of a Redis user with the pool's commands and keys but no pub/sub channel (Redis 7's
    default for a new user, `resetchannels`)."""
    admin = redis.Redis.from_url(redis_server.admin_url)
    major = int(str(admin.info("server")["redis_version"]).split(".")[0])
    commands = (POOL_COMMANDS_7 if major >= 7 else POOL_COMMANDS).split()
    admin.execute_command(
        "ACL", "SETUSER", "nochan", "on", ">nochan-pw", "~*", "resetchannels", *commands
    )
    try:
        yield f"redis://nochan:nochan-pw@{redis_server.host}:{redis_server.port}"
    finally:
        admin.execute_command("ACL", "DELUSER", "nochan")


def test_a_user_refused_the_channel_relays_by_reads_and_its_worker_still_appends(
    rig: Any, redis_url: str, no_channels: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A router whose Redis user may not subscribe names no channel to its workers (`pushing`
    stays off), says why once, and relays by reads; a worker whose user may not publish appends
    its events all the same (the step script's PUBLISH is the only thing refused)."""
    r, _, _ = rig
    r_nochan = redis.Redis.from_url(no_channels)
    presence = WorkerPresence(
        r_nochan, "w-nochan", own_queues(r_nochan, "w-nochan", TINY_MODEL), {}
    )
    publisher, intake = Publisher(presence, RqIntake(presence)), RqIntake(presence)

    async def run() -> tuple[bool, list[int]]:
        hub = StreamHub(RedisConfig(url=no_channels))
        await hub.start()
        try:
            enqueue(
                r,
                [1, 2, 3],
                queue=keys.worker_queue_name("w-nochan"),
                relay_channel=keys.router_push("elsewhere"),  # refused to this user
            )
            (taken,) = await asyncio.to_thread(intake.take, 1, None)
            feed = await hub.subscribe(keys.request_stream(taken.id))
            got: list[int] = []
            for seq in range(3):
                await asyncio.to_thread(_step, publisher, taken, seq, 1, seq == 0)
                await _collect(feed, seq + 1, got)
            return hub.pushing, got
        finally:
            await hub.stop()

    with caplog.at_level("WARNING", logger="router.relay.stream_hub"):
        pushing, got = asyncio.run(asyncio.wait_for(run(), 60))
    assert (pushing, got) == (False, [0, 1, 2])
    refusals = [m for m in caplog.messages if "refused the push channel" in m]
    assert len(refusals) == 1

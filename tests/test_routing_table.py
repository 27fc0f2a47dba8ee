"""The pool's placement table on a real Redis (router/placement/pool_table.lua): the worker each
admitted request counts on and every worker's totals, which a placement decision reads instead
of each worker's own keys. Every path that moves a request moves its count: placement, start,
release, a reservation lapsing; the facts table follows a worker's epoch; the first block's
routed marks follow their requests."""

from __future__ import annotations

import asyncio

import redis

from router.placement.ledger import AdmissionLedger
from router.placement.place_call import Placement, Refusal
from shared import keys
from shared.liveness import min_alive_pttl_ms
from tests.test_routing_ledger import (
    MODEL,
    SYSTEM,
    _ledger,
    _members,
    _place,
    _started,
    _worker,
)


def _table(r: redis.Redis) -> tuple[dict[str, str], dict[str, str]]:
    """(request id -> its entry, worker id -> its totals), as text."""

    def text(key: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in r.hgetall(key).items()}

    return text(keys.routing_placed()), text(keys.routing_load())


def _lapse(r: redis.Redis, rid: str) -> None:
    """As if its router crashed long ago: the reservation's lease is over."""
    r.zadd(keys.admission_inflight(), {rid: 1})


def test_a_placement_counts_on_its_worker_with_its_unstarted_tokens(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", holds=SYSTEM)
    ledger = _ledger(redis_url)
    placed = _place(ledger, "a", SYSTEM + [5] * 20)
    assert placed.worker_id == "w1"
    assert _table(r) == ({"a": "w1 20"}, {"w1": "1 20"})

    async def life() -> None:
        await ledger.started("a", "w1", 128)
        assert _table(r) == ({"a": "w1 0"}, {"w1": "1 0"})  # running, nothing left to prefill
        await ledger.release("a")

    asyncio.run(life())
    assert _table(r) == ({}, {})


def test_a_lapsed_reservation_frees_its_workers_count(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    ledger = _ledger(redis_url, max_inflight_per_worker=1)
    assert _place(ledger, "a", [1] * 40).worker_id == "w1"
    refused = ledger.reserve("b", 40, MODEL, [])
    assert isinstance(refused, Refusal) and refused.scope == "model"
    _lapse(r, "a")
    # The next decision purges it: its count, its tokens and its worker's own entries go.
    assert _place(ledger, "b", [2] * 40).worker_id == "w1"
    assert _table(r) == ({"b": "w1 40"}, {"w1": "1 40"})
    assert r.zscore(keys.worker_load("w1"), "a") is None
    assert r.hget(keys.worker_prefill("w1"), "a") is None


def test_a_request_counts_once_however_often_it_ends(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    _worker(r, "w2")
    ledger = _ledger(redis_url, max_inflight_per_worker=2)
    for rid in ("a", "b"):
        assert _place(ledger, rid, [3] * 20).worker_id in ("w1", "w2")

    async def end_twice() -> None:
        await ledger.release("a")
        await ledger.release("a")  # a second release (a retried end) changes nothing
        _lapse(r, "a")  # nor does its lease running out afterwards

    asyncio.run(end_twice())
    placed, load = _table(r)
    assert list(placed) == ["b"]
    assert load == {placed["b"].split()[0]: "1 20"}


def test_a_start_elsewhere_moves_the_count_to_the_worker_that_took_it(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", holds=SYSTEM)
    _worker(r, "w2")
    ledger = _ledger(redis_url, max_inflight_per_worker=1)
    assert _place(ledger, "a", SYSTEM + [4] * 3).worker_id == "w1"

    async def taken() -> None:
        await ledger.started("a", "w2", 0)  # w2 stole it from w1's queue

    asyncio.run(taken())
    assert _table(r) == ({"a": "w2 0"}, {"w2": "1 0"})
    # w1 is free again, w2 is at its bound: the next request goes to w1 whatever it holds.
    assert _place(ledger, "b", [9] * 40).worker_id == "w1"


def test_a_start_is_not_waited_for_and_a_release_right_after_it_leaves_no_count(
    redis_url: str,
) -> None:
    """The relay does not wait for a start's script (it goes on at once):
    `started` returns with the script on its way, its effect lands (the count moves to the
    worker that took it), and a release asked for at once after it leaves no count on either
    worker."""
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", holds=SYSTEM)
    _worker(r, "w2")
    ledger = _ledger(redis_url)
    assert _place(ledger, "a", SYSTEM + [4] * 3).worker_id == "w1"

    async def start_then_end() -> tuple[bool, tuple[dict[str, str], dict[str, str]]]:
        recorded = ledger.started("a", "w2", 0)  # w2 stole it from w1's queue
        answered = recorded.done()
        await recorded
        moved = _table(r)
        await ledger.release("a")
        return answered, moved

    answered, moved = asyncio.run(start_then_end())
    assert answered is False
    assert moved == ({"a": "w2 0"}, {"w2": "1 0"})
    assert _table(r) == ({}, {})
    assert r.zscore(keys.worker_load("w2"), "a") is None
    assert r.zscore(keys.worker_load("w1"), "a") is None


def test_a_request_taken_off_the_shared_queue_counts_on_its_taker(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    ledger = _ledger(redis_url)
    waiting = _place(ledger, "a", [1] * 40)  # no live worker: the model's shared queue
    assert waiting.outcome == "no_worker" and _table(r) == ({}, {})

    async def taken() -> None:
        await ledger.started("a", "w1", 0)

    asyncio.run(taken())
    assert _table(r) == ({"a": "w1 0"}, {"w1": "1 0"})


def test_a_dead_workers_count_does_not_block_the_live_ones(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    ledger = _ledger(redis_url, max_inflight_per_worker=2)
    assert {_place(ledger, rid, [1] * 20).worker_id for rid in ("a", "b")} == {"w1"}
    r.pexpire(keys.worker_info("w1"), min_alive_pttl_ms() - 1000)  # its heartbeat stops
    _worker(r, "w2")
    # Only w2 is live: its own bound alone decides, w1's two requests are not counted.
    assert {_place(ledger, rid, [2] * 20).worker_id for rid in ("c", "d")} == {"w2"}
    refused = ledger.reserve("e", 20, MODEL, [])
    assert isinstance(refused, Refusal) and (refused.scope, refused.current, refused.bound) == (
        "model",
        2,
        2,
    )
    assert _table(r)[1] == {"w1": "2 40", "w2": "2 40"}


def test_siblings_count_on_their_worker_one_place_each(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    ledger = _ledger(redis_url)
    prompt = SYSTEM + [1] * 12
    placed = ledger.reserve("a", len(prompt), MODEL, _members(prompt), ["a1", "a2"])
    assert isinstance(placed, Placement) and placed.worker_id == "w1"
    assert _table(r) == (
        {"a": f"w1 {len(prompt)}", "a1": "w1 0", "a2": "w1 0"},
        {"w1": f"3 {len(prompt)}"},
    )

    async def one_ends() -> None:
        await ledger.release("a1")

    asyncio.run(one_ends())
    assert _table(r)[1] == {"w1": f"2 {len(prompt)}"}


def test_a_workers_new_life_is_seen_at_once(redis_url: str) -> None:
    """The facts table (model, cache mode) holds per epoch: a worker that comes back under a new
    epoch with another model or another cache is placed as what it is now."""
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", model="alpha", epoch="e1", holds=SYSTEM)
    ledger = _ledger(redis_url)
    assert _place(ledger, "a", SYSTEM + [1], model="alpha").worker_id == "w1"
    facts = r.hget(keys.routing_facts(), "w1")
    assert facts == b"e1||||alpha"
    # Restarted: a new epoch, another model, a paged cache.
    _worker(r, "w1", model="beta", epoch="e2", holds=SYSTEM[:48])
    r.hset(keys.worker_info("w1"), mapping={"storage_mode": "paged", "paged_block_size": "32"})
    gone = _place(ledger, "b", SYSTEM + [1], model="alpha")
    assert (gone.worker_id, gone.outcome) == ("", "no_worker")
    now = _place(ledger, "c", SYSTEM, model="beta")
    assert (now.worker_id, now.outcome, now.predicted_tokens) == ("w1", "cache", 32)
    assert r.hget(keys.routing_facts(), "w1") == b"e2|paged|32||beta"


def _first(tokens: list[int]) -> str:
    return keys.routing_first(_members(tokens)[0].hex())


def test_the_first_blocks_marks_follow_the_requests_that_wrote_them(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    _worker(r, "w2")
    ledger = _ledger(redis_url)

    async def life() -> None:
        first = _place(ledger, "a", SYSTEM + [1] * 5)
        wid = first.worker_id
        assert r.zscore(_first(SYSTEM), wid) == first.mark_score
        await ledger.started("a", wid, 0)  # prefilling: its blocks are on their way there
        await asyncio.sleep(0.002)  # marks are told apart by their score, in ms
        second = _place(ledger, "b", SYSTEM + [2] * 5)  # same first block: rewritten by b
        assert (second.worker_id, second.outcome) == (wid, "cache")
        assert r.zscore(_first(SYSTEM), wid) == second.mark_score
        await ledger.release("a")  # a's mark was rewritten: it stays, b's
        assert r.zscore(_first(SYSTEM), wid) == second.mark_score
        await ledger.release("b")
        assert r.zcard(_first(SYSTEM)) == 0

    asyncio.run(life())


def test_a_worker_listed_by_the_first_block_but_holding_nothing_matches_nothing(
    redis_url: str,
) -> None:
    """A reaper deletes a dead worker's routed marks but not the first block's listing: the
    listing alone never makes a match."""
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    _worker(r, "w2")
    ledger = _ledger(redis_url)
    wid = _place(ledger, "a", SYSTEM + [1] * 5).worker_id
    asyncio.run(_started(ledger, "a", wid))
    r.delete(keys.worker_routed(wid))  # as the reaper does
    assert r.zscore(_first(SYSTEM), wid) is not None
    again = _place(ledger, "b", SYSTEM + [2] * 5)
    assert (again.outcome, again.predicted_tokens) == ("load", 0)


def test_decisions_read_no_per_worker_load_keys(redis_url: str) -> None:
    """The table, not each worker's load zset, is what a decision counts: a worker's own keys
    deleted (as a reaper does) change nothing while its requests are still admitted."""
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    _worker(r, "w2")
    ledger: AdmissionLedger = _ledger(redis_url, max_inflight_per_worker=1)
    wid = _place(ledger, "a", [1] * 20).worker_id
    r.delete(keys.worker_load(wid), keys.worker_prefill(wid))
    other = _place(ledger, "b", [2] * 20)
    assert other.worker_id not in ("", wid)


def test_an_entry_whose_reservation_went_elsewhere_is_taken_off(redis_url: str) -> None:
    """A reservation purged by a router that keeps no table (an older one, mid-upgrade) leaves
    its entry: the next decision samples it, finds no reservation and frees its worker."""
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    ledger = _ledger(redis_url, max_inflight_per_worker=1)
    assert _place(ledger, "a", [1] * 20).worker_id == "w1"
    r.zrem(keys.admission_inflight(), "a")
    r.hdel(keys.admission_queued_tokens(), "a")
    assert _place(ledger, "b", [2] * 20).worker_id == "w1"
    assert _table(r) == ({"b": "w1 20"}, {"w1": "1 20"})
    assert r.zrange(keys.worker_load("w1"), 0, -1) == [b"b"]

"""Placement on a real Redis: the one script that admits a request and picks its worker, against
worker records written as workers write them (info hash with model and epoch, block set under
that epoch; the alive key a worker also writes only where a test says so, as a worker that writes
none is judged by its info hash alone). The pool end to end, with real workers, is
tests/test_routing_e2e.py."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from router.placement.ledger import AdmissionLedger
from router.placement.place_call import Placement, Refusal
from shared import keys
from shared.block_hash import BlockHasher, CacheNamespace, index_members
from shared.config import AdmissionConfig, PromptCacheConfig, RoutingConfig
from shared.liveness import alive_ttl_ms, min_alive_pttl_ms

MODEL = "m"
HASHER = BlockHasher(16, "sha256")


def _members(tokens: list[int], model: str = MODEL) -> list[bytes]:
    return index_members(HASHER.chain(tokens, CacheNamespace(model).seed()))


def _ledger(redis_url: str, policy: str = "cache_aware", **admission: Any) -> AdmissionLedger:
    config = AdmissionConfig(
        **{
            "max_inflight": 0,
            "max_inflight_per_worker": 0,
            "max_queued_prompt_tokens": 0,
            **admission,
        }
    )
    return AdmissionLedger(
        config,
        RoutingConfig(policy=policy),
        PromptCacheConfig(),
        redis.Redis.from_url(redis_url),
        aioredis.Redis.from_url(redis_url),
    )


def _worker(
    r: redis.Redis,
    wid: str,
    *,
    model: str = MODEL,
    epoch: str = "e1",
    alive: bool = True,
    holds: list[int] | None = None,
) -> None:
    r.sadd(keys.workers_roster(), wid)
    info = keys.worker_info(wid)
    r.hset(info, mapping={"pid": "1", "model": model, "epoch": epoch})
    r.pexpire(info, keys.LIVENESS_TTL_S * 1000 if alive else min_alive_pttl_ms() - 1000)
    blocks = keys.worker_blocks(wid, epoch)
    r.sadd(blocks, keys.INDEX_MARKER)
    if holds:
        r.sadd(blocks, *_members(holds, model))


def _marks(r: redis.Redis, routed: str) -> int:
    """The routed marks in a worker's set (its pin, scored +inf, is none)."""
    return int(r.zcount(routed, "-inf", "(inf"))


def _place(ledger: AdmissionLedger, rid: str, tokens: list[int], model: str = MODEL) -> Placement:
    placed = ledger.reserve(rid, len(tokens), model, _members(tokens, model))
    assert isinstance(placed, Placement), placed
    return placed


SYSTEM = list(range(100, 228))  # 8 blocks: a long shared system prompt


def test_a_request_goes_to_the_worker_holding_its_prefix(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    _worker(r, "w2", holds=SYSTEM + [1] * 16)
    _worker(r, "w3")
    placed = _place(_ledger(redis_url), "a", SYSTEM + [5] * 20)
    assert (placed.worker_id, placed.outcome, placed.predicted_tokens) == ("w2", "cache", 128)
    # Reserved there: the worker's load, its prefill, the pool's ledger, the decision's counter.
    assert r.zscore(keys.worker_load("w2"), "a") is not None
    assert int(r.hget(keys.worker_prefill("w2"), "a")) == len(SYSTEM) + 20 - 128
    assert r.zscore(keys.admission_inflight(), "a") is not None
    assert int(r.hget(keys.routing_stats(), "decisions:cache")) == 1
    assert int(r.hget(keys.routing_stats(), "predicted_tokens:w2")) == 128


def test_no_useful_match_goes_to_the_least_loaded_worker(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    _worker(r, "w2", holds=SYSTEM[:16])  # one block: under min_prefix_tokens (32), worth nothing
    ledger = _ledger(redis_url)
    first = _place(ledger, "a", SYSTEM + [7] * 10)
    assert first.outcome == "load" and first.predicted_tokens == 0
    second = _place(ledger, "b", list(range(900, 950)))
    assert second.outcome == "load" and second.worker_id != first.worker_id


def test_blocks_under_another_epoch_or_of_a_dead_worker_never_count(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    _worker(r, "w2", epoch="new")
    r.sadd(keys.worker_blocks("w2", "old"), *_members(SYSTEM))  # a zombie's, or the last life's
    _worker(r, "w3", alive=False, holds=SYSTEM)
    placed = _place(_ledger(redis_url), "a", SYSTEM + [3] * 8)
    assert placed.outcome == "load" and placed.worker_id in ("w1", "w2")
    assert placed.predicted_tokens == 0


def test_a_prefix_still_prefilling_counts_for_the_worker_it_was_sent_to(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    for wid in ("w1", "w2", "w3"):
        _worker(r, wid)
    ledger = _ledger(redis_url)

    async def life() -> None:
        first = _place(ledger, "a", SYSTEM + [1] * 5)
        assert first.outcome == "load"
        # Its worker started it (its prompt no longer waits there), and its blocks are not in
        # that worker's cache yet: they count as cached for the next request all the same.
        await ledger.started("a", first.worker_id, 0)
        second = _place(ledger, "b", SYSTEM + [2] * 5)
        assert (second.worker_id, second.outcome, second.predicted_tokens) == (
            first.worker_id,
            "cache",
            128,
        )
        # The marks go with the request that wrote them last; until then they stay.
        routed = keys.worker_routed(first.worker_id)
        await ledger.release("a")
        assert _marks(r, routed) == 8
        await ledger.release("b")
        assert _marks(r, routed) == 0
        third = _place(ledger, "c", SYSTEM + [3] * 5)
        assert third.outcome == "load" and third.predicted_tokens == 0

    asyncio.run(life())


def test_a_saturated_worker_spills_a_hot_prefix_to_a_second_one(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", holds=SYSTEM)
    _worker(r, "w2")
    ledger = _ledger(redis_url, max_inflight_per_worker=4)
    placed = [_place(ledger, f"r{i}", SYSTEM + [i] * 4) for i in range(6)]
    assert [p.worker_id for p in placed[:4]] == ["w1"] * 4
    assert all(p.outcome == "cache" for p in placed[:4])
    # w1 is at its bound: the rest spill to w2 (which then holds the prefix on its way).
    assert placed[4].worker_id == "w2" and placed[4].outcome == "spill"
    assert placed[5].worker_id == "w2"
    refused = ledger.reserve("r6", 140, MODEL, _members(SYSTEM))
    refused2 = [ledger.reserve(f"x{i}", 140, MODEL, []) for i in range(3)]
    assert isinstance(refused, Placement) and refused.worker_id == "w2"
    assert [isinstance(x, Refusal) for x in refused2] == [False, True, True]


def test_the_imbalance_gate_lets_load_decide(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", holds=SYSTEM)
    # w1 runs 40 sequences already (placed by another router before w2 came), w2 none.
    other = _ledger(redis_url)
    assert {_place(other, f"busy{i}", [900 + i] * 10).worker_id for i in range(40)} == {"w1"}
    _worker(r, "w2")
    placed = _place(_ledger(redis_url), "a", SYSTEM + [9] * 4)
    assert (placed.worker_id, placed.outcome) == ("w2", "spill")


def test_round_robin_and_least_loaded_ignore_the_caches(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", holds=SYSTEM)
    _worker(r, "w2")
    rr = _ledger(redis_url, policy="round_robin")
    picks = [_place(rr, f"rr{i}", SYSTEM + [i]).worker_id for i in range(4)]
    assert sorted(picks) == ["w1", "w1", "w2", "w2"] and picks[0] != picks[1]

    async def release_all() -> None:
        for i in range(4):
            await rr.release(f"rr{i}")

    asyncio.run(release_all())
    # w1 runs one request (placed by another router while w2 was away), w2 none.
    r.pexpire(keys.worker_info("w2"), min_alive_pttl_ms() - 1000)
    assert _place(_ledger(redis_url), "busy", [1] * 10).worker_id == "w1"
    r.pexpire(keys.worker_info("w2"), keys.LIVENESS_TTL_S * 1000)
    least = _place(_ledger(redis_url, policy="least_loaded"), "ll", SYSTEM + [1])
    assert (least.worker_id, least.outcome) == ("w2", "load")


def test_only_workers_of_the_requested_model_are_considered(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "a1", model="alpha", holds=SYSTEM)
    _worker(r, "b1", model="beta")
    ledger = _ledger(redis_url)
    assert _place(ledger, "x", SYSTEM + [1], model="alpha").worker_id == "a1"
    assert _place(ledger, "y", SYSTEM + [1], model="beta").worker_id == "b1"
    none = _place(ledger, "z", SYSTEM, model="gamma")
    assert (none.worker_id, none.outcome) == ("", "no_worker")


def test_a_start_elsewhere_moves_the_placement_and_release_frees_it(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", holds=SYSTEM)
    _worker(r, "w2")
    ledger = _ledger(redis_url)
    placed = _place(ledger, "a", SYSTEM + [4] * 3)
    assert placed.worker_id == "w1"

    async def life() -> None:
        await ledger.started("a", "w2", 64)  # w2 took it from w1's queue
        assert r.zscore(keys.worker_load("w1"), "a") is None
        assert r.zscore(keys.worker_load("w2"), "a") is not None
        assert r.hget(keys.worker_prefill("w1"), "a") is None
        assert r.hget(keys.admission_queued_tokens(), "a") is None
        await ledger.release("a")

    asyncio.run(life())
    assert r.zcard(keys.worker_load("w2")) == 0 and r.zcard(keys.admission_inflight()) == 0
    stats = {k.decode(): int(v) for k, v in r.hgetall(keys.routing_stats()).items()}
    assert stats["reused_tokens:w2"] == 64 and stats["taken_over:w2"] == 1


@pytest.mark.parametrize("routers", [2, 4])
def test_routers_racing_never_book_one_slot_twice(redis_url: str, routers: int) -> None:
    """Several router processes' ledgers place at once: each idle worker's single slot goes to
    exactly one of them, and the rest are refused."""
    r = redis.Redis.from_url(redis_url)
    for wid in ("w1", "w2"):
        _worker(r, wid)
    ledgers = [_ledger(redis_url, max_inflight_per_worker=1) for _ in range(routers)]
    answers: list[Placement | Refusal] = []
    lock, start = threading.Lock(), threading.Barrier(routers)

    def go(i: int) -> None:
        start.wait()
        got = ledgers[i].reserve(f"r{i}", 10, MODEL, _members(SYSTEM))
        with lock:
            answers.append(got)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(routers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    placed = sorted(a.worker_id for a in answers if isinstance(a, Placement))
    assert placed == ["w1", "w2"]
    assert sum(isinstance(a, Refusal) for a in answers) == routers - 2


def test_a_paged_workers_match_is_floored_to_its_pages(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", holds=SYSTEM[:48])  # three 16-token blocks
    r.hset(keys.worker_info("w1"), mapping={"storage_mode": "paged", "paged_block_size": "32"})
    placed = _place(_ledger(redis_url), "a", SYSTEM)
    assert (placed.outcome, placed.predicted_tokens) == ("cache", 32)  # it adopts one page


LONG_SHARED = [(7 + i * 13) % 900 + 5 for i in range(300)]  # ~a shared system prompt


def _snapshot_worker(r: redis.Redis, wid: str, checkpoints: list[list[int]]) -> None:
    """A snapshot-mode worker as it publishes itself: only the last block of each checkpoint
    it holds is in its index (worker/prompt_cache/entries.py resume_points)."""
    _worker(r, wid)
    r.hset(keys.worker_info(wid), mapping={"storage_mode": "snapshot", "checkpoint_tokens": "256"})
    for tokens in checkpoints:
        r.sadd(keys.worker_blocks(wid, "e1"), _members(tokens)[-1])


def test_a_snapshot_workers_match_is_its_deepest_checkpoint_inside_the_prompt(
    redis_url: str,
) -> None:
    r = redis.Redis.from_url(redis_url)
    first = LONG_SHARED + [1] * 24
    _snapshot_worker(r, "w1", [first[:256], first[:320]])
    _worker(r, "w2")
    ledger = _ledger(redis_url)
    # Diverges at 300: the checkpoint at 320 is not inside what it shares, the one at 256 is.
    placed = _place(ledger, "a", LONG_SHARED + [2] * 24)
    assert (placed.worker_id, placed.outcome, placed.predicted_tokens) == ("w1", "cache", 256)
    # An identical prompt resumes at its last checkpoint, short of its last token.
    again = _place(ledger, "b", first)
    assert (again.worker_id, again.predicted_tokens) == ("w1", 320)
    # A prompt that is exactly a checkpoint long cannot restore it (one token must be left).
    exact = _place(ledger, "c", first[:320])
    assert (exact.worker_id, exact.predicted_tokens) == ("w1", 256)


def test_a_prompt_sent_to_a_snapshot_worker_marks_only_its_checkpoints(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _snapshot_worker(r, "w1", [])
    ledger = _ledger(redis_url)
    placed = _place(ledger, "a", LONG_SHARED + [1] * 24)  # 324 tokens: checkpoints 256 and 320
    assert placed.worker_id == "w1" and placed.predicted_tokens == 0
    prompt = LONG_SHARED + [1] * 24
    members = _members(prompt)
    routed = set(r.zrangebyscore(keys.worker_routed("w1"), "-inf", "(inf"))
    assert routed == {members[15], members[19]}
    second = _place(ledger, "b", LONG_SHARED + [2] * 24)
    assert (second.worker_id, second.outcome, second.predicted_tokens) == ("w1", "cache", 256)


def test_the_choices_of_one_prompt_are_placed_together_or_refused_together(
    redis_url: str,
) -> None:
    """A request's siblings (the other choices of its prompt) are admitted with it and placed on
    its worker, even past that worker's own bound (they cost it no prefill); past the pool's
    bound they are refused with it, leaving nothing reserved."""
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    _worker(r, "w2")
    ledger = _ledger(redis_url, max_inflight=5, max_inflight_per_worker=3)
    prompt = SYSTEM + [1] * 12
    group = ["a", "a1", "a2", "a3"]
    placed = ledger.reserve("a", len(prompt), MODEL, _members(prompt), group[1:])
    assert isinstance(placed, Placement) and placed.worker_id
    wid, other = placed.worker_id, "w2" if placed.worker_id == "w1" else "w1"
    assert sorted(m.decode() for m in r.zrange(keys.worker_load(wid), 0, -1)) == group
    assert r.zcard(keys.worker_load(other)) == 0
    assert all(r.zscore(keys.admission_inflight(), rid) is not None for rid in group)
    # The prompt waits once: only the first choice has prompt tokens to compute.
    assert r.hkeys(keys.admission_queued_tokens()) == [b"a"]
    assert r.hkeys(keys.worker_prefill(wid)) == [b"a"]
    stats = {k.decode(): int(v) for k, v in r.hgetall(keys.routing_stats()).items()}
    assert (
        stats[f"routed:{wid}"] == 4
        and sum(v for k, v in stats.items() if k.startswith("decisions:")) == 1
    )
    # Each sibling is expected to reuse all of the prompt but its last token.
    assert stats[f"predicted_tokens:{wid}"] == 3 * (len(prompt) - 1)

    refused = ledger.reserve("b", 10, MODEL, [], ["b1"])  # 4 + 2 places: past the bound of 5
    assert isinstance(refused, Refusal) and refused.reason == "inflight"
    assert r.zscore(keys.admission_inflight(), "b") is None
    assert r.zscore(keys.admission_inflight(), "b1") is None
    alone = ledger.reserve("c", 10, MODEL, [])  # one place is left, on the other worker
    assert isinstance(alone, Placement) and alone.worker_id == other

    async def release_all() -> None:
        for rid in [*group, "c"]:
            await ledger.release(rid)

    asyncio.run(release_all())
    assert r.zcard(keys.admission_inflight()) == 0 and r.zcard(keys.worker_load(wid)) == 0


def test_a_worker_counts_as_alive_by_its_alive_key_or_else_by_its_info_hash(
    redis_url: str,
) -> None:
    r = redis.Redis.from_url(redis_url)
    # w1's info hash looks stale, but its alive key, which it writes with every beat, stands:
    # the key decides, and names the epoch its block index is read under.
    _worker(r, "w1", alive=False, epoch="e7", holds=SYSTEM)
    r.set(keys.worker_alive("w1"), "e7", px=alive_ttl_ms())
    r.sadd(keys.routing_holders(_members(SYSTEM)[0].hex()), "w1")  # it lists itself, too
    _worker(r, "w2")  # writes no alive key: its info hash's TTL decides
    _worker(r, "w3", alive=False)  # neither
    rr = _ledger(redis_url, policy="round_robin")
    assert {_place(rr, f"r{i}", [i] * 20).worker_id for i in range(6)} == {"w1", "w2"}
    placed = _place(_ledger(redis_url), "c", SYSTEM + [9] * 5)
    assert (placed.worker_id, placed.outcome, placed.predicted_tokens) == ("w1", "cache", 128)
    # Its alive key lapsed: w1 no longer counts, whatever its info hash holds.
    r.delete(keys.worker_alive("w1"))
    r.pexpire(keys.worker_info("w1"), min_alive_pttl_ms() - 1000)
    assert {_place(rr, f"s{i}", [i] * 20).worker_id for i in range(4)} == {"w2"}


def test_a_workers_routed_marks_are_kept_in_a_skiplist(redis_url: str) -> None:
    """Its pin keeps the set a skiplist from its first mark: a prompt's marks are looked up,
    never scanned for in a listpack once per block. The pin counts as no block."""
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1")
    ledger = _ledger(redis_url)
    first = _place(ledger, "a", SYSTEM + [1] * 5)
    routed = keys.worker_routed("w1")
    assert r.object("encoding", routed) == b"skiplist"
    assert r.zscore(routed, keys.ROUTED_PIN) == float("inf") and _marks(r, routed) == 8
    second = _place(ledger, "b", SYSTEM + [2] * 5)
    assert (second.worker_id, second.outcome, second.predicted_tokens) == ("w1", "cache", 128)
    assert first.worker_id == "w1"


def test_a_worker_that_lists_itself_is_found_by_the_holders_of_the_first_block(
    redis_url: str,
) -> None:
    """A worker with an alive key lists itself under the first blocks it holds: a decision reads
    that one set, not the worker's block set, to rule it out; a listing is checked against the
    worker's own set, and one its set does not bear out (an earlier life's) goes."""
    r = redis.Redis.from_url(redis_url)
    first = _members(SYSTEM)[0]
    holders = keys.routing_holders(first.hex())
    for wid in ("w1", "w2", "w3"):
        _worker(r, wid, holds=SYSTEM if wid != "w3" else None)
        r.set(keys.worker_alive(wid), "e1", px=alive_ttl_ms())
    # w1 holds the prefix and lists itself; w2 holds it and is not listed (its listing lapsed):
    # it is not found; w3 is listed from an earlier life and holds nothing now.
    r.sadd(holders, "w1", "w3")
    ledger = _ledger(redis_url)
    placed = _place(ledger, "a", SYSTEM + [1] * 5)
    assert (placed.worker_id, placed.outcome, placed.predicted_tokens) == ("w1", "cache", 128)
    assert r.smembers(holders) == {b"w1"}  # w3's stale entry went
    assert r.pttl(holders) > (keys.HOLDERS_TTL_S - 60) * 1000  # a holder found: the set lives on
    asyncio.run(ledger.release("a"))
    # With w1 unlisted, nothing finds the prefix (w2's block set is never read for it).
    r.srem(holders, "w1")
    assert _place(ledger, "b", SYSTEM + [2] * 5).outcome == "load"


def _listing(r: redis.Redis, wid: str, epoch: str = "e1", holds: list[int] | None = None) -> None:
    """A worker that writes its alive key (and lists itself under the first blocks it holds)."""
    _worker(r, wid, epoch=epoch, holds=holds)
    r.set(keys.worker_alive(wid), epoch, px=alive_ttl_ms())
    if holds:
        r.sadd(keys.routing_holders(_members(holds)[0].hex()), wid)


def test_a_kept_live_list_never_places_on_a_worker_gone_since(redis_url: str) -> None:
    """A decision keeps the model's live workers for the next ones (keys.LIVE_CACHE_MS); the one
    it would choose from them is read again, so a worker whose alive key lapsed meanwhile is not
    chosen, and the list is read anew."""
    r = redis.Redis.from_url(redis_url)
    _listing(r, "w1")
    _listing(r, "w2")
    ledger = _ledger(redis_url)
    assert _place(ledger, "a", [7] * 40).worker_id == "w1"
    assert r.pttl(keys.routing_live(MODEL)) > 0  # kept for the next decisions
    # w2, the least loaded now, died: its alive key lapsed, its info hash is past its time; the
    # roster still names it.
    r.delete(keys.worker_alive("w2"))
    r.pexpire(keys.worker_info("w2"), min_alive_pttl_ms() - 1000)
    assert _place(ledger, "b", [8] * 40).worker_id == "w1"


def test_a_kept_live_list_sees_a_worker_that_joins_or_restarts(redis_url: str) -> None:
    """A worker new to the roster changes its size: the kept list is read anew. A worker that
    restarted under the same id (a new epoch) is read again when chosen: its new block set
    counts, not its last life's."""
    r = redis.Redis.from_url(redis_url)
    _listing(r, "w1")
    ledger = _ledger(redis_url)
    assert _place(ledger, "a", [7] * 40).worker_id == "w1"
    _listing(r, "w2", holds=SYSTEM)
    joined = _place(ledger, "b", SYSTEM + [1] * 5)
    assert (joined.worker_id, joined.outcome, joined.predicted_tokens) == ("w2", "cache", 128)
    # w2 restarts as e2 holding the prefix again; its e1 set is gone with its last life.
    r.delete(keys.worker_blocks("w2", "e1"))
    _listing(r, "w2", epoch="e2", holds=SYSTEM)
    again = _place(ledger, "c", SYSTEM + [2] * 5)
    assert (again.worker_id, again.outcome, again.predicted_tokens) == ("w2", "cache", 128)


def test_a_kept_live_list_without_a_worker_is_read_again(redis_url: str) -> None:
    """No live worker in the kept list (the request goes to the model's shared queue) is not
    taken on trust: a worker back to life since, still on the roster, takes the next request."""
    r = redis.Redis.from_url(redis_url)
    _worker(r, "w1", alive=False)
    ledger = _ledger(redis_url)
    assert _place(ledger, "a", [7] * 40).outcome == "no_worker"
    assert r.pttl(keys.routing_live(MODEL)) > 0
    _listing(r, "w1")  # its beat again: alive key and info hash, the roster unchanged
    assert _place(ledger, "b", [8] * 40).worker_id == "w1"


async def _started(ledger: AdmissionLedger, request_id: str, worker_id: str) -> None:
    """The start recorded, waited for (the relay does not wait for it)."""
    await ledger.started(request_id, worker_id, 0)

"""The pool's admission ledger: one bound on requests in flight and queued prompt tokens, shared
by every router process and host, decided in ONE atomic Redis script before anything is enqueued.

A reservation is a member of a sorted set scored by when it lapses: its router refreshes the
reservations it holds every third of `reservation_ttl_s` and removes each when its request ends,
so a crashed router's reservations free themselves. The script purges lapsed members first, then
counts; the clock is Redis's own (TIME), so routers on hosts with skewed clocks agree. Per-worker
bound: the pool bound is at most `max_inflight_per_worker` times the live workers
(shared.liveness), while at least one is live.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from router.cancellation import stop_if_cancelled
from router.edge.busy_gate import BusyGate
from router.placement.place_call import PlaceArgs, Placement, Refusal, parse_reply
from router.placement.routing_metrics import observe_start
from router.redis_batch import RedisBatch
from shared import keys
from shared.config import AdmissionConfig, PromptCacheConfig, RoutingConfig
from shared.liveness import min_alive_pttl_ms

log = logging.getLogger(__name__)

# The pool's placement table (router/placement/pool_table.lua): its helpers go in front of each
# script that places, starts or ends a request, so every one of them moves a request's count.
POOL_TABLE_LUA = (Path(__file__).with_name("pool_table.lua")).read_text()


def _with_table(script: str) -> str:
    return POOL_TABLE_LUA + script


# Admission and placement: one script (router/placement/placement.lua), so a bound and a worker's
# slot are decided and reserved together.
PLACE_LUA = _with_table((Path(__file__).with_name("placement.lua")).read_text())
PLACE_KEYS = [
    keys.admission_inflight(),
    keys.admission_queued_tokens(),
    keys.workers_roster(),
    keys.routing_stats(),
    keys.routing_cursor(),
    keys.routing_placed(),
    keys.routing_load(),
    keys.routing_facts(),
]

# A request started: its prompt tokens stop waiting, its load entry follows the worker that took
# it (a stealing peer, or any worker off the shared queue), lapsing with its reservation, and the
# routing counters learn what that worker reused: one round trip.
# KEYS: queued, placed worker's prefill and load ('' none), taker's load, inflight, stats,
#       placements, worker loads
# ARGV: request id, routed ttl ms, the taker's id, its cached tokens, the placed worker ('')
STARTED_LUA = _with_table("""
redis.call('HDEL', KEYS[1], ARGV[1])
if KEYS[2] ~= '' then redis.call('HDEL', KEYS[2], ARGV[1]) end
local score = redis.call('ZSCORE', KEYS[5], ARGV[1])
if KEYS[3] ~= KEYS[4] then
  if KEYS[3] ~= '' then redis.call('ZREM', KEYS[3], ARGV[1]) end
  if score then
    redis.call('ZADD', KEYS[4], score, ARGV[1])
    redis.call('PEXPIRE', KEYS[4], ARGV[2])
  end
end
-- In the table it counts on the taker now, with nothing left to prefill (while it is admitted).
if unplace(KEYS[7], KEYS[8], ARGV[1]) or score then
  place_on(KEYS[7], KEYS[8], ARGV[3], {ARGV[1]}, 0)
end
redis.call('HINCRBY', KEYS[6], 'reused_tokens:' .. ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[6], 'started:' .. ARGV[3], 1)
if ARGV[5] ~= '' and ARGV[5] ~= ARGV[3] then
  redis.call('HINCRBY', KEYS[6], 'taken_over:' .. ARGV[3], 1)
end
return 1
""")

# A request ended: its reservations go, its count in the placement table (once: the entry goes
# with it), and so do the routed marks it wrote, unless a later placement of the same blocks
# rewrote them (then that request's end removes them).
# KEYS: inflight, queued, placements, worker loads, load, prefill, routed, first block's marks
#       ('' for the last four: none)
# ARGV: request id, the marks' score, the marked worker, the members
RELEASE_LUA = _with_table("""
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
unplace(KEYS[3], KEYS[4], ARGV[1])
if KEYS[5] == '' then return 0 end
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
local mine, gone = ARGV[2], 0
if #ARGV < 4 or mine == '0' then return 0 end
if KEYS[8] ~= '' and tonumber(redis.call('ZSCORE', KEYS[8], ARGV[3]) or -1) == tonumber(mine) then
  redis.call('ZREM', KEYS[8], ARGV[3])
end
local scores = redis.call('ZMSCORE', KEYS[7], unpack(ARGV, 4))
local stale = {}
for i, score in ipairs(scores) do
  if score and tonumber(score) == tonumber(mine) then stale[#stale + 1] = ARGV[i + 3] end
end
for i = 1, #stale, 1000 do
  gone = gone + redis.call('ZREM', KEYS[7], unpack(stale, i, math.min(i + 999, #stale)))
end
return gone
""")

# Extends only reservations still held (XX): one that lapsed meanwhile stays released.
# ARGV: ttl ms, then (request id, its worker's load key or '') pairs.
REFRESH_LUA = """
local t = redis.call('TIME')
local ttl = tonumber(ARGV[1])
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
for i = 2, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
  local load = ARGV[i + 1]
  if load ~= '' then
    redis.call('ZADD', load, 'XX', expiry, ARGV[i])
    redis.call('PEXPIRE', load, ttl)
  end
end
return (#ARGV - 1) / 2
"""


class AdmissionLedger:
    def __init__(
        self,
        config: AdmissionConfig,
        routing: RoutingConfig,
        prompt_cache: PromptCacheConfig,
        sync_redis: redis.Redis,
        aredis: aioredis.Redis,
        batch: RedisBatch | None = None,
    ) -> None:
        self.config = config
        self.routing = routing
        self.block_size = prompt_cache.apc_block_size
        # A worker adopts no match shorter than this, so shorter ones are worth nothing.
        self.min_match = max(prompt_cache.min_prefix_tokens, 1)
        self._place = sync_redis.register_script(PLACE_LUA)
        self._started = aredis.register_script(STARTED_LUA)
        self._refresh = aredis.register_script(REFRESH_LUA)
        # One registration serves both sides: the command batch sends only its sha and text.
        self._release = sync_redis.register_script(RELEASE_LUA)
        self.aredis = aredis
        # The start and release scripts go through the process's command batch (one of its own
        # when none is given: it stops with this ledger).
        self._own_batch = batch is None
        self.batch = batch if batch is not None else RedisBatch(aredis)
        self._ttl_ms = int(config.reservation_ttl_s * 1000)
        # this process's reservations: original request id -> the worker it is placed on ("")
        self._held: dict[str, str] = {}
        # the routed marks each wrote: request id -> (worker, their score, the members)
        self._marks: dict[str, tuple[str, int, list[bytes]]] = {}
        self._task: asyncio.Task[None] | None = None
        # Remembers the last refusal at a bound of requests in flight (router.edge.busy_gate).
        self.gate = BusyGate(config.busy_hold_ms / 1000)

    def reserve(
        self,
        request_id: str,
        prompt_tokens: int,
        model_id: str,
        members: list[bytes],
        siblings: Sequence[str] = (),
    ) -> Placement | Refusal:
        """Admit and place the request, blocking (a thread's, or a benchmark's): what
        reserve_async does, on the sync client."""
        call = self._place_call(request_id, prompt_tokens, model_id, siblings)
        opened = self.gate.opened  # a release after this makes this refusal stale
        reply = self._place(keys=PLACE_KEYS, args=call.argv(members))
        return self._placed(call, members, parse_reply(reply), opened)

    async def reserve_async(
        self,
        request_id: str,
        prompt_tokens: int,
        model_id: str,
        members: list[bytes],
        siblings: Sequence[str] = (),
    ) -> Placement | Refusal:
        """Admit and place the request: a Placement, or a Refusal when the pool is at a bound.
        `members` are the prompt's block index members (shared.block_hash.index_members), in
        order. `siblings`: the request ids of the other choices of its prompt, admitted and
        placed with it on the same worker (each holds its own reservation, released by its own
        id), or refused with it. The script goes out in the process's command batch."""
        call = self._place_call(request_id, prompt_tokens, model_id, siblings)
        opened = self.gate.opened
        reply = await self.batch.script(self._place, PLACE_KEYS, call.argv(members))
        return self._placed(call, members, parse_reply(reply), opened)

    def _place_call(
        self, request_id: str, prompt_tokens: int, model_id: str, siblings: Sequence[str]
    ) -> PlaceArgs:
        c, r = self.config, self.routing
        t = keys.WORKER_KEY_TEMPLATES
        return PlaceArgs(
            request_id=request_id,
            ttl_ms=self._ttl_ms,
            prompt_tokens=prompt_tokens,
            max_inflight=c.max_inflight,
            max_inflight_per_worker=c.max_inflight_per_worker,
            max_queued_prompt_tokens=c.max_queued_prompt_tokens,
            min_alive_pttl_ms=min_alive_pttl_ms(),
            info_template=t["info"],
            alive_template=t["alive"],
            blocks_template=t["blocks"],
            routed_template=t["routed"],
            first_template=keys.ROUTING_FIRST_TEMPLATE,
            holders_template=keys.ROUTING_HOLDERS_TEMPLATE,
            live_key=keys.routing_live(model_id),
            live_ttl_ms=keys.LIVE_CACHE_MS,
            load_template=t["load"],
            prefill_template=t["prefill"],
            model=model_id,
            policy=r.policy,
            block_size=self.block_size,
            min_match=self.min_match,
            decode_weight=r.decode_weight,
            balance_abs=r.balance_abs_threshold,
            balance_rel=r.balance_rel_threshold,
            routed_ttl_ms=keys.ROUTED_TTL_S * 1000,
            holders_ttl_ms=keys.HOLDERS_TTL_S * 1000,
            skiplist_pin=keys.ROUTED_PIN,
            siblings=list(siblings),
        )

    def _placed(
        self, call: PlaceArgs, members: list[bytes], reply: Placement | Refusal, opened: int
    ) -> Placement | Refusal:
        """The script's answer taken in: a reservation held (and its marks), or the busy gate
        closed by a refusal at a bound of requests in flight."""
        if isinstance(reply, Refusal):
            pool_wide = reply.scope == "pool"
            # Too many choices for the places left is no sign of a full pool: a lone request
            # would still fit, so the door stays open.
            too_many = pool_wide and reply.current + 1 <= reply.bound
            if reply.reason == "inflight" and not too_many:
                self.gate.close(call.model, reply.message(), pool_wide, opened)
            return reply
        for rid in (call.request_id, *call.siblings):
            self._held[rid] = reply.worker_id
        if reply.mark_score:
            self._marks[call.request_id] = (reply.worker_id, reply.mark_score, members)
        return reply

    def started(self, request_id: str, worker_id: str, cached_tokens: int) -> asyncio.Future[None]:
        """A worker started the request: its prompt tokens are no longer waiting; the placement
        follows the worker that took it (a stealing peer, or any worker off the shared queue),
        and what it reused is counted beside what the router predicted. The script goes out in
        the command batch's next write, ahead of any command asked for later (the request's
        release among them), so the relay goes on without waiting for its reply; the future
        returned is done once Redis answered (a failure is logged, not raised)."""
        placed = self._held.get(request_id, "")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not worker_id:
            done.set_result(None)
            return done
        self._held[request_id] = worker_id
        observe_start(worker_id, cached_tokens)
        reply = self.batch.script(
            self._started,
            keys=[
                keys.admission_queued_tokens(),
                keys.worker_prefill(placed) if placed else "",
                keys.worker_load(placed) if placed else "",
                keys.worker_load(worker_id),
                keys.admission_inflight(),
                keys.routing_stats(),
                keys.routing_placed(),
                keys.routing_load(),
            ],
            args=[request_id, keys.ROUTED_TTL_S * 1000, worker_id, cached_tokens, placed],
        )

        def answered(sent: asyncio.Future[Any]) -> None:
            if not sent.cancelled() and sent.exception() is not None:
                log.warning(
                    "could not record the start of %s", request_id, exc_info=sent.exception()
                )
            if not done.done():
                done.set_result(None)

        reply.add_done_callback(answered)
        return done

    async def release(self, request_id: str) -> None:
        # Open before the release too: once Redis has applied it, a request this process takes
        # (which may be read before the script's reply) must ask the ledger, not a stale refusal.
        self.gate.open()
        try:
            await self.batch.script(self._release, **self._release_call(request_id))
        except redis.RedisError:  # it lapses on its own within reservation_ttl_s
            log.warning("could not release the reservation of %s", request_id, exc_info=True)
        self.gate.open()  # after the release: a refusal decided before it is stale

    def release_sync(self, request_id: str, client: redis.Redis) -> None:
        """Release, blocking: reserve()'s counterpart, for a caller off the event loop (the
        tests' second router, a tool)."""
        with suppress(redis.RedisError):
            self._release(**self._release_call(request_id), client=client)
        self.gate.open()

    def _release_call(self, request_id: str) -> dict[str, Any]:
        worker_id = self._held.pop(request_id, "")
        marked, score, members = self._marks.pop(request_id, ("", 0, []))
        placed = (
            [keys.worker_load(worker_id), keys.worker_prefill(worker_id)] if worker_id else ["", ""]
        )
        routed = keys.worker_routed(marked) if marked else ""
        first = keys.routing_first(members[0].hex()) if marked and members else ""
        table = [keys.routing_placed(), keys.routing_load()]
        return {
            "keys": [
                keys.admission_inflight(),
                keys.admission_queued_tokens(),
                *table,
                *placed,
                routed,
                first,
            ],
            "args": [request_id, score if marked else 0, marked, *members],
        }

    # -- keeping this process's reservations alive -------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._keep_alive(), name="admission-ledger")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        if self._own_batch:
            await self.batch.stop()

    async def _keep_alive(self) -> None:
        while True:
            stop_if_cancelled()  # a stop swallowed by the last refresh's send ends it here
            await asyncio.sleep(self.config.reservation_ttl_s / 3)
            held = list(self._held.items())
            if not held:
                continue
            args: list[object] = [self._ttl_ms]
            for rid, wid in held:
                args += [rid, keys.worker_load(wid) if wid else ""]
            try:
                await self._refresh(keys=[keys.admission_inflight()], args=args)
            except redis.RedisError as exc:
                log.warning("could not refresh %d reservation(s): %s", len(held), exc)

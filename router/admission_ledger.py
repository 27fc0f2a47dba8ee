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
from contextlib import suppress
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.config import AdmissionConfig
from shared.liveness import min_alive_pttl_ms

log = logging.getLogger(__name__)

RESERVE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 1, #lapsed, 1000 do
  redis.call('HDEL', KEYS[2], unpack(lapsed, i, math.min(i + 999, #lapsed)))
end
if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
local limit = tonumber(ARGV[4])
local per_worker = tonumber(ARGV[5])
if per_worker > 0 then
  local at = string.find(ARGV[8], '{wid}', 1, true)
  local min_pttl = tonumber(ARGV[7])
  local live = 0
  for _, wid in ipairs(redis.call('SMEMBERS', KEYS[3])) do
    local info = string.sub(ARGV[8], 1, at - 1) .. wid .. string.sub(ARGV[8], at + 5)
    if redis.call('PTTL', info) > min_pttl then live = live + 1 end
  end
  if live > 0 and (limit == 0 or per_worker * live < limit) then limit = per_worker * live end
end
local n = redis.call('ZCARD', KEYS[1])
if limit > 0 and n >= limit then return {0, 'inflight', n, limit} end
local tokens = tonumber(ARGV[3])
local max_queued = tonumber(ARGV[6])
if max_queued > 0 then
  local queued = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do queued = queued + tonumber(v) end
  if queued > 0 and queued + tokens > max_queued then return {0, 'tokens', queued, max_queued} end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if tokens > 0 then redis.call('HSET', KEYS[2], ARGV[1], tokens) end
return {1, 'ok', n + 1, limit}
"""

# Extends only reservations still held (XX): one that lapsed meanwhile stays released.
REFRESH_LUA = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i]) end
return #ARGV - 1
"""


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: `inflight` or `tokens`, with the count and the bound."""

    reason: str
    current: int
    bound: int

    def message(self) -> str:
        if self.reason == "inflight":
            return f"The pool is at its bound of {self.bound} requests in flight; retry shortly."
        return (
            f"The pool has {self.current} prompt tokens waiting for a worker (bound "
            f"{self.bound}); retry shortly."
        )


class AdmissionLedger:
    def __init__(
        self, config: AdmissionConfig, sync_redis: redis.Redis, aredis: aioredis.Redis
    ) -> None:
        self.config = config
        self._reserve = sync_redis.register_script(RESERVE_LUA)
        self._refresh = aredis.register_script(REFRESH_LUA)
        self.aredis = aredis
        self._ttl_ms = int(config.reservation_ttl_s * 1000)
        self._held: set[str] = set()  # this process's reservations (by original request id)
        self._task: asyncio.Task[None] | None = None

    def reserve(self, request_id: str, prompt_tokens: int) -> Refusal | None:
        """Reserve a place for the request (blocking: call it off the event loop); a Refusal
        when the pool is at a bound."""
        c = self.config
        reply = self._reserve(
            keys=[keys.admission_inflight(), keys.admission_queued_tokens(),
                  keys.workers_roster()],
            args=[request_id, self._ttl_ms, prompt_tokens, c.max_inflight,
                  c.max_inflight_per_worker, c.max_queued_prompt_tokens, min_alive_pttl_ms(),
                  keys.WORKER_KEY_TEMPLATES["info"]],
        )  # fmt: skip
        if int(reply[0]) != 1:
            reason = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            return Refusal(reason, int(reply[2]), int(reply[3]))
        self._held.add(request_id)
        return None

    async def started(self, request_id: str) -> None:
        """A worker started the request: its prompt tokens are no longer waiting."""
        with suppress(redis.RedisError):
            await self.aredis.hdel(keys.admission_queued_tokens(), request_id)

    async def release(self, request_id: str) -> None:
        self._held.discard(request_id)
        try:
            async with self.aredis.pipeline(transaction=False) as pipe:
                pipe.zrem(keys.admission_inflight(), request_id)
                pipe.hdel(keys.admission_queued_tokens(), request_id)
                await pipe.execute()
        except redis.RedisError:  # it lapses on its own within reservation_ttl_s
            log.warning("could not release the reservation of %s", request_id, exc_info=True)

    def release_sync(self, request_id: str, client: redis.Redis) -> None:
        """Release from a worker thread (an enqueue that failed after its reservation)."""
        self._held.discard(request_id)
        with suppress(redis.RedisError), client.pipeline(transaction=False) as pipe:
            pipe.zrem(keys.admission_inflight(), request_id)
            pipe.hdel(keys.admission_queued_tokens(), request_id)
            pipe.execute()

    # -- keeping this process's reservations alive -------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._keep_alive(), name="admission-ledger")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.config.reservation_ttl_s / 3)
            held = list(self._held)
            if not held:
                continue
            try:
                await self._refresh(keys=[keys.admission_inflight()], args=[self._ttl_ms, *held])
            except redis.RedisError as exc:
                log.warning("could not refresh %d reservation(s): %s", len(held), exc)

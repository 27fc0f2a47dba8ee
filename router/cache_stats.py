"""The pool's view of its workers, read in ONE Redis round trip.

A Lua script (registered once in lifespan) walks the worker roster and returns, per member, its
info, counters, gauges and last-reject values. Keys reach the script only as the roster key and
the templates from shared.keys.WORKER_KEY_TEMPLATES; nothing here formats a key.
`/v1/cache/stats` merges the snapshots; `/health` reads liveness and info from the same call.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from shared import keys
from shared.cache_stats import (
    COUNTER_FIELDS,
    GAUGE_FIELDS,
    LAST_REJECT_FIELDS,
    SETTING_FIELDS,
    WorkerCacheSnapshot,
    merge_pool,
)

_TEMPLATE_ORDER = ("info", "counters", "gauges", "last_reject")

# Per member: {wid, info (flat HGETALL), counters, gauges (numbers, in the field lists' order),
# settings, last_reject (strings or nil)}. Fields go in as ARGV so replies carry values only, and
# counts come back as Redis integers: the router parses ~4x fewer strings than with HGETALL.
READ_POOL_LUA = """
local function split(s)
  local t = {}
  for f in string.gmatch(s, '[^,]+') do t[#t + 1] = f end
  return t
end
local counter_f, gauge_f = split(ARGV[5]), split(ARGV[6])
local setting_f, reject_f = split(ARGV[7]), split(ARGV[8])
local function key(template, wid)
  return (string.gsub(template, '{wid}', function() return wid end))
end
local function numbers(k, fields)
  local vals = redis.call('HMGET', k, unpack(fields))
  for i = 1, #vals do vals[i] = tonumber(vals[i]) or 0 end
  return vals
end
local out = {}
for _, wid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local gauges = key(ARGV[3], wid)
  out[#out + 1] = {
    wid,
    redis.call('HGETALL', key(ARGV[1], wid)),
    numbers(key(ARGV[2], wid), counter_f),
    numbers(gauges, gauge_f),
    redis.call('HMGET', gauges, unpack(setting_f)),
    redis.call('HMGET', key(ARGV[4], wid), unpack(reject_f)),
  }
end
return out
"""

_ARGS = [
    *(keys.WORKER_KEY_TEMPLATES[name] for name in _TEMPLATE_ORDER),
    ",".join(COUNTER_FIELDS),
    ",".join(GAUGE_FIELDS),
    ",".join(SETTING_FIELDS),
    ",".join(LAST_REJECT_FIELDS),
]


def register_pool_script(client: aioredis.Redis) -> AsyncScript:
    return client.register_script(READ_POOL_LUA)


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_pool(script: AsyncScript) -> list[WorkerCacheSnapshot]:
    """Every worker in the roster (dead ones too: their counters still count), by worker id."""
    rows = await script(keys=[keys.workers_roster()], args=_ARGS)
    snapshots = [
        WorkerCacheSnapshot.from_values(_text(row[0]), _pairs(row[1]), *row[2:6]) for row in rows
    ]
    return sorted(snapshots, key=lambda s: s.worker_id)


async def pool_cache_stats(script: AsyncScript) -> dict[str, Any]:
    return merge_pool(await read_pool(script))

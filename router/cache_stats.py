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

# Per member: {wid, info (flat HGETALL), numbers, settings, last_reject}. `numbers` is ONE
# comma-joined string of the counters then the gauges, in the field lists' order (missing -> 0):
# with 64 workers the reply parse, not Redis, was the cost, and 64 strings parse far faster than
# 4,000 bulk replies. Fields go in as ARGV; keys only as the roster key and shared.keys templates.
READ_POOL_LUA = """
local function split(s)
  local t = {}
  for f in string.gmatch(s, '[^,]+') do t[#t + 1] = f end
  return t
end
local counter_f, gauge_f = split(ARGV[5]), split(ARGV[6])
local reject_f = split(ARGV[8])
local n_gauges = #gauge_f
for _, f in ipairs(split(ARGV[7])) do gauge_f[#gauge_f + 1] = f end
local function key(template, wid)
  return (string.gsub(template, '{wid}', function() return wid end))
end
local out = {}
for _, wid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local nums = redis.call('HMGET', key(ARGV[2], wid), unpack(counter_f))
  local g = redis.call('HMGET', key(ARGV[3], wid), unpack(gauge_f))
  local settings = {}
  for i = 1, #g do
    if i <= n_gauges then nums[#nums + 1] = g[i] else settings[#settings + 1] = g[i] end
  end
  for i = 1, #nums do if not nums[i] then nums[i] = '0' end end
  out[#out + 1] = {
    wid,
    redis.call('HGETALL', key(ARGV[1], wid)),
    table.concat(nums, ','),
    settings,
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
_N_COUNTERS = len(COUNTER_FIELDS)


def register_pool_script(client: aioredis.Redis) -> AsyncScript:
    return client.register_script(READ_POOL_LUA)


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def _int(value: bytes) -> int:
    try:
        return int(float(value))
    except ValueError:
        return 0  # a hand-edited field that is not a number counts as nothing


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_pool(script: AsyncScript) -> list[WorkerCacheSnapshot]:
    """Every worker in the roster (dead ones too: their counters still count), by worker id."""
    rows = await script(keys=[keys.workers_roster()], args=_ARGS)
    snapshots = []
    for wid, info, numbers, settings, last_reject in rows:
        try:
            nums = list(map(int, numbers.split(b",")))
        except ValueError:  # a hand-edited, non-integer field
            nums = [_int(x) for x in numbers.split(b",")]
        snapshots.append(
            WorkerCacheSnapshot.from_values(
                _text(wid), _pairs(info), nums[:_N_COUNTERS], nums[_N_COUNTERS:], settings,
                last_reject,
            )
        )  # fmt: skip
    return sorted(snapshots, key=lambda s: s.worker_id)


async def pool_cache_stats(script: AsyncScript) -> dict[str, Any]:
    return merge_pool(await read_pool(script))

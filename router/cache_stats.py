"""The pool's view of its workers, read in ONE Redis round trip.

A Lua script (registered once in lifespan) walks the worker roster and returns, per member, its
counters, gauges, last reject, settings and info. Keys reach the script only as the roster key and
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
    INFO_FIELDS,
    LAST_REJECT_HASH_FIELDS,
    SETTING_FIELDS,
    WorkerCacheSnapshot,
    merge_pool,
)

# Per member, from two HMGETs (its counters hash and its info hash):
# {wid, numbers, strings}. `numbers` is ONE comma-joined string of the counters then the gauges in
# the field lists' order (missing -> 0): with 64 workers the reply parse dominated, and 64 strings
# parse far faster than 4,000 bulk replies. `strings` holds the last reject, the settings and the
# info fields (nil where missing). Field lists go in as ARGV; keys only as the roster key and the
# shared.keys templates.
READ_POOL_LUA = """
local function split(s)
  local t = {}
  for f in string.gmatch(s, '[^,]+') do t[#t + 1] = f end
  return t
end
local counter_f, reject_f = split(ARGV[3]), split(ARGV[4])
local gauge_f, string_f = split(ARGV[5]), split(ARGV[6])
local n_counters, n_gauges = #counter_f, #gauge_f
for _, f in ipairs(reject_f) do counter_f[#counter_f + 1] = f end
for _, f in ipairs(string_f) do gauge_f[#gauge_f + 1] = f end
local counters_at = string.find(ARGV[2], '{wid}', 1, true)
local info_at = string.find(ARGV[1], '{wid}', 1, true)
local function key(template, at, wid)
  return string.sub(template, 1, at - 1) .. wid .. string.sub(template, at + 5)
end
local out = {}
for _, wid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local c = redis.call('HMGET', key(ARGV[2], counters_at, wid), unpack(counter_f))
  local g = redis.call('HMGET', key(ARGV[1], info_at, wid), unpack(gauge_f))
  local nums, strs = {}, {}
  for i = 1, n_counters do nums[i] = c[i] or '0' end
  for i = 1, n_gauges do nums[n_counters + i] = g[i] or '0' end
  for i = n_counters + 1, #c do strs[#strs + 1] = c[i] end
  for i = n_gauges + 1, #g do strs[#strs + 1] = g[i] end
  out[#out + 1] = {wid, table.concat(nums, ','), strs}
end
return out
"""

_ARGS = [
    keys.WORKER_KEY_TEMPLATES["info"],
    keys.WORKER_KEY_TEMPLATES["counters"],
    ",".join(COUNTER_FIELDS),
    ",".join(LAST_REJECT_HASH_FIELDS),
    ",".join(GAUGE_FIELDS),
    ",".join(SETTING_FIELDS + INFO_FIELDS),
]
_N_COUNTERS = len(COUNTER_FIELDS)
_N_REJECT = len(LAST_REJECT_HASH_FIELDS)
_N_SETTINGS = len(SETTING_FIELDS)


def register_pool_script(client: aioredis.Redis) -> AsyncScript:
    return client.register_script(READ_POOL_LUA)


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
    for wid, numbers, strs in rows:
        try:
            nums = list(map(int, numbers.split(b",")))
        except ValueError:  # a hand-edited, non-integer field
            nums = [_int(x) for x in numbers.split(b",")]
        settings_end = _N_REJECT + _N_SETTINGS
        snapshots.append(
            WorkerCacheSnapshot.from_values(
                _text(wid), nums[:_N_COUNTERS], nums[_N_COUNTERS:],
                strs[_N_REJECT:settings_end], strs[settings_end:], strs[:_N_REJECT],
            )
        )  # fmt: skip
    return sorted(snapshots, key=lambda s: s.worker_id)


async def pool_cache_stats(script: AsyncScript) -> dict[str, Any]:
    return merge_pool(await read_pool(script))

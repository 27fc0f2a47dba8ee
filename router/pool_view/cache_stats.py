"""The pool's view of its workers, read in ONE Redis round trip.

A Lua script (registered once in lifespan) walks the worker roster and returns, per member, its
counters, gauges, last reject, settings, info and restart count. Keys reach the script only as the
roster key, the restart counts' key and the templates from shared.keys.WORKER_KEY_TEMPLATES;
nothing here formats a key.
`/v1/cache/stats` merges the snapshots; `/health` reads liveness and info from the same call.
"""

from __future__ import annotations

import operator
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
from shared.liveness import min_alive_pttl_ms

# Per member, from two HGETALLs (its counters hash and its info hash) and its field of the
# supervisors' restart counts (KEYS[2], '0' when absent): {wid, numbers, strings, alive,
# restarts}. `numbers` is ONE comma-joined string of the counters then the gauges in the field
# lists' order (missing -> 0); `strings` is the last reject, the settings and the info fields
# joined by the ASCII unit separator (missing -> empty); `alive` is 1 while the worker's
# heartbeat is fresh (shared.liveness: its info hash's PTTL above ARGV[7]). Many workers make
# the reply parse the cost: a few strings per worker parse faster than one bulk reply per
# field. HGETALL, not HMGET: these hashes are small ziplists, which HMGET scans once per field
# asked. Field lists go in as ARGV; keys only as the roster key, the restart counts' key and
# the shared.keys templates.
READ_POOL_LUA = """
local function split(s)
  local t = {}
  for f in string.gmatch(s, '[^,]+') do t[#t + 1] = f end
  return t
end
local counter_f, reject_f = split(ARGV[3]), split(ARGV[4])
local gauge_f, string_f = split(ARGV[5]), split(ARGV[6])
local n_counters = #counter_f
local min_pttl = tonumber(ARGV[7])
local US = string.char(31)  -- the ASCII unit separator
local n_numbers, n_strings = n_counters + #gauge_f, #reject_f + #string_f
-- field name -> its slot: numbers in `cpos` (counters hash) and `gpos` (info hash), strings in
-- `spos` (either hash).
local cpos, gpos, spos = {}, {}, {}
for i, f in ipairs(counter_f) do cpos[f] = i end
for i, f in ipairs(gauge_f) do gpos[f] = n_counters + i end
for i, f in ipairs(reject_f) do spos[f] = i end
for i, f in ipairs(string_f) do spos[f] = #reject_f + i end
local counters_at = string.find(ARGV[2], '{wid}', 1, true)
local info_at = string.find(ARGV[1], '{wid}', 1, true)
local function key(template, at, wid)
  return string.sub(template, 1, at - 1) .. wid .. string.sub(template, at + 5)
end
local function fill(flat, numpos, nums, strs)
  for i = 1, #flat, 2 do
    local f = flat[i]
    local p = numpos[f]
    if p then
      nums[p] = flat[i + 1]
    else
      p = spos[f]
      if p then strs[p] = flat[i + 1] end
    end
  end
end
local out = {}
for _, wid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local nums, strs = {}, {}
  for i = 1, n_numbers do nums[i] = '0' end
  for i = 1, n_strings do strs[i] = '' end
  fill(redis.call('HGETALL', key(ARGV[2], counters_at, wid)), cpos, nums, strs)
  local info_key = key(ARGV[1], info_at, wid)
  local info = redis.call('HGETALL', info_key)
  fill(info, gpos, nums, strs)
  local alive = 0
  if #info > 0 and redis.call('PTTL', info_key) > min_pttl then alive = 1 end
  local restarts = redis.call('HGET', KEYS[2], wid) or '0'
  out[#out + 1] = {wid, table.concat(nums, ','), table.concat(strs, US), alive, restarts}
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
    str(min_alive_pttl_ms()),
]
_N_REJECT = len(LAST_REJECT_HASH_FIELDS)
_SETTINGS_END = _N_REJECT + len(SETTING_FIELDS)
_by_worker_id = operator.attrgetter("worker_id")
_UNIT_SEPARATOR = "\x1f"  # joins the string fields in the Lua reply (a worker never writes it)


def register_pool_script(client: aioredis.Redis) -> AsyncScript:
    return client.register_script(READ_POOL_LUA)


def _int(value: bytes) -> int:
    try:
        return int(float(value))
    except ValueError:
        return 0  # a hand-edited field that is not a number counts as nothing


async def read_pool(script: AsyncScript) -> list[WorkerCacheSnapshot]:
    """Every worker in the roster (dead ones too: their counters still count), by worker id."""
    rows = await script(keys=[keys.workers_roster(), keys.supervisor_restarts()], args=_ARGS)
    snapshots = []
    for wid, numbers, strings, alive, restarts in rows:
        try:
            nums = list(map(int, numbers.split(b",")))
        except ValueError:  # a hand-edited, non-integer field
            nums = [_int(x) for x in numbers.split(b",")]
        strs = strings.decode(errors="replace").split(_UNIT_SEPARATOR)
        snapshots.append(
            WorkerCacheSnapshot.from_values(
                wid.decode(),
                alive == 1,
                nums,
                strs[_N_REJECT:_SETTINGS_END],
                strs[_SETTINGS_END:],
                strs[:_N_REJECT],
                _int(restarts),
            )
        )
    snapshots.sort(key=_by_worker_id)
    return snapshots


async def pool_cache_stats(script: AsyncScript) -> dict[str, Any]:
    return merge_pool(await read_pool(script))

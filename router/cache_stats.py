"""The pool's view of its workers, read in ONE Redis round trip.

A Lua script (registered once in lifespan) walks the worker roster and returns, per member, its
info, counters, gauges and last-reject hashes. Keys reach the script only as the roster key and
the templates from shared.keys.WORKER_KEY_TEMPLATES; nothing here formats a key.
`/v1/cache/stats` merges the snapshots; `/health` reads liveness and info from the same call.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from shared import keys
from shared.cache_stats import WorkerCacheSnapshot, merge_pool

_TEMPLATE_ORDER = ("info", "counters", "gauges", "last_reject")

# Returns {{wid, info, counters, gauges, last_reject}, ...} with each hash as a flat HGETALL list.
_READ_POOL_LUA = """
local out = {}
local members = redis.call('SMEMBERS', KEYS[1])
for _, wid in ipairs(members) do
  local row = {wid}
  for i = 1, #ARGV do
    local key = string.gsub(ARGV[i], '{wid}', function() return wid end)
    row[#row + 1] = redis.call('HGETALL', key)
  end
  out[#out + 1] = row
end
return out
"""


def register_pool_script(client: aioredis.Redis) -> AsyncScript:
    return client.register_script(_READ_POOL_LUA)


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_pool(script: AsyncScript) -> list[WorkerCacheSnapshot]:
    """Every worker in the roster (dead ones too: their counters still count), by worker id."""
    templates = [keys.WORKER_KEY_TEMPLATES[name] for name in _TEMPLATE_ORDER]
    rows = await script(keys=[keys.workers_roster()], args=templates)
    snapshots = [
        WorkerCacheSnapshot.from_hashes(
            _text(row[0]), _pairs(row[1]), _pairs(row[2]), _pairs(row[3]), _pairs(row[4])
        )
        for row in rows
    ]
    return sorted(snapshots, key=lambda s: s.worker_id)


async def pool_cache_stats(script: AsyncScript) -> dict[str, Any]:
    return merge_pool(await read_pool(script))

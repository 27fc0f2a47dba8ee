-- The pool's placement table, shared by the placement, start and release scripts (ledger.py
-- puts this in front of each): the worker each admitted request counts on, and each worker's
-- totals, so a decision reads every worker's load in one call instead of scanning its keys.
-- The script that places, starts, ends or lapses a request moves its totals in the same step,
-- and only by the entry it takes off: a request counts once, however often it ends.
--
--   placed: request id -> '<worker id> <prompt tokens it still computes there>'
--   load:   worker id -> '<requests counted there> <their prompt tokens not yet started>'

-- '<a> <b>' as two numbers (0, 0 for anything else).
local function pair(v)
  local a, b = string.match(v or '', '^(%-?%d+) (%-?%d+)$')
  return tonumber(a) or 0, tonumber(b) or 0
end

local function count_on(load, wid, requests, tokens)
  local n, q = pair(redis.call('HGET', load, wid))
  n, q = n + requests, q + tokens
  if n <= 0 then
    redis.call('HDEL', load, wid)
  else
    redis.call('HSET', load, wid, n .. ' ' .. math.max(q, 0))
  end
end

-- Takes the request off the table; returns the worker it counted on (nil: none).
local function unplace(placed, load, rid)
  local entry = redis.call('HGET', placed, rid)
  if not entry then return nil end
  redis.call('HDEL', placed, rid)
  local wid, tokens = string.match(entry, '^(.*) (%d+)$')  -- a worker id may hold spaces
  if not wid then return nil end
  count_on(load, wid, -1, -tonumber(tokens))
  return wid
end

-- Counts the requests on the worker: the first with `tokens` still to compute, the rest (the
-- siblings of its prompt) with none.
local function place_on(placed, load, wid, ids, tokens)
  local fields = {}
  for i, id in ipairs(ids) do
    unplace(placed, load, id)  -- placed again under the same id: it still counts once
    fields[#fields + 1] = id
    fields[#fields + 1] = wid .. ' ' .. (i == 1 and tokens or 0)
  end
  redis.call('HSET', placed, unpack(fields))
  count_on(load, wid, #ids, tokens)
end

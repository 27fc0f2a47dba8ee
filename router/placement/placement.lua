-- Admission and placement in ONE atomic step (router/placement/ledger.py calls it, with
-- router/placement/pool_table.lua in front).
--
-- Admits a request against the pool's bounds, picks the live worker of its model that should
-- run it, and reserves both before returning: two routers can never both book the last slot or
-- the same idle worker, and nothing is enqueued for a request that was refused. A request's
-- siblings (the other choices of its prompt, `n` > 1) are admitted and placed with it, on the
-- same worker, or refused with it: that worker computes their shared prompt once.
--
-- A decision costs one call per live worker (the prompt's first block in its index) and a few
-- per worker that holds that block: every worker's liveness and epoch come from one read of
-- their alive keys (or from the live list a decision of the last LIVE_CACHE_MS kept, where only
-- a worker whose epoch is used or that is chosen is read again), every worker's load from the
-- pool's placement table in one read, and the first block's routed marks from one key.
--
-- KEYS: 1 admission inflight zset, 2 admission queued hash, 3 worker roster set,
--       4 routing stats hash, 5 round-robin cursor, 6 placements hash, 7 worker loads hash
--       (6 and 7: pool_table.lua), 8 worker facts hash
-- ARGV: 1 the named scalars as one JSON object (router/placement/place_call.py PlaceArgs:
--         request id, lease, bounds, key templates, model, policy, scoring weights, siblings),
--       2.. the prompt's block index members, in order
-- Returns {1, outcome, worker id or '', predicted cached tokens (the group's), cost, inflight,
--          bound, the routed marks' score (0: none written)}
--      or {0, 'inflight' | 'tokens', current, bound, 'pool' | 'model' (whose bound: the
--          pool's, or that of every live worker of the request's model)}

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local p = cjson.decode(ARGV[1])
local rid, ttl, prompt = p.request_id, p.ttl_ms, p.prompt_tokens
local limit, per_worker = p.max_inflight, p.max_inflight_per_worker
local max_queued, min_pttl = p.max_queued_prompt_tokens, p.min_alive_pttl_ms
local model, policy = p.model, p.policy
local block_size, min_match = p.block_size, p.min_match
local decode_weight = p.decode_weight
local balance_abs, balance_rel = p.balance_abs, p.balance_rel
local routed_ttl = p.routed_ttl_ms
local siblings, k = p.siblings, #p.siblings
local members = {}
for i = 2, #ARGV do members[#members + 1] = ARGV[i] end
local count = 1 + k  -- places in flight the request takes

-- A key template split once around its placeholder: a worker's key is then a concatenation.
local function template(text, name)
  local head, tail = string.match(text, '^(.-){' .. name .. '}(.*)$')
  return function(v) return head .. v .. tail end
end
local info_key, routed_key = template(p.info_template, 'wid'), template(p.routed_template, 'wid')
local alive_key = template(p.alive_template, 'wid')
local load_key, prefill_key = template(p.load_template, 'wid'), template(p.prefill_template, 'wid')
local blocks_head, blocks_mid, blocks_tail =
  string.match(p.blocks_template, '^(.-){wid}(.-){epoch}(.*)$')
local function blocks_key(w) return blocks_head .. w.wid .. blocks_mid .. w.epoch .. blocks_tail end
-- The prompt's first block's routed marks: worker id -> when its mark lapses (members are
-- binary, the key names the block in hex).
local first_key, holders_key = nil, nil
if #members > 0 then
  local m = members[1]
  local hex = string.format(string.rep('%02x', #m), string.byte(m, 1, -1))
  first_key = template(p.first_template, 'block')(hex)
  holders_key = template(p.holders_template, 'block')(hex)
end

-- A request off the table, with its entries on its worker.
local function take_off(id)
  local wid = unplace(KEYS[6], KEYS[7], id)
  if wid then
    redis.call('ZREM', load_key(wid), id)
    redis.call('HDEL', prefill_key(wid), id)
  end
end

-- Lapsed reservations (a crashed router's) go, with their tokens and their place on a worker.
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 1, #lapsed, 1000 do
  redis.call('HDEL', KEYS[2], unpack(lapsed, i, math.min(i + 999, #lapsed)))
end
for _, id in ipairs(lapsed) do take_off(id) end
if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
-- An entry whose reservation is gone all the same (purged by a router that keeps no table, or
-- deleted by hand) goes when a decision samples it: two a decision, so the table converges on
-- the ledger instead of counting such a request for ever.
local sample = redis.call('HRANDFIELD', KEYS[6], 2)
if #sample > 0 then
  local held = redis.call('ZMSCORE', KEYS[1], unpack(sample))
  for i, id in ipairs(sample) do
    if not held[i] then take_off(id) end
  end
end

-- A hash read whole, as a table (one call, linear in its size).
local function hash_table(key)
  local flat, out = redis.call('HGETALL', key), {}
  for i = 1, #flat, 2 do out[flat[i]] = flat[i + 1] end
  return out
end

local loads = hash_table(KEYS[7])

-- A worker's load from the placement table (its requests, their prompt tokens not started).
local function with_load(w)
  w.running, w.queued, w.cached = 0, 0, 0
  if loads[w.wid] then w.running, w.queued = pair(loads[w.wid]) end
  w.load = w.queued + decode_weight * w.running  -- the load score (cost: prompt left + it)
end

-- A worker without an alive key (it writes none) is judged by its info hash: its TTL left, then
-- its epoch ('' for none); nil when it does not count as alive.
local function info_epoch(wid)
  if redis.call('PTTL', info_key(wid)) <= min_pttl then return nil end
  return redis.call('HGET', info_key(wid), 'epoch') or ''
end

-- The live workers of the model, in id order, each with its load from the placement table.
-- Every worker's liveness and epoch come from one read of the alive keys (a worker's lapses
-- exactly when it stops counting as alive); a worker without one (it writes none) is judged by
-- its info hash: its TTL left, then its epoch. The rest of what routing needs of it (its model,
-- its cache's mode) comes from the facts table, which holds it per epoch: a worker writes those
-- fields once per life, so they hold while its epoch does, and they are read from its info hash
-- again when the epoch is new. What stays the same while a worker's epoch does is kept under
-- p.live_key with the roster's size, for the decisions of the next p.live_ttl_ms.
local function read_live()
  local roster = redis.call('SMEMBERS', KEYS[3])
  table.sort(roster)
  local facts = hash_table(KEYS[8])
  local epochs = {}
  for i = 1, #roster, 1000 do
    local names = {}
    for j = i, math.min(i + 999, #roster) do names[#names + 1] = alive_key(roster[j]) end
    for _, e in ipairs(redis.call('MGET', unpack(names))) do epochs[#epochs + 1] = e end
  end
  local live, plain = {}, '||||' .. model  -- a plain worker of the model: '<epoch>' .. plain
  for i = 1, #roster do
    local wid = roster[i]
    local epoch, listing = epochs[i], epochs[i] ~= false
    if not epoch then epoch = info_epoch(wid) end
    if epoch then
      -- '<epoch>|<mode>|<paged_block_size>|<checkpoint_tokens>|<model>', the mode and its
      -- setting only for a paged or snapshot cache: a plain one's model is one comparison.
      local fact, mode, page, every_tokens = facts[wid], '', '', ''
      local of_model = fact == epoch .. plain
      if not of_model then
        local seen, its_model
        if fact then
          seen, mode, page, every_tokens, its_model =
            string.match(fact, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
        end
        if epoch == '' or seen ~= epoch then
          local f = redis.call('HMGET', info_key(wid), 'model', 'storage_mode', 'paged_block_size',
                               'checkpoint_tokens')
          its_model, mode, page, every_tokens = f[1] or '', f[2] or '', f[3] or '', f[4] or ''
          if mode ~= 'paged' then page = '' end
          if mode ~= 'snapshot' then every_tokens = '' end
          if mode ~= 'paged' and mode ~= 'snapshot' then mode = '' end
          if epoch ~= '' then
            redis.call('HSET', KEYS[8], wid,
                       table.concat({epoch, mode, page, every_tokens, its_model}, '|'))
          end
        end
        of_model = its_model == model
      end
      if of_model then
        -- listing: a worker that writes an alive key lists itself in the holders sets too.
        local w = {wid = wid, epoch = epoch, unit = 1, every = 0, listing = listing}
        -- A paged cache adopts whole pages: what it can reuse is floored to its page size.
        if mode == 'paged' then w.unit = math.max(tonumber(page) or 1, 1) end
        -- A snapshot cache resumes only where it kept a checkpoint: its index holds just those
        -- blocks (the last of each checkpoint), and it keeps one every `every` blocks.
        if mode == 'snapshot' then
          w.snapshot = true
          w.every = math.floor((tonumber(every_tokens) or 0) / block_size)
        end
        live[#live + 1] = w
      end
    end
  end
  local kept = {}
  for i, w in ipairs(live) do
    kept[i] = {wid = w.wid, epoch = w.epoch, unit = w.unit, every = w.every,
               listing = w.listing, snapshot = w.snapshot}
    with_load(w)
  end
  redis.call('SET', p.live_key, cmsgpack.pack({size = #roster, workers = kept}),
             'PX', p.live_ttl_ms)
  return live
end

-- The kept list serves while the roster's size is what it was (a worker that joins or leaves it
-- is seen at once); a worker that died or restarted since is caught before its epoch is used or
-- it is chosen (current, below).
local roster_size = redis.call('SCARD', KEYS[3])
local live, from_kept = nil, false
local blob = redis.call('GET', p.live_key)
if blob then
  local ok, t = pcall(cmsgpack.unpack, blob)
  if ok and type(t) == 'table' and t.size == roster_size and type(t.workers) == 'table' then
    live, from_kept = t.workers, true
    for _, w in ipairs(live) do with_load(w) end
  end
end
if not live then live = read_live() end

-- Whether a worker of the kept list still counts as alive under the epoch it was read with.
local function still_live(w)
  if w.listing then return redis.call('GET', alive_key(w.wid)) == w.epoch end
  return info_epoch(w.wid) == w.epoch
end

-- Before a worker's epoch is used (its block set read, or it is chosen): from the kept list, it
-- is checked once; one that fails marks the list stale, and the decision is made again on the
-- list read anew (a stale epoch would hide a restarted worker's blocks and drop its listing).
local kept_stale, checked = false, {}
local function current(w)
  if not from_kept then return true end
  local ok = checked[w.wid]
  if ok == nil then
    ok = still_live(w)
    checked[w.wid] = ok
  end
  if not ok then kept_stale = true end
  return ok
end

-- The pool's bound counts every model's requests in flight; a model's own workers bound only
-- its requests (below: a request is refused when every one of them is at its bound).
local n = redis.call('ZCARD', KEYS[1])
if limit > 0 and n + count > limit then return {0, 'inflight', n, limit, 'pool'} end
if max_queued > 0 then
  local queued = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do queued = queued + tonumber(v) end
  if queued > 0 and queued + prompt > max_queued then
    return {0, 'tokens', queued, max_queued, 'pool'}
  end
end

-- The workers with a live routed mark on the prompt's first block, read from one key. It may
-- list a worker whose own marks are gone (a reaper deleted them): that costs the worker a
-- look at its marks, never a match.
local first_routed = nil
local function routed_first(w)
  if first_routed == nil then
    first_routed = {}
    for _, wid in ipairs(redis.call('ZRANGEBYSCORE', first_key, '(' .. now, '+inf')) do
      first_routed[wid] = true
    end
  end
  return first_routed[w.wid] == true
end

-- The workers listed as holding the prompt's first block (those that list themselves: the rest
-- are looked up in their block sets), read from one key. An entry may be from a worker's
-- earlier life: each is checked in the worker's own set, and one that fails goes.
local holders, stale, held_first = nil, {}, false
local function listed_holder(w)
  if holders == nil then
    holders = {}
    for _, wid in ipairs(redis.call('SMEMBERS', holders_key)) do holders[wid] = true end
  end
  return holders[w.wid] == true
end

-- A snapshot worker: the deepest of the prompt's blocks it holds or was sent, short of the
-- prompt's last token (a snapshot is restored only whole, and one token is left to compute).
local function resumable_tokens(w)
  local last = math.min(#members, math.floor((prompt - 1) / block_size))
  if last < 1 then return 0 end
  local blocks, routed = blocks_key(w), routed_key(w.wid)
  local held = redis.call('SMISMEMBER', blocks, unpack(members, 1, last))
  local marks = {}
  if redis.call('EXISTS', routed) == 1 then
    marks = redis.call('ZMSCORE', routed, unpack(members, 1, last))
  end
  for k = last, 1, -1 do
    if held[k] == 1 or (marks[k] and tonumber(marks[k]) > now) then
      local tokens = k * block_size
      if tokens < min_match then return 0 end
      return tokens
    end
  end
  return 0
end

-- How many of the prompt's leading blocks the worker holds or was already sent (each block the
-- one or the other), as tokens. Most workers hold no block of a given prompt: the first block
-- alone rules them out (the holders set read once, or one O(1) call a worker that lists itself
-- nowhere), so a decision's cost beyond that grows with the workers that match, not with every
-- live one. A worker the first block was sent to has its marks read first: a run of them ends
-- where that earlier prompt and this one part.
local function cached_tokens(w)
  if #members == 0 then return 0 end
  if w.snapshot then return current(w) and resumable_tokens(w) or 0 end
  local sent = routed_first(w)
  if not sent and w.listing and not listed_holder(w) then return 0 end
  if not current(w) then return 0 end
  local n, blocks, k = #members, blocks_key(w), 0
  if not sent then
    if redis.call('SISMEMBER', blocks, members[1]) == 0 then
      if w.listing then stale[#stale + 1] = w.wid end
      return 0
    end
    k = 1
    held_first = held_first or w.listing
  end
  local routed, marks, from = routed_key(w.wid), {}, k
  if k < n and (sent or redis.call('ZCARD', routed) > 0) then
    marks = redis.call('ZMSCORE', routed, unpack(members, k + 1, n))
  end
  local function marked(i) return marks[i - from] and tonumber(marks[i - from]) > now end
  while k < n and marked(k + 1) do k = k + 1 end
  if k < n then
    -- Where the marks end, the worker's index: past a run of marks (blocks still on their way)
    -- the next block alone first, as it mostly ends the match; else the rest of the prompt.
    local held, base = nil, k
    if k > from then
      if redis.call('SISMEMBER', blocks, members[k + 1]) == 1 then
        held = {1}
        if k + 1 < n then
          for _, v in ipairs(redis.call('SMISMEMBER', blocks, unpack(members, k + 2, n))) do
            held[#held + 1] = v
          end
        end
      end
    else
      held = redis.call('SMISMEMBER', blocks, unpack(members, k + 1, n))
    end
    if held then
      while k < n and (held[k + 1 - base] == 1 or marked(k + 1)) do k = k + 1 end
    end
  end
  local tokens = math.min(k * block_size, prompt - 1)
  tokens = tokens - tokens % w.unit
  if tokens < min_match then return 0 end
  return tokens
end

-- What the holders set showed: an entry whose worker lacks the block goes, and a set that named
-- a holder lives on (a worker holding a block long unchanged relisted by the prompts it serves).
local function tidy_holders()
  if #stale > 0 then redis.call('SREM', holders_key, unpack(stale)) end
  if held_first then redis.call('PEXPIRE', holders_key, p.holders_ttl_ms) end
end

-- The worker for the request among `live`, or the refusal when every one is at its bound.
local function choose(live)
  stale, held_first = {}, false  -- what the holders set showed, this list's
  -- Workers below their own bound (a request's siblings ride with it: they may take its worker
  -- up to k past the bound, as they cost it no prefill of their own).
  local open, mine = {}, 0
  for _, w in ipairs(live) do
    mine = mine + w.running
    if per_worker == 0 or w.running < per_worker then open[#open + 1] = w end
  end
  if #live > 0 and #open == 0 then
    return nil, 'no_worker', 0, {0, 'inflight', mine, per_worker * #live, 'model'}
  end
  local chosen, outcome, cost = nil, 'no_worker', 0
  if #open > 0 then
    if policy == 'round_robin' then
      local cursor = redis.call('INCR', KEYS[5])
      chosen, outcome = open[(cursor - 1) % #open + 1], 'round_robin'
      chosen.cached = cached_tokens(chosen)
    elseif policy == 'least_loaded' then
      for _, w in ipairs(open) do
        if chosen == nil or w.load < chosen.load then chosen = w end
      end
      outcome = 'load'
      chosen.cached = cached_tokens(chosen)
    else -- cache_aware: lowest cost = prompt tokens still to compute + the worker's load
      local best, lightest, hi, lo = nil, nil, nil, nil
      for _, w in ipairs(live) do  -- the best match among all, so a full worker's shows as a spill
        w.cached = cached_tokens(w)
        if w.cached > 0 and (best == nil or w.cached > best.cached) then best = w end
      end
      for _, w in ipairs(open) do
        w.cost = prompt - w.cached + w.load
        if chosen == nil or w.cost < chosen.cost then chosen = w end
        if lightest == nil or w.load < lightest.load then lightest = w end
        if hi == nil or w.running > hi then hi = w.running end
        if lo == nil or w.running < lo then lo = w.running end
      end
      -- SGLang's imbalance gate: once the busiest open worker runs far more than the idlest,
      -- load decides alone, so a hot prefix spills instead of piling onto one worker.
      if hi - lo > balance_abs and hi > balance_rel * lo then chosen = lightest end
      if best == nil then outcome = 'load'
      elseif chosen == best then outcome = 'cache'
      else outcome = 'spill' end
    end
    cost = prompt - chosen.cached + chosen.load
  end
  return chosen, outcome, cost, nil
end

-- No worker, or a refusal, from the kept list is made again on the list read anew: a worker
-- back to life since (still on the roster) takes the request, and a refusal stands on a fresh read.
local chosen, outcome, cost, refused = choose(live)
if from_kept and (kept_stale or chosen == nil or not current(chosen)) then
  from_kept = false
  live = read_live()
  chosen, outcome, cost, refused = choose(live)
end
if refused ~= nil then return refused end
if chosen ~= nil then tidy_holders() end

-- Reserve: the pool's ledger, then the worker's load and the blocks now on their way to it.
-- The prompt's tokens wait once (its siblings compute none of them).
local function reserve(zset)
  redis.call('ZADD', zset, now + ttl, rid)
  for _, sid in ipairs(siblings) do redis.call('ZADD', zset, now + ttl, sid) end
end
reserve(KEYS[1])
if prompt > 0 then redis.call('HSET', KEYS[2], rid, prompt) end
redis.call('HINCRBY', KEYS[4], 'decisions:' .. outcome, 1)
if chosen == nil then return {1, outcome, '', 0, 0, n + count, limit, 0} end
local load, prefill = load_key(chosen.wid), prefill_key(chosen.wid)
reserve(load)
redis.call('HSET', prefill, rid, prompt - chosen.cached)
redis.call('PEXPIRE', load, routed_ttl)
redis.call('PEXPIRE', prefill, routed_ttl)
place_on(KEYS[6], KEYS[7], chosen.wid, {rid, unpack(siblings)}, prompt - chosen.cached)
local routed_score = 0
if #members > 0 and policy == 'cache_aware' then
  routed_score = now + routed_ttl
  local routed = routed_key(chosen.wid)
  redis.call('ZREMRANGEBYSCORE', routed, '-inf', now)
  -- A member longer than zset-max-listpack-value keeps the set a skiplist for its life: as a
  -- listpack (up to 128 members, one or two requests' marks) every ZMSCORE and ZADD of a
  -- prompt's blocks scans the whole list once per block. Scored +inf, it never lapses.
  redis.call('ZADD', routed, '+inf', p.skiplist_pin)
  -- A snapshot worker will hold only the blocks where this prompt's prefill keeps checkpoints
  -- (worker/prompt_cache/checkpoints.py): each `every`-th, and the last before its last token.
  local scored, last = {}, math.floor((prompt - 1) / block_size)
  -- The score as text once: a number would be formatted again for every mark it is passed with.
  local score_text = string.format('%d', routed_score)
  for i, m in ipairs(members) do
    local kept = not chosen.snapshot
      or (chosen.every > 0 and i * block_size >= min_match and (i % chosen.every == 0 or i == last))
    if kept then
      scored[#scored + 1] = score_text
      scored[#scored + 1] = m
    end
  end
  for i = 1, #scored, 2000 do
    redis.call('ZADD', routed, unpack(scored, i, math.min(i + 1999, #scored)))
  end
  redis.call('PEXPIRE', routed, routed_ttl)
  if not chosen.snapshot then  -- the first block's mark, where the next decision looks first
    redis.call('ZADD', first_key, routed_score, chosen.wid)
    redis.call('PEXPIRE', first_key, routed_ttl)
  end
end
-- Each sibling is expected to reuse the whole prompt but its last token, from the first.
local predicted = chosen.cached + k * math.max(prompt - 1, 0)
redis.call('HINCRBY', KEYS[4], 'predicted_tokens:' .. chosen.wid, predicted)
redis.call('HINCRBY', KEYS[4], 'routed:' .. chosen.wid, count)
return {1, outcome, chosen.wid, predicted, cost, n + count, limit, routed_score}

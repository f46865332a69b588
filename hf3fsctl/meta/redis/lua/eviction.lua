-- Where the Redis store decides what to evict (prepended, after common.lua, to the
-- scripts that evict: allocate.lua and evict.lua). The SQL twins of each function are
-- in hf3fsctl/meta/sqlite/eviction.py; docs/design.md, "Eviction", pairs them.

-- Whether a key may be evicted: no rank pending; with `lru`, no lease and not pinned
-- (admin eviction takes leased keys, and pinned ones only when asked). `need_rank`:
-- the key must be committed on that rank. Returns ok, depth.
local function evictable(ns, key, nranks, lru, include_pinned, need_rank)
  local depth = 0
  local committed = 0
  for r = 0, nranks - 1 do
    local e = unpack_entry(redis.call('HGET', k_e(ns, r), key))
    if e then
      if e.state == 0 then return false, 0 end
      if lru and e.lease > NOW then return false, 0 end
      if e.depth > depth then depth = e.depth end
      committed = committed + 1
    elseif need_rank == r then
      return false, 0
    end
  end
  if committed == 0 then return false, -1 end  -- a stale LRU member
  if (lru or not include_pinned) and pinned(ns, key) then return false, 0 end
  return true, depth
end

-- THE eviction decision of the allocate path (SQLite's twin: `choose_victims` in
-- hf3fsctl/meta/sqlite/eviction.py): up to `batch` least-recently-used keys of each
-- namespace of `scope` past `skip[ns]` (the ones walked past as not evictable), merged by
-- last access, chain tails (greatest depth) first among equally old keys. Returns the
-- candidates {ns, key, last_access, evictable, depth} in eviction order, and the
-- `threshold` past which a namespace has keys not fetched (nil: every key is here).
local function choose_victims(scope, skip, ranks, batch, need_rank)
  local cands = {}
  local threshold = nil
  for _, ns in ipairs(scope) do
    local got = redis.call('ZRANGE', k_lru(ns), skip[ns], skip[ns] + batch - 1, 'WITHSCORES')
    for i = 1, #got, 2 do
      cands[#cands + 1] = {ns, got[i], tonumber(got[i + 1])}
    end
    if #got == 2 * batch then
      local last = tonumber(got[#got])
      if threshold == nil or last < threshold then threshold = last end
      -- every key as old as the last one (one commit's chain), so its tail goes first
      local seen = {}
      for i = 1, #got, 2 do seen[got[i]] = true end
      for _, key in ipairs(redis.call('ZRANGEBYSCORE', k_lru(ns), got[#got], got[#got])) do
        if not seen[key] then cands[#cands + 1] = {ns, key, last} end
      end
    end
  end
  for _, c in ipairs(cands) do
    local ok, depth = evictable(c[1], c[2], ranks[c[1]], true, false, need_rank)
    c[4] = ok
    c[5] = depth
  end
  table.sort(cands, function(a, b)
    if a[3] ~= b[3] then return a[3] < b[3] end
    if a[5] ~= b[5] then return a[5] > b[5] end
    return a[2] < b[2]
  end)
  return cands, threshold
end

-- Evict least-recently-used keys of the namespaces `scope` (a list; merged by last
-- access, chain tails first among equally old keys) until `satisfied()`, or `limit`
-- keys were evicted (so one script never holds Redis for long: a swing larger than the
-- limit is spread over the next allocations). `on_free(ns, rank, page)` hears of every
-- freed page. Counts them under `reason`.
local function evict_lru(scope, satisfied, on_free, reason, batch, need_rank, limit)
  local counts = {}
  local skip = {}
  local ranks = {}
  for _, ns in ipairs(scope) do skip[ns] = 0; ranks[ns] = tonumber(redis.call('HGET', k_ns(ns), 'num_ranks')) or 0 end
  local evicted = 0
  while not satisfied() and evicted < limit do
    local cands, threshold = choose_victims(scope, skip, ranks, batch, need_rank)
    if #cands == 0 then break end
    local progressed = false
    for _, c in ipairs(cands) do
      if threshold ~= nil and c[3] > threshold then break end
      if satisfied() or evicted >= limit then break end
      progressed = true
      local ns, key = c[1], c[2]
      if c[4] then
        local freed = drop_key(ns, key, ranks[ns])
        local bytes = 0
        for _, fr in ipairs(freed) do
          bytes = bytes + file_slot(ns, fr[1])
          on_free(ns, fr[1], fr[2])
        end
        count_evictions(counts, ns, 1, bytes)
        evicted = evicted + 1
      elseif c[5] == -1 then
        redis.call('ZREM', k_lru(ns), key)  -- no committed entry left: not a candidate
      else
        skip[ns] = skip[ns] + 1
      end
    end
    if not progressed then break end
  end
  apply_evictions(counts, reason)
  return evicted
end

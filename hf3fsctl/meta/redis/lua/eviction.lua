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

-- Whether candidate `a` {ns, key, last_access, lru member} goes before `b`: the LRU
-- index's own order (last access, then the member: deepest first, then key), then
-- namespace — SQLite's (last_access, depth DESC, key).
local function sorts_before(a, b)
  if a[3] ~= b[3] then return a[3] < b[3] end
  if a[4] ~= b[4] then return a[4] < b[4] end
  return a[1] < b[1]
end

-- THE eviction decision of the allocate path (SQLite's twin: `choose_victims` in
-- hf3fsctl/meta/sqlite/eviction.py): the next `batch` members of each namespace's LRU
-- index past `skip[ns]` (the ones walked past as not evictable) — `ZRANGE`, already in
-- eviction order, so O(batch + log n) each — merged. Returns the candidates {ns, key,
-- last_access, member} in eviction order, and the `threshold` candidate past which a
-- namespace has members not fetched (nil: every member is here).
local function choose_victims(scope, skip, batch)
  local cands = {}
  local threshold = nil
  for _, ns in ipairs(scope) do
    local got = redis.call('ZRANGE', k_lru(ns), skip[ns], skip[ns] + batch - 1, 'WITHSCORES')
    for i = 1, #got, 2 do
      cands[#cands + 1] = {ns, lru_key(got[i]), tonumber(got[i + 1]), got[i]}
    end
    if #got == 2 * batch then
      local last = cands[#cands]
      if threshold == nil or sorts_before(last, threshold) then threshold = last end
    end
  end
  if #scope > 1 then table.sort(cands, sorts_before) end
  return cands, threshold
end

-- Evict least-recently-used keys of the namespaces `scope` (a list; merged by last
-- access, chain tails first among equally old keys) until `satisfied()`, or `limit`
-- keys were evicted (so one script never holds Redis for long: a swing larger than the
-- limit is spread over the next allocations). `on_free(ns, rank, page)` hears of every
-- freed page. Counts them under `reason`. Each candidate is checked (`evictable`) only
-- when reached: the cost is the keys walked, not the store's size.
local function evict_lru(scope, satisfied, on_free, reason, batch, need_rank, limit)
  local counts = {}
  local skip = {}
  local ranks = {}
  for _, ns in ipairs(scope) do skip[ns] = 0; ranks[ns] = tonumber(redis.call('HGET', k_ns(ns), 'num_ranks')) or 0 end
  local evicted = 0
  while not satisfied() and evicted < limit do
    local cands, threshold = choose_victims(scope, skip, batch)
    if #cands == 0 then break end
    local progressed = false
    for _, c in ipairs(cands) do
      if threshold ~= nil and sorts_before(threshold, c) then break end
      if satisfied() or evicted >= limit then break end
      progressed = true
      local ns, key = c[1], c[2]
      local ok, depth = evictable(ns, key, ranks[ns], true, false, need_rank)
      if ok then
        local freed = drop_key(ns, key, ranks[ns])
        local bytes = 0
        for _, fr in ipairs(freed) do
          bytes = bytes + file_slot(ns, fr[1])
          on_free(ns, fr[1], fr[2])
        end
        count_evictions(counts, ns, 1, bytes)
        evicted = evicted + 1
      elseif depth == -1 then
        redis.call('ZREM', k_lru(ns), c[4])  -- no committed entry left: not a candidate
      else
        skip[ns] = skip[ns] + 1
      end
    end
    if not progressed then break end
  end
  apply_evictions(counts, reason)
  return evicted
end

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
      if lru and e.lease > NOW_MS then return false, 0 end
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

-- Whether candidate `a` {ns, key, last_access, lru member, generation} goes before `b`:
-- the LRU index's own order (last access, then the member: deepest first, then key),
-- then namespace — SQLite's (last_access, depth DESC, key).
local function sorts_before(a, b)
  if a[3] ~= b[3] then return a[3] < b[3] end
  if a[4] ~= b[4] then return a[4] < b[4] end
  return a[1] < b[1]
end

-- The next `batch` LRU candidates {ns, key, last_access (µs), member, generation} of a
-- namespace past `from`: the oldest generations' members, already in eviction order
-- (`lru_slice`: O(batch + the generations passed)).
local function lru_window(ns, from, batch)
  local out = {}
  for _, m in ipairs(lru_slice(ns, from, batch, nil)) do
    out[#out + 1] = {ns, lru_key(m[1]), m[2], m[1], m[3]}
  end
  return out
end

-- The next `batch` expired keys {ns, key, expiry, member} of a namespace past `from`:
-- `x:NS` by expiry up to now, soonest first, then deepest (SQLite's twin:
-- `EXPIRED_OF_NAMESPACE`, walked by `choose_victims`).
local function expired_window(ns, from, batch)
  local got = redis.call('ZRANGEBYSCORE', k_x(ns), '-inf', NOW_MS, 'WITHSCORES',
    'LIMIT', from, batch)
  local out = {}
  for i = 1, #got, 2 do out[#out + 1] = {ns, lru_key(got[i]), tonumber(got[i + 1]), got[i]} end
  return out
end

-- THE eviction decision of the allocate path (SQLite's twin: `choose_victims` in
-- hf3fsctl/meta/sqlite/eviction.py, expired keys then LRU ones): the next `batch`
-- candidates of each namespace past `skip[ns]` (the ones walked past as not evictable),
-- from `window` (`expired_window`, then `lru_window`), merged. Returns the candidates
-- in eviction order, and the `threshold` candidate past which a namespace has
-- candidates not fetched (nil: every one is here).
local function choose_victims(scope, skip, batch, window)
  local cands = {}
  local threshold = nil
  for _, ns in ipairs(scope) do
    local got = window(ns, skip[ns], batch)
    for _, c in ipairs(got) do cands[#cands + 1] = c end
    if #got == batch then
      local last = cands[#cands]
      if threshold == nil or sorts_before(last, threshold) then threshold = last end
    end
  end
  if #scope > 1 then table.sort(cands, sorts_before) end
  return cands, threshold
end

-- One walk of `evict_lru`: candidates of `window` in `names`, evicted while not
-- `satisfied()` and fewer than `limit` went (`evicted` so far); counted under `why`.
local function walk(window, names, why, satisfied, on_free, batch, need_rank, limit,
    ranks, evicted)
  local counts, skip = {}, {}
  for _, ns in ipairs(names) do skip[ns] = 0 end
  while not satisfied() and evicted < limit do
    local cands, threshold = choose_victims(names, skip, batch, window)
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
      elseif depth == -1 then  -- no committed entry left: not a candidate
        if c[5] then lru_remove(ns, c[5], {c[4]}, nil) else redis.call('ZREM', k_x(ns), c[4]) end
      else
        skip[ns] = skip[ns] + 1
      end
    end
    if not progressed then break end
  end
  apply_evictions(counts, why)
  return evicted
end

-- Namespaces of `scope` holding keys with an expiry (`x:NS` exists).
local function expiring_of(scope)
  local out = {}
  for _, ns in ipairs(scope) do
    if redis.call('EXISTS', k_x(ns)) == 1 then out[#out + 1] = ns end
  end
  return out
end

-- Evict the expired keys of the namespaces `scope` (a list; soonest expiry first), then
-- least-recently-used ones (merged by last access, chain tails first among equally old
-- keys) until `satisfied()`, or `limit` keys were evicted (so one script never holds
-- Redis for long: a swing larger than the limit is spread over the next allocations).
-- `on_free(ns, rank, page)` hears of every freed page. Counts them under "expired" and
-- `reason`. Each candidate is checked (`evictable`) only when reached: the cost is the
-- keys walked, not the store's size.
local function evict_lru(scope, satisfied, on_free, reason, batch, need_rank, limit)
  local ranks = {}
  for _, ns in ipairs(scope) do ranks[ns] = tonumber(redis.call('HGET', k_ns(ns), 'num_ranks')) or 0 end
  local evicted = 0
  local expiring = expiring_of(scope)
  if #expiring > 0 then
    evicted = walk(expired_window, expiring, 'expired', satisfied, on_free, batch,
      need_rank, limit, ranks, evicted)
  end
  return walk(lru_window, scope, reason, satisfied, on_free, batch, need_rank, limit,
    ranks, evicted)
end

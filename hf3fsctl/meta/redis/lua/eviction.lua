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
  return lru_slice(ns, from, batch, nil, true)
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

-- The head of a packed entry (common.lua's ENTRY up to the generation): flags, page,
-- depth, lease end (ms), generation and whether it has an expiry — what a victim's
-- check and drop read, without `unpack_entry`'s table.
local ENTRY_HEAD = '<BI7I5I2I5I5I3I5I5I4I5'
local function entry_head(v)
  local flags, until_, page, depth, _, _, _, lease, _, _, gen = struct.unpack(ENTRY_HEAD, v)
  if lease > 0 then lease = lease + EPOCH_MS end
  return flags % 2, page, depth, lease, gen, until_ > 0
end

-- A round of evictions, decided one victim at a time and written together
-- (`apply_drops`): per namespace, per rank the entries to delete and the pages to free,
-- the LRU members to remove by generation, the `x:NS` members, the keys gone from every
-- rank. The same writes `drop_key` makes for each victim, as one command per kind.
local function new_drops() return {} end

local function drops_of(drops, ns, nranks)
  local d = drops[ns]
  if not d then
    d = {nranks = nranks, keys = {}, free = {}, gens = {}, x = {}, gone = {}, complete = 0,
      stale = {}, stale_x = {}, ckeys = {}, members = {}}
    for r = 0, nranks - 1 do d.keys[r] = {}; d.free[r] = {} end
    drops[ns] = d
  end
  return d
end

-- Drop `key`, whose committed entries per rank are `heads[r]` ({page, depth, lease, gen,
-- has expiry} or nil), as `drop_key` would. Returns the freed {rank, page} pairs.
local function drop_later(d, ns, key, heads)
  local nranks = d.nranks
  local freed, members = {}, {}
  local had, gen, expiring = 0, 0, false
  for r = 0, nranks - 1 do
    local h = heads[r]
    if h then
      members[lru_member(key, h[2])] = true
      if nranks == 1 then gen = h[4] end
      if h[5] then expiring = true end
      local keys, free = d.keys[r], d.free[r]
      keys[#keys + 1] = key
      free[#free + 1] = free_score(h[3])
      free[#free + 1] = h[1]
      change(ns, key, -1)
      freed[#freed + 1] = {r, h[1]}
      had = had + 1
    end
  end
  if had >= nranks then d.complete = d.complete + 1 end
  d.gone[key] = true
  local list = {}
  for m in pairs(members) do list[#list + 1] = m end
  if nranks > 1 then  -- the generation is in `c:NS`: read when written
    d.ckeys[#d.ckeys + 1] = key
    d.members[#d.members + 1] = list
  elseif gen > 0 then
    local g = d.gens[gen]
    if not g then g = {}; d.gens[gen] = g end
    for _, m in ipairs(list) do g[#g + 1] = m end
  end
  if expiring then for _, m in ipairs(list) do d.x[#d.x + 1] = m end end
  return freed
end

-- The freed pages of one file kept out of its free set for now: {ns, rank, pairs}
-- (score, page, … as `free_page` would add them). allocate.lua holds its own file's, to
-- take them itself (`take_pages`) and add only the rest, instead of adding them all and
-- taking them back at once; nil: every freed page goes to its free set.
local FREE_HELD = nil

-- A candidate's LRU (or `x:NS`) member with no committed entry left goes too.
local function stale_member(d, c)
  if c[5] then
    local s = d.stale[c[5]]
    if not s then s = {}; d.stale[c[5]] = s end
    s[#s + 1] = c[4]
  else
    d.stale_x[#d.stale_x + 1] = c[4]
  end
end

-- `drop_later` of a key of a one-rank namespace, from its entry's fields.
local function drop_one_rank(d, ns, key, page, depth, lease, gen, expiring)
  local keys, free = d.keys[0], d.free[0]
  keys[#keys + 1] = key
  free[#free + 1] = free_score(lease)
  free[#free + 1] = page
  change(ns, key, -1)
  d.complete = d.complete + 1
  d.gone[key] = true
  local member = lru_member(key, depth)
  if gen > 0 then
    local g = d.gens[gen]
    if not g then g = {}; d.gens[gen] = g end
    g[#g + 1] = member
  end
  if expiring then d.x[#d.x + 1] = member end
end

local function apply_drops(drops)
  for ns, d in pairs(drops) do
    for r = 0, d.nranks - 1 do
      local keys = d.keys[r]
      if #keys > 0 then
        call_chunked('HDEL', k_e(ns, r), keys, 1)
        if FREE_HELD and FREE_HELD[1] == ns and FREE_HELD[2] == r then
          local held = FREE_HELD[3]
          for _, v in ipairs(d.free[r]) do held[#held + 1] = v end
        else
          call_chunked('ZADD', k_free(ns, r), d.free[r], 2)
        end
        redis.call('HINCRBY', k_rf(ns, r), 'used', -#keys)
      end
    end
    if d.complete > 0 then redis.call('HINCRBY', k_ns(ns), 'keys', -d.complete) end
    if #d.ckeys > 0 then
      local values = hmget_all(k_c(ns), d.ckeys)
      for j, list in ipairs(d.members) do
        local _, gen = c_parse(values[j])
        if gen and gen > 0 then
          local g = d.gens[gen]
          if not g then g = {}; d.gens[gen] = g end
          for _, m in ipairs(list) do g[#g + 1] = m end
        end
      end
      call_chunked('HDEL', k_c(ns), d.ckeys, 1)
    end
    for gen, members in pairs(d.stale) do  -- members with no committed entry left
      local g = d.gens[gen]
      if not g then g = {}; d.gens[gen] = g end
      for _, m in ipairs(members) do g[#g + 1] = m end
    end
    for gen, members in pairs(d.gens) do lru_remove(ns, gen, members, nil) end
    for _, m in ipairs(d.stale_x) do d.x[#d.x + 1] = m end
    if #d.x > 0 then call_chunked('ZREM', k_x(ns), d.x, 1) end
  end
end

local WINDOW_MAX = 4096  -- candidates one round reads per namespace, at most
local VICTIM_CHUNK = 64  -- candidates whose entries (and pins) one HMGET reads

-- One walk of `evict_lru`: candidates of `window` in `names`, evicted while not
-- `satisfied()` and fewer than `limit` went (`evicted` so far); counted under `why`.
-- The first round reads `batch` candidates per namespace (what the caller expects to
-- evict), each further one twice as many, to WINDOW_MAX: which keys go does not depend
-- on it, only how many rounds a walk past keys that may not go takes.
-- Each candidate is decided as `evictable` and `drop_key` would, in order, from entries
-- read a chunk at a time; a round's drops are written before the next window is read.
local function walk(window, names, why, satisfied, on_free, batch, need_rank, limit,
    ranks, evicted)
  local counts, skip, has_pins = {}, {}, {}
  for _, ns in ipairs(names) do
    skip[ns] = 0
    has_pins[ns] = redis.call('EXISTS', k_pins(ns)) == 1
  end
  while not satisfied() and evicted < limit do
    local cands, threshold = choose_victims(names, skip, batch, window)
    if #cands == 0 then break end
    local progressed = false
    local drops = new_drops()
    local values, pins = {}, {}  -- per namespace: per rank the entries, the pins, by key
    local fetched = 0
    for i, c in ipairs(cands) do
      if threshold ~= nil and sorts_before(threshold, c) then break end
      if satisfied() or evicted >= limit then break end
      if i > fetched then  -- read the next chunk's entries, per namespace and rank
        local last = math.min(#cands, i + VICTIM_CHUNK - 1)
        local want = {}
        for j = i, last do
          local ns = cands[j][1]
          local w = want[ns]
          if not w then w = {}; want[ns] = w end
          w[#w + 1] = cands[j][2]
        end
        for ns, keys in pairs(want) do
          local v = values[ns]
          if not v then v = {}; values[ns] = v; pins[ns] = {} end
          for r = 0, ranks[ns] - 1 do
            local vr = v[r]
            if not vr then vr = {}; v[r] = vr end
            local got = hmget_all(k_e(ns, r), keys)
            for j, key in ipairs(keys) do vr[key] = got[j] or false end
          end
          if has_pins[ns] then
            local got = hmget_all(k_pins(ns), keys)
            for j, key in ipairs(keys) do pins[ns][key] = got[j] or false end
          end
        end
        fetched = last
      end
      progressed = true
      local ns, key = c[1], c[2]
      local nranks = ranks[ns]
      local d = drops_of(drops, ns, nranks)
      -- `evictable(ns, key, nranks, true, false, need_rank)`, on the entries read
      -- (a key met twice in a round has no entries left after its drop)
      local gone = d.gone[key]
      if nranks == 1 then  -- the same decisions, one entry, no tables
        local v = not gone and values[ns][0][key]
        local state, page, depth, lease, gen, expiring
        if v then state, page, depth, lease, gen, expiring = entry_head(v) end
        if (v and (state == 0 or lease > NOW_MS)) or (not v and need_rank == 0) then
          skip[ns] = skip[ns] + 1
        elseif not v then  -- a stale LRU member: no committed entry left
          stale_member(d, c)
        elseif has_pins[ns] and pins[ns][key] and pinned_value(pins[ns][key]) then
          skip[ns] = skip[ns] + 1
        else
          drop_one_rank(d, ns, key, page, depth, lease, gen, expiring)
          on_free(ns, 0, page)
          count_evictions(counts, ns, 1, file_slot(ns, 0))
          evicted = evicted + 1
        end
      else
        local ok, committed, heads = true, 0, {}
        for r = 0, nranks - 1 do
          local v = not gone and values[ns][r][key]
          if v then
            local state, page, depth, lease, gen, expiring = entry_head(v)
            if state == 0 or lease > NOW_MS then ok = false; break end
            heads[r] = {page, depth, lease, gen, expiring}
            committed = committed + 1
          elseif need_rank == r then
            ok = false
            break
          end
        end
        if ok and committed == 0 then  -- a stale LRU member: no committed entry left
          stale_member(d, c)
        elseif ok and has_pins[ns] and pins[ns][key] and pinned_value(pins[ns][key]) then
          skip[ns] = skip[ns] + 1
        elseif ok then
          local bytes = 0
          for _, fr in ipairs(drop_later(d, ns, key, heads)) do
            bytes = bytes + file_slot(ns, fr[1])
            on_free(ns, fr[1], fr[2])
          end
          count_evictions(counts, ns, 1, bytes)
          evicted = evicted + 1
        else
          skip[ns] = skip[ns] + 1
        end
      end
    end
    apply_drops(drops)
    if not progressed then break end
    batch = math.min(WINDOW_MAX, batch * 2)  -- walked past this many: look further at once
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
  batch = math.max(1, math.min(WINDOW_MAX, batch))
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

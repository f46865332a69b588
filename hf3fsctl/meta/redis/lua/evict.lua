-- evict (admin), one batch: committed keys by criteria, every rank at once, expired keys
-- first (soonest expiry first), then LRU (chain tails first among equally old keys);
-- pending keys never; pinned keys only when asked. The client calls it until it says
-- done, so Redis is never held for long.
-- ARGV: ns or '', older_than_s or '', target_usage or '', max_entries left or '',
--       include_pinned (0/1), dry_run (0/1), can_punch (0/1), batch, cutoff or '',
--       bytes a dry run already counted as freed, phase ('x' expired keys, 'l' LRU),
--       expired_by (ms: what the first batch took as expired) or '', then (ns, offset)
--       pairs: how far each namespace's index was walked in this phase by earlier
--       batches (keys left in place).
-- Returns {keys, pages, bytes, {ns, keys, …}, marked, {ns, offset, …}, done, cutoff,
--          phase, expired_by}.
local only = ARGV[1]
local target = tonumber(ARGV[3])
local max_entries = tonumber(ARGV[4])
local include_pinned = ARGV[5] == '1'
local dry = ARGV[6] == '1'
local can_punch = ARGV[7] == '1'
local batch = tonumber(ARGV[8])
local cutoff = tonumber(ARGV[9])
if cutoff == nil and tonumber(ARGV[2]) ~= nil then cutoff = NOW - tonumber(ARGV[2]) end
local counted = tonumber(ARGV[10])
local phase = ARGV[11]
local expired_by = tonumber(ARGV[12]) or NOW_MS
local offset = {}
for i = 13, #ARGV, 2 do offset[ARGV[i]] = tonumber(ARGV[i + 1]) end

local scope
if only ~= '' then ns_ranks(only); scope = {only} else scope = redis.call('ZRANGE', K_NAMESPACES, 0, -1) end

local bytes_used, bytes_total = 0, 0
for _, f in ipairs(all_files()) do
  local ns, r = f[1], f[2]
  if only == '' or ns == only then
    local v = redis.call('HMGET', k_rf(ns, r), 'slot', 'used', 'next_unused')
    bytes_used = bytes_used + tonumber(v[1]) * tonumber(v[2])
    bytes_total = bytes_total + tonumber(v[1]) * tonumber(v[3])
  end
end
local cap = redis.call('HGET', K_INFO, 'capacity_bytes')
if cap then bytes_total = tonumber(cap) end
bytes_used = bytes_used - counted

local below_us = nil  -- the cutoff as the LRU generations score it
if cutoff ~= nil then below_us = lru_us(cutoff) end
local ranks, cands = {}, {}
local threshold = nil
local walked_scope = scope
if phase == 'x' then walked_scope = expiring_of(scope) end
for _, ns in ipairs(scope) do ranks[ns] = tonumber(redis.call('HGET', k_ns(ns), 'num_ranks')) end
for _, ns in ipairs(walked_scope) do
  offset[ns] = offset[ns] or 0
  local n
  if phase == 'x' then  -- the expired keys, soonest first: {ns, key, expiry, member}
    local got = redis.call('ZRANGEBYSCORE', k_x(ns), '-inf', expired_by, 'WITHSCORES',
      'LIMIT', offset[ns], batch)
    for i = 1, #got, 2 do
      cands[#cands + 1] = {ns, lru_key(got[i]), tonumber(got[i + 1]), got[i]}
    end
    n = #got / 2
  else  -- the LRU generations are in eviction order (lua/common.lua, `lru_slice`)
    local got = lru_slice(ns, offset[ns], batch, below_us)
    for _, m in ipairs(got) do cands[#cands + 1] = {ns, lru_key(m[1]), m[2], m[1], m[3]} end
    n = #got
  end
  if n == batch then  -- more beyond: only what sorts before this is in order
    local last = cands[#cands]
    if threshold == nil or sorts_before(last, threshold) then threshold = last end
  end
end
if #walked_scope > 1 then table.sort(cands, sorts_before) end

-- Whether a candidate is out of this phase: an LRU candidate the expired phase already
-- walked; an expired one not last accessed before the cutoff.
local has_expiry = {}
for _, ns in ipairs(expiring_of(scope)) do has_expiry[ns] = true end
local function passed_over(ns, key, depth)
  if phase == 'l' then
    if not has_expiry[ns] then return false end
    local x = tonumber(redis.call('ZSCORE', k_x(ns), lru_member(key, depth)))
    return x ~= nil and x <= expired_by
  end
  if cutoff == nil then return false end
  local gen = 0  -- the key's LRU generation: its entry's (one rank), else `c:NS`'s
  if ranks[ns] == 1 then
    local e = unpack_entry(redis.call('HGET', k_e(ns, 0), key))
    if e then gen = e.gen end
  else
    local _
    _, gen = c_parse(redis.call('HGET', k_c(ns), key))
  end
  local last = nil
  if gen and gen > 0 then
    last = tonumber(redis.call('ZSCORE', k_g(ns, gen), lru_member(key, depth)))
  end
  return last == nil or last >= below_us
end
local keys, pages, freed_bytes = 0, 0, 0
local by_ns, counts = {}, {}
local finished = threshold == nil  -- every candidate is in this batch
for _, c in ipairs(cands) do
  if (max_entries ~= nil and keys >= max_entries)
      or (target ~= nil and bytes_used <= target * bytes_total) then
    finished = true
    break
  end
  if threshold ~= nil and sorts_before(threshold, c) then break end
  local ns, key = c[1], c[2]
  local ok, depth = evictable(ns, key, ranks[ns], false, include_pinned, nil)
  if not ok or passed_over(ns, key, depth) then
    offset[ns] = offset[ns] + 1  -- stays in the set: walk past it
  else
    local freed = {}
    if dry then
      for r = 0, ranks[ns] - 1 do
        local e = unpack_entry(redis.call('HGET', k_e(ns, r), key))  -- dry: what would go
        if e and e.state == 1 then freed[#freed + 1] = {r, e.page} end
      end
      offset[ns] = offset[ns] + 1
    else
      freed = drop_key(ns, key, ranks[ns])
    end
    local bytes = 0
    for _, fr in ipairs(freed) do bytes = bytes + file_slot(ns, fr[1]) end
    pages = pages + #freed
    freed_bytes = freed_bytes + bytes
    bytes_used = bytes_used - bytes
    keys = keys + 1
    by_ns[ns] = (by_ns[ns] or 0) + 1
    count_evictions(counts, ns, 1, bytes)
  end
end
local met = (max_entries ~= nil and keys >= max_entries)
    or (target ~= nil and bytes_used <= target * bytes_total)
if met then finished = true end
if phase == 'x' and finished and not met then  -- every expired key walked: now the LRU
  phase = 'l'
  finished = false
  offset = {}
end
local marked = {}
if not dry then
  apply_evictions(counts, 'admin')
  if can_punch then mark_give_back(marked, nil, nil, nil) end
  flush_changes()
end
local flat, walked = {}, {}
for ns, n in pairs(by_ns) do flat[#flat + 1] = ns; flat[#flat + 1] = n end
for ns, n in pairs(offset) do walked[#walked + 1] = ns; walked[#walked + 1] = n end
local cut = ''
if cutoff ~= nil then cut = f6(cutoff) end
return {keys, pages, freed_bytes, flat, marked, walked, finished and 1 or 0, cut, phase,
  string.format('%.3f', expired_by)}

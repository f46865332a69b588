-- allocate: pages for keys not yet stored on (ns, rank), making room under the store's
-- capacity and the namespace's quotas exactly as hf3fsctl/meta/sqlite/capacity.py decides for
-- SQLite (reclaim dead writers' pages, give back other files' free pages, evict expired
-- then LRU keys of any namespace down to the low watermark). A key whose committed
-- entries expired is dropped on every rank first and granted anew.
-- ARGV: ns, rank, pending_timeout_s, high, low, can_punch (0/1), nquotas,
--       nquotas x (name, "b"|"s", bytes or share), then (key, depth) pairs.
-- Returns {allocated {key, page, …}, existing {…}, no_space {…}, marked {{ns, rank,
-- path, slot, {pages}}, …}}.
local ns, rank = ARGV[1], tonumber(ARGV[2])
local pending_timeout = tonumber(ARGV[3])
local high, low = tonumber(ARGV[4]), tonumber(ARGV[5])
local can_punch = ARGV[6] == '1'
local nq = tonumber(ARGV[7])
local at = 8 + 3 * nq
local EVICT_BEYOND_NEED = 2048  -- keys one allocation may evict beyond its own pages

local nranks = ns_ranks(ns)
local row = require_rank_file(ns, rank)
local ek = k_e(ns, rank)

local allocated, existing, new_keys, depth_of = {}, {}, {}, {}
local deadline = NOW + pending_timeout
-- the deadline as the entries hold it (µs since EPOCH_MS), and so as the pending set's score
local deadline_raw = to_epoch_us(ms(deadline))
local deadline_s = string.format('%d', deadline_raw)
local wanted = {}
for i = at, #ARGV, 2 do
  wanted[#wanted + 1] = ARGV[i]
  depth_of[ARGV[i]] = tonumber(ARGV[i + 1])
end
local known = hmget_all(ek, wanted)
local entry_args, pend_args = {}, {}
local expiring = redis.call('EXISTS', k_x(ns)) == 1
local dropped_expired = {}
for i, key in ipairs(wanted) do
  local e = unpack_entry(known[i])
  if e and e.state == 1 and expiring then
    local x = tonumber(redis.call('ZSCORE', k_x(ns), lru_member(key, e.depth)))
    if x and x <= NOW_MS then  -- expired (on some rank): gone from every rank, saved anew
      local bytes = 0
      for _, fr in ipairs(drop_key(ns, key, nranks)) do bytes = bytes + file_slot(ns, fr[1]) end
      count_evictions(dropped_expired, ns, 1, bytes)
      e = nil
    end
  end
  if e == nil then
    new_keys[#new_keys + 1] = key
  elseif e.state == 0 and e.until_ < NOW_MS then  -- a dead writer's page: regrant it
    e.until_ = ms(deadline)
    e.depth = depth_of[key]
    if NOW_MS > e.created then e.created = NOW_MS end
    entry_args[#entry_args + 1] = key
    entry_args[#entry_args + 1] = pack_entry(e)
    pend_args[#pend_args + 1] = deadline_s
    pend_args[#pend_args + 1] = key
    allocated[#allocated + 1] = key
    allocated[#allocated + 1] = e.page
  else
    existing[#existing + 1] = key
  end
end
apply_evictions(dropped_expired, 'expired')
row = rank_file(ns, rank)
local marked = {}
local need = #new_keys
local pages = {}

local function capacity_bytes()
  local v = redis.call('HGET', K_INFO, 'capacity_bytes')
  return v and tonumber(v) or nil
end

local function quota_scopes(cap)
  local scopes = {}
  for q = 0, nq - 1 do
    local name, kind, value = ARGV[8 + 3 * q], ARGV[9 + 3 * q], tonumber(ARGV[10 + 3 * q])
    local limit = nil
    if kind == 'b' then limit = value elseif cap ~= nil then limit = math.floor(value * cap) end
    if limit ~= nil then
      local scope = nil
      if redis.call('HEXISTS', K_MANIFESTS, name) == 1 then
        scope = {name}
      else
        local members = redis.call('SMEMBERS', P .. 'model:' .. name)
        if #members > 0 then table.sort(members); scope = members end
      end
      if scope then scopes[#scopes + 1] = {scope, limit} end
    end
  end
  return scopes
end

local function growing_namespaces()
  local out = {}
  for _, f in ipairs(all_files()) do
    local _, prealloc = file_slot(f[1], f[2])
    if not prealloc then out[f[1]] = true end
  end
  return out
end

local function evictable_scope(scope)
  if not can_punch then return {ns} end
  local growing = growing_namespaces()
  local allowed = {}
  if scope == nil then
    for n in pairs(growing) do allowed[n] = true end
  else
    for _, n in ipairs(scope) do if growing[n] then allowed[n] = true end end
  end
  allowed[ns] = true
  local out = {}
  for n in pairs(allowed) do out[#out + 1] = n end
  table.sort(out)
  return out
end

-- This file's pages its evictions free are held here (`FREE_HELD`, eviction.lua) until
-- `take_pages` has taken what it needs from them and its free set together, in the free
-- set's own order; the rest join the set at the end (`add_held_pages`).
FREE_HELD = {ns, rank, {}}

local function held_reusable()
  local n = 0
  local held = FREE_HELD[3]
  for i = 1, #held, 2 do if tonumber(held[i]) <= NOW_US then n = n + 1 end end
  return n
end

local function reusable_free()
  return redis.call('ZCOUNT', k_free(ns, rank), '-inf', NOW_SCORE) + held_reusable()
end

-- Whether free page `a` {page, score, …} comes before `b` in a free set (by score, then
-- by the member's bytes, as Redis orders equal scores).
local function free_before(a, b)
  if a[2] ~= b[2] then return a[2] < b[2] end
  return a[1] < b[1]
end

-- The `count` first reusable pages of this file's free set and the held ones together,
-- taken: {page, reusable after (ms since EPOCH_MS, as an entry's page_free_at)} in the
-- set's order.
local function take_free(count)
  local fk = k_free(ns, rank)
  local got = redis.call('ZRANGEBYSCORE', fk, '-inf', NOW_SCORE, 'WITHSCORES', 'LIMIT', 0, count)
  local pool = {}
  for i = 1, #got, 2 do pool[#pool + 1] = {got[i], tonumber(got[i + 1]), true} end
  local held = FREE_HELD[3]
  local kept = {}  -- held pages not taken, as ZADD arguments
  for i = 1, #held, 2 do
    local score = tonumber(held[i])
    if score <= NOW_US then
      pool[#pool + 1] = {string.format('%d', held[i + 1]), score, false, held[i]}
    else
      kept[#kept + 1] = held[i]
      kept[#kept + 1] = held[i + 1]
    end
  end
  if #held > 0 then
    local one_score = true
    for _, p in ipairs(pool) do if p[2] ~= pool[1][2] then one_score = false; break end end
    if one_score then  -- (what evictions free: all reusable now) by member, C comparisons
      local by_member, members = {}, {}
      for _, p in ipairs(pool) do by_member[p[1]] = p; members[#members + 1] = p[1] end
      table.sort(members)
      for j, m in ipairs(members) do pool[j] = by_member[m] end
    else
      table.sort(pool, free_before)
    end
  end
  local out, taken = {}, {}
  for j, p in ipairs(pool) do
    if j <= count then
      out[#out + 1] = {tonumber(p[1]), math.floor(p[2] / 1000)}
      if p[3] then taken[#taken + 1] = p[1] end
    elseif not p[3] then
      kept[#kept + 1] = p[4]
      kept[#kept + 1] = p[1]
    end
  end
  if #taken > 0 then call_chunked('ZREM', fk, taken, 1) end
  FREE_HELD[3] = kept
  return out
end

-- The held pages no allocation took join the free set.
local function add_held_pages()
  local held = FREE_HELD[3]
  if #held > 0 then call_chunked('ZADD', k_free(ns, rank), held, 2) end
  FREE_HELD = nil
end

-- Make room for `need` pages within `limit` bytes held by `scope` (nil: the store).
-- Returns the most pages that may be granted.
local function fit(need, scope, limit)
  if row.prealloc then return need end
  local backed = reusable_free()
  local expected = held(scope) - giving_bytes(scope)
  local function over(ceiling) return expected + (need - backed) * row.slot > ceiling end
  local function refresh()
    expected = held(scope) - giving_bytes(scope)
    backed = reusable_free()
  end
  if over(high * limit) then
    reclaim_all_expired()
    if can_punch then mark_give_back(marked, ns, rank, scope) end
    refresh()
  end
  if over(high * limit) then
    local swing = (high - low) * limit
    local function done()
      return high * limit - expected + backed * row.slot >= need * row.slot + swing
    end
    local function freed(ns2, r2, page)
      if ns2 == ns and r2 == rank then
        backed = backed + 1
      else
        local slot, prealloc = file_slot(ns2, r2)
        if can_punch and not prealloc then expected = expected - slot end
      end
    end
    local reason = 'quota'
    if scope == nil then reason = 'capacity' end
    local batch = need + math.floor(swing / row.slot) + 1
    evict_lru(evictable_scope(scope), done, freed, reason, batch, nil,
      need + EVICT_BEYOND_NEED)
    if can_punch then mark_give_back(marked, ns, rank, scope) end
    refresh()
  end
  return backed + math.max(0, math.floor((limit - held(scope)) / row.slot))
end

-- Up to `count` pages of this file: free ones that hold their space, then punched ones
-- and fresh ones, which grow the file and so stop where the store would pass `cap`.
local function take_pages(count, cap)
  local out = {}
  if count <= 0 then return out end
  local grow_room = nil
  if cap ~= nil and not row.prealloc then
    grow_room = math.max(0, math.floor((cap - held(nil)) / row.slot))
  end
  out = take_free(count)
  local reused_holes = 0
  if #out < count then
    local want = count - #out
    if grow_room ~= nil then want = math.min(want, grow_room) end
    if want > 0 then
      local hk = k_holes(ns, rank)
      local hs = redis.call('ZRANGEBYSCORE', hk, '-inf', f6(NOW), 'WITHSCORES', 'LIMIT', 0, want)
      local reused = {}
      for i = 1, #hs, 2 do
        out[#out + 1] = {tonumber(hs[i]), to_epoch(ms(tonumber(hs[i + 1])))}
        reused[#reused + 1] = hs[i]
        reused_holes = reused_holes + 1
      end
      if #reused > 0 then call_chunked('ZREM', hk, reused, 1) end
      if grow_room ~= nil then grow_room = grow_room - reused_holes end
    end
  end
  local fresh = math.min(count - #out, row.num_pages - row.next_unused)
  if grow_room ~= nil then fresh = math.min(fresh, grow_room) end
  if fresh > 0 then
    for p = row.next_unused, row.next_unused + fresh - 1 do out[#out + 1] = {p, 0} end
    redis.call('HINCRBY', k_rf(ns, rank), 'next_unused', fresh)
    row.next_unused = row.next_unused + fresh
  else
    fresh = 0
  end
  if reused_holes > 0 then redis.call('HINCRBY', k_rf(ns, rank), 'holes', -reused_holes) end
  if not row.prealloc and (fresh + reused_holes) > 0 then
    redis.call('HINCRBY', K_HELD, ns, (fresh + reused_holes) * row.slot)
  end
  return out
end

if need > 0 then
  if row.used + need > high * row.num_pages then  -- the file itself is full
    reclaim_expired(ns, rank)
    row = rank_file(ns, rank)
    local target = math.floor(low * row.num_pages) - need
    local used = row.used
    evict_lru({ns}, function() return used <= target end, function(ns2, r2, page)
      if r2 == rank then used = used - 1 end
    end, 'file_full', used - target, rank, need + EVICT_BEYOND_NEED)
    row = rank_file(ns, rank)
  end
  local cap = capacity_bytes()
  local grant = need
  for _, q in ipairs(quota_scopes(cap)) do
    local covers = false
    for _, n in ipairs(q[1]) do if n == ns then covers = true end end
    if covers then grant = math.min(grant, fit(need, q[1], q[2])) end
  end
  if cap ~= nil and grant > 0 then grant = math.min(grant, fit(grant, nil, cap)) end
  grant = math.max(0, grant)
  row = rank_file(ns, rank)
  pages = take_pages(grant, cap)
end

local no_space = {}
local granted = 0
-- a new pending entry, packed as `pack_entry` packs {state = 0, page, depth, created and
-- last access NOW, until the deadline, free at the page's reusable time, the rest 0}
local now_raw = to_epoch(NOW_MS)
for i, key in ipairs(new_keys) do
  local p = pages[i]
  if p == nil then
    no_space[#no_space + 1] = key
  else
    local freeat = p[2]
    entry_args[#entry_args + 1] = key
    entry_args[#entry_args + 1] = struct.pack(ENTRY, 0, deadline_raw, p[1],
      math.min(depth_of[key], U16), now_raw, now_raw, 0, 0, freeat, 0, 0, 0)
    pend_args[#pend_args + 1] = deadline_s
    pend_args[#pend_args + 1] = key
    allocated[#allocated + 1] = key
    allocated[#allocated + 1] = p[1]
    granted = granted + 1
  end
end
add_held_pages()
call_chunked('HSET', ek, entry_args, 2)
call_chunked('ZADD', k_pend(ns, rank), descending(pend_args), 2)
if granted > 0 then redis.call('HINCRBY', k_rf(ns, rank), 'used', granted) end
redis.call('HSET', k_ns(ns), 'last_used', f6(NOW))
flush_changes()
return {allocated, existing, no_space, marked}

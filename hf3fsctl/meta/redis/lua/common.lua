-- Shared by every script of the Redis metadata store: the head of its function library,
-- or prepended to each script where the server has no functions
-- (hf3fsctl/meta/redis/connection.py). KEYS[1] is the key prefix; every key
-- a script touches starts with it (one hash tag, so one Cluster slot). The key layout is
-- described in hf3fsctl/meta/redis/__init__.py and docs/design.md (decision 13).
--
-- Errors are raised as `error({err = "KIND message"})` before any write, with KIND one
-- of NOTFOUND, INVALID, CONFLICT; the store turns them into its typed errors.

-- Set for each call by `begin` (the end of this file), which every script runs first: the
-- key prefix (KEYS[1]), the server's time (NOW in seconds; NOW_US in µs since EPOCH_MS,
-- exact: the LRU generations' scores; NOW_MS, NOW_S, NOW_SCORE the same in other forms),
-- the store's key names and the per-call caches. Run as Redis functions, this file is
-- loaded once and its functions kept between calls: nothing else may hold a call's state.
local P, NOW, NOW_US, NOW_MS, NOW_S, NOW_SCORE
local K_INFO, K_NAMESPACES, K_MANIFESTS, K_FILES, K_HELD, K_GIVING, K_CHANGES, K_SEQ, K_ADM_AT

local function f6(x) return string.format('%.6f', x) end

local function fail(kind, message) error({err = kind .. ' ' .. message}) end

-- key names ------------------------------------------------------------------------
local function k_ns(ns) return P .. 'ns:' .. ns end            -- hash: counters, num_ranks, …
local function k_rf(ns, r) return P .. 'rf:' .. ns .. ':' .. r end  -- hash: a rank file
local function k_e(ns, r) return P .. 'e:' .. ns .. ':' .. r end    -- hash: key -> entry
local function k_free(ns, r) return P .. 'free:' .. ns .. ':' .. r end  -- zset page -> reusable after (µs)
local function k_holes(ns, r) return P .. 'holes:' .. ns .. ':' .. r end  -- zset page -> reusable_after
local function k_give(ns, r) return P .. 'give:' .. ns .. ':' .. r end   -- zset page -> marked at
local function k_pend(ns, r) return P .. 'pend:' .. ns .. ':' .. r end   -- zset key -> deadline (µs)
local function k_c(ns) return P .. 'c:' .. ns end               -- hash: key -> "ranks[ expiry]" (2+ ranks)
local function k_x(ns) return P .. 'x:' .. ns end               -- zset lru_member -> earliest expiry (ms)
local function k_adm(ns) return P .. 'adm:' .. ns end           -- hash: key -> sightings (admit)
local function k_lru(ns) return P .. 'lru:' .. ns end           -- format 3's LRU (migrations only)
local function k_gi(ns) return P .. 'gi:' .. ns end             -- zset generation id -> id (the live ones)
local function k_g(ns, id) return P .. 'g:' .. ns .. ':' .. string.format('%d', id) end  -- zset lru_member -> last access (µs)
local function k_pins(ns) return P .. 'pins:' .. ns end         -- hash: key -> "expires created"
local function k_ev(ns) return P .. 'ev:' .. ns end             -- hash: reason:keys / reason:bytes
-- info (hash: capacity_bytes, schema), namespaces (zset ns -> created), manifests (hash:
-- ns -> manifest JSON), files (set of "ns:rank"), held (hash: ns -> bytes its files hold),
-- giving (hash: ns -> bytes marked to give back), changes (stream of (ns, key, delta), ids
-- 0-SEQ), seq (the last change's SEQ), adm_at (zset NS .. key -> last sighting: admit's
-- bound): K_INFO … K_ADM_AT, named by `begin`
local CHANGES_KEEP = 200000

-- entries --------------------------------------------------------------------------
-- Keys arrive as bytes (`codec.encode_key`: 64 hex digits are 32 bytes); a script never
-- reads them, only compares and stores them. An entry is packed binary (`struct`, one C
-- call each way): flags (bit 0 committed, bit 1 renew on read), until (pending: the
-- writer's deadline; committed: the expiry, 0 none), page (5 bytes), depth (2 bytes),
-- created, last_access, hits (3 bytes), lease_until, page_free_at, size (4 bytes), the
-- key's LRU generation (5 bytes; one-rank namespaces only, 0 otherwise: `c:NS` holds it),
-- retention (seconds, float32), then the checksum (`codec.encode_checksum`: "xxh3:" and 16
-- hex digits are 9 bytes). Times count from `EPOCH_MS` (0: none): whole milliseconds in 5
-- bytes (to 2059), `until` in microseconds in 7 bytes (an expiry is exact to the
-- microsecond, as SQLite's). Integers are unsigned little-endian; depth saturates at
-- 65,535 (as the LRU member's does: the eviction order is unchanged), hits at 2^24 - 1;
-- sizes past 2^32 - 1 are refused by the store. 60 bytes with an
-- xxh3 checksum, one 64-byte allocation (format 4; `codec.unpack_entry` reads the same
-- layout). Flags and `until` lead, so a lookup reads a committed entry without expiry
-- from its first 8 bytes (`codec.entry_counts`). In a script, every time is in ms (a
-- double: `until` keeps its microseconds).
local ENTRY = '<BI7I5I2I5I5I3I5I5I4I5f'
local U16, U24 = 65535, 16777215
local EPOCH_MS = 1735689600000  -- 2025-01-01 UTC
local TIME_MAX = EPOCH_MS + 1099511627775  -- what 5 bytes of ms hold
local UNTIL_MAX = EPOCH_MS + 72057594037927  -- what 7 bytes of microseconds hold

local function ms(t) return t * 1000 end  -- seconds -> ms

local function from_epoch(t) if t == 0 then return 0 end return t + EPOCH_MS end
local function to_epoch(t)
  if t <= EPOCH_MS then return 0 end
  return math.floor(math.min(t, TIME_MAX)) - EPOCH_MS
end
local function from_epoch_us(t) if t == 0 then return 0 end return t / 1000 + EPOCH_MS end
local function to_epoch_us(t)
  if t <= EPOCH_MS then return 0 end
  return math.floor((math.min(t, UNTIL_MAX) - EPOCH_MS) * 1000 + 0.5)
end
-- an expiry `ms` from now, as the entry will hold it (whole microseconds)
local function expiry_after(ms_)
  return from_epoch_us(to_epoch_us(math.min(UNTIL_MAX, NOW_MS + ms_)))
end

local function unpack_entry(v)
  if not v then return nil end
  local flags, until_, page, depth, created, last, hits, lease, freeat, size, gen, retention,
    at = struct.unpack(ENTRY, v)
  if until_ > 0 then until_ = from_epoch_us(until_) end
  if lease > 0 then lease = lease + EPOCH_MS end
  if freeat > 0 then freeat = freeat + EPOCH_MS end
  return {
    state = flags % 2, renew = flags >= 2, page = page, depth = depth,
    created = created + EPOCH_MS, last = last + EPOCH_MS, hits = hits, until_ = until_,
    lease = lease, freeat = freeat, size = size, gen = gen, retention = retention,
    checksum = string.sub(v, at),
  }
end

local function pack_entry(e)
  local flags = e.state
  if e.renew then flags = flags + 2 end
  local until_, lease, freeat = 0, 0, 0
  if e.until_ > 0 then until_ = to_epoch_us(e.until_) end
  if e.lease > 0 then lease = to_epoch(e.lease) end
  if e.freeat > 0 then freeat = to_epoch(e.freeat) end
  return struct.pack(ENTRY, flags, until_, e.page, math.min(e.depth, U16), to_epoch(e.created),
    to_epoch(e.last), math.min(e.hits, U24), lease, freeat, e.size, e.gen or 0,
    e.retention or 0)
    .. (e.checksum or '')
end

-- Whether a committed entry has expired (its expiry passed): absent for lookups and
-- locates, and the first to go in an eviction.
local function expired(e) return e.state == 1 and e.until_ > 0 and e.until_ <= NOW_MS end

-- The pending and free sets (format 5) are scored in whole µs since EPOCH_MS, as the
-- LRU generations: a pending key by its writer's deadline (its entry's `until`, the same
-- integer), a free page by when it may be reused. Integer scores are stored as integers
-- in a small sorted set's listpack; fractional ones as strings, which every insert
-- parses for each member it walks past (64 keys added to a set of 64: ~500 against
-- ~115 µs of Redis CPU). NOW_SCORE is now's.
-- A free page's score: reusable now, or when the freed entry's lease (ms, 0 none) ends
local function free_score(lease)
  if lease > NOW_MS then return string.format('%d', (lease - EPOCH_MS) * 1000) end
  return NOW_SCORE
end

-- the LRU index ---------------------------------------------------------------------------
-- A member is 0xffff - depth in 2 big-endian bytes (depth clamped to 0..0xffff) then the
-- key: among equally old keys Redis orders members by their bytes, so they come deepest
-- first (a chain's tail before its head), then by key — the order SQLite's index gives
-- (last_access, depth DESC, key). `x:NS` uses the same members.
local function lru_member(key, depth)
  return struct.pack('>H', 0xffff - math.max(0, math.min(0xffff, depth))) .. key
end
local function lru_key(member) return string.sub(member, 3) end

-- The LRU is kept in generations (format 4): small sorted sets `g:NS:ID` of at most
-- GEN_MAX members (listpack-encoded under Redis's compiled-in 128 / 64: ~50 B a member
-- where one big sorted set costs ~134), scored by last access (µs since EPOCH_MS, an
-- integer: compact in a listpack), appended in time order. `gi:NS` lists the live ids
-- (score = id) and `ns:NS`'s `gen` is the last id issued. A touch removes the key's member
-- from its generation (each key's id is in its entry, or with 2+ ranks in `c:NS`) and
-- appends the touched keys, in member order, to the newest generation, so the
-- generations in id order, each in its own order, are the eviction order. An emptied
-- generation is dropped with its last member. A clock that steps back d ms can reorder
-- keys touched within d ms (as one sorted set would too).
local GEN_MAX = 128

-- Remove `members` (a list) from generation `gen` of `ns`; the generation goes when
-- emptied. `stray_keys` (a set of keys, or nil): also remove members of those keys that
-- carry another depth (a key of several ranks whose member came from another rank).
local function lru_remove(ns, gen, members, stray_keys)
  if not gen or gen <= 0 or #members == 0 then return end
  local gk = k_g(ns, gen)
  local removed = 0
  for i = 1, #members, 1000 do
    removed = removed + redis.call('ZREM', gk, unpack(members, i, math.min(i + 999, #members)))
  end
  if stray_keys and removed < #members then
    local stray = {}
    for _, m in ipairs(redis.call('ZRANGE', gk, 0, -1)) do
      if stray_keys[lru_key(m)] then stray[#stray + 1] = m end
    end
    if #stray > 0 then redis.call('ZREM', gk, unpack(stray)) end
  end
  if redis.call('EXISTS', gk) == 0 then redis.call('ZREM', k_gi(ns), gen) end
end

-- Touch keys now: `items` is a list of {key, member, gen} (gen: where the key's member is,
-- 0 none). Each key's member leaves its generation and joins the newest, in member
-- order (deepest first, then key); a key listed twice moves once. `several_ranks`: the
-- key's old member may carry another rank's depth. Returns each item's new generation.
local function lru_touch(ns, items, several_ranks)
  local members, first_of, by_gen = {}, {}, {}
  for i, it in ipairs(items) do
    local key = it[1]
    if not first_of[key] then
      first_of[key] = i
      members[#members + 1] = it[2]
      local g = it[3] or 0
      if g > 0 then
        local b = by_gen[g]
        if not b then b = {{}, {}}; by_gen[g] = b end
        b[1][#b[1] + 1] = it[2]
        b[2][key] = true
      end
    end
  end
  for g, b in pairs(by_gen) do lru_remove(ns, g, b[1], several_ranks and b[2] or nil) end
  table.sort(members)  -- eviction order among equally old keys (C comparisons, no closure)
  local nk = k_ns(ns)
  local cur = tonumber(redis.call('HGET', nk, 'gen') or '0') or 0
  local n = 0
  if cur > 0 then n = redis.call('ZCARD', k_g(ns, cur)) end
  local gen_of = {}  -- member -> its new generation
  local stamp = string.format('%d', NOW_US)
  local i = 1
  while i <= #members do
    if cur == 0 or n >= GEN_MAX then
      cur = redis.call('HINCRBY', nk, 'gen', 1)
      n = 0
    end
    if n == 0 then redis.call('ZADD', k_gi(ns), cur, cur) end
    local first = i
    while i <= #members and n < GEN_MAX do
      gen_of[members[i]] = cur
      n = n + 1
      i = i + 1
    end
    -- the greatest member first: a listpack ZADD scans from the head for each member's
    -- place, so each new one stops at the one added before it (2.8x cheaper for 128)
    local args = {}
    for j = i - 1, first, -1 do
      args[#args + 1] = stamp
      args[#args + 1] = members[j]
    end
    redis.call('ZADD', k_g(ns, cur), unpack(args))
  end
  local out = {}
  for j, it in ipairs(items) do out[j] = gen_of[items[first_of[it[1]]][2]] end
  return out
end

-- The LRU index's members of `ns` in eviction order from position `from` (0-based, over
-- every generation), at most `count`, stopping at the first last-accessed at or after
-- `below_us` (nil: none): a list of {member, last access (µs), generation}, or with
-- `as_candidates` eviction candidates {ns, key, last access, member, generation}. Whole
-- generations before `from` cost one ZCARD each.
local function lru_slice(ns, from, count, below_us, as_candidates)
  local out = {}
  local gi = k_gi(ns)
  local at, skip = 0, from
  while #out < count do
    local ids = redis.call('ZRANGE', gi, at, at + 63)
    if #ids == 0 then break end
    for _, id in ipairs(ids) do
      local gen = tonumber(id)
      local gk = k_g(ns, gen)
      local n = redis.call('ZCARD', gk)
      if skip >= n then
        skip = skip - n
      else
        local got = redis.call('ZRANGE', gk, skip, skip + count - #out - 1, 'WITHSCORES')
        skip = 0
        for i = 1, #got, 2 do
          local score = tonumber(got[i + 1])
          if below_us and score >= below_us then return out end
          if as_candidates then
            out[#out + 1] = {ns, lru_key(got[i]), score, got[i], gen}
          else
            out[#out + 1] = {got[i], score, gen}
          end
        end
        if #out >= count then return out end
      end
    end
    at = at + #ids
  end
  return out
end

-- A time in seconds as the generations score it (µs since EPOCH_MS).
local function lru_us(t) return (t - EPOCH_MS / 1000) * 1000000 end

-- the change log ---------------------------------------------------------------------
-- Each stream entry is a run of consecutive changes of one namespace and sign: fields
-- `ns`, `delta`, `keys` (each key's byte length as one byte, then its bytes: keys are
-- binary); its id is 0-SEQ of the run's last change, so
-- the run's changes are SEQ-n+1 … SEQ. Trimmed by id: the newest CHANGES_KEEP changes.
local CHANGES  -- this call's changes (`begin` empties it)
local function change(ns, key, delta) CHANGES[#CHANGES + 1] = {ns, key, delta} end
local function flush_changes()
  if #CHANGES == 0 then return end
  local last = redis.call('INCRBY', K_SEQ, #CHANGES)
  local seq = last - #CHANGES
  local i = 1
  while i <= #CHANGES do
    local ns, delta = CHANGES[i][1], CHANGES[i][3]
    local keys = {}
    while i <= #CHANGES and CHANGES[i][1] == ns and CHANGES[i][3] == delta and #keys < 1000 do
      local key = CHANGES[i][2]
      keys[#keys + 1] = string.char(#key) .. key
      i = i + 1
    end
    seq = seq + #keys
    redis.call('XADD', K_CHANGES, 'MINID', '~', '0-' .. math.max(0, last - CHANGES_KEEP),
      '0-' .. seq, 'ns', ns, 'delta', delta, 'keys', table.concat(keys))
  end
  CHANGES = {}
end

-- batched commands ----------------------------------------------------------------------
-- HMGET of any number of fields (chunks under Lua's argument limit), aligned with `fields`.
local function hmget_all(key, fields, first)
  local out = {}
  first = first or 1
  for i = first, #fields, 1000 do
    local values = redis.call('HMGET', key, unpack(fields, i, math.min(i + 999, #fields)))
    for j = 1, #values do out[i - first + j] = values[j] end
  end
  return out
end

-- ZADD arguments (score, member, …) reordered greatest member first, for members of one
-- score (a writer's pending keys): a listpack ZADD scans from the head for each member's
-- place, so each then stops at the one added before it (64 keys: 50 µs instead of 140).
-- The set written is the same in any order.
local function descending(args)
  local members, score_of = {}, {}
  for i = 1, #args, 2 do
    members[#members + 1] = args[i + 1]
    score_of[args[i + 1]] = args[i]
  end
  table.sort(members)
  local out = {}
  for j = #members, 1, -1 do
    out[#out + 1] = score_of[members[j]]
    out[#out + 1] = members[j]
  end
  return out
end

-- `cmd key args…` over a flat list of arguments, in chunks of whole items of `per`.
local function call_chunked(cmd, key, args, per)
  local step = per * 500
  for i = 1, #args, step do
    redis.call(cmd, key, unpack(args, i, math.min(i + step - 1, #args)))
  end
end

-- namespaces and rank files -----------------------------------------------------------
local function ns_ranks(ns)
  local n = redis.call('HGET', k_ns(ns), 'num_ranks')
  if not n then fail('NOTFOUND', 'namespace ' .. ns .. ' is not registered') end
  return tonumber(n)
end

local function rank_file(ns, r)
  local v = redis.call('HMGET', k_rf(ns, r), 'path', 'slot', 'num_pages', 'next_unused',
    'used', 'prealloc', 'holes')
  if not v[1] then return nil end
  return {ns = ns, rank = tonumber(r), path = v[1], slot = tonumber(v[2]),
    num_pages = tonumber(v[3]), next_unused = tonumber(v[4]), used = tonumber(v[5]),
    prealloc = v[6] == '1', holes = tonumber(v[7])}
end

local function require_rank_file(ns, r)
  ns_ranks(ns)
  local row = rank_file(ns, r)
  if not row then
    fail('NOTFOUND', 'rank ' .. r .. ' of namespace ' .. ns .. ' has no registered page file')
  end
  return row
end

-- every rank file: list of {ns, rank}
local function all_files()
  local out = {}
  for _, m in ipairs(redis.call('SMEMBERS', K_FILES)) do
    local ns, r = string.match(m, '^(%x+):(%d+)$')
    out[#out + 1] = {ns, tonumber(r)}
  end
  return out
end

local SLOTS  -- "ns:rank" -> {slot, prealloc}: read once a call (`begin` empties it)
local function file_slot(ns, r)
  local id = ns .. ':' .. r
  local s = SLOTS[id]
  if not s then
    local v = redis.call('HMGET', k_rf(ns, r), 'slot', 'prealloc')
    s = {tonumber(v[1]) or 0, v[2] ~= '0'}
    SLOTS[id] = s
  end
  return s[1], s[2]
end

-- pins, held bytes, eviction counters -----------------------------------------------------
-- Whether a pin's value ("expires created") still holds.
local function pinned_value(v)
  local expires = tonumber(string.match(v, '^(%S+)'))
  return expires == 0 or expires > NOW
end

local function pinned(ns, key)
  local v = redis.call('HGET', k_pins(ns), key)
  if not v then return false end
  return pinned_value(v)
end

-- `c:NS`'s value (2+ ranks): the ranks committed, the key's LRU generation, then the key's
-- earliest expiry when it has one: "RANKS GEN" or "RANKS GEN EXPIRY_MS".
local function c_value(count, gen, expiry)
  if expiry and expiry > 0 then return string.format('%d %d %.3f', count, gen, expiry) end
  return string.format('%d %d', count, gen)
end
-- count, generation, expiry (nil: none) of a `c:NS` value (nil: 0, 0, nil)
local function c_parse(v)
  if not v then return 0, 0, nil end
  local c, g, x = string.match(v, '^(%d+) (%d+) ?(%S*)$')
  return tonumber(c), tonumber(g), tonumber(x)
end

-- How many ranks of a key are committed: the entry itself on one rank (no `c:NS`: the
-- lookup reads `e:NS:0`), else `c:NS`'s count.
local function committed_ranks(ns, key, nranks)
  if nranks == 1 then
    local e = unpack_entry(redis.call('HGET', k_e(ns, 0), key))
    if e and e.state == 1 then return 1 end
    return 0
  end
  local v = redis.call('HGET', k_c(ns), key)
  if not v then return 0 end
  return tonumber(string.match(v, '^%d+'))
end

local function sum_hash(key, fields)
  local total = 0
  local values
  if fields == nil then values = redis.call('HVALS', key)
  elseif #fields == 0 then return 0
  else values = redis.call('HMGET', key, unpack(fields)) end
  for _, v in ipairs(values) do total = total + (tonumber(v) or 0) end
  return total
end

local function held(scope) return sum_hash(K_HELD, scope) end
local function giving_bytes(scope) return sum_hash(K_GIVING, scope) end

local function count_evictions(counts, ns, keys, bytes)
  -- counts: ns -> {keys, bytes}, applied by apply_evictions
  local c = counts[ns]
  if not c then c = {0, 0}; counts[ns] = c end
  c[1] = c[1] + keys
  c[2] = c[2] + bytes
end

local function apply_evictions(counts, reason)
  for ns, c in pairs(counts) do
    if c[1] > 0 then
      redis.call('HINCRBY', k_ev(ns), reason .. ':keys', c[1])
      redis.call('HINCRBY', k_ev(ns), reason .. ':bytes', c[2])
    end
  end
end

-- giving pages back ----------------------------------------------------------------
local function free_page(ns, r, page, score)
  redis.call('ZADD', k_free(ns, r), score, page)
end

-- Drop a key's committed entries on every rank; pages go to the free list (reusable
-- when the read lease ends). Pending entries stay (their writer owns the page).
-- Returns the freed {rank, page} pairs.
local function drop_key(ns, key, nranks)
  local freed = {}
  local had = 0
  local members = {}
  local expiring = false  -- an entry has an expiry: the key is in `x:NS` too
  local gen = 0  -- the key's LRU generation
  if nranks > 1 then
    local _
    _, gen = c_parse(redis.call('HGET', k_c(ns), key))
  end
  for r = 0, nranks - 1 do
    local ek = k_e(ns, r)
    local e = unpack_entry(redis.call('HGET', ek, key))
    if e and e.state == 1 then
      members[lru_member(key, e.depth)] = true
      if nranks == 1 then gen = e.gen end
      if e.until_ > 0 then expiring = true end
      redis.call('HDEL', ek, key)
      free_page(ns, r, e.page, free_score(e.lease))
      redis.call('HINCRBY', k_rf(ns, r), 'used', -1)
      change(ns, key, -1)
      freed[#freed + 1] = {r, e.page}
      had = had + 1
    end
  end
  if had > 0 then
    if had >= nranks then redis.call('HINCRBY', k_ns(ns), 'keys', -1) end
    if nranks > 1 then redis.call('HDEL', k_c(ns), key) end
  end
  local list = {}
  for m in pairs(members) do list[#list + 1] = m end
  lru_remove(ns, gen, list, nil)
  if expiring then for m in pairs(members) do redis.call('ZREM', k_x(ns), m) end end
  return freed
end

-- Free the pages of pending entries of one file whose writer's deadline passed.
local function reclaim_expired(ns, r)
  local pk = k_pend(ns, r)
  local keys = redis.call('ZRANGEBYSCORE', pk, '-inf', '(' .. NOW_SCORE)
  for _, key in ipairs(keys) do
    local e = unpack_entry(redis.call('HGET', k_e(ns, r), key))
    if e and e.state == 0 then
      redis.call('HDEL', k_e(ns, r), key)
      free_page(ns, r, e.page, NOW_SCORE)
      redis.call('HINCRBY', k_rf(ns, r), 'used', -1)
    end
    redis.call('ZREM', pk, key)
  end
  return #keys
end

local function reclaim_all_expired()
  for _, f in ipairs(all_files()) do reclaim_expired(f[1], f[2]) end
end

-- Mark the free, lease-free pages of growing files of `scope` (all when nil), but the
-- file `keep_ns`/`keep_r`'s, to give back: they leave the free list for the file's
-- `give` set (never handed out, still counted as held) until settled. Appends
-- {ns, rank, path, slot, pages} to `out`.
local function mark_give_back(out, keep_ns, keep_r, scope)
  local allowed = nil
  if scope then allowed = {}; for _, ns in ipairs(scope) do allowed[ns] = true end end
  for _, f in ipairs(all_files()) do
    local ns, r = f[1], f[2]
    if not (ns == keep_ns and r == keep_r) and (allowed == nil or allowed[ns]) then
      local slot, prealloc = file_slot(ns, r)
      if not prealloc then
        local pages = redis.call('ZRANGEBYSCORE', k_free(ns, r), '-inf', NOW_SCORE)
        if #pages > 0 then
          for i = 1, #pages, 1000 do
            local chunk = {}
            local args = {}
            for j = i, math.min(i + 999, #pages) do
              chunk[#chunk + 1] = pages[j]
              args[#args + 1] = f6(NOW)
              args[#args + 1] = pages[j]
            end
            redis.call('ZREM', k_free(ns, r), unpack(chunk))
            redis.call('ZADD', k_give(ns, r), unpack(args))
          end
          redis.call('HINCRBY', K_GIVING, ns, #pages * slot)
          local path = redis.call('HGET', k_rf(ns, r), 'path')
          out[#out + 1] = {ns, r, path, slot, pages}
        end
      end
    end
  end
end

-- the call ---------------------------------------------------------------------------
-- What every script runs first (the loader adds the call: `hf3fsctl/meta/redis/connection.py`).
local function begin(keys)
  P = keys[1]
  local time = redis.call('TIME')
  NOW = tonumber(time[1]) + tonumber(time[2]) / 1e6
  NOW_US = (tonumber(time[1]) - 1735689600) * 1000000 + tonumber(time[2])
  NOW_MS = ms(NOW)
  NOW_S = f6(NOW)
  NOW_SCORE = string.format('%d', NOW_US)
  K_INFO, K_NAMESPACES, K_MANIFESTS = P .. 'info', P .. 'namespaces', P .. 'manifests'
  K_FILES, K_HELD, K_GIVING = P .. 'files', P .. 'held', P .. 'giving'
  K_CHANGES, K_SEQ, K_ADM_AT = P .. 'changes', P .. 'seq', P .. 'adm_at'
  CHANGES, SLOTS = {}, {}
end

-- migrate_format4: format 3 -> 4 for one namespace (ARGV[1] = ns). Format 4 keeps the
-- LRU in generations (`common.lua`, `lru_touch`): every entry is rewritten in format 4's
-- layout (page in 5 bytes, depth in 2, hits in 3, size in 4, the key's generation in 5),
-- `c:NS`'s values gain the generation ("RANKS GEN[ EXPIRY_MS]"), and `lru:NS` is replaced
-- by generations of GEN_MAX members filled in its own order, each member keeping its
-- score (seconds there, µs here), so the eviction order is unchanged. One atomic call
-- (O(the namespace's keys), once, on the first open by this release); `migrated_4` (a
-- set) records what is done, so a second run skips it. A store whose pages are larger
-- than format 4 holds (2^32 - 1 bytes) is refused before any write. Returns how many LRU members were moved.
local ns = ARGV[1]
if redis.call('SISMEMBER', P .. 'migrated_4', ns) == 1 then return 0 end
local FORMAT3_ENTRY = '<BI7I6I4I5I5I4I5I5I5f'
local U32 = 4294967295
local nranks = tonumber(redis.call('HGET', k_ns(ns), 'num_ranks')) or 0
for r = 0, nranks - 1 do
  if (tonumber(redis.call('HGET', k_rf(ns, r), 'slot')) or 0) > U32 then
    fail('INVALID', 'rank ' .. r .. ' of namespace ' .. ns .. ' has pages larger than '
      .. 'Redis store format 4 holds (2^32 - 1 bytes)')
  end
end

-- Hash `key` rebuilt with each value replaced by `each(value)`: written to a new key, then
-- renamed over the old one (a scan may return a field twice; each is converted from the
-- old value, so twice is harmless).
local function rewrite(key, each)
  local tmp = key .. ':migrating'
  redis.call('DEL', tmp)
  local cursor = '0'
  repeat
    local page = redis.call('HSCAN', key, cursor, 'COUNT', 1000)
    cursor = page[1]
    local items, args = page[2], {}
    for i = 1, #items, 2 do
      args[#args + 1] = items[i]
      args[#args + 1] = each(items[i + 1])
    end
    if #args > 0 then call_chunked('HSET', tmp, args, 2) end
  until cursor == '0'
  if redis.call('EXISTS', tmp) == 1 then redis.call('RENAME', tmp, key) end
end

for r = 0, nranks - 1 do
  rewrite(k_e(ns, r), function(v)
    local flags, until_, page, depth, created, last, hits, lease, freeat, size, retention, at =
      struct.unpack(FORMAT3_ENTRY, v)
    return struct.pack(ENTRY, flags, until_, page, math.min(depth, U16), created, last,
      math.min(hits, U24), lease, freeat, math.min(size, U32), 0, retention)
      .. string.sub(v, at)
  end)
end
if nranks > 1 then
  rewrite(k_c(ns), function(v)
    local count, expiry = string.match(v, '^(%d+) ?(%S*)$')
    return c_value(tonumber(count), 0, tonumber(expiry))
  end)
end

-- the LRU, in its order, into generations; each key's id into its entry or `c:NS`
local lk, nk = k_lru(ns), k_ns(ns)
local index = nranks == 1 and k_e(ns, 0) or k_c(ns)
local total = redis.call('ZCARD', lk)
local cur = tonumber(redis.call('HGET', nk, 'gen') or '0') or 0
local n = 0
local moved = 0
for i = 0, total - 1, 1000 do
  local got = redis.call('ZRANGE', lk, i, i + 999, 'WITHSCORES')
  local keys = {}
  for j = 1, #got, 2 do keys[#keys + 1] = lru_key(got[j]) end
  local values = hmget_all(index, keys)
  local now_in = {}  -- key -> its generation, assigned in this chunk
  local adds, updates = {}, {}  -- generation -> ZADD args; key -> its index value
  for j, key in ipairs(keys) do
    local member, score = got[2 * j - 1], tonumber(got[2 * j])
    local v = values[j]
    local live, old = false, 0
    if nranks == 1 then
      local e = unpack_entry(v)
      live = e ~= nil and e.state == 1
      if live then old = e.gen end
    elseif v then
      live = true
      local _
      _, old = c_parse(v)
    end
    old = now_in[key] or old or 0
    if live then
      if old > 0 then  -- a second member of one key (another rank's depth): keep the newest
        local a = adds[old]
        if a then
          for k = #a, 2, -2 do
            if lru_key(a[k]) == key then table.remove(a, k); table.remove(a, k - 1) end
          end
        end
        lru_remove(ns, old, {member}, {[key] = true})
        if old == cur then n = redis.call('ZCARD', k_g(ns, cur)) + #(adds[cur] or {}) / 2 end
      end
      if cur == 0 or n >= GEN_MAX then
        cur = cur + 1
        n = 0
      end
      local a = adds[cur]
      if not a then a = {}; adds[cur] = a end
      a[#a + 1] = string.format('%d', math.floor((score - EPOCH_MS / 1000) * 1000000 + 0.5))
      a[#a + 1] = member
      n = n + 1
      now_in[key] = cur
      updates[key] = true
      moved = moved + 1
    end
  end
  for gen, a in pairs(adds) do
    if #a > 0 then
      call_chunked('ZADD', k_g(ns, gen), a, 2)
      redis.call('ZADD', k_gi(ns), gen, gen)
    end
  end
  local args = {}
  for j, key in ipairs(keys) do
    if updates[key] then
      updates[key] = nil
      local v = values[j]
      args[#args + 1] = key
      if nranks == 1 then
        local e = unpack_entry(v)
        e.gen = now_in[key]
        args[#args + 1] = pack_entry(e)
      else
        local count, _, expiry = c_parse(v)
        args[#args + 1] = c_value(count, now_in[key], expiry)
      end
    end
  end
  if #args > 0 then call_chunked('HSET', index, args, 2) end
end
redis.call('HSET', nk, 'gen', cur)
redis.call('DEL', lk)
redis.call('SADD', P .. 'migrated_4', ns)
return moved

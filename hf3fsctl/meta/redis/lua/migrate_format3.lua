-- migrate_format3: format 2 -> 3 for one namespace (ARGV[1] = ns), or for the change log
-- (ARGV[1] = ''). Format 3 stores keys as bytes (64 hex digits: 32 bytes; an odd number
-- of digits: the text, padded with NULs to 65 bytes, as `codec.encode_key` does), entries
-- in format 3's 60-byte layout (`FORMAT3_ENTRY` below: times in ms, an "xxh3:" checksum
-- in 9 bytes; format 4 follows, `migrate_format4.lua`),
-- LRU members with the depth in 2 bytes, and no `c:NS` for a namespace of one rank.
-- Each call is atomic (O(the namespace's keys), once, on the first open by this
-- release); `migrated_3` (a set) records what is done, so a second run skips it.
-- Returns how many entries (or change-log runs) were rewritten.
local ns = ARGV[1]
if redis.call('SADD', P .. 'migrated_3', ns == '' and '#changes' or ns) == 0 then return 0 end

local function key_bytes(hex)
  if #hex % 2 == 0 then
    return (string.gsub(hex, '..', function(c) return string.char(tonumber(c, 16)) end))
  end
  return hex .. string.rep('\0', math.max(0, 65 - #hex))
end

local function checksum_bytes(text)
  local digits = string.match(text, '^xxh3:([0-9a-f]+)$')
  if digits and #digits == 16 then return '\1' .. key_bytes(digits) end
  return text
end

-- `key` of a hash or sorted set rebuilt by `each(field_or_member, value_or_score)`,
-- which returns the new (field, value) or nil to drop it; written to a new key, then
-- renamed over the old one.
local function rebuild(key, is_zset, each)
  local tmp = key .. ':migrating'
  redis.call('DEL', tmp)
  local cursor = '0'
  local moved = 0
  repeat
    local page
    if is_zset then
      page = redis.call('ZSCAN', key, cursor, 'COUNT', 1000)
    else
      page = redis.call('HSCAN', key, cursor, 'COUNT', 1000)
    end
    cursor = page[1]
    local args = {}
    local items = page[2]
    for i = 1, #items, 2 do
      local a, b = each(items[i], items[i + 1])
      if a ~= nil then
        if is_zset then args[#args + 1] = b; args[#args + 1] = a
        else args[#args + 1] = a; args[#args + 1] = b end
        moved = moved + 1
      end
    end
    if #args > 0 then
      if is_zset then call_chunked('ZADD', tmp, args, 2) else call_chunked('HSET', tmp, args, 2) end
    end
  until cursor == '0'
  if redis.call('EXISTS', tmp) == 1 then redis.call('RENAME', tmp, key) else redis.call('DEL', key) end
  return moved
end

if ns == '' then  -- the change log: space-separated hex keys -> length-prefixed bytes
  local entries = redis.call('XRANGE', K_CHANGES, '-', '+')
  if #entries == 0 then return 0 end
  local tmp = K_CHANGES .. ':migrating'
  redis.call('DEL', tmp)
  for _, entry in ipairs(entries) do
    local fields = {}
    for i = 1, #entry[2], 2 do fields[entry[2][i]] = entry[2][i + 1] end
    local keys = {}
    for hex in string.gmatch(fields['keys'] or '', '%S+') do
      local key = key_bytes(hex)
      keys[#keys + 1] = string.char(#key) .. key
    end
    redis.call('XADD', tmp, entry[1], 'ns', fields['ns'], 'delta', fields['delta'],
      'keys', table.concat(keys))
  end
  redis.call('RENAME', tmp, K_CHANGES)
  return #entries
end

local OLD_ENTRY = '<Bddddddddd'
-- format 3's entry: flags, until (µs), page, depth, created, last, hits, lease, freeat,
-- size, retention, then the checksum (format 4 narrowed it for the LRU generation)
local FORMAT3_ENTRY = '<BI7I6I4I5I5I4I5I5I5f'
local function pack3(e)
  local until_, lease, freeat = 0, 0, 0
  if e.until_ > 0 then until_ = to_epoch_us(e.until_) end
  if e.lease > 0 then lease = to_epoch(e.lease) end
  if e.freeat > 0 then freeat = to_epoch(e.freeat) end
  return struct.pack(FORMAT3_ENTRY, e.state, until_, e.page, math.min(e.depth, 4294967295),
    to_epoch(e.created), to_epoch(e.last), math.min(e.hits, 4294967295), lease, freeat, e.size,
    0) .. e.checksum
end
local nranks = tonumber(redis.call('HGET', k_ns(ns), 'num_ranks')) or 0
local moved = 0
for r = 0, nranks - 1 do
  moved = moved + rebuild(k_e(ns, r), false, function(hex, v)
    local state, page, depth, created, last, hits, deadline, lease, freeat, size, at =
      struct.unpack(OLD_ENTRY, v)
    local e = {state = state, renew = false, page = page, depth = depth, created = ms(created),
      last = ms(last), hits = hits, until_ = 0, lease = ms(lease), freeat = ms(freeat),
      size = size, retention = 0, checksum = checksum_bytes(string.sub(v, at))}
    if state == 0 then e.until_ = ms(deadline) end
    return key_bytes(hex), pack3(e)
  end)
  rebuild(k_pend(ns, r), true, function(hex, score) return key_bytes(hex), score end)
end
if nranks == 1 then
  redis.call('DEL', k_c(ns))
else
  rebuild(k_c(ns), false, function(hex, count) return key_bytes(hex), count end)
end
rebuild(k_lru(ns), true, function(member, score)
  local depth = 0xffff - tonumber(string.sub(member, 1, 4), 16)
  return lru_member(key_bytes(string.sub(member, 5)), depth), score
end)
rebuild(k_pins(ns), false, function(hex, v) return key_bytes(hex), v end)
return moved

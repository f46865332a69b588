-- commit: pending -> committed for the exact (key, page) pairs; appends to the change log.
-- ARGV: ns, rank, then (key, page, checksum, size, retention_s or '', renew 0/1) sextuples.
-- An entry with a retention expires at NOW + retention; the key's earliest expiry over
-- its committed ranks is its score in `x:NS` (member as in the LRU generations, so equal
-- expiries go deepest first) and, with 2+ ranks, in its `c:NS` value. Each committed key
-- joins the newest LRU generation (`lru_touch`), its id kept in the entry (one rank) or in
-- `c:NS` (more).
-- Returns how many.
local ns, rank = ARGV[1], tonumber(ARGV[2])
local nranks = ns_ranks(ns)
require_rank_file(ns, rank)
local ek, ck, pk, xk = k_e(ns, rank), k_c(ns), k_pend(ns, rank), k_x(ns)
local keys = {}
for i = 3, #ARGV, 6 do keys[#keys + 1] = ARGV[i] end
local entries = hmget_all(ek, keys)
local counts = {}
if nranks > 1 then counts = hmget_all(ck, keys) end
local done, touched, x_args, done_keys = {}, {}, {}, {}
local seen = {}
local complete = 0
local last_raw = to_epoch(NOW_MS)
-- Each entry is read and rewritten as its raw fields (common.lua's ENTRY, one `struct`
-- call each way), changed as `unpack_entry`, the changes, then `pack_entry` would
-- change them; the others are stored again as read.
for n, key in ipairs(keys) do
  local i = 3 + 6 * (n - 1)
  local v = entries[n]
  local f = v and {struct.unpack(ENTRY, v)}  -- flags, until, page, depth, created, last, …
  if f and f[1] % 2 == 0 and f[3] == tonumber(ARGV[i + 1]) and not seen[key] then
    seen[key] = true
    local retention = tonumber(ARGV[i + 4])
    local until_ = 0  -- the expiry (ms), 0 none
    f[1], f[2], f[12] = 1, 0, 0  -- committed, no expiry, no retention, no renew
    if retention then
      until_ = expiry_after(ms(retention))
      f[2] = to_epoch_us(until_)
      f[12] = retention
      if ARGV[i + 5] == '1' then f[1] = 3 end
    end
    f[6] = last_raw
    f[10] = tonumber(ARGV[i + 3])
    f[13] = ARGV[i + 2]  -- the checksum
    local member = lru_member(key, f[4])
    local expiry = nil  -- the key's earliest expiry over its committed ranks
    local c, gen = 0, f[11]
    if nranks > 1 then
      local x
      c, gen, x = c_parse(counts[n])
      c = c + 1
      expiry = x
      if until_ > 0 and (expiry == nil or until_ < expiry) then expiry = until_ end
      if c == nranks then complete = complete + 1 end
      f[11] = 0
    else
      complete = complete + 1
      if until_ > 0 then expiry = until_ end
    end
    if expiry then
      x_args[#x_args + 1] = expiry
      x_args[#x_args + 1] = member
    end
    done[#done + 1] = {key, f, c, expiry}
    touched[#touched + 1] = {key, member, gen or 0}
    done_keys[#done_keys + 1] = key
    change(ns, key, 1)
  end
end
if #done_keys > 0 then
  local gens = lru_touch(ns, touched, nranks > 1)
  local entry_args, count_args = {}, {}
  for j, d in ipairs(done) do
    local key, f = d[1], d[2]
    if nranks > 1 then
      count_args[#count_args + 1] = key
      count_args[#count_args + 1] = c_value(d[3], gens[j], d[4])
    else
      f[11] = gens[j]
    end
    entry_args[#entry_args + 1] = key
    entry_args[#entry_args + 1] = struct.pack(ENTRY, f[1], f[2], f[3], f[4], f[5], f[6], f[7],
      f[8], f[9], f[10], f[11], f[12]) .. f[13]
  end
  call_chunked('HSET', ek, entry_args, 2)
  if nranks > 1 then call_chunked('HSET', ck, count_args, 2) end
  call_chunked('ZREM', pk, done_keys, 1)
  if #x_args > 0 then call_chunked('ZADD', xk, x_args, 2) end
end
if complete > 0 then redis.call('HINCRBY', k_ns(ns), 'keys', complete) end
flush_changes()
return #done_keys

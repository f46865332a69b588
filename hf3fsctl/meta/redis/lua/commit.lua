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
for n, key in ipairs(keys) do
  local i = 3 + 6 * (n - 1)
  local e = unpack_entry(entries[n])
  if e and e.state == 0 and e.page == tonumber(ARGV[i + 1]) and not seen[key] then
    seen[key] = true
    local retention = tonumber(ARGV[i + 4])
    e.state = 1
    e.checksum = ARGV[i + 2]
    e.size = tonumber(ARGV[i + 3])
    e.until_ = 0
    e.retention = 0
    e.renew = false
    if retention then
      e.until_ = expiry_after(ms(retention))
      e.retention = retention
      e.renew = ARGV[i + 5] == '1'
    end
    e.last = NOW_MS
    local member = lru_member(key, e.depth)
    local expiry = nil  -- the key's earliest expiry over its committed ranks
    local c, gen = 0, e.gen
    if nranks > 1 then
      local x
      c, gen, x = c_parse(counts[n])
      c = c + 1
      expiry = x
      if e.until_ > 0 and (expiry == nil or e.until_ < expiry) then expiry = e.until_ end
      if c == nranks then complete = complete + 1 end
      e.gen = 0
    else
      complete = complete + 1
      if e.until_ > 0 then expiry = e.until_ end
    end
    if expiry then
      x_args[#x_args + 1] = expiry
      x_args[#x_args + 1] = member
    end
    done[#done + 1] = {key, e, c, expiry}
    touched[#touched + 1] = {key, member, gen or 0}
    done_keys[#done_keys + 1] = key
    change(ns, key, 1)
  end
end
if #done_keys > 0 then
  local gens = lru_touch(ns, touched, nranks > 1)
  local entry_args, count_args = {}, {}
  for j, d in ipairs(done) do
    local key, e = d[1], d[2]
    if nranks > 1 then
      count_args[#count_args + 1] = key
      count_args[#count_args + 1] = c_value(d[3], gens[j], d[4])
    else
      e.gen = gens[j]
    end
    entry_args[#entry_args + 1] = key
    entry_args[#entry_args + 1] = pack_entry(e)
  end
  call_chunked('HSET', ek, entry_args, 2)
  if nranks > 1 then call_chunked('HSET', ck, count_args, 2) end
  call_chunked('ZREM', pk, done_keys, 1)
  if #x_args > 0 then call_chunked('ZADD', xk, x_args, 2) end
end
if complete > 0 then redis.call('HINCRBY', k_ns(ns), 'keys', complete) end
flush_changes()
return #done_keys

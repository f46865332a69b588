-- locate: where each committed, unexpired key's page is on (ns, rank), taking a read
-- lease on it; an entry committed with renew-on-read moves its expiry to NOW + retention.
-- Each located key joins the newest LRU generation (`lru_touch`).
-- ARGV: ns, rank, lease_s, keys…  Returns {page or -1, checksum, size} per key.
local ns, rank, lease_s = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local nranks = ns_ranks(ns)
local ek = k_e(ns, rank)
local values = hmget_all(ek, ARGV, 4)
local out, found, touched, located = {}, {}, {}, {}
local renewed = {}  -- key -> its entry's new expiry
local until_ = ms(NOW + lease_s)
local lease_raw = to_epoch(until_)  -- the lease as the entry holds it
local last_raw = to_epoch(NOW_MS)
-- Each entry is read and rewritten as its raw fields (common.lua's ENTRY, one `struct`
-- call each way), changed as `unpack_entry`, the changes, then `pack_entry` would
-- change them; the others are stored again as read.
for j = 1, #ARGV - 3 do
  local v = values[j]
  local f = v and {struct.unpack(ENTRY, v)}  -- flags, until, page, depth, created, last, …
  if f and f[1] % 2 == 1 and not (f[2] > 0 and from_epoch_us(f[2]) <= NOW_MS) then  -- live
    local key = ARGV[j + 3]
    f[6] = last_raw
    f[7] = math.min(f[7] + 1, U24)
    if f[8] == 0 or until_ > f[8] + EPOCH_MS then f[8] = lease_raw end
    if f[1] >= 2 and f[2] > 0 then  -- renewed on read
      local expiry = expiry_after(ms(f[12]))
      f[2] = to_epoch_us(expiry)
      renewed[key] = {expiry, f[4]}
    end
    f[13] = string.sub(v, f[13])  -- the checksum
    found[#found + 1] = {key, f}
    touched[#touched + 1] = {key, lru_member(key, f[4]), f[11]}
    located[#located + 1] = key
    out[#out + 1] = f[3]
    out[#out + 1] = f[13]
    out[#out + 1] = f[10]
  else
    out[#out + 1] = -1
    out[#out + 1] = ''
    out[#out + 1] = 0
  end
end
if #found > 0 then
  local counts = {}
  if nranks > 1 then  -- the keys' generations are in `c:NS`
    counts = hmget_all(k_c(ns), located)
    for j = 1, #touched do
      local _, gen = c_parse(counts[j])
      touched[j][3] = gen or 0
    end
  end
  local gens = lru_touch(ns, touched, nranks > 1)
  local entry_args, count_args = {}, {}
  for j, item in ipairs(found) do
    local key, f = item[1], item[2]
    if nranks == 1 then f[11] = gens[j] end
    entry_args[#entry_args + 1] = key
    entry_args[#entry_args + 1] = struct.pack(ENTRY, f[1], f[2], f[3], f[4], f[5], f[6], f[7],
      f[8], f[9], f[10], f[11], f[12]) .. f[13]
    if nranks > 1 then
      local count, _, expiry = c_parse(counts[j])
      local renew = renewed[key]
      if renew then  -- a renewed entry moves its key's earliest expiry (over every rank)
        expiry = renew[1]
        for r = 0, nranks - 1 do
          if r ~= rank then
            local other = unpack_entry(redis.call('HGET', k_e(ns, r), key))
            if other and other.state == 1 and other.until_ > 0 and other.until_ < expiry then
              expiry = other.until_
            end
          end
        end
        renew[1] = expiry
      end
      count_args[#count_args + 1] = key
      count_args[#count_args + 1] = c_value(count, gens[j], expiry)
    end
  end
  call_chunked('HSET', ek, entry_args, 2)
  if nranks > 1 then call_chunked('HSET', k_c(ns), count_args, 2) end
  redis.call('HINCRBY', k_ns(ns), 'hits', #found)
  redis.call('HSET', k_ns(ns), 'last_used', NOW_S)
end
for key, renew in pairs(renewed) do
  redis.call('ZADD', k_x(ns), renew[1], lru_member(key, renew[2]))
end
return out

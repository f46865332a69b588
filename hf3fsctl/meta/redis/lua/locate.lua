-- locate: where each committed key's page is on (ns, rank), taking a read lease on it.
-- ARGV: ns, rank, lease_s, keys…  Returns {page or -1, checksum, size} per key.
local ns, rank, lease_s = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
ns_ranks(ns)
local ek = k_e(ns, rank)
local values = hmget_all(ek, ARGV, 4)
local out, entry_args, lru_args = {}, {}, {}
local until_ = NOW + lease_s
local stamp = NOW_S
for j = 1, #ARGV - 3 do
  local e = unpack_entry(values[j])
  if e and e.state == 1 then
    local key = ARGV[j + 3]
    e.hits = e.hits + 1
    e.last = NOW
    if until_ > e.lease then e.lease = until_ end
    entry_args[#entry_args + 1] = key
    entry_args[#entry_args + 1] = pack_entry(e)
    lru_args[#lru_args + 1] = stamp
    lru_args[#lru_args + 1] = lru_member(key, e.depth)
    out[#out + 1] = e.page
    out[#out + 1] = e.checksum
    out[#out + 1] = e.size
  else
    out[#out + 1] = -1
    out[#out + 1] = ''
    out[#out + 1] = 0
  end
end
if #entry_args > 0 then
  call_chunked('HSET', ek, entry_args, 2)
  call_chunked('ZADD', k_lru(ns), lru_args, 2)
  redis.call('HINCRBY', k_ns(ns), 'hits', #entry_args / 2)
  redis.call('HSET', k_ns(ns), 'last_used', stamp)
end
return out

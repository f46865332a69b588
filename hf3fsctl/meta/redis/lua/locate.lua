-- locate: where each committed key's page is on (ns, rank), taking a read lease on it.
-- ARGV: ns, rank, lease_s, keys…  Returns {page or -1, checksum, size} per key.
local ns, rank, lease_s = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
ns_ranks(ns)
local ek = k_e(ns, rank)
local lk = k_lru(ns)
local out = {}
local found = 0
local until_ = NOW + lease_s
for i = 4, #ARGV, 1000 do
  local last = math.min(i + 999, #ARGV)
  local values = redis.call('HMGET', ek, unpack(ARGV, i, last))
  for j, v in ipairs(values) do
    local e = unpack_entry(v)
    if e and e.state == 1 then
      local key = ARGV[i + j - 1]
      e.hits = e.hits + 1
      e.last = NOW
      if until_ > e.lease then e.lease = until_ end
      redis.call('HSET', ek, key, pack_entry(e))
      redis.call('ZADD', lk, f6(NOW), key)
      out[#out + 1] = e.page
      out[#out + 1] = e.checksum
      out[#out + 1] = e.size
      found = found + 1
    else
      out[#out + 1] = -1
      out[#out + 1] = ''
      out[#out + 1] = 0
    end
  end
end
if found > 0 then
  redis.call('HINCRBY', k_ns(ns), 'hits', found)
  redis.call('HSET', k_ns(ns), 'last_used', f6(NOW))
end
return out

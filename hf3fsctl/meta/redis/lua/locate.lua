-- locate: where each committed, unexpired key's page is on (ns, rank), taking a read
-- lease on it; an entry committed with renew-on-read moves its expiry to NOW + retention.
-- ARGV: ns, rank, lease_s, keys…  Returns {page or -1, checksum, size} per key.
local ns, rank, lease_s = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local nranks = ns_ranks(ns)
local ek = k_e(ns, rank)
local values = hmget_all(ek, ARGV, 4)
local out, entry_args, lru_args, renewed = {}, {}, {}, {}
local until_ = ms(NOW + lease_s)
local stamp = NOW_S
for j = 1, #ARGV - 3 do
  local e = unpack_entry(values[j])
  if e and e.state == 1 and not expired(e) then
    local key = ARGV[j + 3]
    e.hits = e.hits + 1
    e.last = NOW_MS
    if until_ > e.lease then e.lease = until_ end
    if e.renew and e.until_ > 0 then
      e.until_ = expiry_after(ms(e.retention))
      renewed[#renewed + 1] = {key, e.until_, e.depth}
    end
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
-- a renewed entry moves its key's earliest expiry (over every committed rank)
for _, item in ipairs(renewed) do
  local key, expiry, depth = item[1], item[2], item[3]
  if nranks > 1 then
    local v = redis.call('HGET', k_c(ns), key)
    local count = tonumber(string.match(v or '0', '^%d+'))
    for r = 0, nranks - 1 do
      if r ~= rank then
        local other = unpack_entry(redis.call('HGET', k_e(ns, r), key))
        if other and other.state == 1 and other.until_ > 0 and other.until_ < expiry then
          expiry = other.until_
        end
      end
    end
    redis.call('HSET', k_c(ns), key, c_value(count, expiry))
  end
  redis.call('ZADD', k_x(ns), expiry, lru_member(key, depth))
end
return out

-- lookup: how many leading keys are committed on every rank; counts the lookup.
-- ARGV: ns, keys…  Returns the number of leading hits.
local ns = ARGV[1]
local nranks = ns_ranks(ns)
local ck = k_c(ns)
local hits = 0
local n = #ARGV - 1
local done = false
for i = 2, #ARGV, 1000 do
  local last = math.min(i + 999, #ARGV)
  local values = redis.call('HMGET', ck, unpack(ARGV, i, last))
  for _, v in ipairs(values) do
    if v and tonumber(v) >= nranks then hits = hits + 1 else done = true; break end
  end
  if done then break end
end
local nk = k_ns(ns)
redis.call('HINCRBY', nk, 'lookups', 1)
redis.call('HINCRBY', nk, 'lookup_keys', n)
redis.call('HINCRBY', nk, 'hit_keys', hits)
redis.call('HSET', nk, 'last_used', f6(NOW))
return hits

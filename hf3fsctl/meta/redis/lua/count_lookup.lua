-- count_lookup: the traffic counters of one lookup, sent in the same pipeline as the
-- lookup's HMGET (the hot read itself runs natively, outside Lua); returns the
-- namespace's ranks, which a key must all have committed to count, and the time in ms
-- (an entry whose expiry is not after it is absent). Also adds the
-- hits of this process's earlier lookups, which were known only once they answered.
-- ARGV: ns ('' to count only the earlier hits), number of keys, then (ns, hits) pairs.
-- NOTFOUND if `ns` is not registered.
local ns = ARGV[1]
local nranks = 0
if ns ~= '' then nranks = ns_ranks(ns) end  -- before any write: a failed call counts nothing
for i = 3, #ARGV, 2 do
  if redis.call('EXISTS', k_ns(ARGV[i])) == 1 then
    redis.call('HINCRBY', k_ns(ARGV[i]), 'hit_keys', ARGV[i + 1])
  end
end
if ns == '' then return {0, string.format('%.3f', NOW_MS)} end
local nk = k_ns(ns)
redis.call('HINCRBY', nk, 'lookups', 1)
redis.call('HINCRBY', nk, 'lookup_keys', ARGV[2])
redis.call('HSET', nk, 'last_used', NOW_S)
return {nranks, string.format('%.3f', NOW_MS)}

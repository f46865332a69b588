-- count_lookup: the traffic counters of one lookup, sent in the same pipeline as the
-- lookup's HMGET (the hot read itself runs natively, outside Lua); returns the
-- namespace's ranks, which a key must all have committed to count, and the time in ms
-- (an entry whose expiry is not after it is absent). Also adds the
-- hits of this process's earlier lookups, which were known only once they answered.
-- ARGV: ns ('' to count only the earlier hits), number of keys, then (ns, hits) pairs.
-- NOTFOUND if `ns` is not registered.
--
-- The one script without `common.lua` (connection.py: STANDALONE): every lookup runs it,
-- and running common.lua's prelude (dozens of closures) would cost it more than its own
-- work; what it needs of the prelude is here.
local P = KEYS[1]
local t = redis.call('TIME')
local NOW = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function k_ns(ns) return P .. 'ns:' .. ns end
local NOW_MS = string.format('%.3f', NOW * 1000)

local ns = ARGV[1]
local nranks = 0
if ns ~= '' then  -- before any write: a failed call counts nothing
  local n = redis.call('HGET', k_ns(ns), 'num_ranks')
  if not n then error({err = 'NOTFOUND namespace ' .. ns .. ' is not registered'}) end
  nranks = tonumber(n)
end
for i = 3, #ARGV, 2 do
  if redis.call('EXISTS', k_ns(ARGV[i])) == 1 then
    redis.call('HINCRBY', k_ns(ARGV[i]), 'hit_keys', ARGV[i + 1])
  end
end
if ns == '' then return {0, NOW_MS} end
local nk = k_ns(ns)
redis.call('HINCRBY', nk, 'lookups', 1)
redis.call('HINCRBY', nk, 'lookup_keys', ARGV[2])
redis.call('HSET', nk, 'last_used', string.format('%.6f', NOW))
return {nranks, NOW_MS}

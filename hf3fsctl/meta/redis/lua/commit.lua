-- commit: pending -> committed for the exact (key, page) pairs; appends to the change log.
-- ARGV: ns, rank, then (key, page, checksum, size) quadruples.  Returns how many.
local ns, rank = ARGV[1], tonumber(ARGV[2])
local nranks = ns_ranks(ns)
require_rank_file(ns, rank)
local ek, ck, lk, pk = k_e(ns, rank), k_c(ns), k_lru(ns), k_pend(ns, rank)
local committed = 0
local complete = 0
for i = 3, #ARGV, 4 do
  local key, page = ARGV[i], tonumber(ARGV[i + 1])
  local e = unpack_entry(redis.call('HGET', ek, key))
  if e and e.state == 0 and e.page == page then
    e.state = 1
    e.checksum = ARGV[i + 2]
    e.size = tonumber(ARGV[i + 3])
    e.deadline = 0
    e.last = NOW
    redis.call('HSET', ek, key, pack_entry(e))
    redis.call('ZREM', pk, key)
    if redis.call('HINCRBY', ck, key, 1) == nranks then complete = complete + 1 end
    redis.call('ZADD', lk, f6(NOW), key)
    change(ns, key, 1)
    committed = committed + 1
  end
end
if complete > 0 then redis.call('HINCRBY', k_ns(ns), 'keys', complete) end
flush_changes()
return committed

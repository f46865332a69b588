-- release: a writer gives back pending allocations (exact (key, page) pairs).
-- ARGV: ns, rank, then (key, page) pairs.  Returns how many were released.
local ns, rank = ARGV[1], tonumber(ARGV[2])
require_rank_file(ns, rank)
local ek, pk = k_e(ns, rank), k_pend(ns, rank)
local released = 0
for i = 3, #ARGV, 2 do
  local key, page = ARGV[i], tonumber(ARGV[i + 1])
  local e = unpack_entry(redis.call('HGET', ek, key))
  if e and e.state == 0 and e.page == page then
    redis.call('HDEL', ek, key)
    redis.call('ZREM', pk, key)
    free_page(ns, rank, page, NOW_SCORE)
    released = released + 1
  end
end
if released > 0 then redis.call('HINCRBY', k_rf(ns, rank), 'used', -released) end
return released

-- invalidate: drop keys (every rank) whose committed page on `rank` is still exactly the
-- reported (page, checksum). ARGV: ns, rank, then (key, page, checksum) triples.
-- Returns how many keys were dropped.
local ns, rank = ARGV[1], tonumber(ARGV[2])
local nranks = ns_ranks(ns)
require_rank_file(ns, rank)
local ek = k_e(ns, rank)
local counts = {}
local dropped = 0
for i = 3, #ARGV, 3 do
  local key, page, checksum = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local e = unpack_entry(redis.call('HGET', ek, key))
  if e and e.state == 1 and e.page == page and e.checksum == checksum then
    local bytes = 0
    for _, fr in ipairs(drop_key(ns, key, nranks)) do bytes = bytes + file_slot(ns, fr[1]) end
    count_evictions(counts, ns, 1, bytes)
    dropped = dropped + 1
  end
end
apply_evictions(counts, 'corrupt')
flush_changes()
return dropped

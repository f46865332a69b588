-- commit: pending -> committed for the exact (key, page) pairs; appends to the change log.
-- ARGV: ns, rank, then (key, page, checksum, size) quadruples.  Returns how many.
local ns, rank = ARGV[1], tonumber(ARGV[2])
local nranks = ns_ranks(ns)
require_rank_file(ns, rank)
local ek, ck, lk, pk = k_e(ns, rank), k_c(ns), k_lru(ns), k_pend(ns, rank)
local keys = {}
for i = 3, #ARGV, 4 do keys[#keys + 1] = ARGV[i] end
local entries = hmget_all(ek, keys)
local counts = hmget_all(ck, keys)
local entry_args, count_args, lru_args, done_keys = {}, {}, {}, {}
local seen = {}
local complete = {}
local stamp = NOW_S
for n, key in ipairs(keys) do
  local i = 3 + 4 * (n - 1)
  local e = unpack_entry(entries[n])
  if e and e.state == 0 and e.page == tonumber(ARGV[i + 1]) and not seen[key] then
    seen[key] = true
    e.state = 1
    e.checksum = ARGV[i + 2]
    e.size = tonumber(ARGV[i + 3])
    e.deadline = 0
    e.last = NOW
    entry_args[#entry_args + 1] = key
    entry_args[#entry_args + 1] = pack_entry(e)
    local c = (tonumber(counts[n]) or 0) + 1
    if c == nranks then complete[#complete + 1] = key end
    count_args[#count_args + 1] = key
    count_args[#count_args + 1] = c
    lru_args[#lru_args + 1] = stamp
    lru_args[#lru_args + 1] = lru_member(key, e.depth)
    done_keys[#done_keys + 1] = key
    change(ns, key, 1)
  end
end
if #done_keys > 0 then
  call_chunked('HSET', ek, entry_args, 2)
  call_chunked('HSET', ck, count_args, 2)
  call_chunked('ZADD', lk, lru_args, 2)
  call_chunked('ZREM', pk, done_keys, 1)
end
if #complete > 0 then redis.call('HINCRBY', k_ns(ns), 'keys', #complete) end
flush_changes()
return #done_keys

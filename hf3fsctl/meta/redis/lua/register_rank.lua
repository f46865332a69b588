-- register_rank: record one rank's page file; CONFLICT when it differs from before.
-- ARGV: ns, rank, path, page_bytes, slot_bytes, num_pages, preallocated (0/1).
-- Returns 1 if recorded now, 0 if it was already (identically).
local ns, rank = ARGV[1], tonumber(ARGV[2])
local nranks = ns_ranks(ns)
if rank >= nranks then
  fail('INVALID', 'rank ' .. rank .. ' is out of range: namespace ' .. ns .. ' has ' .. nranks .. ' ranks')
end
if tonumber(ARGV[6]) > 281474976710656 then  -- an entry holds its page in 6 bytes
  fail('INVALID', 'num_pages ' .. ARGV[6] .. ' is more than the Redis store addresses in one file (2^48)')
end
local rk = k_rf(ns, rank)
local v = redis.call('HMGET', rk, 'path', 'page_bytes', 'slot', 'num_pages', 'prealloc')
if v[1] then
  if v[1] ~= ARGV[3] or v[2] ~= ARGV[4] or v[3] ~= ARGV[5] or v[4] ~= ARGV[6] or v[5] ~= ARGV[7] then
    fail('CONFLICT', 'rank ' .. rank .. ' of namespace ' .. ns .. ' is registered as {path: ' ..
      v[1] .. ', page_bytes: ' .. v[2] .. ', slot_bytes: ' .. v[3] .. ', num_pages: ' .. v[4] ..
      ', preallocated: ' .. v[5] .. '}, not the one given')
  end
  return 0
end
redis.call('HSET', rk, 'path', ARGV[3], 'page_bytes', ARGV[4], 'slot', ARGV[5],
  'num_pages', ARGV[6], 'prealloc', ARGV[7], 'next_unused', 0, 'used', 0, 'holes', 0)
redis.call('SADD', K_FILES, ns .. ':' .. rank)
if ARGV[7] == '1' then
  redis.call('HINCRBY', K_HELD, ns, tonumber(ARGV[6]) * tonumber(ARGV[5]))
end
return 1

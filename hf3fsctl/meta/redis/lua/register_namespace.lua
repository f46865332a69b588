-- register_namespace: create a namespace, or touch it when registered with the same
-- manifest; CONFLICT when another manifest holds the id.
-- ARGV: ns, manifest (canonical JSON), num_ranks, model, key_bytes.  Returns 1 if created.
local ns, text = ARGV[1], ARGV[2]
local existing = redis.call('HGET', K_MANIFESTS, ns)
if existing == false then
  redis.call('HSET', K_MANIFESTS, ns, text)
  redis.call('HSET', k_ns(ns), 'num_ranks', ARGV[3], 'created', f6(NOW), 'last_used', f6(NOW),
    'hits', 0, 'lookups', 0, 'lookup_keys', 0, 'hit_keys', 0, 'keys', 0, 'model', ARGV[4],
    'key_bytes', ARGV[5])
  redis.call('ZADD', K_NAMESPACES, f6(NOW), ns)
  redis.call('SADD', P .. 'model:' .. ARGV[4], ns)
  redis.call('HSETNX', K_HELD, ns, 0)
  return 1
end
if existing ~= text then fail('CONFLICT', 'namespace ' .. ns .. ' exists with another manifest') end
redis.call('HSET', k_ns(ns), 'last_used', f6(NOW))
return 0

-- pin: keep keys of a namespace out of LRU eviction (until NOW + ttl, or unpinned),
-- refusing what would pin more than max_pinned bytes. Expired pins are dropped first.
-- ARGV: ns, ttl_s or '', max_pinned bytes or '', keys…
-- Returns {pinned, stored, pinned_bytes} or, refused, {-1, new keys, their bytes, total}.
local ns = ARGV[1]
local nranks = ns_ranks(ns)
local ttl, max_pinned = tonumber(ARGV[2]), tonumber(ARGV[3])
local total = 0
for _, other in ipairs(redis.call('ZRANGE', K_NAMESPACES, 0, -1)) do
  local pk = k_pins(other)
  local all = redis.call('HGETALL', pk)
  local live = 0
  for i = 1, #all, 2 do
    local expires = tonumber(string.match(all[i + 1], '^(%S+)'))
    if expires ~= 0 and expires <= NOW then redis.call('HDEL', pk, all[i]) else live = live + 1 end
  end
  total = total + live * (tonumber(redis.call('HGET', k_ns(other), 'key_bytes')) or 0)
end
local size = tonumber(redis.call('HGET', k_ns(ns), 'key_bytes')) or 0
local pk = k_pins(ns)
local seen, unique, new = {}, {}, 0
for i = 4, #ARGV do
  local key = ARGV[i]
  if not seen[key] then
    seen[key] = true
    unique[#unique + 1] = key
    if redis.call('HEXISTS', pk, key) == 0 then new = new + 1 end
  end
end
total = total + new * size
if max_pinned ~= nil and total > max_pinned then return {-1, new, new * size, total} end
local expires = 0
if ttl ~= nil then expires = NOW + ttl end
local stored = 0
for _, key in ipairs(unique) do
  local v = redis.call('HGET', pk, key)
  local created = NOW
  if v then created = tonumber(string.match(v, '^%S+ (%S+)$')) end
  redis.call('HSET', pk, key, f6(expires) .. ' ' .. f6(created))
  if committed_ranks(ns, key, nranks) >= nranks then stored = stored + 1 end
end
return {#unique, stored, total}

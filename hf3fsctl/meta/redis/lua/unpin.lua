-- unpin: drop pins of the given keys, or every pin of the namespace.
-- ARGV: ns, all (0/1), keys…  Returns how many pins were dropped.
local pk = k_pins(ARGV[1])
if ARGV[2] == '1' then
  local n = redis.call('HLEN', pk)
  redis.call('DEL', pk)
  return n
end
local dropped = 0
for i = 3, #ARGV do dropped = dropped + redis.call('HDEL', pk, ARGV[i]) end
return dropped

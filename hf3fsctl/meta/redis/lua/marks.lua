-- marks: pages marked to give back more than ARGV[1] seconds ago and never settled (a
-- process died between marking and punching). Returns {{ns, rank, path, slot, {pages}}}.
local older = NOW - tonumber(ARGV[1])
local out = {}
for _, f in ipairs(all_files()) do
  local ns, r = f[1], f[2]
  local pages = redis.call('ZRANGEBYSCORE', k_give(ns, r), '-inf', f6(older))
  if #pages > 0 then
    local slot = file_slot(ns, r)
    out[#out + 1] = {ns, r, redis.call('HGET', k_rf(ns, r), 'path'), slot, pages}
  end
end
return out

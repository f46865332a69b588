-- admit: one sighting of each key (distinct) of a namespace; per key, 1 when it has now
-- been seen at least `after_hits` times, else 0 (counted in the namespace's
-- `admission_skipped`). Sightings are shared by every process: `adm:NS` (key → count),
-- and `adm_at` (NS .. key → last sighting) bounds them to `limit` per store, the least
-- recently seen dropped first.
-- ARGV: ns, after_hits, limit, keys…  NOTFOUND if `ns` is not registered.
local ns = ARGV[1]
ns_ranks(ns)
local after, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local ak = k_adm(ns)
local out, seen = {}, {}
local skipped = 0
for i = 4, #ARGV do
  local key = ARGV[i]
  if redis.call('HINCRBY', ak, key, 1) >= after then
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
    skipped = skipped + 1
  end
  seen[#seen + 1] = NOW_S
  seen[#seen + 1] = ns .. key
end
call_chunked('ZADD', K_ADM_AT, seen, 2)
if skipped > 0 then redis.call('HINCRBY', k_ns(ns), 'admission_skipped', skipped) end
local over = redis.call('ZCARD', K_ADM_AT) - limit
while over > 0 do  -- the least recently seen go (a dropped namespace's are gone already)
  local oldest = redis.call('ZPOPMIN', K_ADM_AT, math.min(over, 1000))
  for i = 1, #oldest, 2 do
    local m = oldest[i]
    redis.call('HDEL', k_adm(string.sub(m, 1, 16)), string.sub(m, 17))
  end
  over = over - #oldest / 2
end
return out

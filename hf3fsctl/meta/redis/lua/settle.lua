-- settle: after the client punched marked pages, `done` files' pages become holes and
-- `refused` ones plain free pages again. Pages no longer marked (a namespace dropped,
-- another process settled them) are left alone.
-- ARGV: repeated (ns, rank, ok 1|0, npages, pages…).  Returns how many pages settled.
local i = 1
local settled = 0
while i <= #ARGV do
  local ns, r, ok, n = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2] == '1', tonumber(ARGV[i + 3])
  local gk = k_give(ns, r)
  local slot = file_slot(ns, r)
  local moved = 0
  for j = i + 4, i + 3 + n do
    local page = ARGV[j]
    if redis.call('ZREM', gk, page) == 1 then
      if ok then
        redis.call('ZADD', k_holes(ns, r), f6(NOW), page)
      else
        redis.call('ZADD', k_free(ns, r), NOW_SCORE, page)
      end
      moved = moved + 1
    end
  end
  if moved > 0 then
    redis.call('HINCRBY', K_GIVING, ns, -moved * slot)
    if ok then
      redis.call('HINCRBY', k_rf(ns, r), 'holes', moved)
      redis.call('HINCRBY', K_HELD, ns, -moved * slot)
    end
    settled = settled + moved
  end
  i = i + 4 + n
end
return settled

-- migrate_format5: format 4 -> 5 for one namespace (ARGV[1] = ns). Format 5 scores the
-- pending sets `pend:NS:RANK` (a key's writer deadline) and the free sets `free:NS:RANK`
-- (when a page may be reused) in whole µs since EPOCH_MS instead of seconds with six
-- decimals (`common.lua`, `NOW_SCORE`): the same times, to the same µs, so the order of
-- every set and what NOW compares with are unchanged. A pending key's score becomes its
-- entry's `until` (the same deadline, which format 4 also wrote there, in µs), a stale
-- member's (no pending entry) and a free page's its seconds in µs. One atomic call
-- (O(the sets' members), once, on the first open by this release); `migrated_5` (a set)
-- records what is done, so a second run skips it. A score already past 1e11 (µs;
-- seconds get there in the year 5138) is kept, so rewriting a set twice changes
-- nothing. Returns how many members were rescored.
local ns = ARGV[1]
if redis.call('SISMEMBER', P .. 'migrated_5', ns) == 1 then return 0 end
local EPOCH_S = EPOCH_MS / 1000
local function rescore(score)
  local s = tonumber(score)
  if s > 1e11 then return score end
  return string.format('%d', math.max(0, math.floor((s - EPOCH_S) * 1000000 + 0.5)))
end

-- Sorted set `key` rescored: written to a new key, then renamed over the old one (a
-- rescored member would move within the set it is read from). `entries`: the hash whose
-- pending entries give their members' scores.
local function rewrite(key, entries)
  local tmp = key .. ':migrating'
  redis.call('DEL', tmp)
  local total = redis.call('ZCARD', key)
  for i = 0, total - 1, 1000 do
    local got = redis.call('ZRANGE', key, i, i + 999, 'WITHSCORES')
    local values = {}
    if entries then
      local members = {}
      for j = 1, #got, 2 do members[#members + 1] = got[j] end
      values = hmget_all(entries, members)
    end
    local args = {}
    for j = 1, #got, 2 do
      local v, score = values[(j + 1) / 2], nil
      if v then
        local flags, until_ = struct.unpack(ENTRY, v)
        if flags % 2 == 0 and until_ > 0 then score = string.format('%d', until_) end
      end
      args[#args + 1] = score or rescore(got[j + 1])
      args[#args + 1] = got[j]
    end
    if #args > 0 then call_chunked('ZADD', tmp, args, 2) end
  end
  if total > 0 then redis.call('RENAME', tmp, key) end
  return total
end

local nranks = tonumber(redis.call('HGET', k_ns(ns), 'num_ranks')) or 0
local moved = 0
for r = 0, nranks - 1 do
  moved = moved + rewrite(k_pend(ns, r), k_e(ns, r)) + rewrite(k_free(ns, r), nil)
end
redis.call('SADD', P .. 'migrated_5', ns)
return moved

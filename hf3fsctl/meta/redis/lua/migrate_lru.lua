-- migrate_lru: format 1 -> 2 for one namespace: rebuild `lru:NS` with the members of
-- format 2 (`lru_member`: 0xffff - depth in 4 hex digits, then the key), each keeping
-- its score (last access). The depth is the key's committed entries' greatest. One
-- script per namespace (atomic; O(its keys), once, on the first open by this release).
-- `migrated_lru` (a set) records the namespaces done, so a second run skips them. It
-- reads and writes format 2 itself (hex keys, 73-byte entries); format 3 follows
-- (`migrate_format3.lua`).
-- ARGV: ns.  Returns how many members were rewritten.
local ns = ARGV[1]
if redis.call('SADD', P .. 'migrated_lru', ns) == 0 then return 0 end
local nranks = tonumber(redis.call('HGET', k_ns(ns), 'num_ranks')) or 0
local lk = k_lru(ns)
local got = redis.call('ZRANGE', lk, 0, -1, 'WITHSCORES')
if #got == 0 then return 0 end
redis.call('DEL', lk)
local args = {}
for i = 1, #got, 2 do
  local key = got[i]
  local depth = 0
  for r = 0, nranks - 1 do
    local v = redis.call('HGET', k_e(ns, r), key)
    if v then
      local state, _, d = struct.unpack('<Bdd', v)
      if state == 1 and d > depth then depth = d end
    end
  end
  args[#args + 1] = got[i + 1]
  args[#args + 1] = string.format('%04x', 0xffff - math.max(0, math.min(0xffff, depth))) .. key
end
call_chunked('ZADD', lk, args, 2)
return #got / 2

-- drop_namespace: remove a namespace's metadata (entries, rank files, pins, counters),
-- unless a writer holds pending pages whose deadline has not passed. Big keys are
-- UNLINKed (freed by a background thread); each committed entry still adds its -1 to the
-- change log, so dropping N keys holds Redis for about N microseconds.
-- ARGV: ns, dry_run (0/1).  Returns {keys, bytes, {paths by rank}, writing}.
local ns, dry = ARGV[1], ARGV[2] == '1'
local nranks = ns_ranks(ns)
local keys  -- keys with a committed rank: one rank's entries but the pending, else `c:NS`
if nranks == 1 then
  keys = redis.call('HLEN', k_e(ns, 0)) - redis.call('ZCARD', k_pend(ns, 0))
else
  keys = redis.call('HLEN', k_c(ns))
end
local bytes = tonumber(redis.call('HGET', K_HELD, ns)) or 0
local writing = 0
local paths = {}
for r = 0, nranks - 1 do
  local path = redis.call('HGET', k_rf(ns, r), 'path')
  if path then paths[#paths + 1] = path end
  writing = writing + redis.call('ZCOUNT', k_pend(ns, r), NOW_SCORE, '+inf')
end
if writing > 0 or dry then return {keys, bytes, paths, writing} end
for r = 0, nranks - 1 do
  local ek = k_e(ns, r)
  local all = redis.call('HGETALL', ek)
  for i = 1, #all, 2 do
    local e = unpack_entry(all[i + 1])
    if e.state == 1 then change(ns, all[i], -1) end
  end
  redis.call('UNLINK', ek, k_free(ns, r), k_holes(ns, r), k_give(ns, r), k_pend(ns, r), k_rf(ns, r))
  redis.call('SREM', K_FILES, ns .. ':' .. r)
end
local model = redis.call('HGET', k_ns(ns), 'model')
if model then redis.call('SREM', P .. 'model:' .. model, ns) end
local gens = redis.call('ZRANGE', k_gi(ns), 0, -1)
for i = 1, #gens, 1000 do
  local names = {}
  for j = i, math.min(i + 999, #gens) do names[#names + 1] = k_g(ns, tonumber(gens[j])) end
  redis.call('UNLINK', unpack(names))
end
redis.call('UNLINK', k_c(ns), k_gi(ns), k_x(ns), k_adm(ns), k_pins(ns), k_ev(ns), k_ns(ns))
redis.call('HDEL', K_MANIFESTS, ns)
redis.call('HDEL', K_HELD, ns)
redis.call('HDEL', K_GIVING, ns)
redis.call('ZREM', K_NAMESPACES, ns)
flush_changes()
return {keys, bytes, paths, 0}

-- locate: where each committed, unexpired key's page is on (ns, rank), taking a read
-- lease on it; an entry committed with renew-on-read moves its expiry to NOW + retention.
-- Each located key joins the newest LRU generation (`lru_touch`).
-- ARGV: ns, rank, lease_s, keys…  Returns {page or -1, checksum, size} per key.
local ns, rank, lease_s = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local nranks = ns_ranks(ns)
local ek = k_e(ns, rank)
local values = hmget_all(ek, ARGV, 4)
local out, found, touched, located = {}, {}, {}, {}
local renewed = {}  -- key -> its entry's new expiry
local until_ = ms(NOW + lease_s)
for j = 1, #ARGV - 3 do
  local e = unpack_entry(values[j])
  if e and e.state == 1 and not expired(e) then
    local key = ARGV[j + 3]
    e.hits = e.hits + 1
    e.last = NOW_MS
    if until_ > e.lease then e.lease = until_ end
    if e.renew and e.until_ > 0 then
      e.until_ = expiry_after(ms(e.retention))
      renewed[key] = {e.until_, e.depth}
    end
    found[#found + 1] = {key, e}
    touched[#touched + 1] = {key, lru_member(key, e.depth), e.gen}
    located[#located + 1] = key
    out[#out + 1] = e.page
    out[#out + 1] = e.checksum
    out[#out + 1] = e.size
  else
    out[#out + 1] = -1
    out[#out + 1] = ''
    out[#out + 1] = 0
  end
end
if #found > 0 then
  local counts = {}
  if nranks > 1 then  -- the keys' generations are in `c:NS`
    counts = hmget_all(k_c(ns), located)
    for j = 1, #touched do
      local _, gen = c_parse(counts[j])
      touched[j][3] = gen or 0
    end
  end
  local gens = lru_touch(ns, touched, nranks > 1)
  local entry_args, count_args = {}, {}
  for j, item in ipairs(found) do
    local key, e = item[1], item[2]
    if nranks == 1 then e.gen = gens[j] end
    entry_args[#entry_args + 1] = key
    entry_args[#entry_args + 1] = pack_entry(e)
    if nranks > 1 then
      local count, _, expiry = c_parse(counts[j])
      local renew = renewed[key]
      if renew then  -- a renewed entry moves its key's earliest expiry (over every rank)
        expiry = renew[1]
        for r = 0, nranks - 1 do
          if r ~= rank then
            local other = unpack_entry(redis.call('HGET', k_e(ns, r), key))
            if other and other.state == 1 and other.until_ > 0 and other.until_ < expiry then
              expiry = other.until_
            end
          end
        end
        renew[1] = expiry
      end
      count_args[#count_args + 1] = key
      count_args[#count_args + 1] = c_value(count, gens[j], expiry)
    end
  end
  call_chunked('HSET', ek, entry_args, 2)
  if nranks > 1 then call_chunked('HSET', k_c(ns), count_args, 2) end
  redis.call('HINCRBY', k_ns(ns), 'hits', #found)
  redis.call('HSET', k_ns(ns), 'last_used', NOW_S)
end
for key, renew in pairs(renewed) do
  redis.call('ZADD', k_x(ns), renew[1], lru_member(key, renew[2]))
end
return out

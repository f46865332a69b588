"""Redis layouts for issue 21's ≤ 250 B per entry: memory and server CPU, measured.

    .venv/bin/python benchmarks/bench_redis_layouts.py --entries 100000 [--fill 8192]

A private `redis-server` (its compiled-in listpack limits, no CONFIG SET) holds N
synthetic entries in the shapes the store uses or could use, and each shape's
`MEMORY USAGE` (SAMPLES 0: every element) is divided by N. Keys are 32 random bytes,
entries 60 bytes (format 3's packed entry with an xxh3 checksum), LRU members 0xffff -
depth in 2 bytes then the key; the fill commits `--fill` keys a call, chains of 128.

| shape | what |
| --- | --- |
| `entries_hash` | format 3's `e:NS:0`: one hash, key → entry (what `lookup`'s `HMGET` reads) |
| `entries_buckets` | option (a): the entries in hashes of ~64 (by the key's first bytes), listpack |
| `lru_zset` | format 3's `lru:NS`: one sorted set, member → last access (s, to the µs) |
| `lru_generations` | option (b): append-only generations, listpack sorted sets of at most `--gen-max` members (integer µs scores) and an index of the live ones; each key's generation known (it would live in the entry) |

Server CPU per call (redis-server's utime + stime ÷ calls; the figure that does not
depend on where the clients run) of:

- a 1,000-key lookup: format 3's one `HMGET`; option (a)'s pipelined `HGET` per bucket and
  a Lua loop of them; a `ZMSCORE` of an LRU set keyed by the bare key (a lookup that
  would leave the entries free to be bucketed);
- the LRU's upkeep: a touch (what `locate` and `commit` do to it) of a chain prefix of
  16–128 keys, and an eviction of the 64 oldest plus 64 new keys (a full store's save),
  on `lru_zset` and `lru_generations`.

One JSON document on stdout; a summary on stderr. The prototypes are in this file
(`GENERATIONS_LUA`, `ZSET_LUA`); no store code is involved.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf3fsctl.bench.metadata.processes import cpu_seconds
from hf3fsctl.bench.peers.redis_server import RedisServer

P = "{hf3fsctl}:"
EPOCH_US = 1_735_689_600_000_000  # 2025-01-01 UTC, as the store counts
PER_BUCKET = 64  # option (a): mean entries per bucket (Poisson tail far below 128)

# The LRU's upkeep as format 3 does it: one sorted set, ZADD of every touched member.
ZSET_LUA = """
local L = KEYS[1] .. 'lru:' .. ARGV[1]
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6)
if ARGV[2] == 'touch' then
  local args = {}
  for i = 3, #ARGV, 2 do args[#args + 1] = now; args[#args + 1] = ARGV[i + 1] end
  for i = 1, #args, 1000 do redis.call('ZADD', L, unpack(args, i, math.min(#args, i + 999))) end
  return {}
end
local got = redis.call('ZRANGE', L, 0, tonumber(ARGV[3]) - 1)
if #got > 0 then redis.call('ZREM', L, unpack(got)) end
return #got
"""

# Option (b): generations `g:NS:ID` (sorted sets of at most GEN_MAX members, so
# listpack-encoded under Redis's defaults), appended in time order; `gi:NS` the live
# ids. A touch removes each member from its generation (the caller passes the id, as an
# entry would hold it) and appends it, in eviction order, to the newest; an eviction
# takes the oldest generation's first members. Returns each touched member's new id.
GENERATIONS_LUA = """
local P, ns, op, GEN_MAX = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local GI, NK = P .. 'gi:' .. ns, P .. 'ns:' .. ns
local function gk(id) return P .. 'g:' .. ns .. ':' .. id end
local t = redis.call('TIME')
local NOW = tonumber(t[1]) * 1000000 + tonumber(t[2]) - EPOCH_US
if op == 'touch' then
  local by_gen, news = {}, {}
  for i = 4, #ARGV, 2 do
    local g = ARGV[i]
    if g ~= '' then
      local b = by_gen[g]; if not b then b = {}; by_gen[g] = b end
      b[#b + 1] = ARGV[i + 1]
    end
    news[#news + 1] = ARGV[i + 1]
  end
  for g, members in pairs(by_gen) do
    redis.call('ZREM', gk(g), unpack(members))
    if redis.call('EXISTS', gk(g)) == 0 then redis.call('ZREM', GI, g) end
  end
  local order = {}
  for i = 1, #news do order[i] = i end
  table.sort(order, function(a, b) return news[a] < news[b] end)
  local cur = tonumber(redis.call('HGET', NK, 'gen') or '0')
  local n = 0
  if cur > 0 then n = redis.call('ZCARD', gk(cur)) end
  local out, i = {}, 1
  while i <= #order do
    if cur == 0 or n >= GEN_MAX then
      cur = redis.call('HINCRBY', NK, 'gen', 1); n = 0
      redis.call('ZADD', GI, cur, cur)
    end
    local args = {}
    while i <= #order and n < GEN_MAX do
      args[#args + 1] = NOW; args[#args + 1] = news[order[i]]; out[order[i]] = cur
      n = n + 1; i = i + 1
    end
    redis.call('ZADD', gk(cur), unpack(args))
  end
  return out
end
local k, got_all = tonumber(ARGV[4]), 0
while got_all < k do
  local first = redis.call('ZRANGE', GI, 0, 0)[1]
  if not first then break end
  local got = redis.call('ZRANGE', gk(first), 0, k - got_all - 1)
  got_all = got_all + #got
  if #got > 0 then redis.call('ZREM', gk(first), unpack(got)) end
  if redis.call('EXISTS', gk(first)) == 0 then redis.call('ZREM', GI, first) end
end
return got_all
""".replace("EPOCH_US", str(EPOCH_US))

# Option (a)'s lookup inside Redis: one HGET per key, each in its bucket, up to a miss.
BUCKET_LOOKUP_LUA = """
local nb, out = tonumber(ARGV[2]), 0
for i = 3, #ARGV do
  local k = ARGV[i]
  local b = ((string.byte(k, 1) * 256 + string.byte(k, 2)) * 256 + string.byte(k, 3)) * 256
    + string.byte(k, 4)
  if not redis.call('HGET', KEYS[1] .. 'b:' .. ARGV[1] .. ':0:' .. (b % nb), k) then break end
  out = out + 1
end
return out
"""


def member(depth: int, key: bytes) -> bytes:
    """Format 3's LRU member: 0xffff - depth (2 bytes, big-endian), then the key."""
    return struct.pack(">H", 0xFFFF - depth) + key


def usage(client: Any, pattern: str) -> int:
    """`MEMORY USAGE … SAMPLES 0` summed over the keys matching `pattern`."""
    names = list(client.scan_iter(match=pattern, count=10_000))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.memory_usage(name, samples=0)
    return sum(v or 0 for v in pipe.execute())


def server_cpu_us(pid: int, calls: int, fn: Callable[[], None]) -> float:
    """Redis's CPU µs per call over `calls` runs of `fn`."""
    before = cpu_seconds(pid)
    for _ in range(calls):
        fn()
    return (cpu_seconds(pid) - before) / calls * 1e6


class Rotation:
    """A call of `fn` on the next of `items`, round and round."""

    def __init__(self, fn: Callable[[list[bytes]], Any], items: list[list[bytes]]) -> None:
        self.fn, self.items, self.at = fn, items, 0

    def __call__(self) -> None:
        self.fn(self.items[self.at % len(self.items)])
        self.at += 1


class LruShape:
    """One LRU shape on `client`: filled by touches, then timed touches and saves."""

    def __init__(self, client: Any, shape: str, ns: str, gen_max: int, rnd: random.Random) -> None:
        self.client, self.shape, self.ns, self.gen_max, self.rnd = client, shape, ns, gen_max, rnd
        self.generations = shape == "lru_generations"
        self.script = client.register_script(GENERATIONS_LUA if self.generations else ZSET_LUA)
        self.head: list[Any] = [ns, "touch", gen_max] if self.generations else [ns, "touch"]
        self.gen: dict[bytes, Any] = {}  # member → its generation (the entry would hold it)
        self.chains: list[list[bytes]] = []
        self.pick = random.Random(2)

    def touch(self, members: list[bytes]) -> None:
        args = [x for m in members for x in (self.gen.get(m, ""), m)]
        got = self.script(keys=[P], args=[*self.head, *args])
        if self.generations:
            self.gen.update(zip(members, got, strict=True))

    def fill(self, members: list[bytes]) -> None:
        self.touch(members)
        self.chains += [members[j : j + 128] for j in range(0, len(members) - 127, 128)]

    def held(self) -> int:
        index = "g" if self.generations else "lru"
        return usage(self.client, f"{P}{index}:*") + usage(self.client, f"{P}gi:*")

    def chain_touch(self) -> None:
        """What a locate does to the LRU: a prefix of 16–128 keys of one chain."""
        self.touch(
            self.chains[self.pick.randrange(len(self.chains))][: self.pick.randrange(16, 129)]
        )

    def save(self) -> None:
        """What a full store's save does to it: the 64 oldest out, 64 new keys in."""
        evict = [self.ns, "evict", self.gen_max, 64] if self.generations else [self.ns, "evict", 64]
        self.script(keys=[P], args=evict)
        self.touch([member(d, self.rnd.randbytes(32)) for d in range(64)])


def measure(entries: int, fill: int, gen_max: int, calls: int) -> dict[str, Any]:
    """Every shape's bytes per entry and every call's server CPU at `entries`."""
    import redis

    rnd = random.Random(1)
    keys = [rnd.randbytes(32) for _ in range(entries)]
    depths = [i % 128 for i in range(entries)]

    def entry() -> bytes:
        return b"\x01" + bytes(7) + rnd.randbytes(43) + b"\x01" + rnd.randbytes(8)

    ns = "ab" * 16
    buckets = (entries + PER_BUCKET - 1) // PER_BUCKET

    def bucket(key: bytes) -> str:
        return f"{P}b:{ns}:0:{int.from_bytes(key[:4], 'big') % buckets}"

    out: dict[str, Any] = {"entries": entries, "fill_per_call": fill, "gen_max": gen_max}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        assert server.process is not None
        pid = server.process.pid
        client = redis.Redis(host="127.0.0.1", port=server.port)
        out["listpack_limits"] = {
            **client.config_get("hash-max-listpack-*"),
            **client.config_get("zset-max-listpack-*"),
        }
        pipe = client.pipeline(transaction=False)
        for i in range(0, entries, 1000):
            args = [x for k in keys[i : i + 1000] for x in (k, entry())]
            pipe.execute_command("HSET", f"{P}e:{ns}:0", *args)
        by_bucket: dict[str, list[bytes]] = {}
        for key in keys:
            by_bucket.setdefault(bucket(key), []).extend((key, entry()))
        for name, args in by_bucket.items():
            pipe.execute_command("HSET", name, *args)
        for i in range(0, entries, 1000):  # an LRU keyed by the bare key (ZMSCORE lookups)
            args = [x for j, k in enumerate(keys[i : i + 1000]) for x in (i + j, k)]
            pipe.execute_command("ZADD", f"{P}bare:{ns}", *args)
        pipe.execute()
        encodings = {client.object("encoding", name) for name in list(by_bucket)[:500]}
        out["bytes_per_entry"] = {
            "entries_hash": usage(client, f"{P}e:*") / entries,
            "entries_buckets": usage(client, f"{P}b:*") / entries,
        }
        out["bucket_encodings"] = sorted(e.decode() for e in encodings)
        out["largest_bucket"] = max(len(v) // 2 for v in by_bucket.values())

        lookups = [keys[i : i + 1000] for i in range(0, entries - 1000, 997)][:100]
        bucket_lua = client.register_script(BUCKET_LOOKUP_LUA)
        lookup_of: dict[str, Callable[[list[bytes]], Any]] = {
            "hmget_one_hash": lambda ks: client.execute_command("HMGET", f"{P}e:{ns}:0", *ks),
            "zmscore_bare_lru": lambda ks: client.execute_command("ZMSCORE", f"{P}bare:{ns}", *ks),
            "lua_hget_per_bucket": lambda ks: bucket_lua(keys=[P], args=[ns, buckets, *ks]),
        }

        def pipelined(ks: list[bytes]) -> Any:
            p = client.pipeline(transaction=False)
            for k in ks:
                p.execute_command("HGET", bucket(k), k)
            return p.execute()

        lookup_of["pipelined_hget_per_bucket"] = pipelined
        out["lookup_server_cpu_us"] = {
            name: server_cpu_us(pid, calls, Rotation(fn, lookups)) for name, fn in lookup_of.items()
        }
        client.flushall()
        out["lru"] = {}
        for shape in ("lru_zset", "lru_generations"):
            lru = LruShape(client, shape, ns, gen_max, rnd)
            for i in range(0, entries, fill):
                lru.fill([member(depths[j], keys[j]) for j in range(i, min(entries, i + fill))])
            out["lru"][shape] = {
                "bytes_per_entry": lru.held() / entries,
                "touch_chain_prefix_server_cpu_us": server_cpu_us(pid, calls, lru.chain_touch),
                "evict_64_insert_64_server_cpu_us": server_cpu_us(pid, calls, lru.save),
            }
            client.flushall()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[100_000])
    parser.add_argument("--fill", type=int, default=8192, help="keys committed per fill call")
    parser.add_argument("--gen-max", type=int, default=128, help="members per generation")
    parser.add_argument("--calls", type=int, default=300, help="calls per CPU figure")
    args = parser.parse_args()
    results = []
    for n in args.entries:
        started = time.monotonic()
        result = measure(n, args.fill, args.gen_max, args.calls)
        results.append(result)
        b, lru = result["bytes_per_entry"], result["lru"]
        print(
            f"N={n:,}: entries {b['entries_hash']:.1f} B (hash) / {b['entries_buckets']:.1f} B"
            f" (buckets); LRU {lru['lru_zset']['bytes_per_entry']:.1f} B (zset) /"
            f" {lru['lru_generations']['bytes_per_entry']:.1f} B (generations);"
            f" {time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )
    json.dump({"results": results}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()

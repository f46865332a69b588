"""The Redis metadata store: the `MetadataClient` contract shared by a fleet (decision 13).

`RedisMetadataStore` (`store.py`) is chosen by `metadata.url: redis://HOST:PORT/DB`,
`rediss://…` (TLS), `redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE[/DB]` or
`redis+cluster://HOST:PORT[,…]` (`connection.py`); `redis+cluster://…?shards=N` selects
`ShardedRedisStore` (`sharded.py`): N such stores, one slot each, over the cluster.
Every multi-key operation is one Lua script (`lua/*.lua` after `lua/common.lua`: one
function library on Redis 7, scripts on older servers; `connection.StoreLua`), run
atomically by Redis in one round trip; `lookup` is one pipelined round trip of a native
`HMGET` and a counter script.

Key layout, format 5 (every key starts with the prefix `{hf3fsctl}:`, one hash tag). A
block key is stored as bytes (`codec.encode_key`: 64 hex digits are 32 bytes), in every
field and member below that names a key:

| key | type | holds |
| --- | --- | --- |
| `info` | hash | `format` (the layout below: `migration.FORMAT`; formats 1 to 4 are migrated on open, a newer one is refused), `capacity_bytes` (the store's one budget) |
| `namespaces` | zset | namespace id → created |
| `manifests` | hash | namespace id → canonical manifest JSON |
| `ns:NS` | hash | `num_ranks`, `model`, `key_bytes`, `keys` (committed on every rank), `gen` (the last LRU generation id issued), traffic counters, `admission_skipped`, `created`, `last_used` |
| `model:MODEL` | set | the namespaces of a model (quotas by model name) |
| `files` | set | `NS:RANK` of every registered page file |
| `rf:NS:RANK` | hash | the page file: `path`, `page_bytes`, `slot`, `num_pages`, `prealloc`, `next_unused`, `used`, `holes` |
| `e:NS:RANK` | hash | key → entry, packed (`struct` `<BI7I5I2I5I5I3I5I5I4I5f`, then the checksum, `codec.py`): flags (committed, renew on read), until (a pending entry's writer deadline, a committed one's expiry; µs), page, depth (saturates at 65,535, as the LRU member's), created, last_access, hits, lease_until, page_free_at, size (≤ 2³² − 1), the key's LRU generation (one rank; 0 with more: `c:NS` holds it), retention; times in ms from 2025-01-01; 60 bytes with an xxh3 checksum (9 bytes), one 64-byte allocation. A one-rank namespace's `lookup` reads it directly (flags and expiry lead) |
| `pend:NS:RANK` | zset | pending key → writer deadline (µs from 2025-01-01, an integer: its entry's until) |
| `free:NS:RANK` | zset | free page that holds its space → reusable after (the freed entry's lease; µs from 2025-01-01, an integer) |
| `give:NS:RANK` | zset | page marked to give back → when marked (punch, then settle) |
| `holes:NS:RANK` | zset | page whose space was punched back → when |
| `c:NS` | hash | only with 2+ ranks: key → `"RANKS GEN"` or `"RANKS GEN EXPIRY_MS"` (ranks committed, the key's LRU generation, the earliest expiry among them; `lookup` reads it with a native `HMGET`) |
| `g:NS:ID` | zset | one LRU generation (the eviction index, `lua/common.lua`: `lru_touch`, `lru_slice`): at most 128 `lru_member`s (0xffff − depth in 2 bytes, then the key), listpack-encoded, → last access (µs from 2025-01-01, an integer); each key with a committed rank is in exactly one, the one its entry or `c:NS` records; equal scores sort by member, so chain tails first; a touch moves the key to the newest generation, an emptied one is deleted |
| `gi:NS` | zset | the live generation ids (score = id): in id order, each generation in its own order, they are the eviction order |
| `x:NS` | zset | keys with an expiry: `lru_member` (as in `g:NS:ID`) → the earliest expiry of its committed entries (ms): expired keys go first in every eviction, soonest first |
| `pins:NS` | hash | key → `"expires created"` (0: no TTL) |
| `ev:NS` | hash | `REASON:keys`, `REASON:bytes` evicted (capacity, quota, file_full, expired, admin, corrupt) |
| `adm:NS`, `adm_at` | hash, zset | `admit`'s sightings: key → count; `NS` + key → last seen, at most `store.ADMISSION_TRACKED_KEYS` per store (the least recently seen dropped) |
| `held`, `giving` | hash | namespace → bytes its files hold / bytes being given back |
| `changes`, `seq` | stream, counter | the change log: entries `0-SEQ` of `ns`, `key`, `delta` (+1 a rank committed, -1 a committed rank removed), each run's keys length-prefixed bytes, trimmed near 200,000 |
"""

from hf3fsctl.meta.redis.store import RedisMetadataStore

__all__ = ["RedisMetadataStore"]

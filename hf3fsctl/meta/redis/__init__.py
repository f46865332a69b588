"""The Redis metadata store: the `MetadataClient` contract shared by a fleet (decision 13).

`RedisMetadataStore` (`store.py`) is chosen by `metadata.url: redis://HOST:PORT/DB`,
`rediss://…` (TLS) or `redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE[/DB]`
(`connection.py`). Every multi-key operation is one Lua script (`lua/*.lua`, with
`lua/common.lua` prepended), run atomically by Redis in one round trip; `lookup` is one
pipelined round trip of a native `HMGET` and a counter script.

Key layout (every key starts with the prefix `{hf3fsctl}:`, one hash tag):

| key | type | holds |
| --- | --- | --- |
| `info` | hash | `format` (the layout below: `store.FORMAT`; format 1 is migrated on open, another is refused), `capacity_bytes` (the store's one budget) |
| `namespaces` | zset | namespace id → created |
| `manifests` | hash | namespace id → canonical manifest JSON |
| `ns:NS` | hash | `num_ranks`, `model`, `key_bytes`, `keys` (committed on every rank), traffic counters, `created`, `last_used` |
| `model:MODEL` | set | the namespaces of a model (quotas by model name) |
| `files` | set | `NS:RANK` of every registered page file |
| `rf:NS:RANK` | hash | the page file: `path`, `page_bytes`, `slot`, `num_pages`, `prealloc`, `next_unused`, `used`, `holes` |
| `e:NS:RANK` | hash | key → entry, packed (`struct` `<Bddddddddd`, then the checksum): state, page, depth, created, last_access, hits, deadline, lease_until, page_free_at, size |
| `pend:NS:RANK` | zset | pending key → writer deadline |
| `free:NS:RANK` | zset | free page that holds its space → reusable after (the freed entry's lease) |
| `give:NS:RANK` | zset | page marked to give back → when marked (punch, then settle) |
| `holes:NS:RANK` | zset | page whose space was punched back → when |
| `c:NS` | hash | key → ranks committed (`lookup` reads it with a native `HMGET`) |
| `lru:NS` | zset | the eviction index: `lru_member` (4 hex digits of 0xffff − depth, then the key) of each key with a committed rank → last access; equal scores sort by member, so chain tails first, and `ZRANGE … LIMIT` yields victims in eviction order (format 2; format 1's bare-key members are rebuilt on open) |
| `pins:NS` | hash | key → `"expires created"` (0: no TTL) |
| `ev:NS` | hash | `REASON:keys`, `REASON:bytes` evicted (capacity, quota, file_full, admin, corrupt) |
| `held`, `giving` | hash | namespace → bytes its files hold / bytes being given back |
| `changes`, `seq` | stream, counter | the change log: entries `0-SEQ` of `ns`, `key`, `delta` (+1 a rank committed, -1 a committed rank removed), trimmed near 200,000 |
"""

from hf3fsctl.meta.redis.store import RedisMetadataStore

__all__ = ["RedisMetadataStore"]

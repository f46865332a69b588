"""Read-only views of the Redis store: namespaces, stats, entries, pins, the change log,
and the invariants `doctor` checks.

These read with plain commands (pipelined, no script): they are admin calls, never on the
data path, and a view a few microseconds apart between two reads is fine for them.
`list_entries` and `invariants` read every entry (`HSCAN`, a thousand fields per call, so
Redis is never held for long), as the SQLite store's `ls` and `doctor` scan its table.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from hf3fsctl.meta.models import (
    EntryInfo,
    NamespaceInfo,
    NamespaceStats,
    PinInfo,
    RankFile,
    StoreStats,
)
from hf3fsctl.meta.redis.codec import EPOCH_MS, decode_key, decode_run, raw, unpack_entry

if TYPE_CHECKING:
    from hf3fsctl.meta.models import ChangeLog

PENDING, COMMITTED = 0, 1
# A `redis.Redis` with `decode_responses=True`. Typed as Any: redis-py's command stubs
# return one union for its sync and async clients, which every caller would have to cast.
Redis = Any


def _scan(client: Redis, key: str) -> Iterator[tuple[str, str]]:
    """The fields of a hash that may hold millions of entries, a thousand per call
    (`HSCAN`), so no single command holds Redis for long (`HGETALL` of a million
    fields would, for everyone)."""
    yield from client.hscan_iter(key, count=1000)


def _members(client: Redis, key: str) -> list[str]:
    """The members of a sorted set that may be large, a thousand per call (`ZSCAN`)."""
    return [member for member, _ in client.zscan_iter(key, count=1000)]


def _scores(client: Redis, key: str) -> dict[str, float]:
    """`_members`, each with its score."""
    return dict(client.zscan_iter(key, count=1000))


# Format 5 scores the pending and free sets in whole µs since `EPOCH_MS`; format 4's
# seconds (below 1e11 until the year 5138) are a store left half migrated.
_SCORE_US_MIN = 1e11


def _newest_access(client: Redis, prefix: str, ns: str) -> float | None:
    """When a key of `ns` was last touched (s): the newest LRU generation's last member."""
    newest = client.zrange(f"{prefix}gi:{ns}", -1, -1)
    if not newest:
        return None
    last = client.zrange(f"{prefix}g:{ns}:{newest[0]}", -1, -1, withscores=True)
    return float(last[0][1]) / 1e6 + EPOCH_MS / 1000 if last else None


def _lru_problems(
    client: Redis, prefix: str, ns: str, committed: set[bytes], gen_of: dict[bytes, int]
) -> list[str]:
    """What is wrong with a namespace's LRU generations: every key with a committed rank
    has one member, in the generation its entry (or `c:NS`) records; every listed
    generation is live, none is unlisted, none is newer than the last id issued."""
    problems = []
    issued = int(client.hget(f"{prefix}ns:{ns}", "gen") or 0)
    listed = {int(g) for g in client.zrange(f"{prefix}gi:{ns}", 0, -1)}
    found: dict[bytes, list[int]] = defaultdict(list)
    for gen in sorted(listed):
        members = client.zrange(f"{prefix}g:{ns}:{gen}", 0, -1)
        if not members:
            problems.append(f"namespace {ns}: LRU generation {gen} is listed but empty")
        if gen > issued:
            problems.append(f"namespace {ns}: LRU generation {gen} is past the last issued")
        for m in members:
            found[raw(m)[2:]].append(gen)  # `lru_member`: the depth, then the key
    for key in client.scan_iter(match=f"{prefix}g:{ns}:*", count=1000):
        if int(key.rpartition(":")[2]) not in listed:
            problems.append(f"namespace {ns}: LRU generation {key} is not listed")
    if client.exists(f"{prefix}lru:{ns}"):
        problems.append(f"namespace {ns}: a format-3 LRU index is left")
    if set(found) != committed:
        problems.append(f"namespace {ns}: LRU members differ from its committed keys")
    if any(len(gens) > 1 for gens in found.values()):
        problems.append(f"namespace {ns}: a key has more than one LRU member")
    if any(gen_of.get(key) != gens[0] for key, gens in found.items()):
        problems.append(f"namespace {ns}: a key's LRU generation differs from its record")
    return problems


def _now(client: Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6


def _rank_files(client: Redis, prefix: str, ns: str, num_ranks: int) -> list[dict[str, str]]:
    pipe = client.pipeline(transaction=False)
    for rank in range(num_ranks):
        pipe.hgetall(f"{prefix}rf:{ns}:{rank}")
    return [dict(row, rank=str(rank)) for rank, row in enumerate(pipe.execute()) if row]


def namespace_infos(client: Redis, prefix: str, ids: Sequence[str] | None) -> list[NamespaceInfo]:
    """The namespaces `ids` that exist (every one, oldest first, when None)."""
    if ids is None:
        ids = client.zrange(f"{prefix}namespaces", 0, -1)
    out = []
    for ns in ids:
        pipe = client.pipeline(transaction=True)
        pipe.hget(f"{prefix}manifests", ns)
        pipe.hmget(f"{prefix}ns:{ns}", "num_ranks", "created")
        manifest, (num_ranks, created) = pipe.execute()
        if manifest is None or num_ranks is None:
            continue
        files = _rank_files(client, prefix, ns, int(num_ranks))
        out.append(
            NamespaceInfo(
                id=ns,
                manifest=json.loads(manifest),
                num_ranks=int(num_ranks),
                created=float(created),
                rank_files=[
                    RankFile(
                        rank=int(f["rank"]),
                        path=f["path"],
                        page_bytes=int(f["page_bytes"]),
                        slot_bytes=int(f["slot"]),
                        num_pages=int(f["num_pages"]),
                        preallocated=f["prealloc"] == "1",
                    )
                    for f in files
                ],
            )
        )
    return out


def _live_pins(client: Redis, prefix: str, ns: str, now: float) -> dict[str, tuple[float, float]]:
    """Live pins by stored key (bytes, as the entries are keyed)."""
    out = {}
    for key, value in client.hgetall(f"{prefix}pins:{ns}").items():
        expires, created = (float(x) for x in value.split(" "))
        if expires == 0 or expires > now:
            out[key] = (expires, created)
    return out


def _stored(
    client: Redis, prefix: str, ns: str, num_ranks: int, keys: Sequence[str], now_ms: float
) -> list[bool]:
    """Whether each stored key is committed on every rank and unexpired (the lookup's
    test: one rank reads `e:NS:0`, more `c:NS`)."""
    from hf3fsctl.meta.redis.codec import committed_counts, entry_counts

    if not keys:
        return []
    fields = [raw(key) for key in keys]  # hiredis refuses the decoded text's surrogates
    if num_ranks == 1:
        return [entry_counts(v, now_ms) for v in client.hmget(f"{prefix}e:{ns}:0", fields)]
    values = client.hmget(f"{prefix}c:{ns}", fields)
    return [committed_counts(v, num_ranks, now_ms) for v in values]


def store_stats(
    client: Redis,
    prefix: str,
    *,
    capacity: int | None,
    quotas: dict[str, int],
    max_pinned: int | None,
) -> StoreStats:
    """Usage and traffic of every namespace, and totals against the capacity."""
    now = _now(client)
    ids = client.zrange(f"{prefix}namespaces", 0, -1)
    held = {ns: int(v) for ns, v in client.hgetall(f"{prefix}held").items()}
    manifests = client.hgetall(f"{prefix}manifests")
    counters = {}
    by_model: dict[str, list[str]] = defaultdict(list)
    for ns in ids:
        counters[ns] = client.hgetall(f"{prefix}ns:{ns}")
        by_model[counters[ns].get("model", "")].append(ns)
    quota_of: dict[str, int] = {}
    for name, limit in quotas.items():
        scope = [name] if name in counters else by_model.get(name, [])
        for ns in scope:
            quota_of[ns] = min(limit, quota_of.get(ns, limit))
    namespaces = []
    for ns in ids:
        c = counters[ns]
        if not c or ns not in manifests:
            continue
        num_ranks = int(c["num_ranks"])
        used = live = 0
        for f in _rank_files(client, prefix, ns, num_ranks):
            used += int(f["used"])
            live += int(f["used"]) * int(f["slot"])
        accessed = _newest_access(client, prefix, ns)
        pins = len(_live_pins(client, prefix, ns, now))
        expiring = int(client.zcard(f"{prefix}x:{ns}"))
        expired = int(client.zcount(f"{prefix}x:{ns}", "-inf", now * 1000)) if expiring else 0
        evicted: dict[str, list[int]] = {}
        for field, value in client.hgetall(f"{prefix}ev:{ns}").items():
            reason, _, what = field.rpartition(":")
            evicted.setdefault(reason, [0, 0])[0 if what == "keys" else 1] = int(value)
        namespaces.append(
            NamespaceStats(
                id=ns,
                manifest=json.loads(manifests[ns]),
                num_ranks=num_ranks,
                keys=int(c.get("keys", 0)),
                pages_used=used,
                bytes_live=live,
                bytes_used=held.get(ns, 0),
                quota_bytes=quota_of.get(ns),
                pinned_keys=pins,
                pinned_bytes=pins * int(c.get("key_bytes", 0)),
                hits=int(c.get("hits", 0)),
                lookups=int(c.get("lookups", 0)),
                lookup_keys=int(c.get("lookup_keys", 0)),
                hit_keys=int(c.get("hit_keys", 0)),
                last_access=accessed,
                last_used=max(float(c.get("last_used", 0)), accessed or 0.0),
                evicted=evicted,
                admission_skipped=int(c.get("admission_skipped", 0)),
                expiring_keys=expiring,
                expired_keys=expired,
            )
        )
    return StoreStats.summed(namespaces, capacity, max_pinned)


def _entries(
    client: Redis, prefix: str, ns: str, num_ranks: int
) -> list[tuple[int, str, dict[str, Any]]]:
    out = []
    for rank in range(num_ranks):
        for key, value in _scan(client, f"{prefix}e:{ns}:{rank}"):
            out.append((rank, decode_key(key), unpack_entry(value)))
    return out


def list_entries(
    client: Redis, prefix: str, namespace: str | None, limit: int, offset: int
) -> list[EntryInfo]:
    """Entries (one per key and rank), most recently used first."""
    now = _now(client)
    ids = [namespace] if namespace else client.zrange(f"{prefix}namespaces", 0, -1)
    rows: list[tuple[str, int, str, dict[str, Any]]] = []
    pinned: set[tuple[str, str]] = set()
    for ns in ids:
        num_ranks = client.hget(f"{prefix}ns:{ns}", "num_ranks")
        if num_ranks is None:
            continue
        pinned.update((ns, decode_key(key)) for key in _live_pins(client, prefix, ns, now))
        rows.extend(
            (ns, rank, key, e) for rank, key, e in _entries(client, prefix, ns, int(num_ranks))
        )
    rows.sort(key=lambda r: (-r[3]["last_access"], r[3]["depth"], r[2], r[1]))
    return [
        EntryInfo.model_construct(
            namespace=ns,
            key=key,
            rank=rank,
            page=e["page"],
            size=e["size"],
            checksum=e["checksum"] or None,
            state="committed" if e["state"] == COMMITTED else "pending",
            depth=e["depth"],
            created=e["created"],
            last_access=e["last_access"],
            hits=e["hits"],
            pinned=(ns, key) in pinned,
            expires_at=e["expires_at"],
        )
        for ns, rank, key, e in rows[offset : offset + limit]
    ]


def list_pins(client: Redis, prefix: str, namespace: str | None, limit: int) -> list[PinInfo]:
    """Live pins, newest first."""
    now = _now(client)
    ids = [namespace] if namespace else client.zrange(f"{prefix}namespaces", 0, -1)
    rows = []
    for ns in ids:
        num_ranks = client.hget(f"{prefix}ns:{ns}", "num_ranks")
        pins = _live_pins(client, prefix, ns, now)
        keys = list(pins)
        stored = (  # committed on every rank, expiry aside (as `pin` counts them)
            _stored(client, prefix, ns, int(num_ranks), keys, 0)
            if num_ranks is not None
            else [False] * len(keys)
        )
        for key, held in zip(keys, stored, strict=True):
            expires, created = pins[key]
            rows.append((created, ns, decode_key(key), expires, held))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    return [
        PinInfo(namespace=ns, key=key, created=created, expires=expires or None, stored=stored)
        for created, ns, key, expires, stored in rows[:limit]
    ]


def _run_changes(entry_id: str, fields: dict[str, str]) -> list[tuple[int, str, str, int]]:
    """The (seq, namespace, key, delta) of one stream entry: a run ending at its id."""
    last = int(entry_id.split("-")[1])
    keys = decode_run(fields["keys"])
    first = last - len(keys) + 1
    return [(first + i, fields["ns"], key, int(fields["delta"])) for i, key in enumerate(keys)]


def read_changes(
    client: Redis, prefix: str, since: int, namespace: str | None, limit: int
) -> ChangeLog:
    """Changes of the log after `since`, at most `limit` (as SQLite's `changes` rows).

    The log is a stream whose entries are runs of changes (`common.lua`'s
    `flush_changes`), ids `0-SEQ` of each run's last change. `since = -1` starts at the
    log's end. `missed` says changes after `since` were trimmed.
    """
    from hf3fsctl.meta.models import Change, ChangeLog

    last = int(client.get(f"{prefix}seq") or 0)
    if since < 0 or since >= last:
        return ChangeLog(changes=[], next_seq=max(since, last) if since >= 0 else last)
    stream = f"{prefix}changes"
    oldest = client.xrange(stream, "-", "+", count=1)
    oldest_seq = _run_changes(*oldest[0])[0][0] if oldest else None
    missed = oldest_seq is None or oldest_seq > since + 1
    rows: list[tuple[int, str, str, int]] = []
    start = f"(0-{since}"
    while len(rows) < limit:
        entries = client.xrange(stream, start, "+", count=max(1, min(limit, 1000)))
        if not entries:
            break
        for entry_id, fields in entries:
            rows.extend(row for row in _run_changes(entry_id, fields) if row[0] > since)
        start = f"({entries[-1][0]}"
    rows = rows[:limit]
    next_seq = rows[-1][0] if rows else last
    return ChangeLog(
        changes=[
            Change(seq=seq, namespace=ns, key=key, delta=delta)  # type: ignore[arg-type]
            for seq, ns, key, delta in rows
            if namespace is None or ns == namespace
        ],
        next_seq=next_seq,
        missed=missed,
    )


def invariants(client: Redis, prefix: str) -> list[str]:
    """Every violated invariant, one line each (the SQLite store's, plus the Redis
    store's own indexes: committed counts, LRU members, pending deadlines, held bytes)."""
    problems: list[str] = []
    ids = set(client.zrange(f"{prefix}namespaces", 0, -1))
    manifests = set(client.hkeys(f"{prefix}manifests"))
    for ns in ids ^ manifests:
        problems.append(f"namespace {ns} is in only one of the namespace list and manifests")
    files = client.smembers(f"{prefix}files")
    for member in files:
        ns, _, rank = member.partition(":")
        if ns not in ids:
            problems.append(f"rank file {ns} rank {rank} belongs to no registered namespace")
    held = {ns: int(v) for ns, v in client.hgetall(f"{prefix}held").items()}
    giving = {ns: int(v) for ns, v in client.hgetall(f"{prefix}giving").items()}
    for ns in sorted(ids):
        c = client.hgetall(f"{prefix}ns:{ns}")
        num_ranks = int(c["num_ranks"])
        committed: dict[str, int] = defaultdict(int)
        earliest: dict[str, float] = {}  # key → its committed entries' earliest expiry (ms)
        gen_of: dict[bytes, int] = {}  # key → its LRU generation (one rank: its entry's)
        held_bytes = giving_bytes = 0
        for rank in range(num_ranks):
            rf = client.hgetall(f"{prefix}rf:{ns}:{rank}")
            entries = {key: unpack_entry(v) for key, v in _scan(client, f"{prefix}e:{ns}:{rank}")}
            if not rf:
                for key in entries:
                    problems.append(
                        f"entry {ns}/{decode_key(key)} rank {rank} has no registered rank file"
                    )
                continue
            if f"{ns}:{rank}" not in files:
                problems.append(f"rank file {ns} rank {rank} is missing from the file set")
            num_pages, next_unused = int(rf["num_pages"]), int(rf["next_unused"])
            slot = int(rf["slot"])
            free_at = _scores(client, f"{prefix}free:{ns}:{rank}")
            free = {int(p) for p in free_at}
            holes = {int(p) for p in _members(client, f"{prefix}holes:{ns}:{rank}")}
            marked = {int(p) for p in _members(client, f"{prefix}give:{ns}:{rank}")}
            pending = _scores(client, f"{prefix}pend:{ns}:{rank}")
            owners: dict[int, list[str]] = defaultdict(list)
            for key, e in entries.items():
                name = decode_key(key)
                owners[e["page"]].append(name)
                if not 0 <= e["page"] < min(num_pages, next_unused):
                    problems.append(
                        f"entry {ns}/{name} rank {rank}: page {e['page']} is outside the rank "
                        f"file's {num_pages} pages"
                    )
                if e["state"] == COMMITTED:
                    committed[key] += 1
                    if num_ranks == 1:
                        gen_of[raw(key)] = e["generation"]
                    if e["expires_at"] is not None:
                        expiry = round(e["expires_at"] * 1000, 3)
                        earliest[key] = min(expiry, earliest.get(key, expiry))
                    if not e["checksum"]:
                        problems.append(f"committed entry {ns}/{name} rank {rank} has no checksum")
                elif e["state"] == PENDING:
                    if e["deadline"] <= 0:
                        problems.append(
                            f"pending entry {ns}/{name} rank {rank} has no writer deadline"
                        )
                else:
                    problems.append(f"entry {ns}/{name} rank {rank} has unknown state {e['state']}")
                if e["created"] < e["page_free_at"]:
                    problems.append(
                        f"entry {ns}/{name} rank {rank} reused page {e['page']} at "
                        f"{e['created']} while its last lease ran until {e['page_free_at']}"
                    )
            for page, keys in owners.items():
                if len(keys) > 1:
                    problems.append(
                        f"page {page} of {ns} rank {rank} is owned by {len(keys)} entries"
                    )
            sets = {"free": free, "punched": holes, "marked": marked}
            for name, pages in sets.items():
                for page in sorted(pages & set(owners)):
                    problems.append(
                        f"page {page} of {ns} rank {rank} is both {name} and owned by key "
                        f"{owners[page][0]}"
                    )
                for page in sorted(p for p in pages if not 0 <= p < next_unused):
                    problems.append(
                        f"free page {page} of {ns} rank {rank} is beyond the high-water mark "
                        f"{next_unused}"
                    )
            if len(free & holes) + len(free & marked) + len(holes & marked):
                problems.append(f"rank file {ns} rank {rank}: a free page is in two free lists")
            if int(rf["used"]) != len(entries):
                problems.append(
                    f"rank file {ns} rank {rank} counts {rf['used']} used pages but "
                    f"{len(entries)} entries hold pages"
                )
            if next_unused != len(entries) + len(free) + len(holes) + len(marked):
                problems.append(
                    f"rank file {ns} rank {rank}: high-water mark {next_unused} != "
                    f"{len(entries)} owned + {len(free) + len(holes) + len(marked)} free pages (leak)"
                )
            if not 0 <= next_unused <= num_pages:
                problems.append(
                    f"rank file {ns} rank {rank}: high-water mark {next_unused} exceeds its "
                    f"{num_pages} pages"
                )
            if int(rf["holes"]) != len(holes):
                problems.append(
                    f"rank file {ns} rank {rank} counts {rf['holes']} holes but {len(holes)} "
                    "free pages are punched"
                )
            want_pending = {k for k, e in entries.items() if e["state"] == PENDING}
            if set(pending) != want_pending:
                problems.append(
                    f"rank file {ns} rank {rank}: pending index differs from its entries"
                )
            for key, score in pending.items():  # the entry's `until`, in µs (±1: migrated)
                entry = entries.get(key)
                if entry and abs(score - round((entry["deadline"] * 1000 - EPOCH_MS) * 1000)) > 1:
                    problems.append(
                        f"pending entry {ns}/{decode_key(key)} rank {rank}: the pending "
                        f"index's deadline ({score}) differs from its entry's"
                    )
            if any(s < _SCORE_US_MIN or s != int(s) for s in free_at.values()):
                problems.append(
                    f"rank file {ns} rank {rank}: free pages scored other than in whole µs"
                )
            if rf["prealloc"] == "1":
                held_bytes += num_pages * slot
            else:
                held_bytes += (next_unused - int(rf["holes"])) * slot
            giving_bytes += len(marked) * slot
        c_values = {k: v.split(" ") for k, v in _scan(client, f"{prefix}c:{ns}")}
        counts = {k: int(v[0]) for k, v in c_values.items()}  # "RANKS GEN[ EXPIRY_MS]"
        if num_ranks > 1:
            gen_of = {raw(k): int(v[1]) for k, v in c_values.items()}
        if num_ranks == 1 and counts:
            problems.append(f"namespace {ns} has one rank but a committed-count hash")
        if num_ranks > 1 and counts != dict(committed):
            problems.append(f"namespace {ns}: committed counts differ from its entries")
        expiries = {
            raw(m)[2:]: round(v, 3)  # `lru_member`s
            for m, v in client.zrange(f"{prefix}x:{ns}", 0, -1, withscores=True)
        }
        if expiries != {raw(k): v for k, v in earliest.items()}:
            problems.append(f"namespace {ns}: the expiry index differs from its entries")
        complete = sum(1 for n in committed.values() if n >= num_ranks)
        if int(c.get("keys", 0)) != complete:
            problems.append(
                f"namespace {ns} counts {c.get('keys')} complete keys but {complete} are"
            )
        problems += _lru_problems(client, prefix, ns, {raw(k) for k in committed}, gen_of)
        if held.get(ns, 0) != held_bytes:
            problems.append(
                f"namespace {ns} counts {held.get(ns, 0)} held bytes, its files {held_bytes}"
            )
        if giving.get(ns, 0) != giving_bytes:
            problems.append(
                f"namespace {ns} counts {giving.get(ns, 0)} bytes being given back, its files "
                f"{giving_bytes}"
            )
        if client.exists(f"{prefix}e:{ns}:{num_ranks}"):
            problems.append(
                f"entries of {ns} have rank {num_ranks} but the namespace has {num_ranks} ranks"
            )
    for key in client.scan_iter(match=f"{prefix}pins:*", count=1000):
        ns = key[len(prefix) + len("pins:") :]
        if ns not in ids:
            for pin in client.hkeys(key):
                problems.append(f"pin {ns}/{pin} belongs to no registered namespace")
    return problems

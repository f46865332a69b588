"""Hit rate of an N-sharded Redis store's per-shard LRU against exact LRU, simulated.

    .venv/bin/python benchmarks/bench_shard_lru.py [--quick] [--json PATH|-]

Contract: a deterministic (seeded) trace-driven simulation, pure Python, no store code.
It answers one question: how much token hit rate does splitting one store into N
independent shards (key → shard `crc32(key) % N`, each with capacity C/N and its own
exact LRU) lose against one store with capacity C and exact LRU (N = 1)?

What it models:

- **Traffic.** Requests whose prompts are chains of block keys (a key is a hash of the
  token prefix up to its block, so keys are uniform random hex and a key fixes its whole
  prefix). A new request takes a shared prefix (`--prefixes` distinct ones, chosen by
  Zipf popularity `--zipf`, `--prefix-blocks` long) and a unique suffix
  (`--suffix-blocks`). With probability `--repeat` a request is instead a later turn of
  one of the last `--repeat-window` requests: that full prompt again, then
  `--turn-blocks` new blocks (0: an exact repeat).
- **A request on the store**, all its keys at one time t (the request's index): `lookup`
  counts leading hits (blocks 0..k-1 stored; the first missing block ends it);
  `locate` touches the k hits (last access t, leased for the rest of the request);
  `allocate` + `commit` store the missing blocks after the first miss that are not
  stored (blocks already stored past the first miss are "existing": neither stored again
  nor touched, as `allocate` does).
- **Eviction, per shard, as `allocate` of a full file decides it**: when the shard's used
  pages + the new keys would pass `--high` × its capacity, it evicts until used <=
  int(`--low` × capacity) − new keys, oldest last access first and, among equal access
  times, deepest block first ("chain tails first"); leased (this request's hits) keys are
  skipped. It never holds more than its capacity (a key without room is not stored).
- **Capacity** C as a share of the trace's distinct blocks (`--capacities`); shard s of N
  holds C // N pages, plus one for the first C % N shards.
- **Figures per (capacity, N)**: the token hit rate (leading-hit blocks ÷ blocks asked,
  over the requests after the first `--warmup` share; the store starts empty, and until
  its first eviction every N is the same store), its ratio to N = 1, and the share of
  stored blocks at the end that are orphans (stored, but some block before it in its
  chain is not, so no lookup can ever reach it).

`--low` just under `--high` (0.9499) evicts only what each allocation needs: the loss
left is the shards' LRU horizons drifting apart, the rest is their swings (0.95 → 0.85
of a shard at once, each shard at its own time). The loss shrinks as blocks per shard
grow (`--requests` with `--prefixes` and `--repeat-window` scaled alike).

What it does not model: the real store's capacity is in bytes, shared by every
(namespace, rank) page file, and a full file also evicts within itself — here one
namespace, one rank, one page a block; expiry, pins, admission (issue 22) and quotas;
concurrency (a real locate and allocate are at different times, with other requests'
calls between them, and leases last beyond the request); lookups that run ahead of a
save of the same blocks; the engine's own prefix cache in front of the store (which
hides repeats of very recent prompts from it); a lookup never covering the last prompt
token; free pages reused or given back (a page is a page).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

HIGH_WATERMARK = 0.95  # the store's defaults (docs/design.md, "Eviction")
LOW_WATERMARK = 0.85

# The table's columns: header → the JSON row field it shows (a test holds them together).
TABLE_COLUMNS = {
    "capacity": "capacity_share",
    "blocks": "capacity_blocks",
    "shards": "shards",
    "per shard": "shard_capacity",
    "hit rate": "hit_rate",
    "÷ exact": "vs_exact",
    "orphans": "orphan_share",
    "evicted": "evicted",
    "CPU s": "cpu_s",
}


@dataclass(frozen=True)
class TrafficParams:
    """The trace's shape (the CLI's traffic options)."""

    requests: int = 20_000  # requests in the trace
    prefixes: int = 500  # distinct shared prefixes
    zipf: float = 1.0  # Zipf exponent of the prefixes' popularity
    prefix_blocks: int = 32  # blocks in a shared prefix
    suffix_blocks: int = 16  # blocks in a new request's unique suffix
    repeat: float = 0.3  # probability that a request is a later turn of a recent one
    repeat_window: int = 2_000  # a later turn continues one of this many latest requests
    turn_blocks: int = 4  # new blocks a later turn appends (0: an exact repeat)
    warmup: float = 0.25  # share of the first requests whose hits are not counted
    seed: int = 0


QUICK = TrafficParams(requests=2_000, prefixes=50, repeat_window=200)


@dataclass
class Trace:
    """Requests as chains of key ids; a key id's parent precedes it (ids in creation order)."""

    chains: list[tuple[int, ...]]  # each request's prompt: key ids, block 0 first
    crc: list[int]  # crc32 of each key's hex (what picks its shard)
    parent: list[int]  # the block before each key in its chain; -1 for a block 0
    counted_from: int  # index of the first request whose hits are counted

    @property
    def distinct(self) -> int:
        """Distinct blocks in the trace."""
        return len(self.crc)


def build_trace(params: TrafficParams) -> Trace:
    """The seeded trace of `params`."""
    rng = random.Random(params.seed)
    crc: list[int] = []
    parent: list[int] = []
    hexes: list[str] = []

    def new_key(after: int, label: str) -> int:
        # a block key: a hash of the one before it (the prefix so far) and this block
        prev = hexes[after] if after >= 0 else ""
        digest = hashlib.blake2b(f"{prev}|{label}".encode(), digest_size=32).hexdigest()
        hexes.append(digest)
        crc.append(zlib.crc32(digest.encode()))
        parent.append(after)
        return len(crc) - 1

    def extend(chain: tuple[int, ...], count: int, label: str) -> tuple[int, ...]:
        keys = list(chain)
        for j in range(count):
            keys.append(new_key(keys[-1] if keys else -1, f"{label}:{j}"))
        return tuple(keys)

    weights = [1.0 / (rank + 1) ** params.zipf for rank in range(params.prefixes)]
    cumulative: list[float] = []
    total = 0.0
    for weight in weights:
        total += weight
        cumulative.append(total)
    prefix_chains: dict[int, tuple[int, ...]] = {}
    chains: list[tuple[int, ...]] = []
    for r in range(params.requests):
        if chains and rng.random() < params.repeat:
            earlier = chains[-rng.randint(1, min(params.repeat_window, len(chains)))]
            chain = extend(earlier, params.turn_blocks, f"r{r}")
        else:
            p = rng.choices(range(params.prefixes), cum_weights=cumulative)[0]
            if p not in prefix_chains:
                prefix_chains[p] = extend((), params.prefix_blocks, f"p{p}")
            chain = extend(prefix_chains[p], params.suffix_blocks, f"r{r}")
        chains.append(chain)
    return Trace(chains, crc, parent, counted_from=int(params.warmup * params.requests))


def shard_capacities(capacity: int, shards: int) -> list[int]:
    """Each shard's pages: C // N, plus one for the first C % N shards."""
    base, extra = divmod(capacity, shards)
    return [base + (1 if s < extra else 0) for s in range(shards)]


class ShardedLRU:
    """N one-slot stores, each an exact LRU in (last access, depth descending) order.

    Each shard is an OrderedDict in eviction order: a request's keys are (re)inserted at
    its end deepest first, so within one access time the deepest block is evicted first.
    """

    def __init__(
        self,
        capacity: int,
        shards: int,
        crc: Sequence[int],
        high: float = HIGH_WATERMARK,
        low: float = LOW_WATERMARK,
    ) -> None:
        self.capacities = shard_capacities(capacity, shards)
        self.shards: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(shards)]
        self.shard_of = [c % shards for c in crc]
        self.stored = bytearray(len(crc))  # 1: the key is in its shard
        self.high = high
        self.low = low
        self.evicted = 0

    def leading_hits(self, chain: Sequence[int]) -> int:
        """`lookup`: blocks 0..k-1 stored, the first missing block ends it."""
        stored = self.stored
        k = 0
        for key in chain:
            if not stored[key]:
                break
            k += 1
        return k

    def serve(self, chain: Sequence[int]) -> int:
        """One request: lookup, locate the hits, allocate + commit the missing blocks.

        Returns the leading hits.
        """
        stored, shard_of, shards = self.stored, self.shard_of, self.shards
        k = self.leading_hits(chain)
        wanted: dict[int, list[int]] = {}
        for key in chain[k:]:
            if not stored[key]:
                wanted.setdefault(shard_of[key], []).append(key)
        granted: set[int] = set()
        leased: set[int] | None = None
        for s, keys in wanted.items():
            lru, capacity, need = shards[s], self.capacities[s], len(keys)
            if len(lru) + need > self.high * capacity:
                if leased is None:
                    leased = set(chain[:k])
                self._evict(lru, int(self.low * capacity) - need, leased)
            room = capacity - len(lru)
            for key in keys[:room]:
                stored[key] = 1
                granted.add(key)
        # locate + commit: every touched key at this request's time, deepest last-in
        for depth in range(len(chain) - 1, -1, -1):
            key = chain[depth]
            if depth < k:
                shards[shard_of[key]].move_to_end(key)
            elif key in granted:
                shards[shard_of[key]][key] = None
        return k

    def _evict(self, lru: OrderedDict[int, None], target: int, leased: set[int]) -> None:
        """Evict from the LRU head until `len(lru) <= target`, skipping leased keys."""
        skipped: list[int] = []
        while lru and len(lru) + len(skipped) > target:
            key, _ = lru.popitem(last=False)
            if key in leased:
                skipped.append(key)
            else:
                self.stored[key] = 0
                self.evicted += 1
        for key in skipped:  # this request's hits; its touch moves them to the end
            lru[key] = None

    def orphans(self, parent: Sequence[int]) -> int:
        """Stored keys some block before which (in their chain) is not stored."""
        stored = self.stored
        loadable = bytearray(len(stored))
        orphans = 0
        for key, up in enumerate(parent):  # a parent's id precedes its child's
            if stored[key]:
                if up < 0 or loadable[up]:
                    loadable[key] = 1
                else:
                    orphans += 1
        return orphans


def simulate(
    trace: Trace,
    capacity: int,
    shards: int,
    high: float = HIGH_WATERMARK,
    low: float = LOW_WATERMARK,
) -> dict[str, Any]:
    """Run the trace through `shards` shards of `capacity` pages in all; one result row."""
    started = time.process_time()
    store = ShardedLRU(capacity, shards, trace.crc, high, low)
    hits = asked = 0
    for r, chain in enumerate(trace.chains):
        k = store.serve(chain)
        if r >= trace.counted_from:
            hits += k
            asked += len(chain)
    held = sum(store.stored)
    orphans = store.orphans(trace.parent)
    return {
        "capacity_blocks": capacity,
        "shards": shards,
        "shard_capacity": capacity // shards,  # the smaller shards' pages
        "hits": hits,
        "asked": asked,
        "hit_rate": hits / asked if asked else 0.0,
        "stored": held,
        "orphans": orphans,
        "orphan_share": orphans / held if held else 0.0,
        "evicted": store.evicted,
        "shard_held_max": max(len(lru) for lru in store.shards),
        "cpu_s": round(time.process_time() - started, 2),
    }


def sweep(
    trace: Trace,
    capacity_shares: Sequence[float],
    shard_counts: Sequence[int],
    high: float = HIGH_WATERMARK,
    low: float = LOW_WATERMARK,
) -> list[dict[str, Any]]:
    """Every (capacity, N); each row's `vs_exact` is its hit rate ÷ N = 1's at that capacity."""
    rows: list[dict[str, Any]] = []
    counts = sorted(set(shard_counts) | {1})
    for share in capacity_shares:
        capacity = max(1, round(share * trace.distinct))
        exact: float | None = None
        for n in counts:
            row = {"capacity_share": share, **simulate(trace, capacity, n, high, low)}
            if n == 1:
                exact = row["hit_rate"]
            row["vs_exact"] = row["hit_rate"] / exact if exact else None
            if n in shard_counts:
                rows.append(row)
    return rows


def render_table(rows: Sequence[dict[str, Any]], console: Console) -> None:
    """The rows as a Rich table, one column per `TABLE_COLUMNS` entry."""
    table = Table(title="Token hit rate of N-sharded LRU against exact LRU (N = 1)")
    for header in TABLE_COLUMNS:
        table.add_column(header, justify="right")
    formats = {
        "capacity_share": "{:.0%}",
        "capacity_blocks": "{:,}",
        "shard_capacity": "{:,}",
        "hit_rate": "{:.2%}",
        "vs_exact": "{:.3f}",
        "orphan_share": "{:.1%}",
        "evicted": "{:,}",
    }
    for row in rows:
        table.add_row(
            *(
                "—" if row[field] is None else formats.get(field, "{}").format(row[field])
                for field in TABLE_COLUMNS.values()
            )
        )
    console.print(table)


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The CLI: the traffic, the sweep, the output."""
    defaults = TrafficParams()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--requests", type=int, help=f"requests in the trace (default {defaults.requests})")
    add("--prefixes", type=int, help=f"distinct shared prefixes (default {defaults.prefixes})")
    add("--zipf", type=float, help=f"Zipf exponent of prefix popularity (default {defaults.zipf})")
    add("--prefix-blocks", type=int, help=f"blocks per prefix (default {defaults.prefix_blocks})")
    add(
        "--suffix-blocks",
        type=int,
        help=f"unique blocks per request (default {defaults.suffix_blocks})",
    )
    add("--repeat", type=float, help=f"probability of a later turn (default {defaults.repeat})")
    add(
        "--repeat-window",
        type=int,
        help=f"latest requests a turn continues (default {defaults.repeat_window})",
    )
    add(
        "--turn-blocks",
        type=int,
        help=f"new blocks of a later turn (default {defaults.turn_blocks})",
    )
    add(
        "--warmup",
        type=float,
        help=f"share of first requests not counted (default {defaults.warmup})",
    )
    add("--seed", type=int, help=f"trace seed (default {defaults.seed})")
    add(
        "--capacities",
        type=_floats,
        default=[0.05, 0.2, 0.5],
        help="capacity shares of the distinct blocks",
    )
    add("--shards", type=_ints, default=[1, 2, 4, 8, 16, 64], help="shard counts (1: exact LRU)")
    add("--high", type=float, default=HIGH_WATERMARK, help="high watermark")
    add("--low", type=float, default=LOW_WATERMARK, help="low watermark")
    add("--quick", action="store_true", help="a small trace (a few seconds), for tests")
    add("--json", metavar="PATH", help="write the JSON document to PATH ('-': stdout, no table)")
    return parser.parse_args(argv)


def params_of(args: argparse.Namespace) -> TrafficParams:
    """The traffic: `--quick`'s or the defaults, with the options given on top."""
    base = asdict(QUICK if args.quick else TrafficParams())
    for name in base:
        value = getattr(args, name, None)
        if value is not None:
            base[name] = value
    return TrafficParams(**base)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the trace and sweep it; the JSON document."""
    params = params_of(args)
    started = time.process_time()
    trace = build_trace(params)
    trace_cpu = time.process_time() - started
    rows = sweep(trace, args.capacities, args.shards, args.high, args.low)
    return {
        "traffic": asdict(params),
        "high_watermark": args.high,
        "low_watermark": args.low,
        "distinct_blocks": trace.distinct,
        "requests": len(trace.chains),
        "blocks_asked": sum(len(chain) for chain in trace.chains[trace.counted_from :]),
        "trace_cpu_s": round(trace_cpu, 2),
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    document = run(args)
    if args.json == "-":
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    console = Console()
    if not console.is_terminal:  # a pipe or a file: the whole table, not 80 columns of it
        console = Console(width=120)
    render_table(document["rows"], console)
    traffic = document["traffic"]
    console.print(
        f"{document['requests']:,} requests, {document['distinct_blocks']:,} distinct blocks,"
        f" {document['blocks_asked']:,} blocks asked after the first {traffic['warmup']:.0%};"
        f" seed {traffic['seed']}"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(document, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

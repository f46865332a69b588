"""`benchmarks/bench_shard_lru.py`: the sharded LRU simulation against a plain reference.

The reference below is written the obvious way (a dict of last accesses, a full sort of
a shard's keys for every eviction), so it shares no structure with the benchmark's
OrderedDict walk; tiny traces make its sorts cheap.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from rich.console import Console

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_shard_lru.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_shard_lru", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


bench = _load()

TINY = bench.TrafficParams(
    requests=400,
    prefixes=8,
    prefix_blocks=6,
    suffix_blocks=4,
    repeat=0.3,
    repeat_window=50,
    turn_blocks=2,
    warmup=0.0,
)


def reference_lru(
    chains: Sequence[tuple[int, ...]],
    shard_of: Sequence[int],
    capacities: Sequence[int],
    high: float,
    low: float,
) -> tuple[list[int], set[int]]:
    """Each request's leading hits and the keys stored at the end, computed plainly."""
    # per shard: key -> (last access, depth)
    shards: list[dict[int, tuple[int, int]]] = [{} for _ in capacities]
    hits: list[int] = []
    for t, chain in enumerate(chains):
        k = 0
        while k < len(chain) and chain[k] in shards[shard_of[chain[k]]]:
            k += 1
        leased = set(chain[:k])
        granted: list[int] = []
        for s, capacity in enumerate(capacities):
            entries = shards[s]
            new = [key for key in chain[k:] if shard_of[key] == s and key not in entries]
            if not new:
                continue
            if len(entries) + len(new) > high * capacity:
                excess = len(entries) - (int(low * capacity) - len(new))
                order = sorted(
                    (key for key in entries if key not in leased),
                    key=lambda key: (entries[key][0], -entries[key][1]),
                )
                for key in order[: max(0, excess)]:
                    del entries[key]
            granted += new[: max(0, capacity - len(entries))]
        for key in [*chain[:k], *granted]:
            shards[shard_of[key]][key] = (t, chain.index(key))
        hits.append(k)
    return hits, {key for entries in shards for key in entries}


def _run(trace: Any, capacity: int, shards: int) -> tuple[list[int], set[int], Any]:
    store = bench.ShardedLRU(capacity, shards, trace.crc)
    hits = [store.serve(chain) for chain in trace.chains]
    stored = {key for key, flag in enumerate(store.stored) if flag}
    return hits, stored, store


@pytest.mark.parametrize(
    ("seed", "capacity", "shards"),
    [(0, 40, 1), (1, 90, 1), (2, 17, 1), (3, 90, 4), (4, 60, 3)],
    ids=["seed0-c40", "seed1-c90", "seed2-c17", "seed3-c90-n4", "seed4-c60-n3"],
)
def test_simulation_matches_plain_reference_lru(seed: int, capacity: int, shards: int) -> None:
    trace = bench.build_trace(bench.TrafficParams(**{**TINY.__dict__, "seed": seed}))
    hits, stored, store = _run(trace, capacity, shards)
    ref_hits, ref_stored = reference_lru(
        trace.chains,
        store.shard_of,
        bench.shard_capacities(capacity, shards),
        bench.HIGH_WATERMARK,
        bench.LOW_WATERMARK,
    )
    assert store.evicted > 0  # the trace does exercise eviction
    assert sum(hits) > 0
    assert hits == ref_hits
    assert stored == ref_stored


def test_no_eviction_means_every_shard_count_hits_alike() -> None:
    trace = bench.build_trace(TINY)
    rows = bench.sweep(trace, [3.0], [1, 2, 4, 8, 16, 64])
    assert [row["evicted"] for row in rows] == [0] * 6
    assert {row["hits"] for row in rows} == {rows[0]["hits"]}
    assert rows[0]["hits"] > 0
    assert all(row["orphans"] == 0 and row["vs_exact"] == 1.0 for row in rows)


@pytest.mark.parametrize(("capacity", "shards"), [(1000, 64), (1321, 16), (7, 8), (50, 1)])
def test_partition_gives_each_shard_its_share(capacity: int, shards: int) -> None:
    capacities = bench.shard_capacities(capacity, shards)
    assert len(capacities) == shards
    assert sum(capacities) == capacity
    assert all(abs(c - capacity / shards) < 1 for c in capacities)


def test_shards_never_hold_more_than_their_capacity() -> None:
    trace = bench.build_trace(TINY)
    _, _, store = _run(trace, 120, 8)
    held = [len(lru) for lru in store.shards]
    assert store.evicted > 0
    assert all(h <= c for h, c in zip(held, store.capacities, strict=True))
    assert sum(held) == sum(store.stored)


def test_orphans_are_stored_blocks_past_a_missing_one() -> None:
    # chain 0 -> 1 -> 2 -> 3 and a second chain 0 -> 4: with 1 gone, 2 and 3 are orphans
    store = bench.ShardedLRU(10, 1, [0, 1, 2, 3, 4])
    for key in (0, 2, 3, 4):
        store.stored[key] = 1
    assert store.orphans([-1, 0, 1, 2, 0]) == 2


def test_trace_is_seeded() -> None:
    assert bench.build_trace(TINY).chains == bench.build_trace(TINY).chains
    other = bench.build_trace(bench.TrafficParams(**{**TINY.__dict__, "seed": 9}))
    assert other.chains != bench.build_trace(TINY).chains


def test_json_has_every_field_the_table_shows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["--quick", "--requests", "300", "--capacities", "0.2", "--shards", "1,4"]
    assert bench.main([*args, "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [row["shards"] for row in document["rows"]] == [1, 4]
    for row in document["rows"]:
        assert set(bench.TABLE_COLUMNS.values()) <= set(row)
    assert document["rows"][0]["vs_exact"] == 1.0

    console = Console(record=True, width=200)
    bench.render_table(document["rows"], console)
    text = console.export_text()
    assert all(header in text for header in bench.TABLE_COLUMNS)

    path = tmp_path / "out.json"
    assert bench.main([*args, "--json", str(path)]) == 0
    assert "hit rate" in capsys.readouterr().out

    def without_cpu(rows: list[dict[str, object]]) -> list[dict[str, object]]:
        return [{k: v for k, v in row.items() if k != "cpu_s"} for row in rows]

    assert without_cpu(json.loads(path.read_text())["rows"]) == without_cpu(document["rows"])

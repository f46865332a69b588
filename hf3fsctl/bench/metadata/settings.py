"""What a `bench metadata` run measures: its operations, modes, sizes and settings.

Contract: `MetadataSettings.check` refuses settings that cannot run with an
`InvalidRequest` naming the setting; `MetadataSettings.quick` is `--quick`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf3fsctl.bench.loopback import check_loopback_url
from hf3fsctl.config.urls import MAX_SHARDS
from hf3fsctl.errors import InvalidRequest

OPS = ("ping", "lookup", "locate", "alloc_commit", "full_1ns", "full_8ns")


FULL_OPS = ("full_1ns", "full_8ns")


MODES = ("embedded", "serve", "in-tree", "redis", "serve-redis", "redis-cluster", "redis-sharded")


# A private Redis Cluster of `CLUSTER_MASTERS` masters: `redis-cluster` holds the one-slot
# store (every key on one master), `redis-sharded` the store split into `shards` shards.
CLUSTER_MODES = ("redis-cluster", "redis-sharded")


CLUSTER_MASTERS = 3


# Modes that need a program this machine may lack: skipped (and said so) when it does.
OPTIONAL_MODES = ("in-tree", "redis", "serve-redis", *CLUSTER_MODES)


OP_LABELS = {
    "ping": "ping (1-key lookup)",
    "lookup": "lookup 1,000 keys",
    "locate": "locate 64 keys",
    "alloc_commit": "allocate + commit 64",
    "full_1ns": "full store, 1 namespace",
    "full_8ns": "full store, 8 namespaces",
}


BATCH = 64


LOOKUP_KEYS = 1000


FILL_CHUNK = 8192


URL_FILL_CHUNK = 4096  # under the server's default max_batch (8192)


PAGE_BYTES = 2 << 20  # a Llama-8B-like page: 32 layers x K,V x 8 heads x 128 x 16 x bf16


FULL_NAMESPACES = 8


UNBOUNDED_BYTES = 1 << 62  # the capacity recorded in stores that must never fill


FULL_GOAL = 1.5


@dataclass(frozen=True)
class MetadataSettings:
    """What one `bench metadata` run measures.

    Attributes:
        modes: of `MODES` (ignored when `url` is given); the cluster modes only when
            asked for.
        ops: the operations (see the module docstring); `ping` is always measured.
        clients: concurrent client processes, one cell each per operation.
        seconds: timed window of each cell.
        entries: committed keys every store is pre-filled with (and the full stores'
            capacity in pages).
        url: a running `hf3fsctl serve` to measure instead (loopback only).
        token: its bearer token.
        workers: server processes of the server this starts (`serve` mode).
        directory: where the work directory is made.
        keep: leave the work directory (and, with `url`, the namespaces) behind.
        shards: the shards of `redis-sharded`'s store (`?shards=N`), spread over the
            cluster's `CLUSTER_MASTERS` masters.
    """

    modes: tuple[str, ...] = tuple(m for m in MODES if m not in CLUSTER_MODES)
    ops: tuple[str, ...] = OPS
    clients: tuple[int, ...] = (1, 16)
    seconds: float = 3.0
    entries: int = 200_000
    url: str | None = None
    token: str | None = None
    workers: int = 1
    directory: Path | None = None
    keep: bool = False
    shards: int = 3

    @classmethod
    def quick(cls, **overrides: Any) -> MetadataSettings:
        """Short cells on a small store (about 1.5 min on 2 cores, the in-tree server included)."""
        base: dict[str, Any] = {"clients": (1, 4), "seconds": 0.3, "entries": 10_000}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def check(self) -> None:
        """Refuse settings that cannot run.

        Raises:
            InvalidRequest: naming the setting.
        """
        if not self.clients or any(c < 1 for c in self.clients):
            raise InvalidRequest(f"clients must be positive, got {list(self.clients)}")
        if max(self.clients) > 256:
            raise InvalidRequest(f"at most 256 client processes, got {max(self.clients)}")
        if not 0 < self.seconds <= 3600:
            raise InvalidRequest(f"seconds must be in (0, 3600], got {self.seconds}")
        if self.entries < LOOKUP_KEYS + BATCH:
            raise InvalidRequest(
                f"entries must be at least {LOOKUP_KEYS + BATCH} (the lookup chain and a "
                f"locate batch are read from them), got {self.entries}"
            )
        for op in self.ops:
            if op not in OPS:
                raise InvalidRequest(f"unknown operation {op!r}; one of {', '.join(OPS)}")
        for mode in self.modes:
            if mode not in MODES:
                raise InvalidRequest(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        if self.url is not None:
            check_loopback_url(self.url)
        elif not self.modes:
            raise InvalidRequest("no mode to measure: give embedded and/or serve, or --url")
        if self.workers < 1:
            raise InvalidRequest(f"workers must be at least 1, got {self.workers}")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise InvalidRequest(f"--shards must be in 1..{MAX_SHARDS}, got {self.shards}")


SCALE_MODES = ("embedded", "serve", "redis", "in-tree", *CLUSTER_MODES)


# (name, operation, keys per call) of each cell, in order: see the module docstring.
SCALE_CELLS = (("lookup", "lookup_spread", LOOKUP_KEYS), ("save", "full_1ns", BATCH))


@dataclass(frozen=True)
class ScaleSettings:
    """What one `bench metadata --entries N[,N…]` run measures.

    Attributes:
        entries: the store sizes N (each store full at N: capacity N pages).
        modes: of `SCALE_MODES`.
        clients: client processes of each cell.
        seconds: timed window of each cell.
        workers: server processes of each `serve`.
        directory: where the work directory is made.
        keep: leave the work directory behind.
        cells: (name, operation, keys per call) of the cells at each N (`--fleet`
            measures its routes with its own).
        shards: the shards of `redis-sharded`'s store.
    """

    entries: tuple[int, ...] = (100_000, 1_000_000)
    modes: tuple[str, ...] = tuple(m for m in SCALE_MODES if m not in CLUSTER_MODES)
    clients: int = 2
    seconds: float = 3.0
    workers: int = 1
    directory: Path | None = None
    keep: bool = False
    cells: tuple[tuple[str, str, int], ...] = SCALE_CELLS
    shards: int = 3

    @classmethod
    def quick(cls, **overrides: Any) -> ScaleSettings:
        """Small stores, short cells."""
        base: dict[str, Any] = {"entries": (10_000, 50_000), "seconds": 0.5}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def check(self) -> None:
        """Refuse settings that cannot run.

        Raises:
            InvalidRequest: naming the setting.
        """
        if not self.entries or min(self.entries) < LOOKUP_KEYS + BATCH:
            raise InvalidRequest(
                f"--entries: every size must be at least {LOOKUP_KEYS + BATCH}, "
                f"got {list(self.entries)}"
            )
        if max(self.entries) > 100_000_000:
            raise InvalidRequest(f"--entries: at most 10^8, got {max(self.entries):,}")
        for mode in self.modes:
            if mode not in SCALE_MODES:
                raise InvalidRequest(
                    f"--mode {mode!r} has no full-store scale run; one of {', '.join(SCALE_MODES)}"
                )
        if not self.modes:
            raise InvalidRequest("--mode: no mode to measure")
        if not 1 <= self.clients <= 256:
            raise InvalidRequest(f"--clients must be in 1..256, got {self.clients}")
        if not 0 < self.seconds <= 3600:
            raise InvalidRequest(f"--seconds must be in (0, 3600], got {self.seconds}")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise InvalidRequest(f"--shards must be in 1..{MAX_SHARDS}, got {self.shards}")

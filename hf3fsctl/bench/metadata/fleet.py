"""`bench metadata --fleet NODES`: a fleet's metadata load, measured per route, sized.

The model (docs/design.md, "Fleet sizing"): NODES × `gpus_per_node` GPUs, each
scheduling `requests_per_gpu` requests per second of `prompt_tokens` tokens, stored as
pages of `block_size` tokens (`blocks` = ⌈prompt ÷ block⌉), of which a share
`hit_ratio` is found in the store. Each scheduled request makes, on the metadata
service (the connector's data path; one rank per engine, TP 1):

- `lookup`: 1 call of `blocks` keys (the scheduler asks how much of the prompt is stored);
- `locate`: 1 call of `hit` keys (the pages to load), when any hit;
- `allocate` + `commit`: 1 call each of `miss` = `blocks − hit` keys (the pages saved),
  when any missed — measured together as `save`, on a FULL store: every allocate evicts.

The scaled-down run: each backend's store full at `entries`, then one cell per route
with exactly those key counts (`clients` processes, `seconds` each), each cell's server
CPU per call (`/proc` utime+stime of the server process; Redis: `redis-server`). The
fleet needs Σ route rate × CPU per call cores of server; one `serve` replica (one worker
process: the GIL) or one Redis shard (single-threaded) gives one core, used to
`utilization`: instances = ⌈cores ÷ utilization⌉.

JSON document (`benchmark: "metadata-fleet"`): `settings`, `model` (`blocks`, `hit`,
`miss`, `requests_per_s`), `routes[]` (`route`, `calls_per_s`, `keys_per_call`),
`measured` (the scale study's `results` at `entries`), `sizing[]` (`mode`, `instance`,
`cpu_us_per_request`, `cpu_us` per route, `cores`, `instances`,
`requests_per_s_per_instance`, `nodes_per_instance`), `skipped_modes`, `failed`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.bench.metadata.scale import run_scale
from hf3fsctl.bench.metadata.settings import ScaleSettings
from hf3fsctl.errors import InvalidRequest

FLEET_MODES = ("serve", "redis", "in-tree", "redis-sharded")
DEFAULT_FLEET_MODES = ("serve", "redis", "in-tree")  # redis-sharded when asked (a cluster)


# What one instance is: a `serve` replica or an in-tree server (one core each), a Redis
# store of its own (one core: the fleet split over separate stores), or one master of a
# sharded store (one shard each, `?shards=N`: the fleet on one store over N masters;
# its CPU per call is every master's, so it counts the cost of touching N shards).
INSTANCE = {
    "serve": "serve replicas",
    "redis": "Redis stores (one core each)",
    "in-tree": "in-tree servers",
    "redis-sharded": "Redis Cluster masters (one shard each)",
}


@dataclass(frozen=True)
class FleetSettings:
    """A fleet and the scaled-down run that prices its calls (module docstring)."""

    nodes: int = 100
    gpus_per_node: int = 8
    requests_per_gpu: float = 4.0
    prompt_tokens: int = 4096
    block_size: int = 16
    hit_ratio: float = 0.5
    utilization: float = 0.7
    entries: int = 100_000
    modes: tuple[str, ...] = DEFAULT_FLEET_MODES
    clients: int = 2
    shards: int = 3  # redis-sharded: shards on the private cluster's 3 masters, one each
    seconds: float = 3.0
    workers: int = 1
    directory: Path | None = None
    keep: bool = False

    @classmethod
    def quick(cls, **overrides: Any) -> FleetSettings:
        base: dict[str, Any] = {"entries": 20_000, "seconds": 1.0}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def check(self) -> None:
        """Raises: InvalidRequest naming the setting."""
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise InvalidRequest("--fleet and --gpus-per-node must be at least 1")
        if not 0 <= self.hit_ratio <= 1:
            raise InvalidRequest(f"--hit-ratio must be in [0, 1], got {self.hit_ratio}")
        if not 0 < self.utilization <= 1:
            raise InvalidRequest(f"--utilization must be in (0, 1], got {self.utilization}")
        if self.requests_per_gpu <= 0 or self.prompt_tokens < 1 or self.block_size < 1:
            raise InvalidRequest("--requests-per-gpu, --prompt-tokens, --block-size must be > 0")
        if self.entries < 2 * self.blocks() + 100:
            raise InvalidRequest(
                f"--entries {self.entries} is too small for {self.blocks()} blocks a prompt"
            )
        for mode in self.modes:
            if mode not in FLEET_MODES:
                raise InvalidRequest(f"--mode {mode!r}: the fleet sizes {', '.join(FLEET_MODES)}")

    def blocks(self) -> int:
        return math.ceil(self.prompt_tokens / self.block_size)

    def split(self) -> tuple[int, int]:
        """(hit, miss) blocks of a prompt."""
        hit = round(self.blocks() * self.hit_ratio)
        return hit, self.blocks() - hit


def routes(settings: FleetSettings) -> list[dict[str, Any]]:
    """Calls per second per route of the whole fleet, and keys per call."""
    requests = settings.nodes * settings.gpus_per_node * settings.requests_per_gpu
    hit, miss = settings.split()
    return [
        {"route": "lookup", "calls_per_s": requests, "keys_per_call": settings.blocks()},
        {"route": "locate", "calls_per_s": requests if hit else 0.0, "keys_per_call": hit},
        {"route": "allocate", "calls_per_s": requests if miss else 0.0, "keys_per_call": miss},
        {"route": "commit", "calls_per_s": requests if miss else 0.0, "keys_per_call": miss},
    ]


def size(settings: FleetSettings, measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instances of each backend the fleet needs, from its measured CPU per call."""
    requests = settings.nodes * settings.gpus_per_node * settings.requests_per_gpu
    hit, miss = settings.split()
    used = {"lookup": True, "locate": hit > 0, "save": miss > 0}  # save = allocate + commit
    out = []
    for row in measured:
        costs = {name: row.get(f"cpu_us_per_{name}") for name, on in used.items() if on}
        known = all(v is not None for v in costs.values())
        per_request = sum(v for v in costs.values() if v is not None) if known else None
        cores = None if per_request is None else requests * per_request / 1e6
        out.append(
            {
                "mode": row["mode"],
                "instance": INSTANCE[row["mode"]],
                "cpu_us": costs,
                "cpu_us_per_request": per_request,
                "cores": cores,
                "instances": None
                if cores is None
                else max(1, math.ceil(cores / settings.utilization)),
                "requests_per_s_per_instance": None
                if not per_request
                else settings.utilization * 1e6 / per_request,
                "nodes_per_instance": None
                if not per_request
                else settings.utilization
                * 1e6
                / per_request
                / (settings.gpus_per_node * settings.requests_per_gpu),
            }
        )
    return out


def run_fleet(
    settings: FleetSettings | None = None, progress: report.Progress | None = None
) -> dict[str, Any]:
    """Measure each route's CPU per call on full stores, then size the fleet."""
    settings = settings or FleetSettings()
    settings.check()
    hit, miss = settings.split()
    cells = [("lookup", "lookup_spread", settings.blocks())]
    if hit:
        cells.append(("locate", "locate", hit))
    if miss:
        cells.append(("save", "full_1ns", miss))
    scale = run_scale(
        ScaleSettings(
            entries=(settings.entries,),
            modes=settings.modes,
            clients=settings.clients,
            seconds=settings.seconds,
            workers=settings.workers,
            directory=settings.directory,
            keep=settings.keep,
            cells=tuple(cells),
            shards=settings.shards,
        ),
        progress=progress,
    )
    requests = settings.nodes * settings.gpus_per_node * settings.requests_per_gpu
    return {
        "benchmark": "metadata-fleet",
        "schema": report.SCHEMA,
        "machine": scale["machine"],
        "settings": {
            **{k: v for k, v in dataclasses.asdict(settings).items() if k != "directory"},
            "directory": scale["settings"]["directory"],
        },
        "model": {
            "blocks": settings.blocks(),
            "hit": hit,
            "miss": miss,
            "requests_per_s": requests,
            "instance_cores": 1,
        },
        "routes": routes(settings),
        "measured": scale["results"],
        "sizing": size(settings, scale["results"]),
        "skipped_modes": scale["skipped_modes"],
        "failed": scale["failed"],
        "seconds": scale["seconds"],
    }

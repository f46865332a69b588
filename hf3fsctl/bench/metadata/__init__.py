"""`hf3fsctl bench metadata`: ops/s and latency of the store's hot calls under load.

Operations (the connector's calls, each a cell per client count):

- `ping`: a 1-key lookup, the cheapest hot call over the same path. It is the ceiling
  every other cell of the same mode and client count is a ratio of (`ratio_to_ping`).
- `lookup`: one batched lookup of a 1,000-key chain (all committed);
- `locate`: locate 64 committed keys (with read leases);
- `alloc_commit`: allocate 64 new keys, then commit them, on a store with room;
- `full_1ns` / `full_8ns`: the same on a FULL store — its one capacity (every namespace
  shares it, DESIGN decision 5b) reached, with watermarks so close that every allocate
  evicts what it needs — whose entries and allocations are in 1 namespace, or spread
  over 8 (each call the next namespace). With 8, the least-recently-used keys are mostly
  other namespaces', so each allocate evicts across namespaces, punches their pages back
  to the file system and grows its own file (the real path: the store has a storage
  root and real growing page files). The document reports both, and the ratio of keys
  saved (committed) per second, 1 namespace over 8 — saved keys, not calls, since an
  allocate that refuses keys (no space) is fast but saves nothing; the goal is at most
  1.5. Each full-store cell starts from its own copy of the same full store, and
  reports what it evicted per call and the share of keys refused.

Every store is pre-filled with `entries` committed keys (2 MiB pages), through the store
API in big batches (8,192 keys per allocate and commit); the full stores hold exactly
their capacity. Memory: the resident set of a fresh store process (the embedded client,
or the `hf3fsctl serve` process tree) is read before and after its first lookup loads
the store (the committed-key index and SQLite's cache), divided by the entries:
bytes/entry, beside the in-tree vLLM metadata server's measured in the same run (mode
`in-tree`; none when that mode did not run).

Modes: `embedded` (`sqlite:///`, each client its own process sharing one database file,
as the workers of a node do), `serve` (a real `hf3fsctl serve` this starts on loopback,
with a token; each client its own process with its own keep-alive connection), or a
running server given by URL (loopback only; its own store, so no full-store cells, and
the benchmark's namespaces are dropped afterwards). Beside them, on stores of their own
(no full-store cells): `in-tree` (vLLM's own hf3fs metadata server, through its own
client: the reference every cell's "÷ in-tree" is measured against, in the same run and
only then — a cell without an in-tree twin in this run has no ratio),
`redis` (clients straight to a private `redis-server`), `serve-redis` (two `serve`
replicas on that Redis, clients split between them) and, only when asked,
`redis-cluster` / `redis-sharded` (a private 3-master Redis Cluster: the one-slot store,
or the store split into `shards` shards; the server CPU is every master's, and each row
gives the busiest master's share of it); a mode whose program is missing
here is skipped and listed in `skipped_modes`. Clients are processes, not threads,
so client-side Python shares no GIL with the server or with each other; on a 2-core
machine they share the cores with the server, so the figures include the clients' CPU.
Each cell runs for `seconds` after every client is connected and warmed up.

Rooms: `settings` (operations, modes, `MetadataSettings`), `stores` (keys, manifests,
filling and copying stores), `children` (forked set-up children), `processes` (`hf3fsctl
serve` servers, RSS), `cells` (one timed cell), `figures` (ratios, memory, the full-store
comparison), `run` (the document), `scale` (`--entries N[,N…]`: every backend's store
full at each N, its own document, keys documented there), `fleet` (`--fleet NODES`:
a fleet's calls per route, priced by the scale study's cells, sized). The peers it measures beside its own store are in
`hf3fsctl.bench.peers`; the tables and the plot are the CLI's (`hf3fsctl.cli.bench_metadata`).
"""

from hf3fsctl.bench.loopback import check_loopback_url
from hf3fsctl.bench.metadata.cells import cutoff_s, measure
from hf3fsctl.bench.metadata.fleet import FLEET_MODES, FleetSettings, run_fleet
from hf3fsctl.bench.metadata.processes import rss_bytes
from hf3fsctl.bench.metadata.run import run
from hf3fsctl.bench.metadata.scale import run_scale
from hf3fsctl.bench.metadata.settings import (
    FULL_GOAL,
    FULL_OPS,
    MODES,
    OP_LABELS,
    OPS,
    PAGE_BYTES,
    SCALE_MODES,
    MetadataSettings,
    ScaleSettings,
)
from hf3fsctl.bench.metadata.stores import (
    StoreSpec,
    bench_manifest,
    bench_rank_file,
    fill_spec,
    key,
)

__all__ = [
    "FLEET_MODES",
    "FULL_GOAL",
    "FULL_OPS",
    "MODES",
    "OPS",
    "OP_LABELS",
    "PAGE_BYTES",
    "SCALE_MODES",
    "FleetSettings",
    "MetadataSettings",
    "ScaleSettings",
    "StoreSpec",
    "bench_manifest",
    "bench_rank_file",
    "check_loopback_url",
    "cutoff_s",
    "fill_spec",
    "key",
    "measure",
    "rss_bytes",
    "run",
    "run_fleet",
    "run_scale",
]

"""`hf3fsctl bench`: load tests of every layer, each against the ceiling it is measured by.

One room per sub-command — `storage` (page I/O against the file system's own sequential
ceiling), `metadata/` (ops/s and latency of the store's calls under concurrent clients,
embedded or against a server, beside vLLM's in-tree server), `e2e/` (a prefix-repetition
workload through vLLM against no connector, peers and vLLM's own prefix cache) — each
exposing `run(settings, progress) -> dict`: one JSON document (settings, figures, the
ceiling and every figure's ratio to it, all measured in the same run). What they share
is here once: `report` (the document's frame, parsing, statistics), `loopback`
(loopback-only URLs, free ports), `peers/` (the other servers measured: vLLM's in-tree
metadata server, Redis, LMCache). Tables and plots are the CLI's
(`hf3fsctl/cli/bench_*.py`); `benchmarks/` scripts are thin callers.

Benchmarks are bounded in time and use loopback only. Nothing here imports the CLI, and
nothing in the connector or the core library imports this.
"""

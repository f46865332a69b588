"""`hf3fsctl bench`: load tests of every layer, each against the ceiling it is measured by.

One module per sub-command — `storage` (page I/O against the file system's own
sequential ceiling), `metadata` (ops/s and latency of the store's calls under concurrent
clients, embedded or against a server), `e2e` (a prefix-repetition workload through
vLLM against no connector, peers and vLLM's own prefix cache) — each exposing
`run(...) -> dict` (one JSON document: settings, figures, the ceiling and every figure's
ratio to it), `render(document)` (Rich tables) and `plot(document, path)` (a PNG).
`report.py` holds what they share. `benchmarks/` scripts are thin callers.

Benchmarks are bounded in time and use loopback only. Nothing here is imported by the
connector or the core library.
"""

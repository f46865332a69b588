"""End-to-end benchmark: a prefix-repetition workload through real vLLM, against its ceilings.

The workload is vLLM's `prefix_repetition` dataset shape: `prefixes` random shared
prefixes of `prefix_tokens` tokens, each followed by `suffixes` distinct random suffixes
of `suffix_tokens` tokens (token ids, so no tokenizer round trip), shuffled with a seed,
`output_tokens` greedy tokens each (`ignore_eos`). Every configuration is a fresh engine
process (`hf3fsctl.vllm_tools.runner`), so "warm" really means another process reading the
store:

- `none`: no connector (vLLM's own prefix cache is on, as it always is). It is pass 1
  of a process that then runs the same prompts again:
- `floor`: pass 2 of that process: every prompt hits vLLM's own prefix cache in the
  same process. No connector can load faster than this, so it is the ceiling of TTFT.
- `cold`: our connector on an empty store (prefill + asynchronous save). Its prefill
  throughput is measured against `none` (the goal: within 10%).
- `warm`: our connector, a fresh process on the same store: loads instead of prefill.
- `warm-dropped` (`drop_page_cache`): `warm` after the store's files were dropped from
  the page cache; `warm-async` (`warm_async`): `warm` with `connector.load_mode=async`.
- `example-cold` / `example-warm` (`peers=("example",)`): vLLM's `ExampleConnector`.
- `lmcache-cold` / `lmcache-warm` (`peers=("lmcache",)`): LMCache's multiprocess server
  mode (docs/vllm.md's recipe), only when the `lmcache` package is importable here. It
  needs vLLM's multiprocess engine, so it is measured against `none-mp` / `floor-mp`,
  the same two passes in that engine mode, with `VLLM_CPU_NUM_OF_RESERVED_CPU=1` in
  every run so each engine gets the same cores (the thread-binding trap).

Our store is made the way a user makes one: `hf3fsctl init --storage-path DIR
--write-config C` then `hf3fsctl vllm-config --config C` (subprocesses, embedded SQLite
metadata), private to the run and removed after it.

Figures per configuration: TTFT p50/p99 (vLLM's per-request `first_token_latency`,
arrival to first token; all requests arrive together unless `sequential`), throughput
(requests/s, output and total tokens/s over the timed `generate()`), prefill throughput
(prompt tokens served per second of the prefill window: arrival to the last first
token, or the sum of TTFTs when sequential), hit rate (vLLM's `num_cached_tokens` over
prompt tokens), the connector's own hit rate, and a hash of the outputs, which must
equal `none`'s. Each figure also appears as a ratio to its ceiling from the same run:
TTFT to `floor`, throughput to `none`.

`url=http://127.0.0.1:PORT` drives a running OpenAI-compatible vLLM server on loopback
instead (streamed `/v1/completions`, httpx): the workload twice, `server` then
`server-repeat`, whose prompts hit the server's own prefix cache (its floor).

`run(settings, progress) -> dict` is the one JSON document; the tables and the plot are
the CLI's (`hf3fsctl.cli.bench_e2e`). Nothing here imports vLLM: engines run in child
processes.

Rooms: `settings` (workload, configurations, settings), `samples` (figures of one
configuration), `engines` (model, sizing, the private store), `offline` (the engine
runs), `url` (a running server), `document` (figures and ratios), `admission`
(`--admission N`: store_after_hits N vs storing all, its own workload and section), `run`. LMCache's
server is a peer: `hf3fsctl.bench.peers.lmcache`.
"""

from hf3fsctl.bench.e2e.engines import auto_kv_cache_bytes, auto_max_model_len, make_store
from hf3fsctl.bench.e2e.run import run
from hf3fsctl.bench.e2e.samples import percentile
from hf3fsctl.bench.e2e.settings import (
    GOAL_COLD_PREFILL,
    LABELS,
    PEERS,
    E2ESettings,
    Workload,
    default_work_dir,
    prefix_repetition_prompts,
    quick_settings,
)
from hf3fsctl.bench.loopback import check_loopback_url
from hf3fsctl.bench.peers.lmcache import lmcache_available

__all__ = [
    "GOAL_COLD_PREFILL",
    "LABELS",
    "PEERS",
    "E2ESettings",
    "Workload",
    "auto_kv_cache_bytes",
    "auto_max_model_len",
    "check_loopback_url",
    "default_work_dir",
    "lmcache_available",
    "make_store",
    "percentile",
    "prefix_repetition_prompts",
    "quick_settings",
    "run",
]

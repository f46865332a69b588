"""vLLM KV connector for hf3fsctl (installed as `hf3fsctl_connector`).

Use it by name (the `vllm.general_plugins` entry point registers it) or by module path:

    KVTransferConfig(
        kv_connector="Hf3fsctlConnector",
        kv_role="kv_both",
        kv_connector_module_path="hf3fsctl_connector.connector",  # optional with the plugin
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "config_file": "/etc/hf3fsctl/config.yaml",  # optional; else the search order
            "storage.path": "/mnt/3fs/kv",                # any dotted config key overrides
            "metadata.url": "http://meta:18765",
        },
    )

Modules: `connector` (the facade), `scheduler` / `worker` (the two sides), `jobs` (the
background halves of loads and saves), `metadata` (per-step and per-request
dataclasses), `namespace` (settings and the namespace manifest from vLLM's config),
`geometry` (KV tensors as byte segments), `service` (metadata calls with backoff),
`stats` (vLLM stats, Prometheus, process totals), `plugin` (registration).

Hooks for tests and benchmarks (in-process vLLM, `VLLM_ENABLE_V1_MULTIPROCESSING=0`):

- `hf3fsctl_connector.process_totals() -> dict`: cumulative counters of every
  connector side in this process (`hit_blocks`, `hit_tokens`, `blocks_loaded`,
  `bytes_loaded`, `blocks_saved`, `bytes_saved`, `save_existing`, `save_dropped`,
  `misses`, `lookups`, `failed_<kind>` for kinds not_found (a load's key, or a
  save's namespace the store no longer knows: registered again), io, checksum, timeout,
  pool_exhausted, reused, metadata_down, no_space, disabled, paused, error;
  `failed_blocks`, `load_gbps`, `save_gbps`). Never reset. Same as `hf3fsctl_connector.stats.process_totals()`.
- `hf3fsctl_connector.wait_for_saves(timeout_s) -> bool`: block until no save is in
  flight in this process (saves are asynchronous; `LLM.generate` returns before they
  are committed). Engine shutdown also drains them.

This package imports nothing heavy at import time (the plugin runs in every vLLM
process); the functions above import vLLM/torch when called.
"""

from __future__ import annotations


def process_totals() -> dict[str, float]:
    """Cumulative connector counters of this process (see the module docstring)."""
    from .stats import process_totals as totals

    return totals()


def wait_for_saves(timeout_s: float = 30.0) -> bool:
    """Wait until no save is in flight in this process; True if none is left."""
    from .worker import wait_for_saves as wait

    return wait(timeout_s)

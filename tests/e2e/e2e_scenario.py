"""What the end-to-end tests run: prompt shapes, store builders, page corruption.

Constants describe the session's prompt set (see `conftest.py`); `make_store` writes a
small store's config; `corrupt_committed_pages` flips bytes of stored pages on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf3fsctl.vllm_tools.runner import hf3fsctl_kv_config

# The model's own dtype. vLLM's "auto" would run an fp32 checkpoint in bfloat16, which
# this CPU (no AVX512-BF16) emulates slowly.
DTYPE = "float32"
BLOCK = 32  # tokens per block (CPU attention needs a multiple of 32)
PREFIX, SUFFIX = 1500, 300  # three long prompts sharing a 1,500-token prefix
SHORT = 20  # shorter than one block: nothing to save or load
EXACT_BLOCKS = 4  # a prompt of exactly 4 blocks: the last token is never loaded
STEP_BUDGET = 512  # max_num_batched_tokens: every long prompt is prefilled in chunks
RUN_TIMEOUT_S = 240.0
BOUNDED_RUN_S = 120.0  # runs that could loop or hang on a fault: fail sooner
# One CPU left to another process: what `bench e2e` gives its engines
# (`bench.e2e.settings.ENGINE_ENV`) and the OpenAI server test its engines (conftest's
# `reserved_cpu_zygote` forks runs with it).
RESERVED_CPU = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
# Indexes into `prompts`.
LONG = (0, 1, 2)
SHORT_IDX, EXACT_IDX = 3, 4


@dataclass(frozen=True)
class E2EStore:
    """A store the connector writes: its config file and the runs' extra config."""

    root: Path
    config_file: Path
    extra: dict[str, Any]

    def kv_config(self) -> dict[str, Any]:
        """`kv_transfer_config` that points our connector at this store."""
        return hf3fsctl_kv_config(self.extra)


def make_store(
    directory: Path, *, root: Path | None = None, metadata: dict[str, Any] | None = None
) -> E2EStore:
    """A config file for a small store under `directory` (embedded SQLite by default).

    Args:
        directory: where the config (and the embedded database) go.
        root: the storage root; default `directory/storage`.
        metadata: `metadata.*` settings over the embedded default.
    """
    root = root or directory / "storage"
    config_file = directory / "hf3fs.yaml"
    lines = [
        "storage:",
        f"  path: {root}",
        "  file_size: 64MiB",
        "  preallocate: false",
        "  io_threads: 2",
        "metadata:",
    ]
    metadata = {"url": f"sqlite:///{directory / 'metadata.db'}", **(metadata or {})}
    lines += [f"  {key}: {value}" for key, value in metadata.items()]
    directory.mkdir(parents=True, exist_ok=True)
    config_file.write_text("\n".join(lines) + "\n")
    return E2EStore(root, config_file, {"config_file": str(config_file)})


def corrupt_committed_pages(store: E2EStore) -> int:
    """Flip 16 bytes inside every committed page of the store; returns pages hit."""
    from hf3fsctl.config import load_config
    from hf3fsctl.meta.client import connect

    client = connect(load_config(store.config_file, environ={}))
    corrupted = 0
    try:
        for namespace in client.namespaces():
            files = {r.rank: r for r in namespace.rank_files}
            entries = client.list_entries(namespace.id, limit=100_000)
            for entry in entries:
                if entry.state != "committed":
                    continue
                rank_file = files[entry.rank]
                with open(store.root / rank_file.path, "r+b") as handle:
                    offset = entry.page * rank_file.slot_bytes + entry.size // 2
                    handle.seek(offset)
                    old = handle.read(16)
                    handle.seek(offset)
                    handle.write(bytes(b ^ 0xFF for b in old))
                corrupted += 1
    finally:
        client.close()
    return corrupted

"""Builders of the numerics e2e tests (issue 16): stores whose config carries the serving
engines' args (`vllm:`), the real CLI, prompt files, and a page swapped for another
key's page with its checksum rewritten to match (what a checksum cannot catch)."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e_scenario import BLOCK, RUN_TIMEOUT_S
from helpers.cli_runner import run_hf3fsctl

DTYPE = "bfloat16"  # rounding-level differences are realistic in bf16
# The serving engines' args every store's config carries (eager, like the test engines).
SERVING_ARGS: dict[str, Any] = {
    "dtype": DTYPE,
    "block_size": BLOCK,
    "enforce_eager": True,
    "kv_cache_memory_bytes": "64MiB",
    "max_model_len": 4096,
}
WORDS = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "kappa", "theta"]


@dataclass(frozen=True)
class NumericsStore:
    root: Path
    config_file: Path


def make_numerics_store(
    directory: Path, engine_args: dict[str, Any] | None = None
) -> NumericsStore:
    """A store made by `hf3fsctl init`, its config holding a `vllm:` section."""
    config = directory / "hf3fs.yaml"
    cli(
        "init",
        "--storage-path",
        str(directory / "store"),
        "--create-path",
        "--write-config",
        str(config),
    )
    args = SERVING_ARGS if engine_args is None else engine_args
    text = config.read_text().replace("\nvllm: {}\n", "\n")  # init's empty section
    lines = "".join(f"  {key}: {json.dumps(value)}\n" for key, value in args.items())
    config.write_text(text + "vllm:\n" + lines)
    return NumericsStore(directory / "store", config)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`hf3fsctl ARGS` as a fresh process (`helpers.cli_runner`: the CLI zygote's child)."""
    return run_hf3fsctl(*args, timeout=RUN_TIMEOUT_S, check=check)


def cli_json(*args: str, check: bool = True) -> tuple[int, dict[str, Any]]:
    done = cli(*args, "--json", check=check)
    return done.returncode, json.loads(done.stdout)


def prompt_file(path: Path, seed: int, count: int = 3) -> Path:
    """`count` prompts sharing a long prefix, one per line (~20 blocks each)."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n))

    shared = words(120)
    path.write_text("".join(f"{shared} {words(40)}\n" for _ in range(count)))
    return path


def swap_page(store: NumericsStore) -> str:
    """Overwrite one committed page with another key's page and rewrite its checksum to
    that page's: the entry passes every checksum, but holds other tokens' KV. Returns
    the swapped key."""
    db = sqlite3.connect(store.root / "metadata.db")
    try:
        rows = db.execute(
            "SELECT e.key, e.page, e.checksum, e.depth, r.path, r.slot_bytes, r.page_bytes"
            " FROM entries e JOIN rank_files r ON r.namespace = e.namespace AND r.rank = e.rank"
            " WHERE e.state = 1 ORDER BY e.depth, e.key"
        ).fetchall()
        (key, page, _, _, path, slot, size) = rows[1]  # depth 0 or 1
        (_, other_page, other_checksum, _, _, _, _) = rows[-1]  # the deepest: other tokens
        with open(store.root / path, "r+b") as handle:
            handle.seek(other_page * slot)
            data = handle.read(size)
            handle.seek(page * slot)
            handle.write(data)
        db.execute("UPDATE entries SET checksum = ? WHERE key = ?", (other_checksum, key))
        db.commit()
    finally:
        db.close()
    return str(key)

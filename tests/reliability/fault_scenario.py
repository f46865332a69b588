"""What the fault campaign runs, and the faults it injects.

- `make_prompts`: text prompts sharing a prefix (`hf3fsctl warm` reads them from a
  file) and their token ids as vLLM tokenizes them (the engine runs get the ids, so
  block counts are exact and every run compares to one baseline).
- `make_store`: a config file for a store under a directory (embedded SQLite unless told
  otherwise), `Store.kv_config()` for vLLM, `Store.db()` for direct looks at SQLite,
  `invariants(db_path)` for the store's own consistency check.
- `spawn_engine` / `EngineProcess`: one real vLLM engine in a child process
  (`hf3fsctl.vllm_tools.runner`) that the test can SIGKILL or run beside another;
  `EngineProcess.result()` gives the same `EngineResult` as `run_engine`. Forked from
  the session's engine zygote when the run is eligible (as `run_engine` does), else a
  fresh `python -m` start.
- Page faults on disk: `flip_bytes`, `swap_pages`, `truncate_file`.
- `cli`: the real `hf3fsctl` command as a fresh process (`helpers.cli_runner`).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from helpers.cli_runner import run_hf3fsctl
from helpers.forked_child import ForkedChild, fork_if_eligible

from hf3fsctl.vllm_tools import zygote
from hf3fsctl.vllm_tools.runner import (
    EngineResult,
    EngineRun,
    PassResult,
    RequestResult,
    child_env,
    hf3fsctl_kv_config,
)

DTYPE = "float32"  # the tiny model's own dtype (bf16 is emulated slowly on this CPU)
BLOCK = 32  # tokens per block (CPU attention needs a multiple of 32)
STEP_BUDGET = 512  # max_num_batched_tokens: long prompts prefill in chunks, saves overlap
RUN_TIMEOUT_S = 240.0
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "sigma"]
PROMPTS = 6  # prompts of the set
PREFIX_WORDS, SUFFIX_WORDS = 200, 260  # ~850 + ~1,100 tokens


@dataclass(frozen=True)
class Prompts:
    """One prompt set as text and as the token ids vLLM makes of it."""

    texts: list[str]
    token_ids: list[list[int]]

    def full_blocks(self) -> int:
        """Distinct full blocks of the set (shared prefixes count once): keys it stores."""
        return len(
            {
                tuple(ids[: (b + 1) * BLOCK])
                for ids in self.token_ids
                for b in range(len(ids) // BLOCK)
            }
        )


def make_prompts(model: Path, seed: int = 11) -> Prompts:
    """`PROMPTS` prompts: one shared random-word prefix, distinct suffixes."""
    from hf3fsctl.prompt_keys import load_tokenizer, tokenize

    rng = random.Random(seed)

    def words(count: int) -> str:
        return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(count))

    prefix = words(PREFIX_WORDS)
    texts = [f"{prefix} {words(SUFFIX_WORDS)}" for _ in range(PROMPTS)]
    tokenizer = load_tokenizer(str(model))
    return Prompts(texts, [list(tokenize(tokenizer, text)) for text in texts])


def engine_run(
    model: Path, prompts: Prompts, kv_transfer_config: dict[str, Any] | None, **overrides: Any
) -> EngineRun:
    """An engine run of the prompt set's token ids, batched under chunked prefill."""
    spec: dict[str, Any] = {
        "model": str(model),
        "prompts": prompts.token_ids,
        "max_tokens": 8,
        "block_size": BLOCK,
        "dtype": DTYPE,
        "kv_transfer_config": kv_transfer_config,
        "kv_cache_memory_bytes": 64 << 20,
        "max_model_len": 4096,
        "batch": True,
        "max_num_batched_tokens": STEP_BUDGET,
        "warmup_tokens": 0,  # no unrelated blocks in the store: its keys are the set's
        "timeout_s": RUN_TIMEOUT_S,
    }
    return EngineRun(**(spec | overrides))


@dataclass(frozen=True)
class Store:
    """A store the connector writes: its directory, config file and storage root."""

    directory: Path
    config_file: Path
    root: Path
    db_path: Path | None  # the SQLite file (embedded, or the one a test's serve uses)

    def kv_config(self) -> dict[str, Any]:
        """`kv_transfer_config` for our connector on this store."""
        return hf3fsctl_kv_config({"config_file": str(self.config_file)})

    def db(self) -> sqlite3.Connection:
        """A read connection to the store's SQLite file (the test closes it)."""
        assert self.db_path is not None
        return sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30)

    def counts(self) -> dict[str, int]:
        """Entries by state (`committed`, `pending`), and `free` pages."""
        with self.db() as conn:
            rows = dict(conn.execute("SELECT state, COUNT(*) FROM entries GROUP BY state"))
            free = conn.execute("SELECT COUNT(*) FROM free_pages").fetchone()[0]
        return {"committed": rows.get(1, 0), "pending": rows.get(0, 0), "free": int(free)}


def invariants(db_path: Path | None) -> list[str]:
    """`MetadataStore.check_invariants()` of a SQLite store (opened and closed here)."""
    from hf3fsctl.meta.sqlite.store import MetadataStore

    assert db_path is not None
    store = MetadataStore(db_path)
    try:
        return store.check_invariants()
    finally:
        store.close()


def make_store(
    directory: Path,
    *,
    metadata: dict[str, Any] | None = None,
    db_path: Path | None = None,
) -> Store:
    """A config file for a store under `directory` (embedded SQLite by default).

    Args:
        directory: where the config, the storage root and the embedded database go.
        metadata: `metadata.*` settings over the embedded default.
        db_path: the SQLite file behind an `http://` URL (for direct inspection).
    """
    root = directory / "storage"
    embedded = directory / "metadata.db"
    settings = {"url": f"sqlite:///{embedded}", **(metadata or {})}
    lines = ["storage:", f"  path: {root}", "  io_threads: 2", "metadata:"]
    lines += [f"  {key}: {value}" for key, value in settings.items()]
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "hf3fs.yaml"
    config.write_text("\n".join(lines) + "\n")
    is_embedded = str(settings["url"]).startswith("sqlite:")
    return Store(directory, config, root, embedded if is_embedded else db_path)


# --- engines the test controls -----------------------------------------------------


@dataclass
class EngineProcess:
    """A vLLM engine child process (`python -m hf3fsctl.vllm_tools.runner SPEC OUT`, or
    the same forked from the session's engine zygote)."""

    process: subprocess.Popen[str] | ForkedChild
    out_path: Path
    stderr_path: Path

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def result(self, timeout_s: float = RUN_TIMEOUT_S) -> EngineResult:
        """Wait for the run and parse what it wrote (raises on a failed run)."""
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"engine passed {timeout_s} s:\n{self.stderr()}") from None
        if code != 0 or not self.out_path.is_file():
            raise AssertionError(f"engine exited {code}:\n{self.stderr()}")
        data = json.loads(self.out_path.read_text())
        return EngineResult(
            requests=[RequestResult(**r) for r in data["requests"]],
            engine_start_s=data["engine_start_s"],
            generate_s=data["generate_s"],
            wall_s=0.0,
            connector=data["connector"],
            connector_totals=data["connector_totals"],
            engine_info=data["engine_info"],
            pass_results=[
                PassResult([RequestResult(**r) for r in p["requests"]], p["generate_s"])
                for p in data.get("passes", [])
            ],
        )

    def stderr(self, lines: int = 60) -> str:
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def spawn_engine(run: EngineRun, directory: Path) -> EngineProcess:
    """Start `run` in a fresh process (the environment `run_engine` gives it): a child of
    the session's engine zygote when `zygote.eligible` says it runs as a fresh start
    would (~3 s instead of ~10-15 s of vLLM import first), else `python -m`."""
    directory.mkdir(parents=True, exist_ok=True)
    spec, out, err = directory / "spec.json", directory / "out.json", directory / "stderr.log"
    spec.write_text(json.dumps(asdict(run)))
    env = child_env(run.env)  # in-process vLLM, offline, no PYTHONHASHSEED
    forked = fork_if_eligible(zygote.RUNNER, [str(spec), str(out)], env, asdict(run), directory)
    if forked is not None:
        return EngineProcess(forked, out, err)
    with err.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "hf3fsctl.vllm_tools.runner", str(spec), str(out)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
    return EngineProcess(process, out, err)


# --- faults on disk ------------------------------------------------------------------


@dataclass(frozen=True)
class StoredPage:
    """Where one committed entry's bytes are."""

    key: str
    file: Path
    offset: int
    size: int


def committed_pages(store: Store) -> list[StoredPage]:
    """Every committed entry of the store's SQLite file, with its page's place on disk."""
    with store.db() as conn:
        rows = conn.execute(
            "SELECT e.key, r.path, e.page * r.slot_bytes, e.size FROM entries e"
            " JOIN rank_files r ON r.namespace = e.namespace AND r.rank = e.rank"
            " WHERE e.state = 1 ORDER BY r.path, e.page"
        ).fetchall()
    return [StoredPage(key, store.root / path, offset, size) for key, path, offset, size in rows]


def flip_bytes(page: StoredPage, count: int = 16) -> None:
    """Invert `count` bytes in the middle of the page."""
    with page.file.open("r+b") as handle:
        handle.seek(page.offset + page.size // 2)
        old = handle.read(count)
        handle.seek(page.offset + page.size // 2)
        handle.write(bytes(b ^ 0xFF for b in old))


def swap_pages(a: StoredPage, b: StoredPage) -> None:
    """Exchange the bytes of two pages (each entry now points at the other's data)."""
    with a.file.open("r+b") as fa, b.file.open("r+b") as fb:
        fa.seek(a.offset)
        data_a = fa.read(a.size)
        fb.seek(b.offset)
        data_b = fb.read(b.size)
        fa.seek(a.offset)
        fa.write(data_b)
        fb.seek(b.offset)
        fb.write(data_a)


def truncate_file(page: StoredPage) -> None:
    """Cut the page's file half-way through the page (a torn tail: it and all after it)."""
    os.truncate(page.file, page.offset + page.size // 2)


def cli(*args: str, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`hf3fsctl ARGS` as a fresh process (`helpers.cli_runner`; not checked)."""
    return run_hf3fsctl(*args, timeout=timeout_s)


def scrub(config: Path) -> list[dict[str, Any]]:
    """`hf3fsctl doctor --checksums --all-pages --json`: the checksum checks' results."""
    done = cli("doctor", "--config", str(config), "--checksums", "--all-pages", "--json")
    document = json.loads(done.stdout)
    checks = document["checks"] if isinstance(document, dict) else document
    return [c for c in checks if str(c.get("name", "")).startswith("checksums")]

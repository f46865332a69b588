"""Crash the engine: kill -9 of a vLLM process in the middle of its saves.

A real vLLM engine (`fault_scenario.spawn_engine`) prefills the prompt set with our
connector on an empty embedded store whose allocations have a 2 s deadline
(`metadata.pending_timeout_s`). The test watches the store's SQLite file and SIGKILLs
the engine the moment some pages are committed and others are allocated but not yet
committed (a save in flight). Then:

- the kill left allocations pending (the fault really cut saves);
- every committed entry points at a page whose bytes match its checksum
  (`hf3fsctl doctor --checksums --all-pages`), and the store is sound;
- the next engine, started after the deadline, hits what was committed and gives the
  no-connector tokens; the dead engine's pending pages came back (granted again to the
  keys they were allocated for) and the store ends with one page per block, none
  pending, none leaked.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_scenario import (
    Prompts,
    Store,
    engine_run,
    invariants,
    make_store,
    scrub,
    spawn_engine,
)

from hf3fsctl.vllm_tools.runner import EngineResult, run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PENDING_S = 2.0  # metadata.pending_timeout_s: a dead writer's pages come back after this
ATTEMPTS = 3  # engine runs tried until a kill lands with a save in flight
POLL_S = 0.002


@dataclass(frozen=True)
class Killed:
    """A store whose writer was SIGKILLed mid-save."""

    store: Store
    at_kill: dict[str, int]  # entry counts the test saw just before the kill
    pending: dict[str, int]  # key → page of the allocations the kill left pending
    committed: int  # committed entries after the kill
    killed_at: float  # time.time() of the kill


def _pending(store: Store) -> dict[str, int]:
    with store.db() as conn:
        return dict(conn.execute("SELECT key, page FROM entries WHERE state = 0"))


def _kill_mid_save(model: Path, prompts: Prompts, directory: Path) -> Killed:
    store = make_store(directory, metadata={"pending_timeout_s": PENDING_S})
    engine = spawn_engine(engine_run(model, prompts, store.kv_config()), directory / "run")
    seen: dict[str, int] = {}
    try:
        while engine.process.poll() is None:
            if store.db_path is not None and store.db_path.exists():
                try:
                    seen = store.counts()
                except sqlite3.Error:  # the schema is being created
                    seen = {}
                if seen.get("pending", 0) > 0 and seen.get("committed", 0) > 0:
                    break
            time.sleep(POLL_S)
    finally:
        engine.kill()
    killed_at = time.time()
    if store.db_path is None or not store.db_path.exists():
        return Killed(store, seen, {}, 0, killed_at)
    return Killed(store, seen, _pending(store), store.counts()["committed"], killed_at)


@pytest.fixture(scope="module")
def killed(
    fault_model: Path, fault_prompts: Prompts, tmp_path_factory: pytest.TempPathFactory
) -> Killed:
    """The first of up to `ATTEMPTS` engine runs whose kill left a save in flight."""
    for attempt in range(ATTEMPTS):
        result = _kill_mid_save(
            fault_model, fault_prompts, tmp_path_factory.mktemp(f"crash-{attempt}")
        )
        if result.pending and result.committed:
            break
    record = {"attempts": attempt + 1, "at_kill": result.at_kill, "pending": len(result.pending)}
    (result.store.directory / "killed.json").write_text(json.dumps(record))
    return result


@pytest.fixture(scope="module")
def next_engine(fault_model: Path, fault_prompts: Prompts, killed: Killed) -> EngineResult:
    """A fresh engine on the crashed store, once the dead writer's deadline has passed."""
    # Every allocation the dead engine made has a deadline before this.
    time.sleep(max(0.0, killed.killed_at + PENDING_S + 0.2 - time.time()))
    return run_engine(engine_run(fault_model, fault_prompts, killed.store.kv_config()))


def test_kill_left_saves_in_flight(killed: Killed) -> None:
    assert killed.committed > 0 and len(killed.pending) > 0


def test_no_committed_entry_points_at_an_unwritten_page(killed: Killed) -> None:
    checks = scrub(killed.store.config_file)
    assert checks and all(c["status"] == "ok" for c in checks), checks
    assert f"({killed.committed} read)" in " ".join(c["detail"] for c in checks)


def test_store_is_sound_after_the_engine_died(killed: Killed) -> None:
    assert invariants(killed.store.db_path) == []


def test_next_engine_gives_the_no_connector_tokens(
    next_engine: EngineResult, baseline: EngineResult
) -> None:
    assert next_engine.outputs == baseline.outputs


def test_next_engine_hits_what_was_committed(next_engine: EngineResult) -> None:
    assert next_engine.connector is not None
    assert next_engine.connector["hit_tokens"] > 0


def test_dead_engines_pending_pages_come_back(next_engine: EngineResult, killed: Killed) -> None:
    with killed.store.db() as conn:
        committed = dict(conn.execute("SELECT key, page FROM entries WHERE state = 1"))
    # Each key the dead engine held pending was granted again, with the same page.
    assert {key: committed.get(key) for key in killed.pending} == killed.pending


def test_store_ends_with_one_page_per_block(
    next_engine: EngineResult, killed: Killed, fault_prompts: Prompts
) -> None:
    counts = killed.store.counts()
    with killed.store.db() as conn:
        high_water = conn.execute("SELECT SUM(next_unused) FROM rank_files").fetchone()[0]
    assert counts["pending"] == 0
    assert counts["committed"] == fault_prompts.full_blocks()
    assert high_water == counts["committed"] + counts["free"]

"""Concurrent writers of the same keys: metadata clients, and two vLLM engines at once.

- Several spawned processes allocating, committing, locating and evicting the same and
  their own keys against one database (embedded) or one server: the store stays sound
  and every acknowledged commit is either still there or was logged as evicted.
- Two vLLM engines started together on one empty store with the same prompts: one
  stored copy per key (committed entries = the set's distinct full blocks), no page
  leaked or left pending, every page verifies, and both give the no-connector tokens.
"""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fault_scenario import (
    Prompts,
    Store,
    engine_run,
    invariants,
    make_store,
    scrub,
)
from helpers.meta_builders import register
from helpers.meta_workload import run_worker
from helpers.servers import TOKEN, start_server

from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.vllm_tools.runner import EngineResult, run_engine

ENGINES = 2


def _evicted_keys(db_path: Path) -> set[str]:
    with sqlite3.connect(db_path) as conn:
        return {row[0] for row in conn.execute("SELECT key FROM changes WHERE delta < 0")}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["embedded", "server"], ids=["embedded", "server"])
def test_concurrent_processes_keep_store_sound(tmp_path: Path, mode: str) -> None:
    db_path = tmp_path / "meta.db"
    store = MetadataStore(db_path)
    ns = register(store, num_pages=40)  # small: allocate evicts under pressure
    server = None
    url, token = f"sqlite:///{db_path}", None
    if mode == "server":
        server = start_server(tmp_path / "server", token=TOKEN, db_path=db_path)
        url, token = server.url, TOKEN
    try:
        context = multiprocessing.get_context("spawn")
        with context.Pool(3) as pool:
            results = pool.starmap(run_worker, [(url, token, ns, w, 25) for w in range(3)])
    finally:
        if server is not None:
            server.stop()
    assert store.check_invariants() == []
    acknowledged = {key for result in results for key in result}
    located = store.locate(ns, 0, sorted(acknowledged))
    lost = {
        loc_key for loc_key, loc in zip(sorted(acknowledged), located, strict=True) if loc is None
    }
    assert lost <= _evicted_keys(db_path)
    assert len(acknowledged) > 0


# --- two engines, one store ------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """An empty embedded store both engines write."""
    return make_store(tmp_path_factory.mktemp("two-writers"))


@pytest.fixture(scope="module")
def two_engines(
    fault_model: Path,
    fault_prompts: Prompts,
    shared_store: Store,
    tmp_path_factory: pytest.TempPathFactory,
) -> list[EngineResult]:
    """`ENGINES` vLLM processes started together on the empty store, same prompts (each a
    fresh process: `run_engine` in a thread apiece, forked from the engine zygote when it
    can; each is killed past its timeout)."""
    run = engine_run(fault_model, fault_prompts, shared_store.kv_config())
    work = tmp_path_factory.mktemp("two-writers-runs")
    with ThreadPoolExecutor(ENGINES) as pool:
        results = list(pool.map(run_engine, [run] * ENGINES))
    saved = [r.connector.get("blocks_saved") if r.connector else None for r in results]
    (work / "saved.json").write_text(json.dumps(saved))
    return results


@pytest.mark.e2e
@pytest.mark.slow
def test_two_engines_store_one_copy_per_key(
    two_engines: list[EngineResult], shared_store: Store, fault_prompts: Prompts
) -> None:
    assert shared_store.counts()["committed"] == fault_prompts.full_blocks()


@pytest.mark.e2e
@pytest.mark.slow
def test_two_engines_leak_no_page(two_engines: list[EngineResult], shared_store: Store) -> None:
    counts = shared_store.counts()
    with shared_store.db() as conn:
        high_water = conn.execute("SELECT SUM(next_unused) FROM rank_files").fetchone()[0]
    assert counts["pending"] == 0
    assert high_water == counts["committed"] + counts["free"]
    assert invariants(shared_store.db_path) == []


@pytest.mark.e2e
@pytest.mark.slow
def test_two_engines_pages_all_verify(two_engines: list[EngineResult], shared_store: Store) -> None:
    checks = scrub(shared_store.config_file)
    assert checks and all(c["status"] == "ok" for c in checks), checks


@pytest.mark.e2e
@pytest.mark.slow
def test_two_engines_give_the_no_connector_tokens(
    two_engines: list[EngineResult], baseline: EngineResult
) -> None:
    assert [r.outputs for r in two_engines] == [baseline.outputs] * ENGINES


@pytest.mark.e2e
@pytest.mark.slow
def test_two_engines_both_wrote_or_found_the_keys(
    two_engines: list[EngineResult], fault_prompts: Prompts
) -> None:
    # Every distinct block was saved by one engine; the other found it stored (being
    # written, or committed: a lookup hit) — never a second copy.
    saved = [r.connector["blocks_saved"] for r in two_engines if r.connector]
    assert sum(saved) == fault_prompts.full_blocks()

"""Torn and stale pages: whatever happened to a page's bytes, a load is a detected miss.

Tier level (no vLLM: a real embedded store, a real growing page file, the POSIX engine):
a page file truncated through a page, flipped bytes, two pages swapped, and a page
evicted and reused by another key while a reader holds its old location — each is a
miss for exactly the damaged keys, dropped from the store so it is saved again; a read
lease keeps a located page from being reused at all while it lasts.

Through vLLM: `hf3fsctl evict --all` (and a tight in-process evictor doing the same
store call) runs over and over while `hf3fsctl warm` fills the store; the next engine
reproduces the no-connector tokens and the store is sound. Then pages of that store are
torn (the file truncated through its last page), swapped and flipped, and a fresh engine
still gives the same tokens, counting the damage as checksum failures.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from fault_scenario import (
    BLOCK,
    DTYPE,
    RUN_TIMEOUT_S,
    Prompts,
    Store,
    StoredPage,
    cli,
    committed_pages,
    engine_run,
    flip_bytes,
    invariants,
    make_store,
    scrub,
    swap_pages,
    truncate_file,
)
from helpers.cli_runner import run_hf3fsctl
from helpers.meta_builders import PAGE_BYTES, keys, register_growable

from hf3fsctl.meta.models import EvictRequest, Location
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.storage.layout import PageFile
from hf3fsctl.storage.posix import PosixEngine
from hf3fsctl.tier import CHECKSUM, LOADED, NOT_FOUND, SAVED, StagingRows, Tier
from hf3fsctl.vllm_tools.runner import EngineResult, run_engine

# --- tier level ------------------------------------------------------------------------


def _page(key: str) -> np.ndarray:
    """The bytes key `key`'s page holds here (distinct per key)."""
    seed = np.frombuffer(bytes.fromhex(key), dtype=np.uint8)
    return np.resize(seed, PAGE_BYTES) ^ np.arange(PAGE_BYTES, dtype=np.uint8)


@dataclass
class PageStore:
    """An embedded store over one growing page file, and a tier over both."""

    store: MetadataStore
    ns: str
    file: PageFile
    engine: PosixEngine

    def tier(self) -> Tier:
        return Tier(self.ns, 0, self.file, self.engine, lambda fn: fn(self.store))

    def save(self, chain: list[str]) -> None:
        assert self.tier().save(chain, [_page(k) for k in chain]).kinds == [SAVED] * len(chain)

    def load(self, chain: list[str]) -> tuple[list[str], list[np.ndarray]]:
        rows = [np.zeros(PAGE_BYTES, dtype=np.uint8) for _ in chain]
        return self.tier().load(chain, StagingRows(rows)).kinds, rows

    def location(self, key: str) -> Location:
        found = self.store.locate(self.ns, 0, [key])[0]
        assert found is not None
        return found

    def read_at(self, location: Location) -> bool:
        """A reader that kept `location`: read and verify its page now."""
        buffer = np.zeros(PAGE_BYTES, dtype=np.uint8)
        result = self.engine.read_pages(
            self.file, [location.page], [buffer], expected=[location.checksum]
        )
        return result[0].ok


def _page_store(tmp_path: Path, lease_s: float) -> Iterator[PageStore]:
    root = tmp_path / "root"
    root.mkdir()
    # No storage root in the policy: freed pages stay in the file and are reused at once.
    store = MetadataStore(tmp_path / "meta.db", policy=StorePolicy(), lease_s=lease_s)
    ns, files = register_growable(store, root)
    engine = PosixEngine(io_threads=2)
    try:
        yield PageStore(store, ns, files[0], engine)
    finally:
        engine.close()
        files[0].close()
        store.close()


@pytest.fixture
def pages(tmp_path: Path) -> Iterator[PageStore]:
    """A page store whose read leases last a minute."""
    yield from _page_store(tmp_path, lease_s=60.0)


@pytest.fixture
def short_lease(tmp_path: Path) -> Iterator[PageStore]:
    """A page store whose read leases last 0.2 s."""
    yield from _page_store(tmp_path, lease_s=0.2)


def _file_page(ps: PageStore, key: str) -> StoredPage:
    location = ps.location(key)
    return StoredPage(key, ps.file.path, location.page * ps.file.slot_bytes, location.size)


def test_truncated_page_file_is_a_miss_for_the_torn_pages_only(pages: PageStore) -> None:
    chain = keys(4)
    pages.save(chain)
    truncate_file(_file_page(pages, chain[2]))
    kinds, _ = pages.load(chain)
    assert kinds == [LOADED, LOADED, CHECKSUM, CHECKSUM]


def test_truncated_pages_are_dropped_and_saved_again(pages: PageStore) -> None:
    chain = keys(4)
    pages.save(chain)
    truncate_file(_file_page(pages, chain[2]))
    pages.load(chain)
    pages.save(chain[2:])  # SAVED, not EXISTING: the torn entries are gone
    kinds, rows = pages.load(chain)
    assert kinds == [LOADED] * 4
    assert all(np.array_equal(r, _page(k)) for r, k in zip(rows, chain, strict=True))


def test_flipped_bytes_are_a_checksum_miss(pages: PageStore) -> None:
    chain = keys(3)
    pages.save(chain)
    flip_bytes(_file_page(pages, chain[1]))
    assert pages.load(chain)[0] == [LOADED, CHECKSUM, LOADED]


def test_swapped_pages_are_both_checksum_misses(pages: PageStore) -> None:
    chain = keys(3)
    pages.save(chain)
    swap_pages(_file_page(pages, chain[0]), _file_page(pages, chain[2]))
    assert pages.load(chain)[0] == [CHECKSUM, LOADED, CHECKSUM]
    assert pages.load(chain)[0] == [NOT_FOUND, LOADED, NOT_FOUND]  # both dropped


def test_page_reused_under_an_old_location_reads_as_a_checksum_miss(
    short_lease: PageStore,
) -> None:
    ps = short_lease
    old_key, new_key = keys(2, salt="reuse")
    ps.save([old_key])
    held = ps.location(old_key)  # a reader takes the location, then stalls
    time.sleep(0.4)  # past its 0.2 s lease
    assert ps.store.evict(EvictRequest(all=True)).keys == 1
    ps.save([new_key])
    assert ps.location(new_key).page == held.page  # the slot was reused
    assert not ps.read_at(held)  # the stalled reader sees a mismatch: a miss


def test_stale_readers_invalidate_leaves_the_new_owner(short_lease: PageStore) -> None:
    ps = short_lease
    old_key, new_key = keys(2, salt="reuse")
    ps.save([old_key])
    held = ps.location(old_key)
    time.sleep(0.4)
    ps.store.evict(EvictRequest(all=True))
    ps.save([new_key])
    assert ps.tier().invalidate([held]) == 0
    assert ps.load([new_key])[0] == [LOADED]


def test_page_is_not_reused_while_a_reader_holds_its_lease(pages: PageStore) -> None:
    old_key, new_key = keys(2, salt="lease")
    pages.save([old_key])
    held = pages.location(old_key)
    assert pages.store.evict(EvictRequest(all=True)).keys == 1
    pages.save([new_key])
    assert pages.location(new_key).page != held.page
    assert pages.read_at(held)  # the reader still reads the bytes it located


# --- through vLLM ----------------------------------------------------------------------

EVICT_EVERY_S = 0.5  # the in-process evictor's pace (leaves keys for the CLI between)
POLL_S = 0.05  # how often the test looks for warm's first commit


@dataclass
class WarmUnderEviction:
    """`hf3fsctl warm` run while evictions ran over and over."""

    returncode: int
    stderr: str
    cli_calls: int = 0  # `hf3fsctl evict --all` runs
    cli_keys: int = 0  # keys they removed
    store_calls: int = 0  # in-process `MetadataStore.evict(all=True)` calls
    store_keys: int = 0
    errors: list[str] = field(default_factory=list)


def _evict_until(store: Store, done: threading.Event, report: WarmUnderEviction) -> None:
    """`MetadataStore.evict(all)` every `EVICT_EVERY_S` until `done` (what the CLI calls)."""
    assert store.db_path is not None
    while not store.db_path.exists() and not done.is_set():
        time.sleep(EVICT_EVERY_S)
    evictor = MetadataStore(store.db_path)
    try:
        while not done.is_set():
            try:
                report.store_keys += evictor.evict(EvictRequest(all=True)).keys
                report.store_calls += 1
            except Exception as exc:  # reported, and fails the test that checks it
                report.errors.append(repr(exc))
            time.sleep(EVICT_EVERY_S)
    finally:
        evictor.close()


@pytest.fixture(scope="module")
def evicted_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """The embedded store `hf3fsctl warm` fills while evictions run."""
    return make_store(tmp_path_factory.mktemp("warm-evict"))


@pytest.fixture(scope="module")
def warm_under_eviction(
    fault_model: Path, fault_prompts: Prompts, evicted_store: Store
) -> WarmUnderEviction:
    """`hf3fsctl warm` of the prompt set with `hf3fsctl evict --all` looping beside it."""
    prompts = evicted_store.directory / "prompts.txt"
    prompts.write_text("\n".join(fault_prompts.texts) + "\n")
    config = str(evicted_store.config_file)
    assert evicted_store.db_path is not None
    MetadataStore(evicted_store.db_path).close()  # warm needs a store (as `init` makes)
    engine = ["--dtype", DTYPE, "--block-size", str(BLOCK), "--kv-cache-memory", "64MiB"]
    engine += ["--max-model-len", "4096"]
    # Eager, as every `run_engine` engine: the store has no `vllm:` args, and vLLM's default
    # (torch.compile) costs 25-40 s more at engine start on 2 cores, before any commit.
    engine += ["--engine-arg", "enforce_eager=true"]
    command = ["warm", "--config", config, "--model", str(fault_model), "--prompts"]
    report = WarmUnderEviction(returncode=-1, stderr="")
    done = threading.Event()
    evictor = threading.Thread(target=_evict_until, args=(evicted_store, done, report))
    # The warm runs beside this thread's `evict` loop (a fresh process, from the CLI zygote
    # when it can: `run_hf3fsctl` kills it past RUN_TIMEOUT_S).
    with ThreadPoolExecutor(1) as pool:
        warm = pool.submit(
            run_hf3fsctl,
            *command,
            str(prompts),
            *engine,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            timeout=RUN_TIMEOUT_S,
        )
        evictor.start()
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            # `hf3fsctl evict --all` back to back from warm's first commit until it exits.
            while not warm.done() and time.monotonic() < deadline:
                if not report.cli_calls and evicted_store.counts()["committed"] == 0:
                    time.sleep(POLL_S)
                    continue
                done_cli = cli("evict", "--config", config, "--all", "-y", "--json")
                if done_cli.returncode == 0:
                    report.cli_keys += int(json.loads(done_cli.stdout)["keys"])
                    report.cli_calls += 1
                else:
                    report.errors.append(done_cli.stderr[-500:])
            finished = warm.result()
        finally:
            done.set()
            evictor.join()
    report.returncode, report.stderr = finished.returncode, finished.stderr[-3000:]
    (evicted_store.directory / "evictions.json").write_text(json.dumps(report.__dict__))
    return report


@pytest.fixture(scope="module")
def after_eviction(
    fault_model: Path,
    fault_prompts: Prompts,
    evicted_store: Store,
    warm_under_eviction: WarmUnderEviction,
) -> EngineResult:
    """A fresh engine on what `warm` left; it saves what is missing."""
    return run_engine(engine_run(fault_model, fault_prompts, evicted_store.kv_config()))


@pytest.fixture(scope="module")
def torn_run(
    fault_model: Path, fault_prompts: Prompts, evicted_store: Store, after_eviction: EngineResult
) -> EngineResult:
    """A fresh engine after the store's pages were swapped, flipped and torn."""
    stored = committed_pages(evicted_store)
    assert len(stored) > 4
    swap_pages(stored[0], stored[1])  # the first pages written: the shared prefix
    flip_bytes(stored[len(stored) // 2])
    truncate_file(stored[-1])  # the file's last page, cut half-way
    return run_engine(engine_run(fault_model, fault_prompts, evicted_store.kv_config()))


@pytest.mark.e2e
@pytest.mark.slow
def test_warm_completes_while_evict_all_runs(warm_under_eviction: WarmUnderEviction) -> None:
    assert warm_under_eviction.returncode == 0, warm_under_eviction.stderr
    assert warm_under_eviction.errors == []


@pytest.mark.e2e
@pytest.mark.slow
def test_evictions_removed_keys_while_warm_wrote(warm_under_eviction: WarmUnderEviction) -> None:
    report = warm_under_eviction
    assert report.cli_calls > 0
    assert report.cli_keys + report.store_keys > 0


@pytest.mark.e2e
@pytest.mark.slow
def test_store_is_sound_after_warm_under_eviction(
    warm_under_eviction: WarmUnderEviction, evicted_store: Store
) -> None:
    assert invariants(evicted_store.db_path) == []
    checks = scrub(evicted_store.config_file)
    assert all(c["status"] == "ok" for c in checks), checks


@pytest.mark.e2e
@pytest.mark.slow
def test_engine_after_evictions_gives_the_no_connector_tokens(
    after_eviction: EngineResult, baseline: EngineResult
) -> None:
    assert after_eviction.outputs == baseline.outputs


@pytest.mark.e2e
@pytest.mark.slow
def test_torn_and_swapped_pages_give_the_no_connector_tokens(
    torn_run: EngineResult, baseline: EngineResult
) -> None:
    assert torn_run.outputs == baseline.outputs
    assert all(r.finish_reason == "length" for r in torn_run.requests)


@pytest.mark.e2e
@pytest.mark.slow
def test_torn_and_swapped_pages_are_counted_as_corrupt(torn_run: EngineResult) -> None:
    assert torn_run.connector is not None
    assert torn_run.connector["failed_checksum"] >= 3  # two swapped, one flipped, one torn


@pytest.mark.e2e
@pytest.mark.slow
def test_torn_and_swapped_pages_are_gone_after_the_run(
    torn_run: EngineResult, evicted_store: Store
) -> None:
    checks = scrub(evicted_store.config_file)
    assert checks and all(c["status"] == "ok" for c in checks), checks

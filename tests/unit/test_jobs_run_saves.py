"""`jobs.run_saves` (issue 23): a step's save jobs through one `Tier.save_many` — an
outcome per job and the same counts as saving each job alone (`run_saves` of one job takes
`Tier.save`'s path), in two transactions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.meta_builders import PAGE_BYTES, keys, register_growable

from connector.jobs import run_saves
from connector.metadata import SaveJob
from connector.stats import StatsRecorder
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.storage.posix import PosixEngine
from hf3fsctl.tier import EXISTING, SAVED, Tier


def _tier(tmp_path: Path, name: str) -> Iterator[Tier]:
    root = tmp_path / name
    root.mkdir()
    store = MetadataStore(tmp_path / f"{name}.db")
    ns, files = register_growable(store, root)
    engine = PosixEngine(io_threads=2)
    yield Tier(ns, 0, files[0], engine, lambda fn: fn(store))
    engine.close()
    files[0].close()
    store.close()


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[tuple[Tier, Tier]]:
    for a in _tier(tmp_path, "a"):
        for b in _tier(tmp_path, "b"):
            yield a, b


def test_run_saves_counts_what_saving_each_job_alone_counts(tiers: tuple[Tier, Tier]) -> None:
    batched, one_by_one = tiers
    chain = keys(4)
    jobs = [
        SaveJob("r1", [0, 1, 2], chain[:3], 0),
        SaveJob("r2", [3, 1], [chain[3], chain[1]], 3),  # a key the first job saves too
    ]
    rows = [[np.full(PAGE_BYTES, b, dtype=np.uint8) for b in job.block_ids] for job in jobs]
    together, alone = StatsRecorder(), StatsRecorder()
    outcomes = run_saves(batched, jobs, rows, together)
    singles = [
        run_saves(one_by_one, [job], [job_rows], alone)[0]
        for job, job_rows in zip(jobs, rows, strict=True)
    ]
    assert [o.kinds for o in outcomes] == [o.kinds for o in singles]
    assert [o.kinds for o in outcomes] == [[SAVED] * 3, [SAVED, EXISTING]]
    assert together.take() == alone.take()

"""`bench e2e --admission N`: the two-wave workload and the section's figures (no engine)."""

from __future__ import annotations

import pytest

from hf3fsctl.bench.e2e.admission import (
    admission_document,
    admission_waves,
    reference_name,
    run_name,
)
from hf3fsctl.bench.e2e.offline import OfflineRuns
from hf3fsctl.bench.e2e.samples import Samples
from hf3fsctl.bench.e2e.settings import E2ESettings, Workload, validate
from hf3fsctl.errors import InvalidRequest
from hf3fsctl.vllm_tools.runner import RequestResult

WORKLOAD = Workload(prefixes=2, suffixes=3, prefix_tokens=64, suffix_tokens=16, output_tokens=2)
BLOCK = 32


def first_blocks(prompts: list[list[int]]) -> list[tuple[int, ...]]:
    return [tuple(p[:BLOCK]) for p in prompts]


def repeated_prefixes(wave: list[list[int]]) -> set[tuple[int, ...]]:
    prefixes = [tuple(p[: WORKLOAD.prefix_tokens]) for p in wave]
    return {p for p in prefixes if prefixes.count(p) > 1}


def test_each_wave_repeats_the_prefixes_and_holds_as_many_one_offs() -> None:
    wave1, wave2 = admission_waves(WORKLOAD, seed=3)
    for wave in (wave1, wave2):
        assert len(wave) == 2 * WORKLOAD.requests
        assert {len(p) for p in wave} == {WORKLOAD.prompt_tokens}
        prefixes = [tuple(p[: WORKLOAD.prefix_tokens]) for p in wave]
        counts = sorted(prefixes.count(p) for p in set(prefixes))
        assert counts == [1] * WORKLOAD.requests + [WORKLOAD.suffixes] * WORKLOAD.prefixes
        assert min(min(p) for p in wave) >= 3  # bos/eos/pad ids avoided
    assert repeated_prefixes(wave1) == repeated_prefixes(wave2)  # wave 2 keeps the prefixes
    assert not set(map(tuple, wave1)) & set(map(tuple, wave2))  # ... and no whole prompt


def test_one_offs_share_no_block_with_any_other_prompt() -> None:
    wave1, wave2 = admission_waves(WORKLOAD, seed=3)
    blocks = first_blocks(wave1 + wave2)
    one_offs = [b for b in blocks if blocks.count(b) == 1]
    assert len(one_offs) == 2 * WORKLOAD.requests


def test_the_waves_are_deterministic_for_a_seed() -> None:
    assert admission_waves(WORKLOAD, seed=5) == admission_waves(WORKLOAD, seed=5)
    assert admission_waves(WORKLOAD, seed=5) != admission_waves(WORKLOAD, seed=6)


def samples(hit_tokens: int, saved_blocks: int, outputs: int = 7) -> Samples:
    one = Samples()
    requests = [RequestResult(100, [outputs], hit_tokens // 2, 0.5, "length") for _ in range(2)]
    one.add_pass(requests, 1.0, sequential=False)
    one.add_connector(
        {
            "hit_tokens": hit_tokens,
            "blocks_saved": saved_blocks,
            "bytes_saved": saved_blocks * 10,
            "admission_skipped_blocks": 50 - saved_blocks,
        }
    )
    return one


def runner_with(runs: dict[str, Samples]) -> OfflineRuns:
    runner = OfflineRuns(E2ESettings(workload=WORKLOAD, admission=2), lambda message: None)
    runner.samples.update(runs)
    for name in runs:
        runner.admission_stores[name] = {"keys": 1, "bytes_live": 10, "admission_skipped": 0}
    return runner


def test_the_section_divides_admission_by_store_all_of_the_same_run() -> None:
    runner = runner_with(
        {
            reference_name(1): samples(0, 0),
            reference_name(2): samples(0, 0),
            run_name(0, "cold"): samples(0, 40),
            run_name(0, "warm"): samples(120, 30),
            run_name(2, "cold"): samples(0, 10),
            run_name(2, "warm"): samples(90, 0),
        }
    )
    section = admission_document(runner.s, runner)
    base, admitted = section["runs"]
    assert (base["store_after_hits"], admitted["store_after_hits"]) == (0, 2)
    assert (base["bytes_written"], admitted["bytes_written"]) == (700, 100)
    assert admitted["warm"]["store_hit_rate"] == pytest.approx(90 / 200)
    assert (admitted["cold"]["blocks_skipped"], admitted["warm"]["blocks_skipped"]) == (40, 50)
    ratios = section["ratios"]
    assert ratios["bytes_written_over_store_all"] == pytest.approx(100 / 700)
    assert ratios["cold_bytes_written_over_store_all"] == pytest.approx(10 / 40)
    assert ratios["warm_store_hit_rate_over_store_all"] == pytest.approx(90 / 120)
    assert ratios["warm_hit_rate_over_store_all"] == pytest.approx(90 / 120)
    assert section["outputs_identical"] is True
    assert admitted["warm"]["store_after"] == {"keys": 1, "bytes_live": 10, "admission_skipped": 0}


def test_a_failed_run_leaves_its_figures_none_and_outputs_that_differ_are_flagged() -> None:
    runner = runner_with(
        {
            reference_name(1): samples(0, 0),
            reference_name(2): samples(0, 0),
            run_name(0, "cold"): samples(0, 40),
            run_name(0, "warm"): samples(120, 30, outputs=8),  # not the reference's tokens
            run_name(2, "cold"): samples(0, 10),
        }
    )
    runner.failures[run_name(2, "warm")] = "engine crashed"
    section = admission_document(runner.s, runner)
    base, admitted = section["runs"]
    assert admitted["warm"] == {"status": "failed", "error": "engine crashed"}
    assert admitted["bytes_written"] is None
    assert section["ratios"]["bytes_written_over_store_all"] is None
    assert section["ratios"]["cold_bytes_written_over_store_all"] == pytest.approx(10 / 40)
    assert base["warm"]["outputs_match_none"] is False
    assert section["outputs_identical"] is False


@pytest.mark.parametrize("after_hits", [-1, 1], ids=["negative", "one"])
def test_admission_refuses_what_stores_everything_or_nothing(after_hits: int) -> None:
    with pytest.raises(InvalidRequest, match="--admission"):
        validate(E2ESettings(admission=after_hits))


def test_admission_is_offline_only() -> None:
    with pytest.raises(InvalidRequest, match="--admission"):
        validate(E2ESettings(admission=2, url="http://127.0.0.1:8000"))


def test_the_table_shows_both_settings_and_a_failed_wave() -> None:
    from rich.console import Console

    from hf3fsctl.cli.bench_e2e_admission import render_admission

    runner = runner_with(
        {
            reference_name(1): samples(0, 0),
            reference_name(2): samples(0, 0),
            run_name(0, "cold"): samples(0, 40),
            run_name(0, "warm"): samples(120, 30),
            run_name(2, "cold"): samples(0, 10),
        }
    )
    runner.failures[run_name(2, "warm")] = "Traceback ...\nRuntimeError: engine crashed"
    console = Console(width=250, record=True)
    console.print(render_admission(admission_document(runner.s, runner)))
    text = console.export_text()
    assert "0 (store all)" in text and "2 (store when seen 2 times)" in text
    assert "failed: RuntimeError: engine crashed" in text
    assert "bytes_written_over_store_all" in text

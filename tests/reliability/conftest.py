"""The reliability campaign: faults injected into real processes, files and stores.

Every test under this directory gets the `reliability` marker. The vLLM scenarios share
one tiny model and one no-connector run of one prompt set (`baseline`): every faulted
run must reproduce its tokens. Builders and fault injectors live in `fault_scenario.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_scenario import Prompts, engine_run, make_prompts

from hf3fsctl.vllm_tools.runner import EngineResult, run_engine

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this directory `reliability`."""
    for item in items:
        if _HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture(scope="session")
def fault_model(tiny_model: Path) -> Path:
    """The tiny random Llama (seed 0, fp32): the session's one (tests/conftest.py)."""
    return tiny_model


@pytest.fixture(scope="session")
def fault_prompts(fault_model: Path) -> Prompts:
    """Text prompts sharing a prefix, and their token ids as vLLM tokenizes them."""
    return make_prompts(fault_model)


@pytest.fixture(scope="session")
def baseline(fault_model: Path, fault_prompts: Prompts) -> EngineResult:
    """The prompts through vLLM without any connector: the tokens every run must give."""
    return run_engine(engine_run(fault_model, fault_prompts, None))

"""Test-suite wide settings: environment for vLLM, where markers are skipped, and the one
tiny model every directory's tests share."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Rich sizes tables to the terminal; a pytest-xdist worker has none (80 columns, so long
# cells wrap and a test looking for a namespace id in `stats` misses it). Tests read
# tables at one width wherever they run; a test about another width sets its own.
os.environ.setdefault("COLUMNS", "200")

# A suite started in the background by a non-interactive shell (`make test &` in a script)
# inherits SIGINT ignored (POSIX: asynchronous commands without job control), and so does
# every engine and CLI process it starts, zygotes and their children included; the tests
# that interrupt a `warm` with SIGINT need it delivered as in a terminal. Caught here, it
# is SIG_DFL again in every exec'd child (whose Python then raises KeyboardInterrupt).
# Found 2026-12-03: such a run's interrupted warm ran all its prompts and exited 0.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _connector_status_files(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Connector status files (`hf3fsctl.health`) go to a private directory per session."""
    os.environ["HF3FSCTL_STATE_DIR"] = str(tmp_path_factory.getbasetemp() / "connector-state")


@pytest.fixture(scope="session", autouse=True)
def _engine_zygote(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Two engine zygotes per session that runs vLLM engines (tests using `tiny_model`),
    each importing vLLM once and forking a child per run (hf3fsctl.vllm_tools.zygote)
    instead of a `python -m` start that spends ~6-12 s importing: one for `run_engine`
    (its socket in ENGINE_ZYGOTE_SOCKET, started with `runner.child_env()`), one for the
    CLI (`helpers.cli_runner.run_hf3fsctl`, CLI_ZYGOTE_SOCKET, `cli_env()`). Off with
    ENGINE_ZYGOTE_SOCKET=0; never on outside the test suite.
    """
    from helpers.cli_runner import CLI_ZYGOTE_ENV, cli_env

    from hf3fsctl.vllm_tools.runner import child_env
    from hf3fsctl.vllm_tools.zygote import ZYGOTE_ENV, Zygote

    wanted = os.environ.get(ZYGOTE_ENV, "1") != "0"
    engines = any("tiny_model" in item.fixturenames for item in request.session.items)
    if not (wanted and engines):
        os.environ.pop(ZYGOTE_ENV, None)
        os.environ.pop(CLI_ZYGOTE_ENV, None)
        yield
        return
    _pin_import_time_env()
    directory = tmp_path_factory.mktemp("zygote")
    started = {
        ZYGOTE_ENV: Zygote.start(directory / "engine.sock", child_env()),
        CLI_ZYGOTE_ENV: Zygote.start(directory / "cli.sock", cli_env()),
    }
    os.environ.update({name: str(zygote.path) for name, zygote in started.items()})
    _SESSION_IMPORT_ENV.update(_import_time(os.environ))
    try:
        yield
    finally:
        _SESSION_IMPORT_ENV.clear()
        for name, zygote in started.items():
            os.environ.pop(name, None)
            zygote.stop()


# The import-time variables (`zygote.IMPORT_TIME_PREFIXES`) as the session's zygotes were
# started with them; empty when no zygote runs.
_SESSION_IMPORT_ENV: dict[str, str] = {}


def _import_time(env: Mapping[str, str]) -> dict[str, str]:
    from hf3fsctl.vllm_tools.zygote import IMPORT_TIME_PREFIXES

    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def _pin_import_time_env() -> None:
    """Set, before the zygotes start, what importing torch's compiler sets in this process.

    `import torch._dynamo` (transformers imports it: any tokenizer or config loaded in
    process) sets TORCHINDUCTOR_CACHE_DIR in `os.environ`, to torch's default. From then
    on every engine run's environment differed from the zygotes' in an import-time
    variable, so `zygote.eligible` refused it and it started fresh (`python -m`, ~10-15 s
    of vLLM import): found 2026-12-03, a reliability run after `make_prompts`. Set to that
    same default now, the later import changes nothing (torch keeps an absolute value).
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()  # sets os.environ["TORCHINDUCTOR_CACHE_DIR"] exactly as the import would


@pytest.fixture(autouse=True)
def _import_time_env_as_the_zygotes_have_it() -> None:
    """Before each test, put back import-time variables that code run in this process
    (an in-process vLLM config sets VLLM_WORKER_MULTIPROC_METHOD, for one) added or
    changed since the zygotes started: a later engine run then still matches them and is
    forked. A test's own `monkeypatch.setenv` comes after this and is undone by it."""
    if not _SESSION_IMPORT_ENV:
        return
    for name, value in _import_time(os.environ).items():
        if _SESSION_IMPORT_ENV.get(name) != value:
            if name in _SESSION_IMPORT_ENV:
                os.environ[name] = _SESSION_IMPORT_ENV[name]
            else:
                del os.environ[name]
    for name, value in _SESSION_IMPORT_ENV.items():
        os.environ.setdefault(name, value)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (seed 0, fp32) and its tokenizer, built once per session for
    every directory (unit `tiny_model_dir`, e2e `tiny_model`, reliability `fault_model`).

    Read-only: a test that needs another model (other weights, another dtype) builds its
    own. Building it costs ~5-10 s on 2 cores; it used to be built once per directory.
    """
    from hf3fsctl.vllm_tools.tiny_model import SIZES, build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-model", SIZES["tiny"])


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests without CUDA (the only marker that is ever skipped)."""
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

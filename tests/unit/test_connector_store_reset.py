"""A store that forgets a running engine's namespace: the engine registers it again.

Found running vLLM on a Redis store that restarted without persistence: every save of
the still-running engine failed with "namespace … is not registered", and every lookup
logged it, until the engine was restarted. The same happens when `hf3fsctl evict --stale`
removes a namespace (metadata and page files) under an idle engine. Now the save that
meets an unknown namespace makes the worker register again (a new page file if the old
one went with it) with its next save, logged once; lookups answer again once it has.
vLLM's real scheduler and the real worker side (`tests.helpers.connector_harness`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import hf3fsctl_connector
import pytest
import yaml
from helpers.connector_harness import BLOCK_SIZE, Harness, make_harness, make_request, prompt_tokens
from helpers.redis_servers import RedisServer, redis_binaries_missing, redis_server
from typer.testing import CliRunner

from hf3fsctl.cli.main import app

BACKOFF = {"metadata.retry_backoff_s": 0.2, "connector.storage_retry_s": 0.2}
PROMPTS = [prompt_tokens(3 * BLOCK_SIZE + 5, salt=s) for s in (21, 22, 23)]


def _loaded_blocks(harness: Harness, prompt: list[int], tag: str) -> int:
    harness.run(make_request(tag, prompt, max_tokens=1))
    assert hf3fsctl_connector.wait_for_saves(10)
    return sum(len(job.keys) for meta in harness.metas for job in meta.loads if job.req_id == tag)


def _saved(harness: Harness, prompt: list[int], tag: str) -> None:
    harness.run(make_request(tag, prompt, max_tokens=1))
    assert hf3fsctl_connector.wait_for_saves(10)


def _redis_restart(tmp_path: Path) -> tuple[dict[str, str], Callable[[], None], Callable[[], None]]:
    if redis_binaries_missing():
        pytest.skip("redis-server is not on PATH (`make redis` installs it)")
    server: RedisServer = redis_server(tmp_path / "redis")  # no persistence

    def reset() -> None:
        server.stop()
        server.start()  # the same port, nothing kept

    return {"metadata.url": server.url}, reset, server.stop


def _stale_eviction(
    tmp_path: Path,
) -> tuple[dict[str, str], Callable[[], None], Callable[[], None]]:
    store = tmp_path / "store"

    def reset() -> None:
        config = tmp_path / "hf3fs.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "storage": {"path": str(store)},
                    "metadata": {"url": f"sqlite:///{store}/metadata.db"},
                }
            )
        )
        time.sleep(1.2)  # unused for longer than the 1 s asked for
        result = CliRunner().invoke(
            app, ["evict", "--config", str(config), "--stale", "--unused-for", "1s", "--yes"]
        )
        assert result.exit_code == 0, result.output
        assert not list(store.glob("*/rank-*.pages"))  # metadata and page files gone

    return {}, reset, lambda: None


@pytest.mark.parametrize("lost", [_redis_restart, _stale_eviction], ids=["redis-restart", "stale"])
def test_a_running_engine_registers_again_after_its_store_forgot_it(
    lost: Callable[[Path], tuple[dict[str, str], Callable[[], None], Callable[[], None]]],
    tiny_model_dir: Path,
    tmp_path: Path,
    harnesses: list[Harness],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, reset, stop = lost(tmp_path)
    store = tmp_path / "store"
    extra = {**BACKOFF, **url}
    try:
        engine = make_harness(tiny_model_dir, store, extra=extra)
        harnesses.append(engine)
        _saved(engine, PROMPTS[0], "before")
        reset()
        time.sleep(0.3)  # past the back-off of any call that met the store down
        caplog.set_level(logging.INFO)
        _saved(engine, PROMPTS[1], "meets-the-reset")  # its saves find the namespace unknown
        _saved(engine, PROMPTS[2], "after")  # registers again, then saves
        fresh = make_harness(tiny_model_dir, store, extra=extra)
        harnesses.append(fresh)
        loaded = _loaded_blocks(fresh, PROMPTS[2], "fresh")
        forgot = [r for r in caplog.records if "no longer registered" in r.getMessage()]
    finally:
        for harness in harnesses:
            harness.close()
        harnesses.clear()
        stop()
    assert loaded == 3  # every full block of the prompt saved after the reset
    assert len(forgot) == 1
    assert not [r.getMessage() for r in caplog.records if r.exc_info]

"""Issue 22 end to end (real vLLM on CPU, tiny random Llama, real store).

* A producer (`kv_role: kv_producer`) and a consumer (`kv_consumer`) engine on one
  store: the consumer loads the producer's pages, saves nothing, and its greedy tokens
  equal a no-connector run.
* The OpenAI server (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve`
  runs) with the connector, requests carrying `kv_transfer_params` in the body:
  `save: false` leaves no entry, `retention: 1` is gone (never looked up again) after a
  second, `pin: true` shows in `hf3fsctl ls --pins`, and a later request loads the
  pinned prompt from the store; every completion's tokens equal those of a no-connector
  engine with the server's engine args (offline, `run_engine`: a second server start
  cost two more vLLM imports and an API server start, ~30 s on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import BLOCK, DTYPE, LONG, RESERVED_CPU, E2EStore, make_store
from helpers.servers import free_port

from hf3fsctl.config import load_config
from hf3fsctl.meta.client import connect
from hf3fsctl.meta.protocol import MetadataClient
from hf3fsctl.vllm_tools.runner import (
    EngineResult,
    EngineRun,
    child_env,
    run_engine,
    shared_prefix_prompts,
)
from hf3fsctl.vllm_tools.zygote import ZYGOTE_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVER_START_S = 300.0
MAX_TOKENS = 8
# RESERVED_CPU: one core left to the API server process, the engine's threads get the
# other (the no-connector engine gets the same: both compute with one OpenMP thread).


def _role(store: E2EStore, role: str) -> dict[str, Any]:
    return store.kv_config() | {"kv_role": role}


def _client(store: E2EStore) -> MetadataClient:
    return connect(load_config(store.config_file, environ={}))


def _committed(store: E2EStore) -> int:
    client = _client(store)
    try:
        return sum(
            1
            for ns in client.namespaces()
            for entry in client.list_entries(ns.id, limit=100_000)
            if entry.state == "committed"
        )
    finally:
        client.close()


def test_a_consumer_loads_a_producers_pages_and_saves_nothing(
    engine: Callable[..., EngineResult],
    baseline: EngineResult,
    prompts: list[list[int]],
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path)
    # The producer sees only the long prompts; the consumer, every prompt: it computes
    # the others and must not save them.
    produced = engine(_role(store, "kv_producer"), prompts=[prompts[i] for i in LONG])
    assert produced.connector is not None
    assert produced.connector["blocks_saved"] > 0 and produced.connector["hit_blocks"] == 0
    before = _committed(store)
    consumed = engine(_role(store, "kv_consumer"))
    assert consumed.connector is not None
    assert consumed.connector["blocks_loaded"] > 0
    assert consumed.connector["save_jobs"] == 0 and consumed.connector["blocks_saved"] == 0
    assert _committed(store) == before
    assert consumed.outputs == baseline.outputs


# --- the OpenAI server ------------------------------------------------------------------


@contextmanager
def _openai_server(
    model: Path, kv_transfer_config: dict[str, Any] | None, log: Path
) -> Iterator[str]:
    """A running OpenAI-compatible vLLM server; yields its base URL."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        DTYPE,
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "4096",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--enforce-eager",
        "--no-enable-prefix-caching",  # a repeated prompt comes from the store
        "--seed",
        "0",
    ]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    env = child_env(RESERVED_CPU)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's engine core is its own process
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + SERVER_START_S
            while True:
                if process.poll() is not None:
                    raise AssertionError(f"vLLM server exited:\n{log.read_text()[-4000:]}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"vLLM server not up:\n{log.read_text()[-4000:]}")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _no_connector_tokens(
    model: Path, prompts: list[list[int]], zygote: str | None
) -> list[list[int]]:
    """What `_openai_server(model, None, ...)` answers `_complete(url, prompt, None)` with:
    the server's engine args (eager, seed 0, no prefix caching, the block size, dtype, KV
    memory and max_model_len) without a connector, one request at a time, greedy; forked
    from `zygote` (the session's, started with RESERVED_CPU) when there is one."""
    run = EngineRun(
        model=str(model),
        prompts=prompts,
        max_tokens=MAX_TOKENS,
        block_size=BLOCK,
        dtype=DTYPE,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=4096,
        warmup_tokens=0,
        env=RESERVED_CPU,
        engine_args={"enable_prefix_caching": False},
        timeout_s=SERVER_START_S,
    )
    with pytest.MonkeyPatch.context() as patch:
        if zygote is not None:
            patch.setenv(ZYGOTE_ENV, zygote)
        return run_engine(run).outputs


def _complete(url: str, prompt: list[int], params: dict[str, Any] | None) -> list[int]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        document = json.load(answer)
    return list(document["choices"][0]["token_ids"])


def _entries_of(client: MetadataClient) -> list[Any]:
    return [e for ns in client.namespaces() for e in client.list_entries(ns.id, limit=100_000)]


def _wait_for(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_openai_requests_carry_kv_transfer_params(
    tiny_model: Path, tmp_path: Path, reserved_cpu_zygote: str | None
) -> None:
    store = make_store(tmp_path / "store")
    private, short_lived, pinned = shared_prefix_prompts(3, 0, 4 * BLOCK + 7, seed=22)
    requests: list[tuple[list[int], dict[str, Any] | None]] = [
        (private, {"save": False}),
        (short_lived, {"retention": 1}),
        (pinned, {"pin": True, "keep_me": "x"}),  # an unknown key: a warning, no error
        (pinned, None),  # loads the pinned prompt from the store
    ]
    prompts = [prompt for prompt, _ in requests]
    expected = _no_connector_tokens(tiny_model, prompts, reserved_cpu_zygote)
    client = _client(store)
    try:
        with _openai_server(tiny_model, store.kv_config(), tmp_path / "server.log") as url:
            got = [_complete(url, *requests[0])]
            got.append(_complete(url, *requests[1]))
            _wait_for(lambda: len(_entries_of(client)) >= 4)  # short_lived's 4 blocks
            short_keys = {e.key for e in _entries_of(client)}
            assert all(e.expires_at is not None for e in _entries_of(client))
            got.append(_complete(url, *requests[2]))
            _wait_for(lambda: len(client.list_pins()) >= 4)
            got.append(_complete(url, *requests[3]))
        assert got == expected
        namespace = client.namespaces()[0].id
        # save: false left nothing; retention 1 s: those entries are gone after it.
        time.sleep(max(0.0, max(e.expires_at or 0 for e in _entries_of(client)) - time.time()))
        time.sleep(0.2)
        assert all(client.lookup(namespace, [key]) == 0 for key in short_keys)
        live = {e.key for e in _entries_of(client) if e.expires_at is None}
        pins = {p.key for p in client.list_pins()}
        assert live == pins and len(pins) == 4  # only the pinned prompt is stored for good
    finally:
        client.close()
    listed = subprocess.run(
        [sys.executable, "-m", "hf3fsctl", "ls", "--pins", "--json", "-c", str(store.config_file)],
        capture_output=True,
        text=True,
        check=True,
        env=child_env(),
    )
    assert len(json.loads(listed.stdout)["pins"]) == 4
    assert "keep_me" in (tmp_path / "server.log").read_text()

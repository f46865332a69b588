"""KV events through vLLM's own publisher (ZMQ on loopback), as a cache-aware router sees them.

One real engine with `--kv-events-config` on and our connector on an embedded store:
after it prefills two prompts sharing a prefix, the `BlockStored` events of medium
"HF3FS" give a router an index that agrees block for block with `hf3fsctl lookup`; after
`hf3fsctl evict --all` in another process, `BlockRemoved` events take every one of those
blocks out again, and `lookup` agrees that nothing is left. The engine keeps stepping on
tiny unrelated prompts (shorter than a block: nothing saved) so its scheduler publishes
what the connector's change-log follower queued.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import BLOCK, DTYPE, RUN_TIMEOUT_S
from helpers.cli_runner import run_hf3fsctl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MEDIUM = "HF3FS"
WAIT_S = 60.0  # events normally arrive within a second; this bounds a broken run

# The engine process: prefill the prompts, then step on tiny prompts until told to go on
# (`go` file), then again until told to stop (`stop` file).
CHILD = r"""
import json, os, sys, time
from pathlib import Path
from vllm import LLM, SamplingParams
from vllm.config import KVEventsConfig

spec = json.loads(Path(sys.argv[1]).read_text())
work = Path(sys.argv[2])
llm = LLM(
    model=spec["model"], enforce_eager=True, dtype=spec["dtype"], block_size=spec["block"],
    kv_cache_memory_bytes=64 << 20, max_model_len=4096, seed=0,
    kv_transfer_config=spec["kv"],
    kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=spec["endpoint"], topic="kv"
    ),
)
params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
out = llm.generate(spec["prompts"], params, use_tqdm=False)
(work / "outputs.json").write_text(json.dumps([o.outputs[0].token_ids for o in out]))
(work / "prefilled").touch()

def step_until(flag):
    deadline = time.monotonic() + 240
    while not (work / flag).exists() and time.monotonic() < deadline:
        llm.generate(["hi"], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.2)

step_until("go")
step_until("stop")
"""


class Subscriber:
    """A router's view: a ZMQ SUB socket decoding vLLM's `KVEventBatch` messages."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        # vLLM's publisher binds only wildcard endpoints and connects to a host: the
        # router side binds loopback here and the engine's PUB socket connects to it.
        self._socket.bind(endpoint)
        self.stored: set[Any] = set()
        self.removed: set[Any] = set()
        self.index: set[Any] = set()  # what a router holds for this medium
        self.other_media: set[str | None] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            batch = decoder.decode(payload)
            with self._lock:
                for event in batch.events:
                    medium = getattr(event, "medium", None)
                    if medium != MEDIUM:
                        self.other_media.add(medium)
                        continue
                    if isinstance(event, BlockStored):
                        assert event.block_size == BLOCK and len(event.token_ids) == BLOCK
                        self.stored.update(event.block_hashes)
                        self.index.update(event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        self.removed.update(event.block_hashes)
                        self.index.difference_update(event.block_hashes)

    def leading(self, hashes: list[Any]) -> int:
        """Leading blocks of a prompt the router's index holds."""
        with self._lock:
            count = 0
            for block in hashes:
                if block not in self.index:
                    break
                count += 1
            return count

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cli(*args: str) -> dict[str, Any]:
    """`hf3fsctl ARGS --json` as a fresh process (`helpers.cli_runner`: the CLI zygote's
    child, which has the tokenizer libraries `lookup` loads imported already)."""
    done = run_hf3fsctl(*args, "--json", timeout=RUN_TIMEOUT_S, check=True)
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def _event_hashes(config: Path, model: Path, prompts: list[str]) -> list[list[Any]]:
    """Each prompt's block hashes as vLLM publishes them, computed offline from the store."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    from hf3fsctl.config import load_config
    from hf3fsctl.meta.client import connect
    from hf3fsctl.prompt_keys import load_tokenizer, prompt_block_keys, tokenize

    client = connect(load_config(config, environ={}))
    try:
        (namespace,) = client.namespaces()
    finally:
        client.close()
    tokenizer = load_tokenizer(str(model))
    return [
        [
            maybe_convert_block_hash(BlockHash(bytes.fromhex(key)))
            for key in prompt_block_keys(namespace.manifest, tokenize(tokenizer, text))
        ]
        for text in prompts
    ]


def _until(check: Any, what: Any, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what() if callable(what) else what}"
        )
        time.sleep(0.2)


def test_router_index_from_kv_events_agrees_with_lookup(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "hf3fs.yaml"
    store = tmp_path / "store"
    init = ["init", "--storage-path", str(store), "--create-path", "--write-config", str(config)]
    run_hf3fsctl(*init, timeout=RUN_TIMEOUT_S, check=True)
    kv = json.loads(run_hf3fsctl("vllm-config", "--config", str(config), check=True).stdout)
    kv["kv_connector_extra_config"]["connector.kv_events_poll_s"] = 0.2
    rng = random.Random(11)
    shared = " ".join(f"w{rng.randrange(1000)}" for _ in range(300))
    prompts = [shared + " alpha beta", shared + " gamma delta epsilon"]
    port = _free_port()
    work = tmp_path / "work"
    work.mkdir()
    spec = {
        "model": str(tiny_model),
        "dtype": DTYPE,
        "block": BLOCK,
        "kv": kv,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "prompts": prompts,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONHASHSEED", None)
    router = Subscriber(f"tcp://127.0.0.1:{port}")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(work / "spec.json"), str(work)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _until(
            lambda: (work / "prefilled").exists() or child.poll() is not None,
            "prefill",
            RUN_TIMEOUT_S,  # a fresh process: vLLM's import and the engine's start first
        )
        assert child.poll() is None, child.stderr.read()[-3000:] if child.stderr else ""
        hashes = _event_hashes(config, tiny_model, prompts)
        lookup_args = ["lookup", "--config", str(config), "--model", str(tiny_model)]
        lookup_args += ["--dtype", DTYPE, "--prompt", prompts[0], "--prompt", prompts[1]]

        def router_agrees_with_lookup() -> bool:
            looked = _cli(*lookup_args)["prompts"]
            return all(
                router.leading(h) == p["stored_blocks"] > 0
                for h, p in zip(hashes, looked, strict=True)
            )

        _until(
            router_agrees_with_lookup,
            lambda: (
                f"BlockStored matching lookup ({len(router.stored)} stored; "
                f"other media {router.other_media}; lookup {_cli(*lookup_args)['prompts']})"
            ),
        )
        assert router.other_media, "vLLM's own GPU-medium events should flow beside ours"
        evicted = _cli("evict", "--config", str(config), "--all", "--yes")
        assert evicted["keys"] > 0
        (work / "go").touch()
        every_block = {h for prompt in hashes for h in prompt}
        _until(lambda: every_block <= router.removed, "BlockRemoved for every evicted block")
        looked = _cli(*lookup_args)["prompts"]
        assert [p["stored_blocks"] for p in looked] == [0, 0]
        assert all(router.leading(h) == 0 for h in hashes)
        (work / "stop").touch()
        assert child.wait(timeout=RUN_TIMEOUT_S) == 0, child.stderr.read()[-3000:]
    finally:
        (work / "go").touch()
        (work / "stop").touch()
        if child.poll() is None:
            child.kill()
            child.wait()
        router.close()

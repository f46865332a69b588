"""End-to-end benchmark: a prefix-repetition workload through real vLLM, against its ceilings.

The workload is vLLM's `prefix_repetition` dataset shape: `prefixes` random shared
prefixes of `prefix_tokens` tokens, each followed by `suffixes` distinct random suffixes
of `suffix_tokens` tokens (token ids, so no tokenizer round trip), shuffled with a seed,
`output_tokens` greedy tokens each (`ignore_eos`). Every configuration is a fresh engine
process (`hf3fsctl.vllm_tools.runner`), so "warm" really means another process reading the
store:

- `none`: no connector (vLLM's own prefix cache is on, as it always is). It is pass 1
  of a process that then runs the same prompts again:
- `floor`: pass 2 of that process: every prompt hits vLLM's own prefix cache in the
  same process. No connector can load faster than this, so it is the ceiling of TTFT.
- `cold`: our connector on an empty store (prefill + asynchronous save). Its prefill
  throughput is measured against `none` (the goal: within 10%).
- `warm`: our connector, a fresh process on the same store: loads instead of prefill.
- `warm-dropped` (`drop_page_cache`): `warm` after the store's files were dropped from
  the page cache; `warm-async` (`warm_async`): `warm` with `connector.load_mode=async`.
- `example-cold` / `example-warm` (`peers=("example",)`): vLLM's `ExampleConnector`.
- `lmcache-cold` / `lmcache-warm` (`peers=("lmcache",)`): LMCache's multiprocess server
  mode (docs/vllm.md's recipe), only when the `lmcache` package is importable here. It
  needs vLLM's multiprocess engine, so it is measured against `none-mp` / `floor-mp`,
  the same two passes in that engine mode, with `VLLM_CPU_NUM_OF_RESERVED_CPU=1` in
  every run so each engine gets the same cores (the thread-binding trap).

Our store is made the way a user makes one: `hf3fsctl init --storage-path DIR
--write-config C` then `hf3fsctl vllm-config --config C` (subprocesses, embedded SQLite
metadata), private to the run and removed after it.

Figures per configuration: TTFT p50/p99 (vLLM's per-request `first_token_latency`,
arrival to first token; all requests arrive together unless `sequential`), throughput
(requests/s, output and total tokens/s over the timed `generate()`), prefill throughput
(prompt tokens served per second of the prefill window: arrival to the last first
token, or the sum of TTFTs when sequential), hit rate (vLLM's `num_cached_tokens` over
prompt tokens), the connector's own hit rate, and a hash of the outputs, which must
equal `none`'s. Each figure also appears as a ratio to its ceiling from the same run:
TTFT to `floor`, throughput to `none`.

`url=http://127.0.0.1:PORT` drives a running OpenAI-compatible vLLM server on loopback
instead (streamed `/v1/completions`, httpx): the workload twice, `server` then
`server-repeat`, whose prompts hit the server's own prefix cache (its floor).

`run(settings, progress) -> dict` (one JSON document), `render(document)` (Rich),
`plot(document, path)` (a PNG); `report.publish` hands them out. Nothing here imports vLLM: engines run in child
processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import ipaddress
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from hf3fsctl.bench import report
from hf3fsctl.errors import Hf3fsctlError, InvalidRequest

if TYPE_CHECKING:
    from rich.console import RenderableType

    from hf3fsctl.vllm_tools.runner import EngineResult, RequestResult

MIB = 1 << 20
PEERS = ("example", "lmcache")
# `warm-async`: the load runs off-step and the first lookup never answers in-step.
ASYNC_LOAD = {"connector.load_mode": "async", "connector.lookup_wait_ms": 0}
# Every engine run reserves the same cores, with or without a connector (docs/vllm.md).
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
TOKEN_ID_LIMIT = 4096  # prompt ids stay below every model's vocabulary (the tiny one: 4096)
GOAL_COLD_PREFILL = 0.90  # cold prefill throughput at least 90% of no connector

LABELS = {
    "none": "no connector",
    "floor": "floor: vLLM prefix cache, same process",
    "cold": "ours, cold store",
    "warm": "ours, warm: a fresh process",
    "warm-dropped": "ours, warm, page cache dropped",
    "warm-async": "ours, warm, async load",
    "example-cold": "ExampleConnector, cold",
    "example-warm": "ExampleConnector, warm",
    "none-mp": "no connector, multiprocess engine",
    "floor-mp": "floor, multiprocess engine",
    "lmcache-cold": "LMCache MP server, cold",
    "lmcache-warm": "LMCache MP server, warm: its DRAM tier",
    "server": "server, first pass",
    "server-repeat": "server, same prompts again",
}
# Which runs each configuration is measured against: (no-connector baseline, floor).
REFERENCES = {
    "lmcache-cold": ("none-mp", "floor-mp"),
    "lmcache-warm": ("none-mp", "floor-mp"),
    "floor-mp": ("none-mp", "floor-mp"),
    "server": ("server", "server-repeat"),
    "server-repeat": ("server", "server-repeat"),
}


@dataclass(frozen=True)
class Workload:
    """vLLM's prefix-repetition shape: `prefixes` × `suffixes` prompts."""

    prefixes: int = 4
    suffixes: int = 4
    prefix_tokens: int = 1024
    suffix_tokens: int = 128
    output_tokens: int = 16

    @property
    def requests(self) -> int:
        """Prompts per pass."""
        return self.prefixes * self.suffixes

    @property
    def prompt_tokens(self) -> int:
        """Tokens of one prompt."""
        return self.prefix_tokens + self.suffix_tokens


@dataclass(frozen=True)
class E2ESettings:
    """Everything `run` needs; `resolve` fills what was left unset."""

    workload: Workload = field(default_factory=Workload)
    model: str | None = None  # model directory (None: build SIZES["bench"] under work_dir)
    model_size: str = "bench"  # the tiny model built when `model` is None
    dtype: str = "float32"
    block_size: int = 128
    max_model_len: int | None = None  # None: the prompt, the output and a block of slack
    kv_cache_memory_bytes: int | None = None  # None: room for every prompt of a pass
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    warmup_tokens: int = 512
    peers: tuple[str, ...] = ()
    drop_page_cache: bool = False  # also run `warm-dropped`
    warm_async: bool = False  # also run `warm-async`
    repeats: int = 1  # the whole set again on new prompts and new stores; samples pooled
    sequential: bool = False  # one request at a time (else one batch per pass)
    seed: int = 0
    timeout_s: float = 1800.0  # the whole benchmark
    url: str | None = None  # drive this running server instead of offline engines
    work_dir: Path | None = None  # model cache and the run's private stores
    keep: bool = False  # keep the run's stores
    quick: bool = False


def quick_settings(**overrides: Any) -> E2ESettings:
    """Settings of `--quick` (tiny model, 2×2 prompts of 512+64 tokens), then `overrides`."""
    quick = E2ESettings(
        workload=Workload(
            prefixes=2, suffixes=2, prefix_tokens=512, suffix_tokens=64, output_tokens=8
        ),
        model_size="tiny",
        block_size=32,
        warmup_tokens=64,
        quick=True,
    )
    return replace(quick, **overrides)


def default_work_dir() -> Path:
    """`$XDG_CACHE_HOME/hf3fsctl/bench-e2e` (else `~/.cache/...`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hf3fsctl" / "bench-e2e"


def prefix_repetition_prompts(
    workload: Workload, *, seed: int, vocab: int = TOKEN_ID_LIMIT
) -> list[list[int]]:
    """Token-id prompts: each of `prefixes` random prefixes with `suffixes` random suffixes.

    Shuffled (as vLLM's dataset does); ids avoid 0-2 (bos/eos/pad of the tiny model).
    """
    rng = random.Random(seed)
    top = max(4, min(vocab, TOKEN_ID_LIMIT))
    prompts = []
    for _ in range(workload.prefixes):
        prefix = [rng.randrange(3, top) for _ in range(workload.prefix_tokens)]
        for _ in range(workload.suffixes):
            prompts.append(prefix + [rng.randrange(3, top) for _ in range(workload.suffix_tokens)])
    rng.shuffle(prompts)
    return prompts


def check_loopback_url(url: str) -> str:
    """`url` without a trailing slash, if it is http(s) on a loopback host.

    Raises:
        InvalidRequest: another scheme, no host, or a host that is not loopback.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidRequest(f"--url {url!r} is not an http://HOST:PORT URL")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidRequest(
            f"--url host {host!r} is not loopback",
            hint="the benchmark only drives a server on this machine: "
            "http://127.0.0.1:PORT or http://localhost:PORT",
        )
    return url.rstrip("/")


# --- statistics -----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (0-100) of `values` (0.0 when empty)."""
    return report.percentile(sorted(values), q / 100.0) if values else 0.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return report.ratio(None if a is None else float(a), None if b is None else float(b))


def _hash(outputs: list[Any]) -> str:
    return hashlib.sha256(json.dumps(outputs, separators=(",", ":")).encode()).hexdigest()


@dataclass
class _Samples:
    """One configuration's samples, pooled over repeats."""

    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    generate_s: float = 0.0
    prefill_window_s: float = 0.0
    engine_start_s: float = 0.0
    process_s: float = 0.0
    outputs: list[Any] = field(default_factory=list)
    connector: dict[str, float] = field(default_factory=dict)
    runs: int = 0

    def add_pass(
        self, requests: list[RequestResult], generate_s: float, *, sequential: bool
    ) -> None:
        ttfts = [r.ttft_s for r in requests]
        self.ttft += ttfts
        self.prompt_tokens += sum(r.prompt_tokens for r in requests)
        self.output_tokens += sum(len(r.output_token_ids) for r in requests)
        self.cached_tokens += sum(r.num_cached_tokens for r in requests)
        self.generate_s += generate_s
        self.prefill_window_s += sum(ttfts) if sequential else max(ttfts, default=0.0)
        self.outputs.append([r.output_token_ids for r in requests])
        self.runs += 1

    def add_connector(self, counters: dict[str, Any] | None) -> None:
        for key in (
            "hit_tokens",
            "blocks_loaded",
            "bytes_loaded",
            "load_seconds",
            "blocks_saved",
            "bytes_saved",
            "save_seconds",
            "failed_blocks",
            "save_dropped",
        ):
            value = (counters or {}).get(key)
            if isinstance(value, (int, float)):
                self.connector[key] = self.connector.get(key, 0) + value

    def figures(self) -> dict[str, Any]:
        gen = self.generate_s
        conn = self.connector
        figures: dict[str, Any] = {
            "status": "ok",
            "requests": len(self.ttft),
            "ttft_p50_s": percentile(self.ttft, 50),
            "ttft_p99_s": percentile(self.ttft, 99),
            "ttft_mean_s": sum(self.ttft) / len(self.ttft) if self.ttft else 0.0,
            "ttft_max_s": max(self.ttft, default=0.0),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": _ratio(self.cached_tokens, self.prompt_tokens),
            "connector_hit_rate": (
                _ratio(conn["hit_tokens"], self.prompt_tokens) if "hit_tokens" in conn else None
            ),
            "generate_s": gen,
            "requests_per_s": _ratio(len(self.ttft), gen),
            "output_tokens_per_s": _ratio(self.output_tokens, gen),
            "total_tokens_per_s": _ratio(self.prompt_tokens + self.output_tokens, gen),
            "prefill_window_s": self.prefill_window_s,
            "prefill_tokens_per_s": _ratio(self.prompt_tokens, self.prefill_window_s),
            "engine_start_s": self.engine_start_s / max(1, self.runs),
            "process_s": self.process_s,
            "outputs_sha256": _hash(self.outputs),
        }
        if conn:
            loaded, saved = conn.get("bytes_loaded", 0), conn.get("bytes_saved", 0)
            figures["connector"] = {
                **conn,
                "load_gbps": _ratio(loaded / 1e9, conn.get("load_seconds")),
                "save_gbps": _ratio(saved / 1e9, conn.get("save_seconds")),
            }
        return figures


# --- the offline engines ------------------------------------------------------------


def _model_shape(model: Path) -> dict[str, int]:
    """Vocabulary and KV bytes per token (at 1 byte per element) from `config.json`."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads") or 0)
    head_dim = int(config.get("head_dim") or (config.get("hidden_size", 0) // max(1, heads)))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    layers = int(config.get("num_hidden_layers") or 0)
    return {
        "vocab_size": int(config.get("vocab_size") or TOKEN_ID_LIMIT),
        "kv_elements_per_token": 2 * layers * kv_heads * head_dim,
    }


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "float", "fp32") else 2


def auto_kv_cache_bytes(settings: E2ESettings, elements_per_token: int) -> int:
    """Room for every block of one pass (so the floor pass finds all of them), + 25%."""
    w, bs = settings.workload, settings.block_size
    prefix_blocks = w.prefixes * (w.prefix_tokens // bs)
    per_request = math.ceil((w.prompt_tokens + w.output_tokens) / bs) - w.prefix_tokens // bs + 1
    warmup = math.ceil((settings.warmup_tokens + w.output_tokens) / bs) + 1
    blocks = prefix_blocks + w.requests * per_request + warmup
    per_block = bs * elements_per_token * _dtype_bytes(settings.dtype)
    need = int(blocks * per_block * 1.25) + 16 * MIB
    return max(64 * MIB, math.ceil(need / MIB) * MIB)


def auto_max_model_len(settings: E2ESettings) -> int:
    """The longest request (a prompt or the warm-up, plus output) and a block of slack."""
    w = settings.workload
    longest = max(w.prompt_tokens, settings.warmup_tokens) + w.output_tokens
    return math.ceil(longest / settings.block_size) * settings.block_size + settings.block_size


def _clean_env() -> dict[str, str]:
    """This environment without `HF3FSCTL_*` config (the store must be the private one)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HF3FSCTL_") or k in ("HF3FSCTL_STATE_DIR", "HF3FSCTL_DEBUG")
    }


def make_store(directory: Path) -> dict[str, Any]:
    """A private store, made as a user would: `hf3fsctl init`, then `hf3fsctl vllm-config`.

    Returns:
        `{"config_file", "storage_path", "kv_transfer_config"}`.

    Raises:
        Hf3fsctlError: either command failed (its stderr is in the message).
    """
    storage, config_file = directory / "storage", directory / "hf3fs.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "hf3fsctl"]
    steps = [
        [
            *base,
            "init",
            "--storage-path",
            str(storage),
            "--metadata-url",
            f"sqlite:///{storage / 'metadata.db'}",
            "--write-config",
            str(config_file),
            "--json",
        ],
        [*base, "vllm-config", "--config", str(config_file), "--compact"],
    ]
    outputs = []
    for argv in steps:
        proc = subprocess.run(
            argv, cwd=directory, env=_clean_env(), capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise Hf3fsctlError(
                f"`hf3fsctl {argv[3]}` for the benchmark store failed "
                f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
            )
        outputs.append(proc.stdout)
    return {
        "config_file": str(config_file),
        "storage_path": str(storage),
        "kv_transfer_config": json.loads(outputs[1]),
    }


def drop_page_cache(root: Path) -> int:
    """Flush and drop every file under `root` from the page cache; returns bytes on disk."""
    dropped = 0
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_blocks * 512  # allocated, not the sparse size
        finally:
            os.close(fd)
    return dropped


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lmcache_available() -> bool:
    """Whether the `lmcache` package is importable here (it is never a dependency)."""
    try:
        return importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        return False


class _LMCacheServer:
    """LMCache's multiprocess server on loopback, with a file-system L2 (docs/vllm.md)."""

    def __init__(self, base_path: Path, chunk_size: int, log_path: Path) -> None:
        self.port, self.http_port = _free_port(), _free_port()
        base_path.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(chunk_size),
            "--l1-size-gb",
            "2",
            "--eviction-policy",
            "LRU",
            "--disable-observability",  # its exporter needs packages we do not install
            "--l2-adapter",
            json.dumps({"type": "fs", "base_path": str(base_path)}),
        ]
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.log_path = log_path

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited {self.proc.returncode}: {self.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"LMCache server not listening after {timeout_s:.0f} s: {self.tail()}")

    def tail(self) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-8:])

    def kv_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.port,
                "lmcache.mp.mp_transfer_mode": "lmcache_driven",
            },
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


def _short_error(message: str, lines: int = 6) -> str:
    useful = [ln for ln in message.splitlines() if ln.strip()]
    return "\n".join(useful[-lines:])


class _Offline:
    """Runs the configurations of one benchmark, repeat after repeat."""

    def __init__(self, settings: E2ESettings, log: Callable[[str], None]) -> None:
        self.s = settings
        self.log = log
        self.deadline = time.monotonic() + settings.timeout_s
        self.samples: dict[str, _Samples] = {}
        self.failures: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.notes: list[str] = []
        self.engine_info: dict[str, Any] = {}

    def names(self) -> list[str]:
        names = ["none", "floor", "cold", "warm"]
        if self.s.drop_page_cache:
            names.append("warm-dropped")
        if self.s.warm_async:
            names.append("warm-async")
        if "example" in self.s.peers:
            names += ["example-cold", "example-warm"]
        if "lmcache" in self.s.peers:
            names += ["none-mp", "floor-mp", "lmcache-cold", "lmcache-warm"]
        return names

    def _engine(
        self,
        names: list[str],
        model: str,
        prompts: list[list[int]],
        kv: dict[str, Any] | None,
        *,
        multiprocess: bool = False,
    ) -> EngineResult | None:
        """One engine process for `names` (two names: two passes); None when it failed."""
        from hf3fsctl.vllm_tools.runner import EngineRun, EngineRunError, run_engine

        s = self.s
        remaining = self.deadline - time.monotonic()
        if remaining < 15:
            for name in names:
                self.skipped.setdefault(name, "skipped: the --timeout budget was spent")
            self.log(f"{'+'.join(names)}: skipped (the --timeout budget is spent)")
            return None
        if any(name in self.failures for name in names):
            self.log(f"{'+'.join(names)}: skipped (failed in an earlier repeat)")
            return None
        env = dict(ENGINE_ENV)
        if multiprocess:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        run = EngineRun(
            model=model,
            prompts=prompts,
            max_tokens=s.workload.output_tokens,
            block_size=s.block_size,
            kv_transfer_config=kv,
            kv_cache_memory_bytes=s.kv_cache_memory_bytes or 0,
            max_model_len=s.max_model_len or 0,
            batch=not s.sequential,
            max_num_batched_tokens=s.max_num_batched_tokens,
            warmup_tokens=s.warmup_tokens,
            dtype=s.dtype,
            env=env,
            timeout_s=remaining,
            passes=len(names),
        )
        try:
            result = run_engine(run)
        except EngineRunError as exc:
            short = _short_error(str(exc))
            for name in names:
                self.failures[name] = short
            self.log(f"{'+'.join(names)}: FAILED\n{short}")
            return None
        self.engine_info = self.engine_info or result.engine_info
        passes = result.pass_results or []
        for name, one in zip(names, passes, strict=False):
            sample = self.samples.setdefault(name, _Samples())
            sample.add_pass(one.requests, one.generate_s, sequential=s.sequential)
            sample.engine_start_s += result.engine_start_s
            sample.process_s += result.wall_s
            p50 = percentile([r.ttft_s for r in one.requests], 50)
            cached = sum(r.num_cached_tokens for r in one.requests)
            total = sum(r.prompt_tokens for r in one.requests)
            self.log(
                f"{name:<13} TTFT p50 {p50:7.3f} s  generate {one.generate_s:6.2f} s  "
                f"cached {cached}/{total} tokens  process {result.wall_s:5.1f} s"
            )
        if kv is not None and kv.get("kv_connector") == "Hf3fsctlConnector":
            self.samples[names[-1]].add_connector(result.connector)
        return result

    def run_repeat(self, repeat: int, model: str, vocab: int, scratch: Path) -> None:
        s = self.s
        names = self.names()
        prompts = prefix_repetition_prompts(s.workload, seed=s.seed + repeat, vocab=vocab)
        tag = f"repeat {repeat + 1}/{s.repeats}: " if s.repeats > 1 else ""
        self.log(f"{tag}{len(prompts)} prompts of {s.workload.prompt_tokens} tokens")
        base = self._engine(["none", "floor"], model, prompts, None)
        if base is None and "none" in self.failures:
            raise Hf3fsctlError(
                f"the no-connector run failed, so nothing can be compared:\n{self.failures['none']}"
            )
        store_dir = scratch / f"ours-{repeat}"
        store = make_store(store_dir)
        kv = store["kv_transfer_config"]
        self._engine(["cold"], model, prompts, kv)
        self._engine(["warm"], model, prompts, kv)
        if "warm-dropped" in names:
            dropped = drop_page_cache(Path(store["storage_path"]))
            self.log(f"dropped {dropped / MIB:.0f} MiB of the store from the page cache")
            self._engine(["warm-dropped"], model, prompts, kv)
        if "warm-async" in names:
            extra = {**kv["kv_connector_extra_config"], **ASYNC_LOAD}
            self._engine(["warm-async"], model, prompts, {**kv, "kv_connector_extra_config": extra})
        if "example-cold" in names:
            from hf3fsctl.vllm_tools.runner import example_kv_config

            example = example_kv_config(scratch / f"example-{repeat}")
            self._engine(["example-cold"], model, prompts, example)
            self._engine(["example-warm"], model, prompts, example)
        if "lmcache-cold" in names:
            self._lmcache(repeat, model, prompts, scratch)

    def _lmcache(self, repeat: int, model: str, prompts: list[list[int]], scratch: Path) -> None:
        group = ["none-mp", "floor-mp", "lmcache-cold", "lmcache-warm"]
        if not lmcache_available():
            for name in group:
                self.skipped[name] = "skipped: the lmcache package is not importable here"
            if repeat == 0:
                self.notes.append(
                    "--peer lmcache skipped: the `lmcache` package is not importable (it is "
                    "never a dependency; install it into a separate --target directory as "
                    "docs/vllm.md says and put that directory on PYTHONPATH)"
                )
            return
        self._engine(["none-mp", "floor-mp"], model, prompts, None, multiprocess=True)
        server = _LMCacheServer(
            scratch / f"lmcache-{repeat}",
            chunk_size=max(256, self.s.block_size),
            log_path=scratch / f"lmcache-{repeat}.log",
        )
        try:
            try:
                server.wait_ready(min(90.0, max(1.0, self.deadline - time.monotonic())))
            except RuntimeError as exc:
                for name in ("lmcache-cold", "lmcache-warm"):
                    self.failures[name] = _short_error(str(exc))
                self.log(f"lmcache: server did not start\n{exc}")
                return
            kv = server.kv_config()
            self._engine(["lmcache-cold"], model, prompts, kv, multiprocess=True)
            self._engine(["lmcache-warm"], model, prompts, kv, multiprocess=True)
        finally:
            server.stop()


def _resolve_model(settings: E2ESettings, work: Path, log: Callable[[str], None]) -> Path:
    if settings.model:
        model = Path(settings.model).expanduser().resolve()
        if not (model / "config.json").is_file():
            raise InvalidRequest(f"--model {settings.model!r} is not a model directory")
        return model
    from hf3fsctl.vllm_tools.tiny_model import SIZES, build_tiny_model

    if settings.model_size not in SIZES:
        raise InvalidRequest(f"unknown tiny model size {settings.model_size!r}")
    target = work / f"model-{settings.model_size}"
    log(f"model: the {settings.model_size!r} tiny model under {target} (built once)")
    return build_tiny_model(target, SIZES[settings.model_size])


def _validate(settings: E2ESettings) -> None:
    w = settings.workload
    if min(w.prefixes, w.suffixes, w.output_tokens) < 1:
        raise InvalidRequest("--prefixes, --suffixes and --output-tokens must be at least 1")
    if w.prefix_tokens < 1 or w.suffix_tokens < 0:
        raise InvalidRequest("--prefix-tokens must be at least 1, --suffix-tokens at least 0")
    if settings.block_size < 1 or settings.block_size % 32:
        raise InvalidRequest(
            f"--block-size {settings.block_size} is not a multiple of 32",
            hint="vLLM's CPU attention needs block sizes that are multiples of 32",
        )
    if settings.repeats < 1:
        raise InvalidRequest("--repeats must be at least 1")
    if settings.timeout_s <= 0:
        raise InvalidRequest("--timeout must be positive")
    unknown = sorted(set(settings.peers) - set(PEERS))
    if unknown:
        raise InvalidRequest(f"unknown --peer {', '.join(unknown)}; choose from {PEERS}")
    offline_only = {
        "--peer": bool(settings.peers),
        "--warm-dropped": settings.drop_page_cache,
        "--warm-async": settings.warm_async,
        "--repeats": settings.repeats > 1,
    }
    given = [flag for flag, used in offline_only.items() if used]
    if settings.url and given:
        raise InvalidRequest(
            f"{', '.join(given)}: only with offline engines, not with --url",
            hint="a running server has its own connector; drop --url to compare configurations",
        )


def run(settings: E2ESettings, progress: report.Progress | None = None) -> dict[str, Any]:
    """Run the benchmark; return its JSON document (settings, figures, ratios, notes).

    Raises:
        InvalidRequest: a bad setting, or a non-loopback `url`.
        Hf3fsctlError: the no-connector run (or the server's first pass) failed.
    """
    log = progress or (lambda message: None)
    _validate(settings)
    if settings.url:
        return _run_url(settings, log)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    work = (settings.work_dir or default_work_dir()).expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = _resolve_model(settings, work, log)
    shape = _model_shape(model)
    settings = replace(
        settings,
        model=str(model),
        max_model_len=settings.max_model_len or auto_max_model_len(settings),
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes
        or auto_kv_cache_bytes(settings, shape.get("kv_elements_per_token") or 64 * 1024),
    )
    runner = _Offline(settings, log)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    try:
        for repeat in range(settings.repeats):
            runner.run_repeat(repeat, str(model), shape.get("vocab_size", TOKEN_ID_LIMIT), scratch)
    finally:
        if settings.keep:
            log(f"kept the run's stores under {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    configurations: dict[str, dict[str, Any]] = {}
    for name in runner.names():
        entry: dict[str, Any] = {"label": LABELS[name]}
        if name in runner.failures:  # even when an earlier repeat gave samples
            entry.update({"status": "failed", "error": runner.failures[name]})
        elif name in runner.samples:
            entry.update(runner.samples[name].figures())
        else:
            entry.update({"status": "skipped", "note": runner.skipped.get(name, "not run")})
        configurations[name] = entry
    document = _document(settings, configurations, runner.notes, runner.engine_info)
    document["engine"]["mode"] = "in-process (lmcache runs: multiprocess)"
    document["seconds"] = time.monotonic() - started
    # Other work on the machine skews every figure: say how busy it was.
    document["machine"]["load_average_1min"] = {"start": load_before, "end": os.getloadavg()[0]}
    if settings.keep:
        document["scratch_dir"] = str(scratch)
    return document


def _settings_dict(settings: E2ESettings) -> dict[str, Any]:
    data = asdict(settings)
    data["work_dir"] = str(settings.work_dir) if settings.work_dir else None
    data["peers"] = list(settings.peers)
    return data


def _document(
    settings: E2ESettings,
    configurations: dict[str, dict[str, Any]],
    notes: list[str],
    engine_info: dict[str, Any],
) -> dict[str, Any]:
    """The JSON document: settings, figures, each figure's ratio to its ceiling, notes."""
    w = settings.workload
    base_hash = configurations.get("none", configurations.get("server", {})).get("outputs_sha256")
    for name, entry in configurations.items():
        if entry.get("status") != "ok":
            continue
        none_name, floor_name = REFERENCES.get(name, ("none", "floor"))
        none, floor = configurations.get(none_name, {}), configurations.get(floor_name, {})
        entry["reference"] = {"baseline": none_name, "floor": floor_name}
        entry["outputs_match_baseline"] = entry["outputs_sha256"] == none.get("outputs_sha256")
        entry["outputs_match_none"] = entry["outputs_sha256"] == base_hash
        entry["ratios"] = {
            "ttft_p50_over_floor": _ratio(entry["ttft_p50_s"], floor.get("ttft_p50_s")),
            "ttft_p99_over_floor": _ratio(entry["ttft_p99_s"], floor.get("ttft_p99_s")),
            "ttft_p50_over_baseline": _ratio(entry["ttft_p50_s"], none.get("ttft_p50_s")),
            "prefill_tokens_per_s_over_baseline": _ratio(
                entry["prefill_tokens_per_s"], none.get("prefill_tokens_per_s")
            ),
            "total_tokens_per_s_over_baseline": _ratio(
                entry["total_tokens_per_s"], none.get("total_tokens_per_s")
            ),
            "hit_rate_over_floor": _ratio(entry["hit_rate"], floor.get("hit_rate")),
        }

    def fig(name: str, key: str) -> Any:
        entry = configurations.get(name, {})
        return entry.get("ratios", {}).get(key) if entry.get("status") == "ok" else None

    def ttft(name: str) -> float | None:
        entry = configurations.get(name, {})
        return entry.get("ttft_p50_s") if entry.get("status") == "ok" else None

    if settings.url:
        ratios = {
            "first_ttft_p50_over_repeat": _ratio(ttft("server"), ttft("server-repeat")),
        }
        goals: dict[str, bool | None] = {}
        ceiling = {
            "ttft": "server-repeat: the same prompts again, hitting the server's own prefix cache",
            "throughput": "server: the first pass",
            "ratio": "*_over_floor: divided by server-repeat's figure; *_over_baseline: by "
            "server's (the same run)",
        }
    else:
        cold_prefill = fig("cold", "prefill_tokens_per_s_over_baseline")
        ratios = {
            "warm_ttft_p50_over_floor": fig("warm", "ttft_p50_over_floor"),
            "warm_ttft_p99_over_floor": fig("warm", "ttft_p99_over_floor"),
            "warm_ttft_p50_over_none": fig("warm", "ttft_p50_over_baseline"),
            "warm_hit_rate_over_floor": fig("warm", "hit_rate_over_floor"),
            "cold_ttft_p50_over_none": fig("cold", "ttft_p50_over_baseline"),
            "cold_prefill_throughput_over_none": cold_prefill,
            "cold_total_throughput_over_none": fig("cold", "total_tokens_per_s_over_baseline"),
            "warm_dropped_ttft_p50_over_floor": fig("warm-dropped", "ttft_p50_over_floor"),
            "warm_async_ttft_p50_over_floor": fig("warm-async", "ttft_p50_over_floor"),
            "example_warm_ttft_p50_over_floor": fig("example-warm", "ttft_p50_over_floor"),
            "ours_warm_over_example_warm": _ratio(ttft("warm"), ttft("example-warm")),
            "lmcache_warm_ttft_p50_over_floor_mp": fig("lmcache-warm", "ttft_p50_over_floor"),
            # Each against its own engine mode's floor: ours in-process, LMCache multiprocess.
            "ours_over_lmcache_warm_vs_floor": _ratio(
                fig("warm", "ttft_p50_over_floor"), fig("lmcache-warm", "ttft_p50_over_floor")
            ),
        }
        goals = {
            "cold_prefill_within_10pct_of_none": (
                None if cold_prefill is None else cold_prefill >= GOAL_COLD_PREFILL
            ),
            "outputs_identical": all(
                e.get("outputs_match_none") for e in configurations.values() if "ratios" in e
            ),
        }
        ceiling = {
            "ttft": "floor: the same prompts hitting vLLM's own prefix cache in the same "
            "process (a second pass in one engine)",
            "throughput": "none: the same prompts with no connector",
            "hit_rate": "floor's hit rate (every full block but the one holding the last "
            "prompt token)",
            "ratio": "each configuration's *_over_floor is its figure divided by its floor's "
            "(floor, or floor-mp for LMCache), *_over_baseline by its no-connector run's "
            "(none, or none-mp), all measured in this run",
        }
    return {
        "benchmark": "e2e",
        "schema": report.SCHEMA,
        "machine": report.machine(),
        "mode": "url" if settings.url else "offline",
        "settings": _settings_dict(settings),
        "workload": {
            "dataset": "prefix_repetition",
            **asdict(w),
            "requests_per_pass": w.requests,
            "arrival": "one at a time" if settings.sequential else "all at once (one batch)",
            "repeats": settings.repeats,
            "seed": settings.seed,
        },
        "engine": {
            "model": settings.model,
            "dtype": settings.dtype,
            "block_size": settings.block_size,
            "max_model_len": settings.max_model_len,
            "kv_cache_memory_bytes": settings.kv_cache_memory_bytes,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            **{f"reported_{k}": v for k, v in engine_info.items()},
        },
        "ceiling": ceiling,
        "configurations": configurations,
        "ratios": ratios,
        "goals": goals,
        "notes": notes,
    }


# --- a running server (--url) -----------------------------------------------------------


async def _stream_one(
    client: Any, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One streamed completion: TTFT (first chunk with a choice), text and usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise Hf3fsctlError(f"{url}/v1/completions answered {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(chunk["choices"][0].get("text") or "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft if ttft is not None else end,
        "text": "".join(text),
        "prompt_tokens": int(usage.get("prompt_tokens") or len(prompt)),
        "output_tokens": int(usage.get("completion_tokens") or len(text)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


async def _url_passes(
    settings: E2ESettings, url: str, prompts: list[list[int]], log: Callable[[str], None]
) -> tuple[str, list[tuple[list[dict[str, Any]], float]]]:
    import httpx

    remaining = max(1.0, settings.timeout_s)
    timeout = httpx.Timeout(remaining, connect=10.0)
    limits = httpx.Limits(max_connections=max(4, len(prompts)))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        try:
            models = (await client.get(f"{url}/v1/models")).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise Hf3fsctlError(f"no OpenAI-compatible server at {url}: {exc}") from None
        model = settings.model or models["data"][0]["id"]
        log(f"server {url}, model {model}")
        out = settings.workload.output_tokens
        if settings.warmup_tokens:
            rng = random.Random(f"{os.getpid()}-{time.time_ns()}")
            warm = [rng.randrange(3, TOKEN_ID_LIMIT) for _ in range(settings.warmup_tokens)]
            await _stream_one(client, url, model, warm, out)
        passes = []
        for name in ("server", "server-repeat"):
            start = time.perf_counter()
            if settings.sequential:
                results = [await _stream_one(client, url, model, p, out) for p in prompts]
            else:
                results = list(
                    await asyncio.gather(
                        *(_stream_one(client, url, model, p, out) for p in prompts)
                    )
                )
            elapsed = time.perf_counter() - start
            p50 = percentile([r["ttft_s"] for r in results], 50)
            log(f"{name:<13} TTFT p50 {p50:7.3f} s  pass {elapsed:6.2f} s")
            passes.append((results, elapsed))
    return model, passes


def _run_url(settings: E2ESettings, log: Callable[[str], None]) -> dict[str, Any]:
    started = time.monotonic()
    url = check_loopback_url(settings.url or "")
    settings = replace(settings, url=url)
    prompts = prefix_repetition_prompts(settings.workload, seed=settings.seed)
    import httpx

    try:
        model, passes = asyncio.run(
            asyncio.wait_for(_url_passes(settings, url, prompts, log), settings.timeout_s)
        )
    except (asyncio.TimeoutError, TimeoutError):
        raise Hf3fsctlError(
            f"the server at {url} did not finish the workload within --timeout "
            f"{settings.timeout_s:.0f} s"
        ) from None
    except httpx.HTTPError as exc:
        raise Hf3fsctlError(f"the server at {url} failed: {type(exc).__name__}: {exc}") from None
    configurations: dict[str, dict[str, Any]] = {}
    for name, (results, elapsed) in zip(("server", "server-repeat"), passes, strict=True):
        sample = _Samples()
        ttfts = [r["ttft_s"] for r in results]
        sample.ttft = ttfts
        sample.prompt_tokens = sum(r["prompt_tokens"] for r in results)
        sample.output_tokens = sum(r["output_tokens"] for r in results)
        sample.cached_tokens = sum(r["cached_tokens"] for r in results)
        sample.generate_s = elapsed
        sample.prefill_window_s = sum(ttfts) if settings.sequential else max(ttfts)
        sample.outputs = [r["text"] for r in results]
        figures = sample.figures()
        if not sample.cached_tokens:
            figures["hit_rate"] = None  # the server did not report cached tokens
        figures.pop("engine_start_s")
        configurations[name] = {"label": LABELS[name], **figures}
    notes = [
        "the server's own connector and prefix cache are whatever it was started with; "
        "hit rates need vLLM's --enable-prompt-tokens-details"
    ]
    document = _document(replace(settings, model=model), configurations, notes, {})
    document["engine"] = {"url": url, "model": model}
    document["seconds"] = time.monotonic() - started
    return document


# --- rendering --------------------------------------------------------------------------


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{format(value, spec)}{suffix}"


def render(document: dict[str, Any]) -> RenderableType:
    """For people: the figures table, the ratios to the ceilings, goals and notes."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    w = document["workload"]
    engine = document["engine"]
    where = (
        f"server {engine['url']}"
        if document["mode"] == "url"
        else f"block {engine.get('block_size')}, {engine.get('dtype')}"
    )
    title = (
        f"e2e: {w['prefixes']} prefixes × {w['suffixes']} suffixes, {w['prefix_tokens']}+"
        f"{w['suffix_tokens']} prompt tokens, {w['output_tokens']} output tokens, "
        f"{w['arrival']}, {where}"
    )
    table = Table(title=title, title_justify="left", header_style="bold")
    columns = (
        "configuration",
        "TTFT p50",
        "TTFT p99",
        "p50 × floor",
        "hit rate",
        "prefill tok/s",
        "× none",
        "tok/s",
        "req/s",
        "outputs",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("configuration",) else "right")
    problems: list[Text] = []
    for name, entry in document["configurations"].items():
        label = f"{name} ({entry['label']})"
        if entry.get("status") != "ok":
            reason = entry.get("error") or entry.get("note") or ""
            last = reason.splitlines()[-1].removeprefix("[rank0]: ") if reason else ""
            table.add_row(label, Text(entry["status"], style="yellow"))
            problems.append(Text(f"{name} {entry['status']}: {last[:200]}", style="yellow"))
            continue
        r = entry.get("ratios", {})
        same = entry.get("outputs_match_none")
        table.add_row(
            label,
            _fmt(entry["ttft_p50_s"], ".3f", " s"),
            _fmt(entry["ttft_p99_s"], ".3f", " s"),
            _fmt(r.get("ttft_p50_over_floor"), ".2f", "×"),
            _fmt(None if entry["hit_rate"] is None else entry["hit_rate"] * 100, ".1f", "%"),
            _fmt(entry["prefill_tokens_per_s"], ",.0f"),
            _fmt(r.get("prefill_tokens_per_s_over_baseline"), ".2f", "×"),
            _fmt(entry["total_tokens_per_s"], ",.0f"),
            _fmt(entry["requests_per_s"], ".2f"),
            Text("same" if same else "DIFFER", style="green" if same else "bold red"),
        )
    out: list[RenderableType] = [table, *problems]
    ratios = Table.grid(padding=(0, 2))
    ratios.title = "ratios (ceilings measured in the same run)"
    ratios.title_justify = "left"
    ratios.add_column(style="bold")
    ratios.add_column()
    for kind, ceiling in document["ceiling"].items():
        if kind != "ratio":
            ratios.add_row(f"{kind} ceiling", ceiling)
    for key, value in document["ratios"].items():
        if value is not None:
            ratios.add_row(key, f"{value:.3f}")
    for key, value in document["goals"].items():
        shown = "n/a" if value is None else ("met" if value else "NOT met")
        ratios.add_row(f"goal {key}", shown)
    out.append(ratios)
    for note in document.get("notes", []):
        out.append(Text(f"note: {note}", style="dim"))
    machine = document.get("machine", {})
    load = machine.get("load_average_1min")
    if load:
        out.append(
            Text(
                f"machine: {machine.get('cpus')} CPUs, 1-minute load average "
                f"{load['start']:.1f} at the start, {load['end']:.1f} at the end "
                f"(other work skews every figure); {document.get('seconds', 0):.0f} s in all",
                style="dim",
            )
        )
    return Group(*out)


def plot(document: dict[str, Any], path: Path) -> None:
    """A PNG at `path`: TTFT p50/p99 bars per configuration with the floor as a line, and
    prefill throughput bars with no connector (and the cold goal) as lines."""
    ok = {n: e for n, e in document["configurations"].items() if e.get("status") == "ok"}
    names = list(ok)
    xs = list(range(len(names)))
    fig = report.figure(13, 5.2)
    ax_ttft, ax_tput = fig.subplots(1, 2)
    width = 0.38
    p50 = [ok[n]["ttft_p50_s"] for n in names]
    p99 = [ok[n]["ttft_p99_s"] for n in names]
    ax_ttft.bar([x - width / 2 for x in xs], p50, width, label="p50")
    ax_ttft.bar([x + width / 2 for x in xs], p99, width, label="p99")
    for floor, style in (("floor", "-"), ("floor-mp", ":"), ("server-repeat", "-")):
        if floor in ok:
            ax_ttft.axhline(
                ok[floor]["ttft_p50_s"],
                color="black",
                linestyle=style,
                linewidth=1,
                label=f"{floor} p50 (the ceiling)",
            )
    ax_ttft.set_yscale("log")
    if p50:
        ax_ttft.set_ylim(bottom=min(p50) / 2)
    ax_ttft.set_ylabel("time to first token (s, log scale)")
    ax_ttft.set_title("TTFT per configuration")
    tput = [ok[n]["prefill_tokens_per_s"] or 0.0 for n in names]
    ax_tput.bar(xs, tput, color="tab:green")
    for base, style in (("none", "-"), ("none-mp", ":"), ("server", "-")):
        value = ok.get(base, {}).get("prefill_tokens_per_s")
        if value:
            ax_tput.axhline(value, color="black", linestyle=style, linewidth=1, label=base)
            ax_tput.axhline(
                value * GOAL_COLD_PREFILL,
                color="tab:red",
                linestyle=style,
                linewidth=0.8,
                label=f"{base} × {GOAL_COLD_PREFILL:.0%} (the cold goal)",
            )
    ax_tput.set_yscale("log")
    if any(tput):
        ax_tput.set_ylim(bottom=min(t for t in tput if t) / 2)
    ax_tput.set_ylabel("prompt tokens per second of prefill (log scale)")
    ax_tput.set_title("prefill throughput")
    for ax in (ax_ttft, ax_tput):
        ax.set_xticks(xs, names, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=8)
    missing = [f"{n} {e['status']}" for n, e in document["configurations"].items() if n not in ok]
    if missing:
        fig.text(0.01, 0.005, "not shown: " + ", ".join(missing), fontsize=8, color="tab:red")
    w = document["workload"]
    fig.suptitle(
        f"hf3fsctl bench e2e: {w['prefixes']}×{w['suffixes']} prompts of "
        f"{w['prefix_tokens']}+{w['suffix_tokens']} tokens, {w['output_tokens']} out, "
        f"{w['arrival']}"
    )
    report.save(fig, Path(path))

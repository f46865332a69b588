"""Run one real vLLM engine in a fresh subprocess and get its results back as JSON.

Contract: `run_engine(EngineRun(...))` starts `python -m hf3fsctl.vllm_tools.runner SPEC OUT` with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine core, scheduler and worker in that one
process), builds `vllm.LLM` with `enforce_eager=True` and an explicit
`kv_cache_memory_bytes`, runs one unrelated warm-up request, then the prompts (greedy),
shuts the engine down (so a connector finishes its asynchronous saves) and returns an
`EngineResult`: per request the output token ids, vLLM's own `num_cached_tokens` and
time to first token (vLLM's per-request `first_token_latency`, arrival to first token),
the wall time, and the connector's cumulative counters
(`hf3fsctl_connector.stats.process_totals()`) minus those of the warm-up.

`passes=2` runs the same prompts twice in the one engine: the second pass hits vLLM's
own prefix cache (the floor a connector's load is measured against). `requests` and
`generate_s` are then the last pass's; `pass_results` holds every pass.

Every call is a fresh process, so "warm" really means another process reading the
store. In the test suite that process may be forked from the session's engine zygote
(`zygote.py`: vLLM imported once, no engine, no connector) instead of `python -m`; runs it
cannot take (other import-time environment, tensor parallel) start fresh, as does every run
outside the tests. A run that fails or passes its timeout raises `EngineRunError` carrying the
tail of the child's stderr.

Stdlib only at import time: the test suite, `benchmarks/bench_vllm.py` and
`scripts/demo.py` import it without torch or vLLM. Not part of the core: nothing in
`hf3fsctl` imports it (vLLM only ever runs in the child process).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Our connector, as vLLM loads it (module path wins over the plugin registry).
CONNECTOR_NAME = "Hf3fsctlConnector"
CONNECTOR_MODULE = "hf3fsctl_connector.connector"
MIB = 1 << 20


@dataclass
class EngineRun:
    """One engine process: model, prompts, sampling and KV transfer settings."""

    model: str  # model directory
    prompts: list[list[int]] | list[str]  # token ids, or text
    max_tokens: int = 8  # greedy tokens per request (ignore_eos, so always this many)
    block_size: int = 32  # tokens per KV block (a multiple of 32 on CPU)
    kv_transfer_config: dict[str, Any] | None = None  # None = no connector
    kv_cache_memory_bytes: int = 128 * MIB
    max_model_len: int = 8192
    batch: bool = False  # one generate() for all prompts (batched); else one per prompt
    max_num_batched_tokens: int | None = None  # chunked-prefill budget per step
    warmup_tokens: int = 64  # length of the unrelated warm-up prompt; 0 = no warm-up
    tensor_parallel_size: int = 1
    dtype: str | None = None  # None = the model's own
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the child
    timeout_s: float = 300.0
    passes: int = 1  # run the prompts this many times in the one engine (2 = floor)
    engine_args: dict[str, Any] = field(default_factory=dict)  # more `vllm.LLM` arguments


@dataclass
class RequestResult:
    """What one request produced."""

    prompt_tokens: int
    output_token_ids: list[int]
    num_cached_tokens: int  # vLLM's own count: local prefix cache + external (connector)
    ttft_s: float  # vLLM's first_token_latency: arrival to first token
    finish_reason: str | None
    queued_s: float = 0.0  # engine core: queued until first scheduled (includes loads)
    prefill_s: float = 0.0  # engine core: first scheduled until first token


@dataclass
class PassResult:
    """One pass over the prompts in an engine (`EngineRun.passes`)."""

    requests: list[RequestResult]
    generate_s: float  # the pass's generate() calls


@dataclass
class EngineResult:
    """What one engine process produced."""

    requests: list[RequestResult]
    engine_start_s: float  # LLM(...) construction
    generate_s: float  # all timed generate() calls, warm-up excluded
    wall_s: float  # the whole child process, as seen by the parent
    connector: dict[str, Any] | None  # connector counters of the timed requests
    connector_totals: dict[str, Any] | None  # raw cumulative counters at exit
    engine_info: dict[str, Any] = field(default_factory=dict)  # dtype, block size, version
    stderr_tail: str = ""
    pass_results: list[PassResult] = field(default_factory=list)  # every pass, in order
    log: str = ""  # the child's whole output (vLLM's log: KV cache size, groups)
    started: str = "fresh"  # "fresh" (python -m) or "forked" (from the session's zygote)

    @property
    def outputs(self) -> list[list[int]]:
        """Output token ids per request."""
        return [r.output_token_ids for r in self.requests]

    @property
    def cached_tokens(self) -> int:
        """Sum of vLLM's `num_cached_tokens` over the requests."""
        return sum(r.num_cached_tokens for r in self.requests)


class EngineRunError(RuntimeError):
    """The engine subprocess failed or ran past its timeout."""


def hf3fsctl_kv_config(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`kv_transfer_config` for our connector.

    Args:
        extra: `kv_connector_extra_config` (config file path and/or dotted overrides).
    """
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra or {}),
    }


def example_kv_config(storage_dir: str | Path) -> dict[str, Any]:
    """`kv_transfer_config` for vLLM's built-in `ExampleConnector` (the peer)."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }


def shared_prefix_prompts(
    count: int, prefix_tokens: int, suffix_tokens: int, *, seed: int = 0, vocab: int = 4096
) -> list[list[int]]:
    """Token-id prompts that share one random prefix and end in distinct random suffixes.

    Ids avoid 0-2 (bos/eos/pad of the tiny model).
    """
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(suffix_tokens)] for _ in range(count)]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process: ours, in-process vLLM, offline, then `extra`."""
    env = os.environ.copy()
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.pop("PYTHONHASHSEED", None)  # vLLM's block hashes must not depend on it
    env.update(extra or {})
    return env


def run_engine(run: EngineRun) -> EngineResult:
    """Run `run` in a fresh Python process and return its results.

    A fresh process is `python -m hf3fsctl.vllm_tools.runner`, or, when the test session
    runs an engine zygote (`zygote.ZYGOTE_ENV`) and the run is eligible, a child forked
    from it after the vLLM imports; either runs `_main` on the same spec.

    Raises:
        EngineRunError: the child exited non-zero or ran past `run.timeout_s`.
    """
    env = child_env(run.env)
    with tempfile.TemporaryDirectory(prefix="vllm-run-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec = asdict(run)
        spec_path.write_text(json.dumps(spec))
        argv = [str(spec_path), str(out_path)]
        start = time.perf_counter()
        done = _run_forked(argv, env, spec, Path(tmp), run.timeout_s)
        started = "fresh" if done is None else "forked"
        if done is None:
            done = _run_fresh(argv, env, run.timeout_s)
        returncode, stdout, stderr = done
        wall = time.perf_counter() - start
        tail = _tail(stderr)
        if returncode != 0 or not out_path.is_file():
            raise EngineRunError(f"vLLM run exited {returncode}:\n{tail}")
        data = json.loads(out_path.read_text())
    return EngineResult(
        requests=[RequestResult(**r) for r in data["requests"]],
        engine_start_s=data["engine_start_s"],
        generate_s=data["generate_s"],
        wall_s=wall,
        connector=data["connector"],
        connector_totals=data["connector_totals"],
        engine_info=data["engine_info"],
        stderr_tail=tail,
        log=stdout + stderr,
        started=started,
        pass_results=[
            PassResult([RequestResult(**r) for r in p["requests"]], p["generate_s"])
            for p in data.get("passes", [])
        ],
    )


def _run_fresh(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hf3fsctl.vllm_tools.runner", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        raise EngineRunError(
            f"vLLM run passed its {timeout_s:.0f} s timeout:\n{_tail(exc.stderr)}"
        ) from None
    return proc.returncode, proc.stdout or "", proc.stderr or ""


def _run_forked(
    argv: list[str], env: dict[str, str], spec: dict[str, Any], tmp: Path, timeout_s: float
) -> tuple[int, str, str] | None:
    """The run in a child of the session's engine zygote; None = start a fresh process."""
    from hf3fsctl.vllm_tools import zygote

    path = os.environ.get(zygote.ZYGOTE_ENV)
    started_with = zygote.zygote_env(path) if path else None
    if not path or started_with is None or not zygote.eligible(env, started_with, spec):
        return None
    try:
        return zygote.run_forked(path, argv, env, tmp, timeout_s)
    except TimeoutError:
        tail = _tail(zygote.read_text(tmp / "stderr.txt"))
        raise EngineRunError(f"vLLM run passed its {timeout_s:.0f} s timeout:\n{tail}") from None
    except ConnectionError as exc:
        tail = _tail(zygote.read_text(tmp / "stderr.txt"))
        raise EngineRunError(f"vLLM run failed: {exc}:\n{tail}") from None


def _tail(text: str | bytes | None, lines: int = 60) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


# --- the child process --------------------------------------------------------------


def _connector_totals() -> dict[str, Any] | None:
    """The connector's process-wide counters, or None when it is not importable."""
    try:
        from hf3fsctl_connector.stats import process_totals
    except ImportError:
        return None
    totals = process_totals()
    return dict(totals) if totals is not None else None


def _wait_for_saves(timeout_s: float = 60.0) -> None:
    """Let the connector finish asynchronous saves, when it is ours."""
    try:
        from hf3fsctl_connector import wait_for_saves
    except ImportError:
        return
    wait_for_saves(timeout_s)


def _span(metrics: Any, start: str, end: str) -> float:
    """Seconds between two engine-core timestamps of a request (0 when unknown)."""
    first, last = getattr(metrics, start, 0.0) or 0.0, getattr(metrics, end, 0.0) or 0.0
    return float(last - first) if first and last else 0.0


def _delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any] | None:
    if after is None:
        return None
    before = before or {}
    out: dict[str, Any] = {}
    for key, value in after.items():
        prev = before.get(key)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        out[key] = value - prev if numeric and isinstance(prev, (int, float)) else value
    # Rates do not subtract: recompute them from the byte and second deltas.
    for kind, done in (("load", "bytes_loaded"), ("save", "bytes_saved")):
        seconds = out.get(f"{kind}_seconds")
        if f"{kind}_gbps" in out and isinstance(seconds, (int, float)):
            moved = out.get(done, 0)
            out[f"{kind}_gbps"] = moved / seconds / 1e9 if seconds > 0 else 0.0
    return out


def _child(spec: EngineRun) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": spec.model,
        "enforce_eager": True,
        "kv_cache_memory_bytes": spec.kv_cache_memory_bytes,
        "block_size": spec.block_size,
        "max_model_len": spec.max_model_len,
        "disable_log_stats": False,  # per-request metrics (first_token_latency)
        "tensor_parallel_size": spec.tensor_parallel_size,
        "seed": 0,
    }
    if spec.dtype:
        kwargs["dtype"] = spec.dtype
    if spec.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = spec.kv_transfer_config
    if spec.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    kwargs.update(spec.engine_args)
    start = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)

    def as_input(prompt: list[int] | str) -> Any:
        return {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt

    if spec.warmup_tokens:
        # Unrelated to every prompt and to earlier processes: a miss that warms the path.
        rng = random.Random(f"{os.getpid()}-{time.time_ns()}")
        warm = [rng.randrange(3, 4000) for _ in range(spec.warmup_tokens)]
        llm.generate([as_input(warm)], params, use_tqdm=False)
        _wait_for_saves()  # so the warm-up's own save is not counted below
    before = _connector_totals()
    passes = []
    for _ in range(max(1, spec.passes)):
        start = time.perf_counter()
        if spec.batch:
            outputs = llm.generate([as_input(p) for p in spec.prompts], params, use_tqdm=False)
        else:
            outputs = [llm.generate([as_input(p)], params, use_tqdm=False)[0] for p in spec.prompts]
        passes.append({"generate_s": time.perf_counter() - start, "requests": _requests(outputs)})
    llm.llm_engine.engine_core.shutdown()  # the connector drains its saves here
    after = _connector_totals()
    import vllm

    config = llm.llm_engine.vllm_config
    info = {
        "vllm_version": vllm.__version__,
        "model": config.model_config.model,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(config.cache_config.cache_dtype),
        "block_size": config.cache_config.block_size,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }
    return {
        "engine_info": info,
        "requests": passes[-1]["requests"],
        "engine_start_s": engine_start,
        "generate_s": passes[-1]["generate_s"],
        "connector": _delta(after, before),
        "connector_totals": after,
        "passes": passes,
    }


def _requests(outputs: list[Any]) -> list[dict[str, Any]]:
    """The per-request results of one pass (`RequestResult` fields)."""
    requests = []
    for out in outputs:
        completion = out.outputs[0]
        metrics = out.metrics
        requests.append(
            {
                "prompt_tokens": len(out.prompt_token_ids or []),
                "output_token_ids": list(completion.token_ids),
                "num_cached_tokens": int(out.num_cached_tokens or 0),
                "ttft_s": float(getattr(metrics, "first_token_latency", 0.0) or 0.0),
                "finish_reason": completion.finish_reason,
                "queued_s": _span(metrics, "queued_ts", "scheduled_ts"),
                "prefill_s": _span(metrics, "scheduled_ts", "first_token_ts"),
            }
        )
    return requests


def _main(argv: list[str]) -> None:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = EngineRun(**json.loads(spec_path.read_text()))
    result = _child(spec)
    out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1:])

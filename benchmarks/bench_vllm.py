"""Time to first token of a long prompt on real vLLM: cold, warm, and against the peer.

Every measurement is one fresh engine process (`hf3fsctl/vllm_runner.py`), so a
warm run really reads the store another process wrote. Per repeat, on a new random
prompt of `--prompt-tokens` tokens (model `SIZES["bench"]`, built under `.bench/`):

- `none`: no connector (the cold baseline);
- `ours-write`: our connector, empty store: prefill + asynchronous save;
- `ours-load`: our connector, a fresh process, the same prompt: load instead of prefill;
- `ours-load-dropped`: the same after `posix_fadvise(DONTNEED)` on our page files;
- `ours-load-async`: `ours-load` with `connector.load_mode=async` and
  `connector.lookup_wait_ms=0` (the request waits off-step for its load);
- `example-write` / `example-load`: vLLM's built-in `ExampleConnector`, the peer.

TTFT is vLLM's own per-request `first_token_latency` (arrival to first token), after one
unrelated warm-up request in the same process. Medians over `--repeats`. Prints a Rich
table and the ratios (warm/cold, ours/peer warm, write-run overhead), or one JSON
document with `--json`.

Run: `python benchmarks/bench_vllm.py [--repeats 3] [--prompt-tokens 4000] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = (
    "none",
    "ours-write",
    "ours-load",
    "ours-load-dropped",
    "ours-load-async",
    "example-write",
    "example-load",
)


# `ours-load-async`: the load runs off-step and the first lookup never answers in-step.
ASYNC_LOAD = {"connector.load_mode": "async", "connector.lookup_wait_ms": 0}


def load_runner() -> ModuleType:
    """The engine runner (`hf3fsctl.vllm_runner`: one vLLM engine per fresh process)."""
    from hf3fsctl import vllm_runner

    return vllm_runner


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


def ours_extra(store: Path) -> dict[str, Any]:
    """Connector overrides: a private store with embedded SQLite metadata."""
    return {
        "storage.path": str(store),
        "metadata.url": f"sqlite:///{store / 'metadata.db'}",
    }


def measure(args: argparse.Namespace, runner: ModuleType, log: Any) -> dict[str, Any]:
    """Run every configuration `args.repeats` times; return the raw samples."""
    from hf3fsctl.tiny_model import SIZES, build_tiny_model

    work = ROOT / ".bench"
    model = build_tiny_model(work / "model-bench", SIZES["bench"])
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in args.configs}
    for repeat in range(args.repeats):
        # A new prompt per repeat: each write run starts from an empty store.
        prompt = runner.shared_prefix_prompts(
            1, args.prompt_tokens, 0, seed=1000 + repeat, vocab=SIZES["bench"].vocab_size
        )
        ours_store, example_store = work / "store-ours", work / "store-example"
        for store in (ours_store, example_store):
            shutil.rmtree(store, ignore_errors=True)
            store.mkdir(parents=True)
        kv = {
            "none": None,
            "ours": runner.hf3fsctl_kv_config(ours_extra(ours_store)),
            "ours-load-async": runner.hf3fsctl_kv_config({**ours_extra(ours_store), **ASYNC_LOAD}),
            "example": runner.example_kv_config(example_store),
        }
        for name in args.configs:
            if name == "ours-load-dropped":
                log(f"dropped {drop_page_cache(ours_store) / 2**20:.0f} MiB from the page cache")
            run = runner.EngineRun(
                model=str(model),
                prompts=prompt,
                max_tokens=1,
                block_size=args.block_size,
                dtype=args.dtype,
                kv_transfer_config=kv.get(name, kv[name.split("-")[0]]),
                kv_cache_memory_bytes=512 * runner.MIB,
                max_model_len=args.prompt_tokens + 64,
                warmup_tokens=args.warmup_tokens,
                timeout_s=args.timeout,
            )
            result = runner.run_engine(run)
            request = result.requests[0]
            sample = {
                "ttft_s": request.ttft_s,
                "queued_s": request.queued_s,
                "prefill_s": request.prefill_s,
                "cached_tokens": request.num_cached_tokens,
                "wall_s": result.wall_s,
                "connector": result.connector,
            }
            samples[name].append(sample)
            log(
                f"repeat {repeat + 1}/{args.repeats} {name:<18} TTFT {request.ttft_s:7.3f} s  "
                f"(queued {request.queued_s:6.3f} s, scheduled→first token "
                f"{request.prefill_s:6.3f} s)  cached {request.num_cached_tokens:>5}  "
                f"process {result.wall_s:5.1f} s"
            )
    return {"model": str(model), "samples": samples}


def summarize(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    """Medians per configuration and the ratios the goals are stated in."""
    medians = {
        name: {
            "ttft_s": statistics.median(s["ttft_s"] for s in runs),
            "ttft_all_s": [s["ttft_s"] for s in runs],
            "cached_tokens": statistics.median(s["cached_tokens"] for s in runs),
        }
        for name, runs in raw["samples"].items()
        if runs
    }

    def ratio(a: str, b: str) -> float | None:
        if a in medians and b in medians and medians[b]["ttft_s"] > 0:
            return float(medians[a]["ttft_s"] / medians[b]["ttft_s"])
        return None

    overhead = ratio("ours-write", "none")
    ratios = {
        "ours_warm_over_cold": ratio("ours-load", "none"),
        "ours_warm_dropped_over_cold": ratio("ours-load-dropped", "none"),
        "ours_warm_over_example_warm": ratio("ours-load", "example-load"),
        "ours_write_overhead_pct": None if overhead is None else (overhead - 1) * 100,
        "example_write_overhead_pct": (
            None
            if ratio("example-write", "none") is None
            else (ratio("example-write", "none") - 1) * 100  # type: ignore[operator]
        ),
    }
    goals = {
        "warm_at_most_1_30_of_cold": _le(ratios["ours_warm_over_cold"], 1 / 30),
        "warm_no_slower_than_example": _le(ratios["ours_warm_over_example_warm"], 1.0),
        "write_overhead_at_most_3pct": _le(ratios["ours_write_overhead_pct"], 3.0),
    }
    return {
        "model": raw["model"],
        "prompt_tokens": args.prompt_tokens,
        "block_size": args.block_size,
        "repeats": args.repeats,
        "medians": medians,
        "ratios": ratios,
        "goals_met": goals,
        "samples": raw["samples"],
    }


def _le(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def print_table(summary: dict[str, Any]) -> None:
    """The Rich table and the ratios, for people."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(
        title=f"TTFT, {summary['prompt_tokens']}-token prompt, block {summary['block_size']}, "
        f"median of {summary['repeats']} (fresh process each)"
    )
    for column in ("configuration", "TTFT median", "all runs", "cached tokens"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for name, m in summary["medians"].items():
        table.add_row(
            name,
            f"{m['ttft_s']:.3f} s",
            " ".join(f"{t:.3f}" for t in m["ttft_all_s"]),
            f"{m['cached_tokens']:.0f}",
        )
    console.print(table)
    r = summary["ratios"]

    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    console.print(
        f"warm/cold: {fmt(r['ours_warm_over_cold'], '.4f')} "
        f"(dropped from page cache: {fmt(r['ours_warm_dropped_over_cold'], '.4f')})  "
        f"ours-warm / ExampleConnector-warm: {fmt(r['ours_warm_over_example_warm'], '.2f')}  "
        f"write-run overhead: {fmt(r['ours_write_overhead_pct'], '+.1f')} % "
        f"(ExampleConnector: {fmt(r['example_write_overhead_pct'], '+.1f')} %)"
    )
    console.print(f"goals met: {summary['goals_met']}")


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="model dtype (vLLM's auto runs this fp32 model in bfloat16, slow on AVX2 CPUs)",
    )
    parser.add_argument("--warmup-tokens", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per engine run")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument(
        "--json",
        metavar="PATH",
        nargs="?",
        const="-",
        help="also write one JSON document to PATH (alone or '-': only the JSON, on stdout)",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # hf3fsctl.tiny_model from a plain checkout too
    runner = load_runner()
    started = time.perf_counter()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    summary = summarize(args, measure(args, runner, log))
    summary["bench_wall_s"] = time.perf_counter() - started
    document = json.dumps(summary, indent=2)
    if args.json == "-":
        print(document)
        return
    print_table(summary)
    if args.json:
        Path(args.json).write_text(document + "\n")


if __name__ == "__main__":
    main()

"""`make demo`: the whole job on one machine, on the embedded defaults.

1. Build a tiny random-weight Llama (no downloads).
2. `hf3fsctl init` a store (the real CLI) and `hf3fsctl vllm-config` for vLLM.
3. Run prompts that share a long prefix through real vLLM with the connector (embedded
   SQLite metadata): the cold run prefills and saves.
4. `hf3fsctl lookup` (no engine) says how much of each prompt is now cached.
5. Run them again in a fresh process: the warm run loads instead of prefilling.
6. Show hit tokens, TTFT cold vs warm, that the outputs are identical, then the admin
   flow: `hf3fsctl stats`, `hf3fsctl ls`, `hf3fsctl evict --all --dry-run`.

Exits 1 when the outputs differ or the warm run got no hits. Everything lives in a new
directory under `.demo/` (git-ignored).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.rule import Rule
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
console = Console()
QUESTIONS = (
    "Which functions in this module wrap text, and what do their arguments mean?",
    "Explain how the module handles tabs and whitespace, step by step.",
    "Write a short usage example for the main class of this module.",
    "List every public name this module exports, with a one-line summary each.",
)


def load_runner() -> ModuleType:
    """The engine runner (`hf3fsctl.vllm_tools.runner`: one vLLM engine per fresh process)."""
    from hf3fsctl.vllm_tools import runner

    return runner


def hf3fsctl(*args: str, capture: bool = False) -> str:
    """Run the real CLI (`python -m hf3fsctl`); echo the command; fail loudly."""
    console.print(f"[bold cyan]$ hf3fsctl {' '.join(args)}[/]")
    proc = subprocess.run(
        [sys.executable, "-m", "hf3fsctl", *args], capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode != 0:
        console.print(proc.stdout + proc.stderr)
        raise SystemExit(f"hf3fsctl {args[0]} exited {proc.returncode}")
    if not capture:
        print(proc.stdout.rstrip())
    return proc.stdout


def prompts() -> list[str]:
    """A long shared prefix (a document: a stdlib module's source) and four questions."""
    import textwrap

    document = Path(textwrap.__file__).read_text()[:9000]
    system = "You are a careful code reviewer. Answer from the document below.\n\n"
    return [f"{system}<document>\n{document}\n</document>\n\nQuestion: {q}" for q in QUESTIONS]


def run(runner: ModuleType, model: Path, kv: dict[str, Any], label: str) -> Any:
    """One engine process over the prompts, one request after another (like users)."""
    with console.status(f"{label}: starting vLLM in a fresh process and running prompts"):
        result = runner.run_engine(
            runner.EngineRun(
                model=str(model),
                prompts=prompts(),
                max_tokens=16,
                block_size=32,
                dtype="float32",  # the model's own; vLLM's auto would pick bfloat16
                kv_transfer_config=kv,
                kv_cache_memory_bytes=64 * runner.MIB,
                max_model_len=8192,
                timeout_s=300,
            )
        )
    console.print(f"{label}: done in {result.wall_s:.1f} s (engine process)")
    return result


def show_runs(cold: Any, warm: Any) -> tuple[bool, int]:
    """The per-request table; returns (outputs identical, warm hit tokens)."""
    table = Table(title="Cold run vs warm run (fresh process, same store)")
    for column in ("request", "prompt tokens", "cached cold", "cached warm", "TTFT cold"):
        table.add_column(column, justify="right")
    table.add_column("TTFT warm", justify="right")
    table.add_column("same output", justify="center")
    for i, (c, w) in enumerate(zip(cold.requests, warm.requests, strict=True)):
        table.add_row(
            str(i),
            str(c.prompt_tokens),
            str(c.num_cached_tokens),
            str(w.num_cached_tokens),
            f"{c.ttft_s * 1000:.0f} ms",
            f"{w.ttft_s * 1000:.0f} ms",
            "[green]yes[/]" if c.output_token_ids == w.output_token_ids else "[red]NO[/]",
        )
    console.print(table)
    identical = cold.outputs == warm.outputs
    warm_hits = int((warm.connector or {}).get("hit_tokens", 0))
    first_cold, first_warm = cold.requests[0].ttft_s, warm.requests[0].ttft_s
    console.print(
        f"First request (nothing in vLLM's own prefix cache): TTFT {first_cold * 1000:.0f} ms "
        f"cold → {first_warm * 1000:.0f} ms warm "
        f"({first_cold / max(first_warm, 1e-9):.1f}x), "
        f"{warm.requests[0].num_cached_tokens} of {warm.requests[0].prompt_tokens} "
        "prompt tokens loaded from the store."
    )
    saved = (cold.connector or {}).get("blocks_saved", 0)
    loaded = (warm.connector or {}).get("blocks_loaded", 0)
    failed = (warm.connector or {}).get("failed_blocks", 0)
    console.print(
        f"Connector: cold run saved {saved:.0f} blocks; warm run loaded {loaded:.0f} blocks, "
        f"{warm_hits} hit tokens, {failed:.0f} failed blocks."
    )
    return identical, warm_hits


def main() -> int:
    """Run the demo; 0 when the warm run hit and reproduced the cold outputs."""
    sys.path.insert(0, str(ROOT))
    from hf3fsctl.vllm_tools.tiny_model import SIZES, build_tiny_model

    runner = load_runner()
    base = ROOT / ".demo"
    base.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    config = work / "hf3fs.yaml"
    console.print(Rule("hf3fsctl demo"))
    console.print(f"Working directory: {work.relative_to(ROOT)}")
    with console.status("Building the tiny model (random weights, stdlib-trained tokenizer)"):
        model = build_tiny_model(base / "model-tiny", SIZES["tiny"])
    console.print(f"Model: {model.relative_to(ROOT)} (tiny random Llama)")

    console.print(Rule("Create the store"))
    storage = work / "storage"
    hf3fsctl("init", "--storage-path", str(storage), "--create-path", "--write-config", str(config))
    kv = json.loads(hf3fsctl("vllm-config", "--config", str(config), capture=True))
    console.print_json(data=kv)

    console.print(Rule("Serve the same prompts twice, each time in a fresh vLLM process"))
    cold = run(runner, model, kv, "cold run")
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts()))
    console.print("What the next run will load, asked without an engine:")
    hf3fsctl(
        "lookup",
        "--config",
        str(config),
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--prompts",
        str(prompt_file),
    )
    warm = run(runner, model, kv, "warm run")
    identical, warm_hits = show_runs(cold, warm)

    console.print(Rule("Administer the store"))
    hf3fsctl("stats", "--config", str(config))
    hf3fsctl("ls", "--config", str(config), "--limit", "5")
    hf3fsctl("evict", "--config", str(config), "--all", "--dry-run")

    console.print(Rule("Result"))
    if not identical:
        console.print("[bold red]FAIL[/]: the warm run's outputs differ from the cold run's.")
        return 1
    if warm_hits <= 0:
        console.print("[bold red]FAIL[/]: the warm run got no hits from the store.")
        return 1
    console.print(
        f"[bold green]OK[/]: identical outputs; the warm run loaded {warm_hits} tokens "
        "instead of prefilling them."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

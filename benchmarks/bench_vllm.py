"""Time to first token of one long prompt on real vLLM: a thin caller of `hf3fsctl bench e2e`.

The measurement lives in `hf3fsctl/bench/e2e/`; this script keeps the old
single-prompt shape and flags. Per repeat, a new random prompt of `--prompt-tokens`
tokens (model `SIZES["bench"]`, built under `.bench/`), each configuration a fresh
engine process: `none` (no connector) and `floor` (the same prompt again in that
process, hitting vLLM's own prefix cache), `cold` (our connector, empty store), `warm`
(a fresh process on that store), `warm-dropped` (after `posix_fadvise(DONTNEED)` on the
store's files), `warm-async` (`connector.load_mode=async`), and vLLM's built-in
`ExampleConnector` (`example-cold` / `example-warm`). TTFT samples are pooled over
`--repeats` (one request per repeat, so p50 is the median of the repeats).

The same run as a command:

    hf3fsctl bench e2e --prefixes 1 --suffixes 1 --prefix-tokens 4000 --suffix-tokens 0 \\
        --output-tokens 1 --warm-dropped --warm-async --peer example --repeats 3

Run: `python benchmarks/bench_vllm.py [--repeats 3] [--prompt-tokens 4000] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    """Parse the old flags, run `hf3fsctl.bench.e2e`, print the table or the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="model dtype (auto is bf16: slow)")
    parser.add_argument("--warmup-tokens", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds, whole run")
    parser.add_argument(
        "--json",
        metavar="PATH",
        nargs="?",
        const="-",
        help="also write one JSON document to PATH (alone or '-': only the JSON, on stdout)",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # hf3fsctl from a plain checkout too
    from rich.console import Console

    from hf3fsctl.bench import e2e

    settings = e2e.E2ESettings(
        workload=e2e.Workload(
            prefixes=1,
            suffixes=1,
            prefix_tokens=args.prompt_tokens,
            suffix_tokens=0,
            output_tokens=1,
        ),
        block_size=args.block_size,
        dtype=args.dtype,
        warmup_tokens=args.warmup_tokens,
        peers=("example",),
        drop_page_cache=True,
        warm_async=True,
        repeats=args.repeats,
        seed=1000,
        timeout_s=args.timeout,
        work_dir=ROOT / ".bench",
    )
    document = e2e.run(settings, lambda message: print(message, file=sys.stderr, flush=True))
    text = json.dumps(document, indent=2, default=str)
    if args.json == "-":
        print(text)
        return
    Console(width=None if sys.stdout.isatty() else 160).print(e2e.render(document))
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Metadata benchmark: a thin caller of `hf3fsctl bench metadata` (the one implementation,
in `hf3fsctl.bench.metadata`).

Ops/s and p50/p99/p99.9 latency of lookup, locate and allocate+commit under concurrent
client processes, embedded and against a real `hf3fsctl serve` it starts (or a running
one: `--url`), on stores pre-filled with `--entries`; RSS bytes per entry; and
allocate+commit on a full store over 8 namespaces against 1. Every flag is the
command's (`hf3fsctl bench metadata --help`):

    python benchmarks/bench_metadata.py                 # both modes, ~4 minutes on 2 cores
    python benchmarks/bench_metadata.py --quick         # ~15 seconds
    python benchmarks/bench_metadata.py --json          # one JSON document on stdout
    python benchmarks/bench_metadata.py --workers 2 --json-out F --plot metadata.png
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf3fsctl.cli.errors import EXIT_INTERRUPTED
from hf3fsctl.cli.main import app


def main(argv: list[str] | None = None) -> None:
    """Run `hf3fsctl bench metadata ARGV` (exits with its exit code)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        app(["bench", "metadata", *args], prog_name="hf3fsctl")
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()

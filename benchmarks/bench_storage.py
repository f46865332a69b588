"""Storage benchmark: a thin caller of `hf3fsctl bench storage` (the one implementation,
in `hf3fsctl.bench.storage`).

Page write/read GB/s of the POSIX engine across page sizes, batches and I/O threads,
each figure also a ratio of a plain dd-style loop on the same file system measured in
the same run. Every flag is the command's (`hf3fsctl bench storage --help`):

    python benchmarks/bench_storage.py                  # default grid, ~30 s on 2 cores
    python benchmarks/bench_storage.py --quick          # a few seconds
    python benchmarks/bench_storage.py --json           # one JSON document on stdout
    python benchmarks/bench_storage.py --json-out F --plot storage.png
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf3fsctl.cli.errors import EXIT_INTERRUPTED
from hf3fsctl.cli.main import app


def main(argv: list[str] | None = None) -> None:
    """Run `hf3fsctl bench storage ARGV` (exits with its exit code)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        app(["bench", "storage", *args], prog_name="hf3fsctl")
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()

"""A private `redis-server` on a free loopback port, persistence off.

Contract: `RedisServer.start` raises `MetadataUnavailable` with a hint when no
`redis-server` is on PATH; its data lives only in the work directory it is given.
`used_memory`, `script_usec` and `memory_usage` read the server's own accounting
(`INFO memory`, `INFO commandstats`, `MEMORY USAGE` over every key, or a sample of them
when there are many), for `bench metadata --entries`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from hf3fsctl.bench.loopback import free_port
from hf3fsctl.bench.peers.process import stop_process, wait_for_port
from hf3fsctl.errors import MetadataUnavailable


class RedisServer:
    """A private `redis-server` on a free loopback port, persistence off."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.log_path = directory / "redis-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        """`redis://127.0.0.1:PORT/DB`."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        """Start it and wait for it to listen.

        Raises:
            MetadataUnavailable: no `redis-server` on PATH, or it did not start.
        """
        binary = shutil.which("redis-server")
        if binary is None:
            raise MetadataUnavailable(
                "redis-server is not installed here",
                hint="apt-get install redis-server (make test does), or leave out the redis modes",
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        command += ["--logfile", str(self.log_path)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        wait_for_port(self.process, self.port, "redis-server", self.log_path)
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        stop_process(self.process)

    def client(self) -> Any:
        """A plain redis-py client of it (for its own accounting, never the store's data)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def used_memory(self) -> int:
        """`INFO memory` used_memory: bytes its allocator holds for data and overhead."""
        with self.client() as client:
            return int(client.info("memory")["used_memory"])

    def script_usec(self) -> tuple[int, int]:
        """(calls, µs) of the Lua run (functions: FCALL; scripts: EVAL, EVALSHA; and their
        `_ro` twins), from `INFO commandstats`: the time inside Redis, each call's own
        commands included (they are also counted under their own names, so those are not
        added)."""
        with self.client() as client:
            stats = client.info("commandstats")
        lua = ("eval", "fcall")
        scripts = [v for k, v in stats.items() if k.removeprefix("cmdstat_").startswith(lua)]
        return sum(int(v["calls"]) for v in scripts), sum(int(v["usec"]) for v in scripts)

    def memory_usage(self, sample_keys: int = 100_000, samples: int = 200) -> dict[str, Any]:
        """`MEMORY USAGE` summed over every key (a random sample of `sample_keys`, scaled
        to the key count, when there are more), and per key pattern (hex ids and numbers
        replaced by `*`): the store's entries and index structures, by what holds them.
        Every key up to 100,000: format 4's LRU generations are ~N/100 small keys beside a
        few big ones, and a sample scaled up would miss or multiply the big ones."""
        with self.client() as client:
            total_keys = int(client.dbsize())
            if total_keys <= sample_keys:
                names = list(client.scan_iter(count=10_000))
            else:
                pipe = client.pipeline(transaction=False)
                for _ in range(sample_keys):
                    pipe.randomkey()
                names = sorted(set(pipe.execute()))
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.memory_usage(name, samples=samples)
                pipe.type(name)
            answers = pipe.execute()
        scale = total_keys / len(names) if names else 0.0
        patterns: dict[str, dict[str, Any]] = {}
        total = 0.0
        for name, used, kind in zip(names, answers[::2], answers[1::2], strict=True):
            pattern = re.sub(r"[0-9a-f]{16,}|(?<=:)\d+(?=:|$)", "*", name)
            row = patterns.setdefault(pattern, {"type": kind, "keys": 0, "bytes": 0.0})
            row["keys"] += scale
            row["bytes"] += (used or 0) * scale
            total += (used or 0) * scale
        return {
            "keys": total_keys,
            "sampled_keys": len(names),
            "samples_per_key": samples,
            "bytes": total,
            "by_pattern": dict(sorted(patterns.items(), key=lambda item: -item[1]["bytes"])),
        }

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The offload tier on a real `hf3fsctl serve`: stores and loads through HTTP metadata, an
outage of the service makes jobs fail (vLLM keeps serving from DRAM or recomputes), and
the tier stores again once the service is back — without a restart of the tier; and two
engines' tiers share chunks through Redis metadata."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from helpers.offload_tier_driver import Driver, make_spec, payload
from helpers.redis_servers import redis_session_server, redis_url
from helpers.servers import ServerProcess
from vllm.v1.kv_offload.base import make_offload_key


def test_store_load_outage_and_recovery_through_serve(
    metadata_server: ServerProcess, tmp_path: Path
) -> None:
    (tmp_path / "store").mkdir()
    entry = {
        "type": "Hf3fsctlOffloadTier",
        "module_path": "hf3fsctl_connector.offload_tier",
        "storage_path": str(tmp_path / "store"),
        "metadata_url": metadata_server.url,
        "metadata.token_file": str(metadata_server.token_file),
    }
    d = Driver(make_spec(entry))
    finished: list[Any] = []
    real = d.tier.get_finished_jobs

    def spy() -> list[Any]:
        jobs = list(real())
        finished.extend(jobs)
        return jobs

    d.tier.get_finished_jobs = spy  # type: ignore[method-assign]
    try:
        keys = [make_offload_key(os.urandom(32), 0) for _ in range(3)]
        data = [payload(i) for i in range(3)]
        d.store(keys, data)
        d.flush_primary(4)
        assert d.load(keys) == data  # located and read through the service

        metadata_server.stop()
        finished.clear()
        down = [make_offload_key(os.urandom(32), 0)]
        d.store(down, [payload(9)])
        assert [job.success for job in finished] == [False]

        metadata_server.start()
        later = [make_offload_key(os.urandom(32), 0) for _ in range(2)]
        later_data = [payload(10), payload(11)]
        d.store(later, later_data)
        d.flush_primary(4)
        assert d.load(later) == later_data  # the same tier, the service back
    finally:
        d.shutdown()


def test_two_engines_share_chunks_through_redis(redis_url: str, tmp_path: Path) -> None:
    """What one engine's tier stored, another engine's tier (its own DRAM tier, the same
    Redis and storage: another node) loads byte-equal."""
    (tmp_path / "store").mkdir()
    entry = {
        "type": "Hf3fsctlOffloadTier",
        "module_path": "hf3fsctl_connector.offload_tier",
        "storage_path": str(tmp_path / "store"),
        "metadata_url": redis_url,
    }
    keys = [make_offload_key(os.urandom(32), 0) for _ in range(3)]
    data = [payload(i) for i in range(3)]
    first = Driver(make_spec(dict(entry)))
    try:
        first.store(keys, data)
    finally:
        first.shutdown()
    second = Driver(make_spec(dict(entry)))
    try:
        assert second.load(keys) == data
    finally:
        second.shutdown()


__all__ = ["redis_session_server", "redis_url"]  # fixtures

"""KV events (connector/events.py) when the store cannot be reached.

The scenarios on live stores are in tests/contract/test_contract_kv_events.py.
"""

from __future__ import annotations

from pathlib import Path

from hf3fsctl_connector.events import BlockPayload, StoreEvents
from hf3fsctl_connector.service import MetadataGuard

from hf3fsctl.config import build_config

BLOCK = 4


def _payloads(count: int) -> list[BlockPayload]:
    return [
        BlockPayload(bytes([i]) * 32, None, tuple(range(BLOCK)), None, None, None)
        for i in range(count)
    ]


def test_a_dead_store_queues_nothing_and_raises_nothing_on_the_engine_thread(
    tmp_path: Path,
) -> None:
    config = build_config(
        [("test", {"metadata": {"url": "http://127.0.0.1:9/", "timeout_s": 0.2}})]
    )
    guard = MetadataGuard(config)
    events = StoreEvents(guard, "0" * 16, num_ranks=1, block_size=BLOCK, medium="M", poll_s=0.05)
    try:
        events.record_saves(_payloads(2))
        assert events.take_events() == []
    finally:
        events.close()
        guard.close()

"""A metadata workload run by several processes at once (spawned; picklable entry points).

Each worker allocates, commits, locates and now and then evicts against one store
(embedded `sqlite:///` or a real server) and returns the keys whose commit the store
acknowledged.
"""

from __future__ import annotations

import hashlib

from hf3fsctl.meta.client import open_metadata_client
from hf3fsctl.meta.models import CommitItem, EvictRequest


def _key(worker: int, i: int) -> str:
    return hashlib.sha256(f"w{worker}-{i}".encode()).hexdigest()


def run_worker(url: str, token: str | None, namespace: str, worker: int, rounds: int) -> list[str]:
    """Allocate/commit chains of 4 keys (some shared by all workers), locate, evict."""
    client = open_metadata_client(url, timeout_s=30.0, token=token)
    acknowledged: list[str] = []
    try:
        for i in range(rounds):
            chain = [_key(-1, i % 3)] + [_key(worker, i * 4 + j) for j in range(3)]
            result = client.allocate(namespace, 0, chain, first_depth=0)
            items = [
                CommitItem(key=a.key, page=a.page, checksum=f"{a.page:x}", size=1)
                for a in result.allocated
            ]
            if client.commit(namespace, 0, items) == len(items):
                acknowledged.extend(item.key for item in items)
            client.locate(namespace, 0, chain)
            client.lookup(namespace, chain)
            if i % 7 == worker % 7:
                client.evict(EvictRequest(namespace=namespace, max_entries=2))
    finally:
        client.close()
    return acknowledged

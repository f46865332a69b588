"""A storm of metadata calls from one client process that must outlive its server.

`storm(...)` (a spawned process's entry point) loops until a stop file appears:
allocate a chain of 4 new keys in the durable namespace, commit it, log each
acknowledged commit to its ack file, locate the chain, and now and then invalidate one
of its own committed keys (logged before the call, since a call cut by a crash may or
may not have happened). In a small churn namespace it allocates and commits (every 5th
chain is abandoned: allocated, never committed, as by a writer that died) and evicts
(`max_entries`), so eviction and reclamation run under pressure. Its last act is
one more abandoned churn allocation. A call that fails (`Hf3fsctlError`: the service is down) is counted and
tried again on the next round: the client is never restarted. Returns a summary.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from hf3fsctl.errors import Hf3fsctlError
from hf3fsctl.meta.client import open_metadata_client
from hf3fsctl.meta.models import CommitItem, EvictRequest, InvalidateItem


def storm_key(worker: int, i: int, salt: str = "") -> str:
    """A 64-hex-digit key of `worker`'s i-th block."""
    return hashlib.sha256(f"{salt}w{worker}-{i}".encode()).hexdigest()


def _items(allocated: Any) -> list[CommitItem]:
    return [
        CommitItem(key=a.key, page=a.page, checksum=f"xxh3:{a.page:016x}", size=4096)
        for a in allocated
    ]


def storm(
    url: str, token: str | None, durable: str, churn: str, worker: int, directory: str
) -> dict[str, Any]:
    """Run the storm until `directory/stop` exists; logs under `directory/w<worker>.*`."""
    out = Path(directory)
    acks = (out / f"w{worker}.acks").open("a")
    dropped = (out / f"w{worker}.invalidated").open("a")
    client = open_metadata_client(url, timeout_s=1.0, token=token)
    calls = failures = abandoned = 0
    last_failure = first_ok_after_failure = 0.0
    try:
        i = 0
        while not (out / "stop").exists():
            chain = [storm_key(worker, i * 4 + j) for j in range(4)]
            churn_chain = [storm_key(worker, i * 4 + j, "churn") for j in range(4)]
            try:
                calls += 1
                granted = client.allocate(durable, 0, chain).allocated
                if granted and client.commit(durable, 0, _items(granted)) == len(granted):
                    acks.write("".join(f"{a.key}\n" for a in granted))
                    acks.flush()
                located = client.locate(durable, 0, chain)
                if i % 3 == 0 and located[0] is not None:
                    loc = located[0]
                    dropped.write(f"{loc.key}\n")
                    dropped.flush()
                    client.invalidate(
                        durable,
                        0,
                        [InvalidateItem(key=loc.key, page=loc.page, checksum=loc.checksum)],
                    )
                churned = client.allocate(churn, 0, churn_chain).allocated
                if i % 5 == 4:
                    abandoned += len(churned)  # a writer that dies before it commits
                else:
                    client.commit(churn, 0, _items(churned))
                if i % 4 == worker % 4:
                    client.evict(EvictRequest(namespace=churn, max_entries=3))
                if last_failure and not first_ok_after_failure:
                    first_ok_after_failure = time.time()
            except Hf3fsctlError:
                failures += 1
                last_failure = time.time()
                first_ok_after_failure = 0.0
                time.sleep(0.05)
            i += 1
        # The last writer dies holding pages: one allocation the test sees abandoned.
        last = [storm_key(worker, j, "last") for j in range(4)]
        abandoned += len(client.allocate(churn, 0, last).allocated)
    finally:
        client.close()
        acks.close()
        dropped.close()
    summary = {
        "worker": worker,
        "rounds": i,
        "calls": calls,
        "failures": failures,
        "abandoned": abandoned,
        "last_failure": last_failure,
        "first_ok_after_failure": first_ok_after_failure,
    }
    (out / f"w{worker}.json").write_text(json.dumps(summary))
    return summary


def logged(directory: Path, suffix: str) -> set[str]:
    """Every key the workers logged in their `*.{suffix}` files."""
    keys: set[str] = set()
    for path in directory.glob(f"w*.{suffix}"):
        keys.update(line for line in path.read_text().split() if line)
    return keys

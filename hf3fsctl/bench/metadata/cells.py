"""One cell: `clients` processes calling one operation for `seconds`, and its figures.

Contract: every client connects and warms up before the timed window starts; a call
still running `cutoff_s(seconds)` after the window is cut off and counted as unfinished
(its time so far counts, so the percentiles are lower bounds, marked `truncated`).
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hf3fsctl.bench import report
from hf3fsctl.bench.metadata.children import fork_context
from hf3fsctl.bench.metadata.stores import StoreSpec, key
from hf3fsctl.errors import Hf3fsctlError, MetadataUnavailable

if TYPE_CHECKING:
    from hf3fsctl.meta.protocol import MetadataClient
from hf3fsctl.bench.metadata.settings import (
    BATCH,
    LOOKUP_KEYS,
    PAGE_BYTES,
    MetadataSettings,
)


def _operation(
    client: MetadataClient,
    spec: StoreSpec,
    op: str,
    worker: int,
    tag: str,
    keys_per_call: int | None = None,
) -> tuple[Callable[[], tuple[int, int]], Callable[[], None]]:
    """(one call of `op` → (keys that found no space, keys committed), its warm-up).

    `keys_per_call` replaces the chain length of `lookup_spread` and the batch of
    `locate`, `alloc_commit` and the full-store saves (None: 1,000 and 64).
    """
    from hf3fsctl.meta.models import CommitItem

    chain_keys = keys_per_call or LOOKUP_KEYS
    batch = keys_per_call or BATCH

    first_ns = spec.namespaces[0]
    head = [key(spec.stored_tag, 0)]
    counter = [0]

    def warm_lookup() -> None:
        client.lookup(first_ns, head)

    if op == "ping":

        def ping() -> tuple[int, int]:
            client.lookup(first_ns, head)
            return 0, 0

        return ping, warm_lookup
    if op == "lookup":
        chain = [key(spec.stored_tag, i) for i in range(LOOKUP_KEYS)]

        def lookup() -> tuple[int, int]:
            client.lookup(first_ns, chain)
            return 0, 0

        def warm() -> None:
            hits = client.lookup(first_ns, chain)
            if hits != LOOKUP_KEYS:
                raise MetadataUnavailable(f"lookup found {hits} of {LOOKUP_KEYS} stored keys")

        return lookup, warm
    if op == "lookup_spread":  # a chain starting anywhere in the store (every page is hit)
        spread = spec.entries - chain_keys

        def chain_now() -> list[str]:
            first = (worker * 7919 + counter[0] * 104_729) % spread
            counter[0] += 1
            return [key(spec.stored_tag, first + i) for i in range(chain_keys)]

        def lookup_spread() -> tuple[int, int]:
            client.lookup(first_ns, chain_now())
            return 0, 0

        def warm_spread() -> None:
            hits = client.lookup(first_ns, chain_now())
            if hits != chain_keys:
                raise MetadataUnavailable(f"lookup found {hits} of {chain_keys} stored keys")

        return lookup_spread, warm_spread
    if op == "locate":
        span = spec.entries - batch

        def keys_now() -> list[str]:
            first = (worker * 7919 + counter[0] * batch) % span
            counter[0] += 1
            return [key(spec.stored_tag, first + i) for i in range(batch)]

        def locate() -> tuple[int, int]:
            client.locate(first_ns, 0, keys_now())
            return 0, 0

        def warm_locate() -> None:
            found = client.locate(first_ns, 0, keys_now())
            if any(location is None for location in found):
                raise MetadataUnavailable("locate missed keys the store was filled with")

        return locate, warm_locate

    def alloc_commit() -> tuple[int, int]:
        n = counter[0]
        counter[0] += 1
        ns = spec.namespaces[(worker + n) % len(spec.namespaces)]
        keys = [key(f"{tag}-{op}-{worker}", n * batch + i) for i in range(batch)]
        result = client.allocate(ns, 0, keys)
        committed = client.commit(
            ns,
            0,
            [
                CommitItem(key=a.key, page=a.page, checksum=f"xxh3:{a.page:016x}", size=PAGE_BYTES)
                for a in result.allocated
            ],
        )
        return len(result.no_space), committed

    return alloc_commit, warm_lookup


def _client_main(
    spec: StoreSpec,
    op: str,
    worker: int,
    seconds: float,
    tag: str,
    barrier: Any,
    queue: Any,
    in_flight: Any,
    keys_per_call: int | None = None,
) -> None:
    """One client process: connect, warm up, wait for the others, run `op` for `seconds`.

    Latencies go to `queue` in chunks (so a client cut off at the deadline loses only its
    last call), and `in_flight[worker]` holds the start of the call under way (0: none).
    """
    try:
        client = spec.client(worker=worker)
        call, warm = _operation(client, spec, op, worker, tag, keys_per_call)
        warm()
    except BaseException as exc:
        queue.put(("error", worker, f"{type(exc).__name__}: {exc}"))
        barrier.abort()
        return
    try:
        barrier.wait(timeout=600)
    except threading.BrokenBarrierError:
        return
    latencies = array("d")
    no_space = committed = failed = 0
    failure = ""
    try:
        cpu_began = _own_cpu_s()
        start = time.monotonic()
        queue.put(("start", worker, start))
        end_at = start + seconds
        flushed = start
        while True:
            in_flight[worker] = time.monotonic()
            tick = time.perf_counter()
            try:
                lost, stored = call()
            except Hf3fsctlError as exc:  # the service said no (busy, unavailable): a
                lost, stored = 0, 0  # failed call, as the connector would see it
                failed += 1
                failure = failure or f"{type(exc).__name__}: {exc}"
            latencies.append(time.perf_counter() - tick)
            in_flight[worker] = 0.0
            no_space += lost
            committed += stored
            now = time.monotonic()
            if now >= end_at or now - flushed >= _FLUSH_S:
                chunk = (latencies.tobytes(), no_space, committed, failed, failure)
                queue.put(("chunk", worker, *chunk))
                latencies, no_space, committed, failed, flushed = array("d"), 0, 0, 0, now
            if now >= end_at:
                break
        queue.put(("done", worker, time.monotonic(), _own_cpu_s() - cpu_began))
        client.close()
    except BaseException as exc:
        queue.put(("error", worker, f"{type(exc).__name__}: {exc}"))


_FLUSH_S = 0.25  # how often a client sends its latencies


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def cutoff_s(seconds: float) -> float:
    """How long after a cell's window a call still running is cut off."""
    return max(5.0, 2.0 * seconds)


def measure(
    spec: StoreSpec,
    op: str,
    clients: int,
    seconds: float,
    tag: str,
    server_cpu: Callable[[], float] | None = None,
    keys_per_call: int | None = None,
) -> dict[str, Any]:
    """One (operation, client count) cell: ops/s, latency percentiles and CPU per call.

    The cell is bounded: clients stop starting calls `seconds` after they start, and a
    call still running `cutoff_s(seconds)` later is cut off (its client killed). It
    counts as `unfinished_calls`, with its time so far among the latencies (a lower
    bound, so a percentile that reaches it is one too); `truncated` says so. A call the
    service refuses (an `Hf3fsctlError`: busy, unavailable) is a `failed_calls`: in the
    latencies, not in ops/s, which counts calls that succeeded.

    CPU per call: `client_cpu_us_per_call` is the client processes' own CPU time
    (user + system) over the window ÷ calls (embedded: the store runs there);
    `server_cpu_us_per_call` is `server_cpu()` (CPU seconds of the server's processes)
    read as the window opens and after it, ÷ calls; None without a server.
    """
    ctx = fork_context()
    barrier = ctx.Barrier(clients + 1)
    queue = ctx.Queue()
    in_flight = ctx.Array("d", clients, lock=False)
    processes = [
        ctx.Process(
            target=_client_main,
            args=(
                spec,
                op,
                worker,
                seconds,
                f"{tag}-x{clients}",
                barrier,
                queue,
                in_flight,
                keys_per_call,
            ),
            daemon=True,
        )
        for worker in range(clients)
    ]
    for process in processes:
        process.start()
    latencies: list[float] = []
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    no_space = committed = failed = 0
    failure = ""
    error: tuple[int, str] | None = None
    deadline: float | None = None
    client_cpu = 0.0
    server_began = server_ended = None
    try:
        try:
            barrier.wait(timeout=600)
        except threading.BrokenBarrierError:
            pass
        server_began = server_cpu() if server_cpu else None
        while len(ends) < clients and error is None:
            now = time.monotonic()
            if deadline is None and starts:
                deadline = min(starts.values()) + seconds + cutoff_s(seconds)
            limit = 600.0 if deadline is None else deadline - now
            if limit <= 0:
                break
            try:
                message = queue.get(timeout=min(limit, 1.0))
            except Exception:  # queue.Empty: check the deadline and the clients again
                if deadline is None and not any(p.is_alive() for p in processes):
                    error = (-1, "every client exited before starting")
                continue
            kind, worker = message[0], message[1]
            if kind == "start":
                starts[worker] = message[2]
            elif kind == "chunk":
                values = array("d")
                values.frombytes(message[2])
                latencies.extend(values)
                no_space += message[3]
                committed += message[4]
                failed += message[5]
                failure = failure or message[6]
            elif kind == "done":
                ends[worker] = message[2]
                client_cpu += message[3]
            else:
                error = (worker, message[2])
        cut = time.monotonic()
        server_ended = server_cpu() if server_cpu else None
        unfinished = [
            cut - in_flight[w] for w in range(clients) if w not in ends and in_flight[w] > 0
        ]
    finally:
        for process in processes:
            if process.is_alive():
                process.join(0.2 if error is None else 0)
            if process.is_alive():
                process.kill()
            process.join()
    if error is not None:
        raise MetadataUnavailable(f"{op} client {error[0]} failed: {error[1]}")
    if not starts:
        raise MetadataUnavailable(f"{op}: no client started")
    truncated = len(ends) < clients
    window = (cut if truncated else max(ends.values())) - min(starts.values())
    succeeded = len(latencies) - failed
    keys = keys_per_call or {"ping": 1, "lookup": LOOKUP_KEYS, "lookup_spread": LOOKUP_KEYS}.get(
        op, BATCH
    )
    ops = succeeded / window if window > 0 else None
    return {
        "op": op,
        "clients": clients,
        "calls": succeeded,
        "failed_calls": failed,
        "first_failure": failure or None,
        "unfinished_calls": len(unfinished),
        "truncated": truncated,
        "window_s": window,
        "ops": ops,
        "keys_per_call": keys,
        "keys_per_s": None if ops is None else ops * keys,
        **report.latency_ms(latencies + unfinished),
        "no_space_keys": no_space,
        "committed_keys": committed,
        "committed_keys_per_s": committed / window if window > 0 else None,
        "client_cpu_us_per_call": 1e6 * client_cpu / succeeded
        if succeeded and not truncated
        else None,
        "server_cpu_us_per_call": None
        if server_began is None or server_ended is None or not succeeded
        else 1e6 * (server_ended - server_began) / succeeded,
    }


def measure_cell(
    mode: str,
    spec: StoreSpec,
    op: str,
    clients: int,
    settings: MetadataSettings,
    tag: str,
    say: report.Progress,
    server_cpu: Callable[[], float] | None = None,
) -> dict[str, Any]:
    row = {"mode": mode, **measure(spec, op, clients, settings.seconds, tag, server_cpu)}
    say(
        f"  {mode:<9} {op:<13} x{clients:<3} {report.fmt(row['ops'], 1):>9} ops/s  "
        f"p50 {report.fmt(row['p50_ms'])} ms  p99 {report.fmt(row['p99_ms'])} ms  "
        f"p99.9 {report.fmt(row['p999_ms'])} ms"
        + (
            f"  server {report.fmt(row['server_cpu_us_per_call'], 0)} µs CPU/call"
            if row["server_cpu_us_per_call"] is not None
            else ""
        )
    )
    return row


def measure_cells(
    mode: str,
    spec: StoreSpec,
    ops: Sequence[str],
    settings: MetadataSettings,
    tag: str,
    say: report.Progress,
    server_cpu: Callable[[], float] | None = None,
) -> list[dict[str, Any]]:
    return [
        measure_cell(mode, spec, op, clients, settings, tag, say, server_cpu)
        for op in ops
        for clients in settings.clients
    ]

"""`hf3fsctl bench metadata`: ops/s and latency of the store's hot calls under load.

Operations (the connector's calls, each a cell per client count):

- `ping`: a 1-key lookup, the cheapest hot call over the same path. It is the ceiling
  every other cell of the same mode and client count is a ratio of (`ratio_to_ping`).
- `lookup`: one batched lookup of a 1,000-key chain (all committed);
- `locate`: locate 64 committed keys (with read leases);
- `alloc_commit`: allocate 64 new keys, then commit them, on a store with room;
- `full_1ns` / `full_8ns`: the same on a FULL store — its one capacity (every namespace
  shares it, DESIGN decision 5b) reached, with watermarks so close that every allocate
  evicts what it needs — whose entries and allocations are in 1 namespace, or spread
  over 8 (each call the next namespace). With 8, the least-recently-used keys are mostly
  other namespaces', so each allocate evicts across namespaces, punches their pages back
  to the file system and grows its own file (the real path: the store has a storage
  root and real growing page files). The document reports both, and the ratio of keys
  saved (committed) per second, 1 namespace over 8 — saved keys, not calls, since an
  allocate that refuses keys (no space) is fast but saves nothing; the goal is at most
  1.5. Each full-store cell starts from its own copy of the same full store, and
  reports what it evicted per call and the share of keys refused.

Every store is pre-filled with `entries` committed keys (2 MiB pages), through the store
API in big batches (8,192 keys per allocate and commit); the full stores hold exactly
their capacity. Memory: the resident set of a fresh store process (the embedded client,
or the `hf3fsctl serve` process tree) is read before and after its first lookup loads
the store (the committed-key index and SQLite's cache), divided by the entries:
bytes/entry, beside the in-tree vLLM metadata server's ~570 B per key.

Modes: `embedded` (`sqlite:///`, each client its own process sharing one database file,
as the workers of a node do), `serve` (a real `hf3fsctl serve` this starts on loopback,
with a token; each client its own process with its own keep-alive connection), or a
running server given by URL (loopback only; its own store, so no full-store cells, and
the benchmark's namespaces are dropped afterwards). Beside them, on stores of their own
(no full-store cells): `in-tree` (vLLM's own hf3fs metadata server, through its own
client: the reference every cell's "÷ in-tree" is measured against in the same run),
`redis` (clients straight to a private `redis-server`) and `serve-redis` (two `serve`
replicas on that Redis, clients split between them); a mode whose program is missing
here is skipped and listed in `skipped_modes`. Clients are processes, not threads,
so client-side Python shares no GIL with the server or with each other; on a 2-core
machine they share the cores with the server, so the figures include the clients' CPU.
Each cell runs for `seconds` after every client is connected and warmed up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from hf3fsctl.bench import report
from hf3fsctl.bench.metadata_peers import free_port
from hf3fsctl.errors import Hf3fsctlError, InvalidRequest, MetadataUnavailable

if TYPE_CHECKING:
    from rich.console import RenderableType

    from hf3fsctl.meta.client import MetadataClient

OPS = ("ping", "lookup", "locate", "alloc_commit", "full_1ns", "full_8ns")
FULL_OPS = ("full_1ns", "full_8ns")
MODES = ("embedded", "serve", "in-tree", "redis", "serve-redis")
# Modes that need a program this machine may lack: skipped (and said so) when it does.
OPTIONAL_MODES = ("in-tree", "redis", "serve-redis")
OP_LABELS = {
    "ping": "ping (1-key lookup)",
    "lookup": "lookup 1,000 keys",
    "locate": "locate 64 keys",
    "alloc_commit": "allocate + commit 64",
    "full_1ns": "full store, 1 namespace",
    "full_8ns": "full store, 8 namespaces",
}
BATCH = 64
LOOKUP_KEYS = 1000
FILL_CHUNK = 8192
URL_FILL_CHUNK = 4096  # under the server's default max_batch (8192)
PAGE_BYTES = 2 << 20  # a Llama-8B-like page: 32 layers x K,V x 8 heads x 128 x 16 x bf16
FULL_NAMESPACES = 8
UNBOUNDED_BYTES = 1 << 62  # the capacity recorded in stores that must never fill
FULL_GOAL = 1.5
# The in-tree vLLM hf3fs metadata server, measured earlier on this machine kind (2
# cores): ops/s and latency of the same calls. A reference, not a ceiling of this run.
IN_TREE: dict[tuple[str, int], dict[str, float]] = {
    ("lookup", 1): {"ops": 274, "p50_ms": 3.2},
    ("lookup", 16): {"ops": 560, "p99_ms": 57},
    ("alloc_commit", 1): {"ops": 141, "p50_ms": 7.5},
    ("alloc_commit", 16): {"ops": 141, "p50_ms": 103},
    ("full_1ns", 1): {"ops": 1.8},
    ("full_1ns", 16): {"ops": 1.8},
    ("full_8ns", 1): {"ops": 1.8},
    ("full_8ns", 16): {"ops": 1.8},
}
IN_TREE_BYTES_PER_KEY = 570
FULL_COLUMNS = [
    "mode",
    "clients",
    "1 ns ops/s",
    "8 ns ops/s",
    "1 ns saved/s",
    "8 ns saved/s",
    "1 ns ÷ 8 ns",
    "p99 ms 1 ns",
    "p99 ms 8 ns",
    "evicted/call 1 ns",
    "evicted/call 8 ns",
    "no space 1 ns",
    "no space 8 ns",
    f"goal ≤ {FULL_GOAL:g}",
]


@dataclass(frozen=True)
class MetadataSettings:
    """What one `bench metadata` run measures.

    Attributes:
        modes: `embedded` and/or `serve` (ignored when `url` is given).
        ops: the operations (see the module docstring); `ping` is always measured.
        clients: concurrent client processes, one cell each per operation.
        seconds: timed window of each cell.
        entries: committed keys every store is pre-filled with (and the full stores'
            capacity in pages).
        url: a running `hf3fsctl serve` to measure instead (loopback only).
        token: its bearer token.
        workers: server processes of the server this starts (`serve` mode).
        directory: where the work directory is made.
        keep: leave the work directory (and, with `url`, the namespaces) behind.
    """

    modes: tuple[str, ...] = MODES
    ops: tuple[str, ...] = OPS
    clients: tuple[int, ...] = (1, 16)
    seconds: float = 3.0
    entries: int = 200_000
    url: str | None = None
    token: str | None = None
    workers: int = 1
    directory: Path | None = None
    keep: bool = False

    @classmethod
    def quick(cls, **overrides: Any) -> MetadataSettings:
        """Short cells on a small store (about 15 s with both modes on 2 cores)."""
        base: dict[str, Any] = {"clients": (1, 4), "seconds": 0.3, "entries": 10_000}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def check(self) -> None:
        """Refuse settings that cannot run.

        Raises:
            InvalidRequest: naming the setting.
        """
        if not self.clients or any(c < 1 for c in self.clients):
            raise InvalidRequest(f"clients must be positive, got {list(self.clients)}")
        if max(self.clients) > 256:
            raise InvalidRequest(f"at most 256 client processes, got {max(self.clients)}")
        if not 0 < self.seconds <= 3600:
            raise InvalidRequest(f"seconds must be in (0, 3600], got {self.seconds}")
        if self.entries < LOOKUP_KEYS + BATCH:
            raise InvalidRequest(
                f"entries must be at least {LOOKUP_KEYS + BATCH} (the lookup chain and a "
                f"locate batch are read from them), got {self.entries}"
            )
        for op in self.ops:
            if op not in OPS:
                raise InvalidRequest(f"unknown operation {op!r}; one of {', '.join(OPS)}")
        for mode in self.modes:
            if mode not in MODES:
                raise InvalidRequest(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        if self.url is not None:
            check_loopback_url(self.url)
        elif not self.modes:
            raise InvalidRequest("no mode to measure: give embedded and/or serve, or --url")
        if self.workers < 1:
            raise InvalidRequest(f"workers must be at least 1, got {self.workers}")


def check_loopback_url(url: str) -> None:
    """Refuse a URL that is not http(s) on a loopback address (benchmarks stay local).

    Raises:
        InvalidRequest: the URL is malformed or names another host.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidRequest(f"--url {url!r} is not http(s)://HOST:PORT")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise InvalidRequest(
                f"--url {url!r} is not on loopback: the benchmark only loads servers on "
                "this machine",
                hint="run it on the server's host against http://127.0.0.1:PORT",
            )


# --- keys, manifests, stores ----------------------------------------------------------


def key(tag: str, index: int) -> str:
    """A block key (64 hex digits, like vLLM's sha256 block hashes)."""
    return hashlib.sha256(f"{tag}-{index}".encode()).hexdigest()


def bench_manifest(model: str) -> dict[str, Any]:
    from hf3fsctl.keys import NamespaceManifest

    return NamespaceManifest(
        model=model,
        revision="bench",
        kv_dtype="bfloat16",
        block_size=16,
        layout="LBNHC",
        backend="FLASH_ATTN",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        tp_size=1,
        pp_size=1,
        page_bytes=PAGE_BYTES,
        hash_algorithm="sha256",
        none_hash="00" * 32,
    ).to_dict()


def _namespace_id(manifest: dict[str, Any]) -> str:
    from hf3fsctl.keys import NamespaceManifest

    return NamespaceManifest(**manifest).namespace_id


def bench_rank_file(namespace: str) -> Any:
    from hf3fsctl.meta.models import RankFile
    from hf3fsctl.storage.layout import GROWABLE_MAX_BYTES, rank_file_name, slot_bytes

    slot = slot_bytes(PAGE_BYTES)
    return RankFile(
        rank=0,
        path=rank_file_name(namespace, 0),
        page_bytes=PAGE_BYTES,
        slot_bytes=slot,
        num_pages=GROWABLE_MAX_BYTES // slot,
        preallocated=False,
    )


@dataclass(frozen=True)
class StoreSpec:
    """One store the cells run against, as every client process opens it."""

    name: str  # "main", "full_1ns", "full_8ns"
    url: str
    token: str | None
    namespaces: tuple[str, ...]
    stored_tag: str  # the prefilled keys are key(stored_tag, 0..entries-1)
    entries: int
    root: str | None = None  # storage root (embedded clients' policy: punching works)
    high: float = 0.95
    low: float = 0.85
    replicas: tuple[str, ...] = ()  # several servers of one store: client i uses i mod n

    def client(self, timeout_s: float = 120.0, worker: int = 0) -> MetadataClient:
        """A client of this store (embedded: its own `MetadataStore` in this process;
        `in-tree+http://`: vLLM's in-tree server through its own client)."""
        from hf3fsctl.bench.metadata_peers import IN_TREE_SCHEME, InTreeClient
        from hf3fsctl.meta.client import open_metadata_client
        from hf3fsctl.meta.policy import StorePolicy

        url = self.replicas[worker % len(self.replicas)] if self.replicas else self.url
        if url.startswith(IN_TREE_SCHEME):
            return InTreeClient(url)  # type: ignore[return-value]  # the cells' calls only
        return open_metadata_client(
            url,
            timeout_s=timeout_s,
            token=self.token,
            high_watermark=self.high,
            low_watermark=self.low,
            policy=StorePolicy(storage_root=self.root) if self.root else None,
        )


def _full_watermarks(pages: int) -> tuple[float, float]:
    """High 1.0 and low half a page below it: once full, each allocate evicts what it needs."""
    return 1.0, 1.0 - 0.5 / pages


def _create_store(
    directory: Path, name: str, entries: int, tag: str, run: str
) -> tuple[StoreSpec, Path]:
    """Create and fill one store (in a child process); returns its spec and database."""
    full = name in FULL_OPS
    count = FULL_NAMESPACES if name == "full_8ns" else 1
    manifests = [bench_manifest(f"hf3fsctl-bench/{run}/{name}/{i}") for i in range(count)]
    namespaces = tuple(_namespace_id(m) for m in manifests)
    db = directory / f"{name}.db"
    root = directory / f"storage-{name}"
    root.mkdir(parents=True, exist_ok=True)
    high, low = _full_watermarks(entries) if full else (0.95, 0.85)
    capacity = entries * PAGE_BYTES if full else UNBOUNDED_BYTES
    spec = StoreSpec(
        name=name,
        url=f"sqlite:///{db}",
        token=None,
        namespaces=namespaces,
        stored_tag=tag,
        entries=entries,
        root=str(root) if full else None,
        high=high,
        low=low,
    )
    _in_child(_fill_store, spec, db, root, capacity, manifests)
    return spec, db


def _fill_store(
    spec: StoreSpec, db: Path, root: Path, capacity: int, manifests: list[dict[str, Any]]
) -> None:
    """Register the namespaces (growing files on disk) and commit `spec.entries` keys."""
    from hf3fsctl.meta.policy import StorePolicy
    from hf3fsctl.meta.store import MetadataStore
    from hf3fsctl.storage.layout import PageFile

    store = MetadataStore(
        db,
        high_watermark=spec.high,
        low_watermark=spec.low,
        policy=StorePolicy(storage_root=spec.root) if spec.root else None,
    )
    try:
        store.set_capacity(capacity)
        for ns, manifest in zip(spec.namespaces, manifests, strict=True):
            store.register_namespace(ns, manifest)
            store.register_rank(ns, bench_rank_file(ns))
            PageFile.create_growable(root, ns, 0, PAGE_BYTES).close()
        for number, start in enumerate(range(0, spec.entries, FILL_CHUNK)):
            ns = spec.namespaces[number % len(spec.namespaces)]
            stop = min(spec.entries, start + FILL_CHUNK)
            _store_chunk(store, spec, ns, start, stop)
    finally:
        store.close()


def _store_chunk(api: Any, spec: StoreSpec, ns: str, start: int, stop: int) -> None:
    """Allocate and commit the prefilled keys `start..stop` in one call each.

    `api` is a `MetadataStore` or a `MetadataClient` (the same two calls).
    """
    from hf3fsctl.meta.models import CommitItem

    keys = [key(spec.stored_tag, i) for i in range(start, stop)]
    result = api.allocate(ns, 0, keys, first_depth=start)
    if result.no_space:
        raise MetadataUnavailable(
            f"filling store {spec.name}: {len(result.no_space)} keys found no space",
            hint="use a store with room (a scratch server), or lower --entries",
        )
    api.commit(
        ns,
        0,
        [
            CommitItem.model_construct(
                key=a.key, page=a.page, checksum=f"xxh3:{a.page:016x}", size=PAGE_BYTES
            )
            for a in result.allocated
        ],
    )


def _fill_url(client: MetadataClient, spec: StoreSpec) -> None:
    """Fill a running server's store through its client (for `--url`)."""
    for start in range(0, spec.entries, URL_FILL_CHUNK):
        _store_chunk(
            client, spec, spec.namespaces[0], start, min(spec.entries, start + URL_FILL_CHUNK)
        )


def _copy_store(spec: StoreSpec, db: Path, directory: Path) -> tuple[StoreSpec, Path]:
    """A private copy of a closed, filled store (each mode starts from the same state)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / db.name
    shutil.copy2(db, target)
    root = None
    if spec.root is not None:
        root = directory / Path(spec.root).name
        shutil.copytree(spec.root, root)
    else:
        (directory / f"storage-{spec.name}").mkdir(exist_ok=True)
    copy = dataclasses.replace(
        spec, url=f"sqlite:///{target}", root=None if root is None else str(root)
    )
    return copy, target


# --- processes ------------------------------------------------------------------------


def _fork() -> Any:
    return multiprocessing.get_context("fork")


def _child_entry(fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as exc:
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def _in_child(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` in a forked child (keeps this process's memory lean); its result."""
    ctx = _fork()
    queue = ctx.Queue()
    child = ctx.Process(target=_child_entry, args=(fn, args, queue), daemon=True)
    child.start()
    try:
        while True:
            try:
                status, value = queue.get(timeout=1.0)
                break
            except Exception:  # queue.Empty: still working, unless it died
                if not child.is_alive():
                    try:  # it may have answered just before exiting
                        status, value = queue.get(timeout=1.0)
                    except Exception:
                        status, value = "error", f"the child exited with {child.exitcode}"
                    break
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    if status != "ok":
        raise MetadataUnavailable(f"benchmark set-up failed: {value}")
    return value


def rss_bytes(pid: int) -> int:
    """Resident set of a process and all its descendants (bytes; 0 when gone)."""
    total = 0
    for current in (pid, *_descendants(pid)):
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def _probe_embedded(spec: StoreSpec) -> dict[str, int]:
    """RSS of a fresh embedded store process before and after its first lookup."""
    code = (
        "import json, os, sys\n"
        "from hf3fsctl.bench.metadata import StoreSpec, key, rss_bytes\n"
        "spec = StoreSpec(**json.loads(sys.argv[1]))\n"
        "client = spec.client()\n"
        "client.health()\n"
        "before = rss_bytes(os.getpid())\n"
        "hits = client.lookup(spec.namespaces[0], [key(spec.stored_tag, 0)])\n"
        "after = rss_bytes(os.getpid())\n"
        "client.close()\n"
        "print(json.dumps({'before': before, 'after': after, 'hits': hits}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(dataclasses.asdict(spec))],
        capture_output=True,
        text=True,
        timeout=600,
        env=_child_env(),
        check=False,
    )
    if done.returncode != 0:
        raise MetadataUnavailable(f"memory probe failed: {done.stderr.strip()[-2000:]}")
    out: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _child_env() -> dict[str, str]:
    """This environment without hf3fsctl configuration overrides (the bench sets its own)."""
    drop = ("HF3FSCTL_STORAGE_", "HF3FSCTL_METADATA_", "HF3FSCTL_SERVER_", "HF3FSCTL_CONNECTOR_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("HF3FSCTL_CONFIG", None)
    return env


class Server:
    """A real `hf3fsctl serve` on loopback over one store, with a token."""

    def __init__(
        self,
        directory: Path,
        spec: StoreSpec,
        db: Path | None,
        workers: int,
        metadata_url: str | None = None,
        name: str | None = None,
    ) -> None:
        self.directory = directory
        self.spec = spec
        self.db = db
        self.workers = workers
        self.metadata_url = metadata_url or f"sqlite:///{db}"
        self.name = name or spec.name
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.log_path = directory / f"serve-{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Server:
        """Write its config and token, start it, and wait for `/healthz`."""
        token_file = self.directory / f"token-{self.name}"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        root = self.spec.root or str(self.directory / f"storage-{self.spec.name}")
        config = self.directory / f"serve-{self.name}.yaml"
        config.write_text(
            f"storage:\n  path: {json.dumps(root)}\n"
            f"metadata:\n  url: {json.dumps(self.metadata_url)}\n"
            f"  high_watermark: {self.spec.high!r}\n  low_watermark: {self.spec.low!r}\n"
            f"server:\n  workers: {self.workers}\n"
        )
        command = [sys.executable, "-m", "hf3fsctl", "serve", "--config", str(config)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        command += ["--token-file", str(token_file)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=_child_env()
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MetadataUnavailable(
                    f"hf3fsctl serve exited with {self.process.returncode}: {self.log()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        self.stop()
        raise MetadataUnavailable(f"hf3fsctl serve did not answer in {timeout_s:g}s: {self.log()}")

    def store_spec(self) -> StoreSpec:
        """How clients reach this store through the server."""
        return dataclasses.replace(
            self.spec, url=self.url, token=self.token, root=None, replicas=()
        )

    def rss(self) -> int:
        """Resident set of the server's process tree."""
        return rss_bytes(self.process.pid) if self.process is not None else 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL (its worker processes too) if it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return
        tree = _descendants(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for pid in tree:  # uvicorn workers left behind by a killed supervisor
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc; empty where it is not readable)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                children = [int(c) for c in (task / "children").read_text().split()]
                found.extend(children)
                pending.extend(children)
    return found


@contextlib.contextmanager
def _serving(directory: Path, spec: StoreSpec, db: Path, workers: int) -> Iterator[Server]:
    server = Server(directory, spec, db, workers).start()
    try:
        yield server
    finally:
        server.stop()


# --- one cell -------------------------------------------------------------------------


def _operation(
    client: MetadataClient, spec: StoreSpec, op: str, worker: int, tag: str
) -> tuple[Callable[[], tuple[int, int]], Callable[[], None]]:
    """(one call of `op` → (keys that found no space, keys committed), its warm-up)."""
    from hf3fsctl.meta.models import CommitItem

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
    if op == "locate":
        span = spec.entries - BATCH

        def keys_now() -> list[str]:
            first = (worker * 7919 + counter[0] * BATCH) % span
            counter[0] += 1
            return [key(spec.stored_tag, first + i) for i in range(BATCH)]

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
        keys = [key(f"{tag}-{op}-{worker}", n * BATCH + i) for i in range(BATCH)]
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
) -> None:
    """One client process: connect, warm up, wait for the others, run `op` for `seconds`.

    Latencies go to `queue` in chunks (so a client cut off at the deadline loses only its
    last call), and `in_flight[worker]` holds the start of the call under way (0: none).
    """
    try:
        client = spec.client(worker=worker)
        call, warm = _operation(client, spec, op, worker, tag)
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
        queue.put(("done", worker, time.monotonic()))
        client.close()
    except BaseException as exc:
        queue.put(("error", worker, f"{type(exc).__name__}: {exc}"))


_FLUSH_S = 0.25  # how often a client sends its latencies


def cutoff_s(seconds: float) -> float:
    """How long after a cell's window a call still running is cut off."""
    return max(5.0, 2.0 * seconds)


def measure(spec: StoreSpec, op: str, clients: int, seconds: float, tag: str) -> dict[str, Any]:
    """One (operation, client count) cell: ops/s and latency percentiles.

    The cell is bounded: clients stop starting calls `seconds` after they start, and a
    call still running `cutoff_s(seconds)` later is cut off (its client killed). It
    counts as `unfinished_calls`, with its time so far among the latencies (a lower
    bound, so a percentile that reaches it is one too); `truncated` says so. A call the
    service refuses (an `Hf3fsctlError`: busy, unavailable) is a `failed_calls`: in the
    latencies, not in ops/s, which counts calls that succeeded.
    """
    ctx = _fork()
    barrier = ctx.Barrier(clients + 1)
    queue = ctx.Queue()
    in_flight = ctx.Array("d", clients, lock=False)
    processes = [
        ctx.Process(
            target=_client_main,
            args=(spec, op, worker, seconds, f"{tag}-x{clients}", barrier, queue, in_flight),
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
    try:
        try:
            barrier.wait(timeout=600)
        except threading.BrokenBarrierError:
            pass
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
            else:
                error = (worker, message[2])
        cut = time.monotonic()
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
    keys = {"ping": 1, "lookup": LOOKUP_KEYS}.get(op, BATCH)
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
    }


# --- a run ----------------------------------------------------------------------------


def _stores_needed(ops: Sequence[str]) -> list[str]:
    names = ["main"]
    names += [op for op in FULL_OPS if op in ops]
    return names


def _memory(entries: int, before: int, after: int, db: Path | None) -> dict[str, Any]:
    grown = max(0, after - before)
    per_entry = grown / entries
    return {
        "entries": entries,
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "bytes_per_entry": per_entry,
        "rss_after_per_entry": after / entries,
        "in_tree_bytes_per_key": IN_TREE_BYTES_PER_KEY,
        "ratio_to_in_tree": per_entry / IN_TREE_BYTES_PER_KEY,
        "db_bytes_per_entry": None
        if db is None or not db.exists()
        else db.stat().st_size / entries,
    }


def _cell(
    mode: str,
    spec: StoreSpec,
    op: str,
    clients: int,
    settings: MetadataSettings,
    tag: str,
    say: report.Progress,
) -> dict[str, Any]:
    row = {"mode": mode, **measure(spec, op, clients, settings.seconds, tag)}
    say(
        f"  {mode:<9} {op:<13} x{clients:<3} {report.fmt(row['ops'], 1):>9} ops/s  "
        f"p50 {report.fmt(row['p50_ms'])} ms  p99 {report.fmt(row['p99_ms'])} ms  "
        f"p99.9 {report.fmt(row['p999_ms'])} ms"
    )
    return row


def _cells(
    mode: str,
    spec: StoreSpec,
    ops: Sequence[str],
    settings: MetadataSettings,
    tag: str,
    say: report.Progress,
) -> list[dict[str, Any]]:
    return [
        _cell(mode, spec, op, clients, settings, tag, say)
        for op in ops
        for clients in settings.clients
    ]


def _ordered(ops: Sequence[str]) -> list[str]:
    """`ping` first (the ceiling), then the rest in the canonical order."""
    wanted = {"ping", *ops}
    return [op for op in OPS if op in wanted]


def run(
    settings: MetadataSettings | None = None, progress: report.Progress | None = None
) -> dict[str, Any]:
    """Run every mode's cells; return the JSON document.

    Raises:
        InvalidRequest: settings that cannot run.
        MetadataUnavailable: a server would not start, or a client call failed.
    """
    settings = settings or MetadataSettings()
    settings.check()
    say = progress or (lambda message: None)
    ops = _ordered(settings.ops)
    run_id = secrets.token_hex(4)
    tag = f"bench-{run_id}"
    parent = Path(settings.directory) if settings.directory else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hf3fsctl-bench-metadata-", dir=parent))
    started = time.monotonic()
    modes: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    skipped_modes: dict[str, str] = {}
    try:
        if settings.url is not None:
            skipped = [op for op in ops if op in FULL_OPS]
            mode_doc, mode_rows = _run_url(
                settings, [o for o in ops if o not in FULL_OPS], tag, run_id, say
            )
            modes.append(mode_doc)
            rows += mode_rows
        else:
            pristine: dict[str, tuple[StoreSpec, Path]] = {}
            fill_started = time.monotonic()
            sqlite_modes = [m for m in settings.modes if m not in OPTIONAL_MODES]
            for name in _stores_needed(ops) if sqlite_modes else []:
                say(f"filling store {name}: {settings.entries:,} entries")
                pristine[name] = _create_store(
                    workdir / "pristine", name, settings.entries, f"{tag}-stored", run_id
                )
            fill_s = time.monotonic() - fill_started
            fill = {
                "entries_per_store": settings.entries,
                "stores": list(pristine),
                "seconds": fill_s,
                "entries_per_s": settings.entries * len(pristine) / fill_s if fill_s else None,
                "chunk": FILL_CHUNK,
            }
            for mode in settings.modes:
                if mode in OPTIONAL_MODES:
                    try:
                        mode_doc, mode_rows = _run_peer(
                            mode, settings, ops, workdir / mode, tag, run_id, say
                        )
                    except MetadataUnavailable as exc:
                        if exc.hint is None:  # it started and then failed: a real error
                            raise
                        say(f"mode {mode} skipped: {exc} ({exc.hint})")
                        skipped_modes[mode] = str(exc)
                        continue
                else:
                    mode_doc, mode_rows = _run_mode(
                        mode, settings, ops, pristine, workdir / mode, tag, say
                    )
                    mode_doc["fill"] = fill
                modes.append(mode_doc)
                rows += mode_rows
    finally:
        if not settings.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    _add_ratios(rows)
    return {
        "benchmark": "metadata",
        "schema": report.SCHEMA,
        "machine": report.machine(),
        "settings": {
            **{
                k: v
                for k, v in dataclasses.asdict(settings).items()
                if k not in ("token", "directory")
            },
            "directory": str(workdir.parent),
            "ops": ops,
            "clients_are": "processes (fork), each with its own client",
            "cutoff_s": cutoff_s(settings.seconds),
            "batch_keys": BATCH,
            "lookup_keys": LOOKUP_KEYS,
            "page_bytes": PAGE_BYTES,
            "full_store": f"capacity = entries pages, filled; watermarks high 1.0, low "
            f"1 - 0.5/entries (each allocate evicts what it needs); "
            f"{FULL_NAMESPACES} namespaces for full_8ns, each call the next one",
        },
        "ceiling": {
            "name": "ping",
            "description": "a 1-key lookup: the cheapest hot call over the same path "
            "(embedded store, or HTTP to the server), with the same clients, in this run",
            "ratio": "ratio_to_ping = ops/s ÷ ping ops/s of the same mode and client count",
        },
        "reference": {
            "name": "in-tree vLLM hf3fs metadata server",
            "measured": "in this run (mode in-tree), where a cell has its in-tree twin; "
            "else recorded earlier on this machine kind (2 cores)",
            "recorded_ops": {f"{op}@{c}": v for (op, c), v in IN_TREE.items()},
            "rss_bytes_per_key": IN_TREE_BYTES_PER_KEY,
        },
        "modes": modes,
        "rows": rows,
        "full_store": _full_store(rows),
        "skipped": skipped,
        "skipped_modes": skipped_modes,
        "seconds": time.monotonic() - started,
    }


def _run_mode(
    mode: str,
    settings: MetadataSettings,
    ops: list[str],
    pristine: dict[str, tuple[StoreSpec, Path]],
    directory: Path,
    tag: str,
    say: report.Progress,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    label = mode if mode == "embedded" or settings.workers == 1 else f"serve w{settings.workers}"
    say(f"mode {label}")
    rows: list[dict[str, Any]] = []
    main_ops = [op for op in ops if op not in FULL_OPS]
    spec, db = _copy_store(*pristine["main"], directory / "main")
    if mode == "embedded":
        probe = _probe_embedded(spec)
        memory = _memory(settings.entries, probe["before"], probe["after"], db)
        memory["process"] = "a fresh embedded client process, before/after its first lookup"
        rows += _cells(label, spec, main_ops, settings, tag, say)
        url = spec.url
    else:
        with _serving(directory, spec, db, settings.workers) as server:
            served = server.store_spec()
            before = server.rss()
            probe_client = served.client()
            try:
                probe_client.lookup(served.namespaces[0], [key(served.stored_tag, 0)])
            finally:
                probe_client.close()
            memory = _memory(settings.entries, before, server.rss(), db)
            memory["process"] = (
                f"the hf3fsctl serve process tree ({settings.workers} worker"
                f"{'s' if settings.workers > 1 else ''}), before/after its first lookup"
            )
            rows += _cells(label, served, main_ops, settings, tag, say)
            memory["rss_end_bytes"] = server.rss()
            url = server.url
    # Every full-store cell starts from its own copy of the same full store, so the
    # first allocate of each cell meets the store exactly at its capacity.
    for name in FULL_OPS:
        if name not in pristine or name not in ops:
            continue
        for clients in settings.clients:
            cell_dir = directory / f"{name}-x{clients}"
            full_spec, full_db = _copy_store(*pristine[name], cell_dir)
            if mode == "embedded":
                row = _cell(label, full_spec, name, clients, settings, tag, say)
                keys_after = _store_keys(full_spec)
            else:
                with _serving(cell_dir, full_spec, full_db, settings.workers) as server:
                    row = _cell(label, server.store_spec(), name, clients, settings, tag, say)
                    # A call cut off is still running in the server: kill it (its
                    # transaction rolls back) rather than wait for it.
                    server.stop(timeout_s=0.0 if row["truncated"] else 15.0)
                keys_after = _store_keys(full_spec)  # from the file, the server gone
            row.update(_evictions(row, settings.entries, keys_after))
            say(
                f"  {'':<9} {'':<13} {'':<4} evicted {row['evicted_keys']:,} keys, "
                f"{report.fmt(row['evicted_per_call'], 1)} per call "
                f"(the store held {settings.entries:,}, then {keys_after:,})"
            )
            rows.append(row)
            if not settings.keep:
                shutil.rmtree(cell_dir, ignore_errors=True)
    say(
        f"  {label}: {memory['bytes_per_entry']:.0f} bytes/entry of RSS "
        f"(in-tree server ~{IN_TREE_BYTES_PER_KEY})"
    )
    return {"mode": label, "url": url, "memory": memory}, rows


IN_TREE_SPARE_PAGES = 1 << 20  # pages beyond the filled ones, for the alloc_commit cells


def fill_spec(spec: StoreSpec, chunk: int) -> float:
    """Fill `spec`'s first namespace with its entries through its client; seconds taken."""
    client = spec.client()
    began = time.monotonic()
    try:
        for start in range(0, spec.entries, chunk):
            stop = min(spec.entries, start + chunk)
            _store_chunk(client, spec, spec.namespaces[0], start, stop)
    finally:
        client.close()
    return time.monotonic() - began


def _register_main(spec: StoreSpec, manifest: dict[str, Any]) -> None:
    """Register the benchmark's namespace and rank file on an empty store, unbounded."""
    client = spec.client()
    try:
        client.set_capacity(UNBOUNDED_BYTES)
        client.register_namespace(spec.namespaces[0], manifest)
        client.register_rank(spec.namespaces[0], bench_rank_file(spec.namespaces[0]))
    finally:
        client.close()


def _run_peer(
    mode: str,
    settings: MetadataSettings,
    ops: list[str],
    directory: Path,
    tag: str,
    run_id: str,
    say: report.Progress,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One of the `OPTIONAL_MODES`, on a store of its own (no full-store cells).

    `in-tree`: vLLM's in-tree server; `redis`: clients straight to a private Redis;
    `serve-redis`: two `hf3fsctl serve` replicas on that Redis, clients split between them.

    Raises:
        MetadataUnavailable: with a hint when the program is missing here (the mode is
            skipped), without one when it started and failed.
    """
    from hf3fsctl.bench.metadata_peers import InTreeServer, RedisServer

    say(f"mode {mode}")
    directory.mkdir(parents=True, exist_ok=True)
    main_ops = [op for op in ops if op not in FULL_OPS]
    stored_tag = f"{tag}-stored"
    fill: dict[str, Any] = {"entries_per_store": settings.entries, "stores": ["main"]}
    note = "its own store: no full-store cells (they need capacity, files and eviction)"
    if mode == "in-tree":
        with InTreeServer(directory, settings.entries + IN_TREE_SPARE_PAGES) as server:
            assert server.process is not None
            spec = StoreSpec("main", server.url, None, ("in-tree",), stored_tag, settings.entries)
            before = rss_bytes(server.process.pid)
            fill["seconds"] = fill_spec(spec, FILL_CHUNK)
            memory = _memory(settings.entries, before, rss_bytes(server.process.pid), None)
            memory["process"] = "vLLM's in-tree metadata server, before/after the fill"
            rows = _cells(mode, spec, main_ops, settings, tag, say)
        url = server.url
    else:
        manifest = bench_manifest(f"hf3fsctl-bench/{run_id}/{mode}")
        namespace = _namespace_id(manifest)
        with RedisServer(directory / "redis") as redis:
            assert redis.process is not None
            spec = StoreSpec("main", redis.url(), None, (namespace,), stored_tag, settings.entries)
            _register_main(spec, manifest)
            before = rss_bytes(redis.process.pid)
            fill["seconds"] = fill_spec(spec, FILL_CHUNK)
            memory = _memory(settings.entries, before, rss_bytes(redis.process.pid), None)
            memory["process"] = "redis-server, before/after the fill"
            if mode == "redis":
                rows = _cells(mode, spec, main_ops, settings, tag, say)
                url = redis.url()
            else:
                rows, url = _cells_on_replicas(
                    mode, spec, redis.url(), directory, settings, main_ops, tag, say
                )
    fill["entries_per_s"] = settings.entries / fill["seconds"] if fill["seconds"] else None
    return {"mode": mode, "url": url, "memory": memory, "fill": fill, "note": note}, rows


def _cells_on_replicas(
    mode: str,
    spec: StoreSpec,
    redis_url: str,
    directory: Path,
    settings: MetadataSettings,
    ops: list[str],
    tag: str,
    say: report.Progress,
) -> tuple[list[dict[str, Any]], str]:
    """The cells through two `serve` replicas of one Redis store (one shared token)."""
    first = Server(directory, spec, None, settings.workers, redis_url, name="replica-a")
    second = Server(directory, spec, None, settings.workers, redis_url, name="replica-b")
    second.token = first.token
    try:
        first.start()
        second.start()
        served = dataclasses.replace(first.store_spec(), replicas=(first.url, second.url))
        return _cells(mode, served, ops, settings, tag, say), f"{first.url},{second.url}"
    finally:
        first.stop()
        second.stop()


def _store_keys(spec: StoreSpec) -> int:
    """Keys committed in the store's namespaces now."""
    client = spec.client()
    try:
        stats = client.stats()
    finally:
        client.close()
    return sum(ns.keys for ns in stats.namespaces if ns.id in spec.namespaces)


def _evictions(row: dict[str, Any], keys_before: int, keys_after: int) -> dict[str, Any]:
    """What a full-store cell evicted: the keys it started with and committed, less what
    is left (every allocate is expected to evict about what it allocates)."""
    evicted = keys_before + row["committed_keys"] - keys_after
    return {
        "store_keys_before": keys_before,
        "store_keys_after": keys_after,
        "evicted_keys": evicted,
        "evicted_per_call": evicted / row["calls"] if row["calls"] else None,
    }


def _run_url(
    settings: MetadataSettings, ops: list[str], tag: str, run_id: str, say: report.Progress
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    assert settings.url is not None
    manifest = bench_manifest(f"hf3fsctl-bench/{run_id}/main")
    ns = _namespace_id(manifest)
    spec = StoreSpec(
        name="main",
        url=settings.url,
        token=settings.token,
        namespaces=(ns,),
        stored_tag=f"{tag}-stored",
        entries=settings.entries,
    )
    client = spec.client()
    try:
        client.health()
        client.register_namespace(ns, manifest)
        client.register_rank(ns, bench_rank_file(ns))
        say(f"filling namespace {ns} on {settings.url}: {settings.entries:,} entries")
        began = time.monotonic()
        _fill_url(client, spec)
        fill_s = time.monotonic() - began
        rows = _cells("url", spec, ops, settings, tag, say)
    finally:
        if not settings.keep:
            with contextlib.suppress(Exception):
                client.drop_namespaces([ns])
        client.close()
    mode = {
        "mode": "url",
        "url": settings.url,
        "namespace": ns,
        "fill": {
            "entries_per_store": settings.entries,
            "stores": ["main"],
            "seconds": fill_s,
            "entries_per_s": settings.entries / fill_s if fill_s else None,
            "chunk": URL_FILL_CHUNK,
        },
        "memory": None,
        "note": "a running server: its memory is not measured, and the full-store cells "
        "need a store of their own (run without --url)",
    }
    return mode, rows


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """÷ ping of the same mode; ÷ in-tree: its cell in this run, else the recorded figure."""
    ping = {(r["mode"], r["clients"]): r["ops"] for r in rows if r["op"] == "ping"}
    same_run = {
        (r["op"], r["clients"]): {k: r[k] for k in ("ops", "p50_ms", "p99_ms")}
        for r in rows
        if r["mode"] == "in-tree" and r["ops"]
    }
    for row in rows:
        row["ratio_to_ping"] = report.ratio(row["ops"], ping.get((row["mode"], row["clients"])))
        if row["mode"] == "in-tree":
            row["in_tree"], row["in_tree_ratio"], row["in_tree_source"] = None, None, None
            continue
        cell = (row["op"], row["clients"])
        bar = same_run.get(cell) or IN_TREE.get(cell)
        row["in_tree"] = bar
        row["in_tree_source"] = (
            None if bar is None else ("this run" if cell in same_run else "recorded")
        )
        row["in_tree_ratio"] = report.ratio(row["ops"], bar["ops"]) if bar else None


def _no_space_share(row: dict[str, Any]) -> float | None:
    """Share of the keys asked for that found no space (a skipped save)."""
    asked = row["calls"] * BATCH
    return row["no_space_keys"] / asked if asked else None


def _full_store(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """1-namespace vs 8-namespace full-store cells, per mode and client count."""
    cells = {(r["mode"], r["op"], r["clients"]): r for r in rows}
    out = []
    for (mode, op, clients), one in cells.items():
        if op != "full_1ns" or (mode, "full_8ns", clients) not in cells:
            continue
        eight = cells[(mode, "full_8ns", clients)]
        # A cell that finished no call within the cut-off has no rate to compare.
        known = one["calls"] > 0 and eight["calls"] > 0
        # Compared on keys saved per second: an allocate that refuses keys (no space)
        # is fast, not useful.
        slowdown = (
            report.ratio(one["committed_keys_per_s"], eight["committed_keys_per_s"])
            if known
            else None
        )
        out.append(
            {
                "mode": mode,
                "clients": clients,
                "ops_1ns": one["ops"],
                "ops_8ns": eight["ops"],
                "saved_keys_per_s_1ns": one["committed_keys_per_s"],
                "saved_keys_per_s_8ns": eight["committed_keys_per_s"],
                "p50_ms_1ns": one["p50_ms"],
                "p50_ms_8ns": eight["p50_ms"],
                "p99_ms_1ns": one["p99_ms"],
                "p99_ms_8ns": eight["p99_ms"],
                "evicted_per_call_1ns": one.get("evicted_per_call"),
                "evicted_per_call_8ns": eight.get("evicted_per_call"),
                "no_space_share_1ns": _no_space_share(one),
                "no_space_share_8ns": _no_space_share(eight),
                "ratio_1ns_over_8ns": slowdown,
                "goal": FULL_GOAL,
                "met": None if slowdown is None else slowdown <= FULL_GOAL,
                "note": None
                if known
                else "no allocate finished within the cut-off in "
                + " and ".join(
                    name for name, cell in (("1 ns", one), ("8 ns", eight)) if not cell["calls"]
                ),
            }
        )
    return out


# --- people ---------------------------------------------------------------------------


def render(document: dict[str, Any]) -> RenderableType:
    """The cells (with ratios to ping and to the in-tree server), memory, full store."""
    from rich.console import Group

    from hf3fsctl.cli import output
    from hf3fsctl.config import format_size

    machine = document["machine"]
    columns = ["mode", "op", "clients", "ops/s", "p50 ms", "p99 ms", "p99.9 ms", "÷ ping"]
    columns += ["in-tree", "÷ in-tree"]
    rows = []
    for r in document["rows"]:
        bar = r.get("in_tree") or {}
        in_tree = ", ".join(
            f"{report.fmt(v, 1 if k == 'ops' else 2)} {k.replace('_ms', ' ms').replace('ops', '/s')}"
            for k, v in bar.items()
            if v is not None
        )
        rows.append(
            [
                r["mode"],
                OP_LABELS[r["op"]],
                r["clients"],
                report.fmt(r["ops"], 1)
                + (f" ({r['unfinished_calls']} cut off)" if r.get("unfinished_calls") else "")
                + (f" ({r['failed_calls']} failed)" if r.get("failed_calls") else ""),
                *(
                    ("≥ " if r.get("truncated") else "") + report.fmt(r[k])
                    for k in ("p50_ms", "p99_ms", "p999_ms")
                ),
                report.fmt(r["ratio_to_ping"]),
                in_tree or "-",
                f"{r['in_tree_ratio']:.1f}×" if r.get("in_tree_ratio") else "-",
            ]
        )
    right = ("clients", "ops/s", "p50 ms", "p99 ms", "p99.9 ms", "÷ ping", "÷ in-tree")
    cells = output.table(
        columns,
        rows,
        title=f"metadata calls, client processes on {machine['cpus']} cores, "
        f"{document['settings']['seconds']:g} s per cell; ÷ ping = ops/s over a 1-key "
        "lookup on the same path in this run (the ceiling)",
        right=right,
    )
    parts: list[Any] = [cells]
    memory_rows = []
    for mode in document["modes"]:
        memory = mode.get("memory")
        fill = mode.get("fill") or {}
        if memory is None:
            continue
        memory_rows.append(
            [
                mode["mode"],
                f"{memory['entries']:,}",
                report.fmt(fill.get("entries_per_s"), 0),
                format_size(memory["rss_before_bytes"]),
                format_size(memory["rss_after_bytes"]),
                f"{memory['bytes_per_entry']:.0f}",
                f"{memory['ratio_to_in_tree']:.2f}",
                report.fmt(memory.get("db_bytes_per_entry"), 0),
            ]
        )
    if memory_rows:
        parts.append(
            output.table(
                [
                    "mode",
                    "entries",
                    "fill/s",
                    "RSS before",
                    "RSS after",
                    "B/entry",
                    f"÷ in-tree {IN_TREE_BYTES_PER_KEY} B",
                    "disk B/entry",
                ],
                memory_rows,
                title="store memory: RSS of a fresh store process before/after loading the entries",
                right=(
                    "entries",
                    "fill/s",
                    "RSS before",
                    "RSS after",
                    "B/entry",
                    f"÷ in-tree {IN_TREE_BYTES_PER_KEY} B",
                    "disk B/entry",
                ),
            )
        )
    full = document["full_store"]
    if full:
        parts.append(
            output.table(
                FULL_COLUMNS,
                [
                    [
                        f["mode"],
                        f["clients"],
                        report.fmt(f["ops_1ns"], 1),
                        report.fmt(f["ops_8ns"], 1),
                        report.fmt(f["saved_keys_per_s_1ns"], 0),
                        report.fmt(f["saved_keys_per_s_8ns"], 0),
                        _ratio(f["ratio_1ns_over_8ns"]),
                        report.fmt(f["p99_ms_1ns"]),
                        report.fmt(f["p99_ms_8ns"]),
                        report.fmt(f["evicted_per_call_1ns"], 1),
                        report.fmt(f["evicted_per_call_8ns"], 1),
                        _share(f["no_space_share_1ns"]),
                        _share(f["no_space_share_8ns"]),
                        {True: "met", False: "missed", None: "unknown"}[f["met"]],
                    ]
                    for f in full
                ],
                title="allocate + commit 64 on a full store, 8 namespaces against 1; "
                "1 ns ÷ 8 ns = keys saved (committed) per second, 1 namespace over 8 "
                f"(goal ≤ {FULL_GOAL:g}); no space = share of keys refused (a skipped save); "
                "each cell starts from the same full store",
                right=FULL_COLUMNS[1:-1],
            )
        )
    truncated = [r for r in document["rows"] if r.get("truncated")]
    if truncated:
        parts.append(
            "≥: a call was still running when the cell was cut off "
            f"({cutoff_s(document['settings']['seconds']):g} s after its window): its time so "
            "far is counted, so those percentiles are lower bounds"
        )
    for r in document["rows"]:
        if r.get("first_failure"):
            parts.append(
                f"{r['mode']} {r['op']} x{r['clients']}: {r['failed_calls']} calls failed, "
                f"e.g. {r['first_failure'][:200]}"
            )
    for f in full:
        if f.get("note"):
            plural = "s" if f["clients"] > 1 else ""
            parts.append(f"full store, {f['mode']}, {f['clients']} client{plural}: {f['note']}")
    if document.get("skipped"):
        parts.append(
            f"skipped with --url: {', '.join(document['skipped'])} (need a store of their own)"
        )
    return Group(*parts)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2g}"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def plot(document: dict[str, Any], path: Path) -> None:
    """Ops/s per operation and client count (log scale), p99 written on each bar; one
    panel per mode; the full-store ratio and bytes/entry in the titles."""
    modes = [m["mode"] for m in document["modes"]]
    fig = report.figure(max(7.5, 6.5 * len(modes)), 5.6)
    axes = fig.subplots(1, len(modes), sharey=True, squeeze=False)[0]
    clients = document["settings"]["clients"]
    width = 0.8 / len(clients)
    measured = [r["ops"] for r in document["rows"] if r["ops"]] or [1.0]
    highest, lowest = max(measured), min(measured)
    for ax, mode in zip(axes, modes, strict=True):
        rows = [r for r in document["rows"] if r["mode"] == mode]
        ops = [op for op in OPS if any(r["op"] == op for r in rows)]
        for i, count in enumerate(clients):
            xs, ys, notes = [], [], []
            for j, op in enumerate(ops):
                cell = next((r for r in rows if r["op"] == op and r["clients"] == count), None)
                if cell is None:
                    continue
                if not cell["ops"]:  # nothing finished before the cut-off
                    ax.annotate(
                        f"cut off, ≥ {_ms(cell['p50_ms'])} ms",
                        (j + (i - (len(clients) - 1) / 2) * width, lowest / 2.5),
                        ha="center",
                        va="bottom",
                        rotation=90,
                        fontsize=7,
                        color="firebrick",
                    )
                    continue
                xs.append(j + (i - (len(clients) - 1) / 2) * width)
                ys.append(cell["ops"])
                notes.append(f"p99 {'≥ ' if cell.get('truncated') else ''}{_ms(cell['p99_ms'])} ms")
            bars = ax.bar(xs, ys, width * 0.92, label=f"{count} client{'s' if count > 1 else ''}")
            for bar, note in zip(bars, notes, strict=True):
                ax.annotate(
                    note,
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    rotation=90,
                    fontsize=7,
                )
        ax.set_yscale("log")
        ax.set_xticks(
            range(len(ops)),
            [OP_LABELS[op].replace(", ", ",\n") for op in ops],
            rotation=30,
            ha="right",
            fontsize=8,
        )
        memory = next((m.get("memory") for m in document["modes"] if m["mode"] == mode), None)
        title = mode
        if memory:
            title += f" — {memory['bytes_per_entry']:.0f} B/entry of RSS (in-tree ~{IN_TREE_BYTES_PER_KEY})"
        full = [f for f in document["full_store"] if f["mode"] == mode]
        if full:
            title += (
                "\nfull store 1 ns ÷ 8 ns: "
                + ", ".join(
                    f"{_ratio(f['ratio_1ns_over_8ns'])} at {f['clients']} client"
                    + ("s" if f["clients"] > 1 else "")
                    for f in full
                )
                + f" (goal ≤ {FULL_GOAL:g})"
            )
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(bottom=lowest / 3, top=highest * 60)
        ax.legend(fontsize=8, loc="upper right")
    axes[0].set_ylabel("ops/s (log scale)")
    machine = document["machine"]
    fig.suptitle(
        f"hf3fsctl bench metadata: {document['settings']['entries']:,} entries, "
        f"{document['settings']['seconds']:g} s per cell, client processes on "
        f"{machine['cpus']} cores (ping = 1-key lookup, the ceiling)",
        fontsize=10,
    )
    report.save(fig, path)

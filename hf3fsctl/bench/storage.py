"""`hf3fsctl bench storage`: page write/read GB/s of the POSIX engine against a plain loop.

For each page size, batch size (pages per call) and I/O thread count it writes a file's
worth of pages through `PosixEngine` (checksums recorded, as the connector does), reads
them back from the page cache (checksums verified, and not), and reads them cold (after
fsync + POSIX_FADV_DONTNEED). The ceiling is measured in the same run, on the same file
system and for the same byte count: a plain single-threaded dd-style loop (`bs` = page
size, no checksums) writes and reads a second file, and every figure carries its ratio
to that loop.

Writes are timed into the page cache, without fsync, for both (as the connector writes:
durability is not awaited, torn pages are caught by checksums); `fsync=True` adds an
fsync inside both timings. Buffers are pre-touched before timing, and each figure is
the best of `repeats` runs (on a shared machine other processes only ever slow a run
down, so the fastest run is the closest estimate of what the code itself can do).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.errors import InvalidRequest, StorageError
from hf3fsctl.storage.layout import PageFile, slot_bytes
from hf3fsctl.storage.posix import MAX_TASK_BYTES, PosixEngine

NS = "0000000000be4c00"
KiB = 1 << 10
MiB = 1 << 20

# (column title, figure key); the ceiling of `*_nochecksum` / `*_noverify` is the plain
# figure of the same direction.
FIGURES = (
    ("write", "write_gbs"),
    ("write, no checksum", "write_nochecksum_gbs"),
    ("warm read", "warm_read_gbs"),
    ("warm, no verify", "warm_read_noverify_gbs"),
    ("cold read", "cold_read_gbs"),
)
CEILING_FIGURES = ("write_gbs", "warm_read_gbs", "cold_read_gbs")


def default_threads() -> tuple[int, ...]:
    """1, twice the cores (at most 16), and 16: serial, what the cores can feed, the default."""
    cpus = os.cpu_count() or 1
    return tuple(sorted({1, min(16, 2 * cpus), 16}))


@dataclass(frozen=True)
class StorageSettings:
    """What one `bench storage` run measures.

    Attributes:
        page_sizes: bytes of one page, one row group each.
        batches: pages per engine call.
        threads: `io_threads` of the engines measured.
        total_bytes: bytes moved per measurement (per page size, rounded down to pages).
        repeats: timed runs per figure; the best is kept.
        fsync: fsync inside the write timings (ours and plain).
        o_direct: also measure O_DIRECT engines.
        max_task_bytes: the engine's largest single vectored call.
        directory: where the work directory is made (its file system is what is measured).
        keep: leave the work directory behind.
    """

    page_sizes: tuple[int, ...] = (256 * KiB, MiB, 4 * MiB)
    batches: tuple[int, ...] = (1, 16, 64)
    threads: tuple[int, ...] = field(default_factory=default_threads)
    total_bytes: int = 256 * MiB
    repeats: int = 3
    fsync: bool = False
    o_direct: bool = False
    max_task_bytes: int = MAX_TASK_BYTES
    directory: Path | None = None
    keep: bool = False

    @classmethod
    def quick(cls, **overrides: Any) -> StorageSettings:
        """A grid that runs in a few seconds (three page sizes, so the plot has lines)."""
        base: dict[str, Any] = {
            "batches": (1, 64),
            "threads": (1, 16),
            "total_bytes": 64 * MiB,
            "repeats": 2,
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def check(self) -> None:
        """Refuse settings that measure nothing.

        Raises:
            InvalidRequest: naming the setting.
        """
        if not self.page_sizes or not self.batches or not self.threads:
            raise InvalidRequest("page sizes, batches and threads need at least one value each")
        if any(t < 1 or t > 256 for t in self.threads):
            raise InvalidRequest(f"threads must be in 1..256, got {list(self.threads)}")
        if self.repeats < 1:
            raise InvalidRequest(f"repeats must be at least 1, got {self.repeats}")
        if self.max_task_bytes < 1:
            raise InvalidRequest(f"max task bytes must be positive, got {self.max_task_bytes}")
        for size in self.page_sizes:
            if self.total_bytes // slot_bytes(size) < 1:
                raise InvalidRequest(
                    f"total bytes {self.total_bytes} hold no page of {size} bytes",
                    hint="raise --total or lower --sizes",
                )


# --- measuring ------------------------------------------------------------------------


def _aligned_buffers(count: int, size: int) -> list[memoryview]:
    """`count` pre-touched, 4096-aligned buffers of `size` bytes (random contents)."""
    import numpy as np

    raw = np.empty(count * size + 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    block = raw[start : start + count * size]
    block[:] = np.random.default_rng(0).integers(0, 256, block.size, dtype=np.uint8)
    view = memoryview(block.data)
    return [view[i * size : (i + 1) * size] for i in range(count)]


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def best_seconds(
    fn: Callable[[], None], repeats: int, before: Callable[[], None] | None = None
) -> float:
    """Best (least) seconds of `fn` over `repeats` runs (`before` runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class Plain:
    """The ceiling: a single-threaded sequential dd-style loop over one preallocated file."""

    def __init__(self, path: Path, buffers: list[memoryview], total: int, fsync: bool) -> None:
        self.path, self.buffers, self.total, self.fsync = path, buffers, total, fsync
        self.block = len(buffers[0])
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, total)  # the same state as a page file
        finally:
            os.close(fd)

    def write(self) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for i, offset in enumerate(range(0, self.total, self.block)):
                os.pwrite(fd, self.buffers[i % len(self.buffers)], offset)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i, offset in enumerate(range(0, self.total, self.block)):
                os.preadv(fd, [self.buffers[i % len(self.buffers)]], offset)
        finally:
            os.close(fd)


def _engine_ops(
    file: PageFile, engine: PosixEngine, buffers: list[memoryview], batch: int, fsync: bool
) -> tuple[Callable[[bool], None], Callable[[bool], None]]:
    """Write / read every page of `file` in calls of `batch` pages, cycling over `buffers`."""
    sums: dict[int, str | None] = {}
    calls = [
        (list(range(first, min(first + batch, file.num_pages))), first % len(buffers))
        for first in range(0, file.num_pages, batch)
    ]

    def write(checksums: bool = True) -> None:
        for pages, at in calls:
            for result in engine.write_pages(
                file, pages, buffers[at : at + len(pages)], checksums=checksums
            ):
                if not result.ok:
                    raise StorageError(f"benchmark write failed: {result}")
                sums[result.page] = result.checksum
        if fsync:
            file.sync()

    def read(verify: bool) -> None:
        for pages, at in calls:
            expected = [sums[p] for p in pages] if verify else None
            for result in engine.read_pages(
                file, pages, buffers[at : at + len(pages)], expected=expected
            ):
                if not result.ok:
                    raise StorageError(f"benchmark read failed: {result}")

    return write, read


def _measure_plain(plain: Plain, nbytes: int, repeats: int) -> dict[str, float]:
    plain.write()  # warm-up: first touch of the file's blocks is not measured
    drop = functools.partial(_drop_cache, plain.path)
    return {
        "write_gbs": nbytes / best_seconds(plain.write, repeats) / 1e9,
        "warm_read_gbs": nbytes / best_seconds(plain.read, repeats) / 1e9,
        "cold_read_gbs": nbytes / best_seconds(plain.read, repeats, drop) / 1e9,
    }


def _measure_engine(
    file: PageFile,
    engine: PosixEngine,
    buffers: list[memoryview],
    batch: int,
    settings: StorageSettings,
) -> dict[str, float]:
    """Seconds of each figure for one (engine, batch)."""
    write, read = _engine_ops(file, engine, buffers, batch, settings.fsync)
    write(True)  # warm-up, and the checksums the reads verify
    drop = functools.partial(_drop_cache, file.path)
    repeats = settings.repeats
    return {
        "write_gbs": best_seconds(functools.partial(write, True), repeats),
        "write_nochecksum_gbs": best_seconds(functools.partial(write, False), repeats),
        "warm_read_gbs": best_seconds(functools.partial(read, True), repeats),
        "warm_read_noverify_gbs": best_seconds(functools.partial(read, False), repeats),
        "cold_read_gbs": best_seconds(functools.partial(read, True), repeats, drop),
    }


def ceiling_key(figure: str) -> str:
    """The plain figure a figure is measured against."""
    return figure.replace("_noverify", "").replace("_nochecksum", "")


def _work_directory(settings: StorageSettings) -> Path:
    parent = Path(settings.directory) if settings.directory else Path(tempfile.gettempdir())
    try:
        parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(parent).free
    except OSError as exc:
        raise StorageError(f"cannot use {parent} for the benchmark: {exc.strerror}") from None
    need = 2 * settings.total_bytes + 64 * MiB
    if free < need:
        raise StorageError(
            f"{parent} has {free >> 20} MiB free; the benchmark needs {need >> 20} MiB",
            hint="lower --total, or pass --dir on a file system with room",
        )
    return Path(tempfile.mkdtemp(prefix="hf3fsctl-bench-storage-", dir=parent))


def run(
    settings: StorageSettings | None = None, progress: report.Progress | None = None
) -> dict[str, Any]:
    """Run the grid; return the JSON document (settings, ceiling, figures with ratios).

    Raises:
        InvalidRequest: settings that measure nothing.
        StorageError: the work directory cannot be made, is too small, or an I/O failed.
    """
    from hf3fsctl.storage.engine import find_mount

    settings = settings or StorageSettings()
    settings.check()
    say = progress or (lambda message: None)
    workdir = _work_directory(settings)
    mount, fstype = find_mount(workdir)
    say(f"storage benchmark in {workdir} ({fstype} at {mount})")
    rows: list[dict[str, Any]] = []
    plain_rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for page_bytes in settings.page_sizes:
            num_pages = settings.total_bytes // slot_bytes(page_bytes)
            nbytes = num_pages * page_bytes
            buffers = _aligned_buffers(min(num_pages, max(settings.batches)), page_bytes)
            plain = Plain(workdir / f"plain-{page_bytes}.bin", buffers, nbytes, settings.fsync)
            plain_row: dict[str, Any] = {
                "page_bytes": page_bytes,
                "page_kib": page_bytes / KiB,
                "bytes": nbytes,
                **_measure_plain(plain, nbytes, settings.repeats),
            }
            plain_rows.append(plain_row)
            say(
                f"{report.size_label(page_bytes):>8} plain: write {plain_row['write_gbs']:.2f}, "
                f"warm read {plain_row['warm_read_gbs']:.2f}, "
                f"cold read {plain_row['cold_read_gbs']:.2f} GB/s"
            )
            root = workdir / f"pages-{page_bytes}"
            file = PageFile.create(root, NS, 0, page_bytes, num_pages * slot_bytes(page_bytes))
            try:
                for threads in settings.threads:
                    for direct in (False, True) if settings.o_direct else (False,):
                        with PosixEngine(
                            io_threads=threads,
                            o_direct=direct,
                            max_task_bytes=settings.max_task_bytes,
                        ) as engine:
                            for batch in settings.batches:
                                seconds = _measure_engine(file, engine, buffers, batch, settings)
                                row = _row(page_bytes, batch, threads, direct, nbytes)
                                for name, took in seconds.items():
                                    gbs = nbytes / took / 1e9
                                    row[name] = gbs
                                    row[name.replace("_gbs", "_ratio")] = (
                                        gbs / plain_row[ceiling_key(name)]
                                    )
                                rows.append(row)
                                say(_line(row))
            finally:
                file.close()
                if not settings.keep:  # bound the disk used to one page size's files
                    shutil.rmtree(root, ignore_errors=True)
                    plain.path.unlink(missing_ok=True)
    finally:
        if not settings.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    settings_doc = dataclasses.asdict(settings)
    settings_doc["directory"] = str(workdir.parent)
    settings_doc.update(
        {
            "statistic": f"best of {settings.repeats}",
            "checksums": "xxh3 on write, verified on read",
            "cold": "fsync + POSIX_FADV_DONTNEED on the file before each timed read",
            "writes": "into the page cache"
            + (", fsync inside the timing" if settings.fsync else ""),
        }
    )
    return {
        "benchmark": "storage",
        "schema": report.SCHEMA,
        "unit": "GB/s (1e9 bytes per second)",
        "engine": "posix",
        "machine": {**report.machine(), "mount": mount, "fstype": fstype},
        "settings": settings_doc,
        "ceiling": {
            "name": "plain",
            "description": "single-threaded sequential pwrite/preadv loop, bs = page size, "
            "no checksums, same file system and byte count, measured in this run",
            "ratio": "every *_ratio is the figure divided by the plain figure of the same "
            "page size and direction (write, warm read, cold read)",
            "rows": plain_rows,
        },
        "results": rows,
        "seconds": time.monotonic() - started,
    }


def _row(page_bytes: int, batch: int, threads: int, direct: bool, nbytes: int) -> dict[str, Any]:
    return {
        "page_bytes": page_bytes,
        "page_kib": page_bytes / KiB,
        "batch": batch,
        "threads": threads,
        "o_direct": direct,
        "bytes": nbytes,
    }


def _line(row: dict[str, Any]) -> str:
    direct = " direct" if row["o_direct"] else ""
    head = (
        f"{report.size_label(row['page_bytes']):>8} b={row['batch']:<3} t={row['threads']:<3}"
        f"{direct}"
    )
    figures = " ".join(
        f"{title} {row[key]:.2f} ({row[key.replace('_gbs', '_ratio')]:.2f}x)"
        for title, key in FIGURES
    )
    return f"{head} {figures}"

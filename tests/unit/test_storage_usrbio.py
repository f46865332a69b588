"""The USRBIO engine against `helpers.fake_hf3fs_fuse`, a FAKE of 3FS's `hf3fs_fuse.io`.

No 3FS mount can exist here, so the binding is the one fake: it keeps the documented
semantics (iovs as shared memory linked under `3fs-virt/iovs/`, I/O only on registered
fds, a ring of `entries` slots, partial waits, a timeout, results as byte counts or
-errno) over real files and real shared memory. The first tests pin those semantics
down; the rest check the engine against them: the one-copy path, per-page errors,
back-pressure, the timeout, and how the engine is chosen.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import pytest
from helpers import fake_hf3fs_fuse as fake
from helpers.meta_builders import PAGE_BYTES, keys, register_growable

from hf3fsctl.errors import StorageError
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.staging import StagingPool
from hf3fsctl.storage.checksum import checksum
from hf3fsctl.storage.engine import engine_host_memory
from hf3fsctl.storage.factory import describe_engine_choice, open_engine
from hf3fsctl.storage.layout import PageFile
from hf3fsctl.storage.posix import PosixEngine
from hf3fsctl.storage.usrbio import UsrbioEngine
from hf3fsctl.tier import LOADED, SAVED, PagePieces, StagingRows, Tier

FAKE = "helpers.fake_hf3fs_fuse"
NS = "0123456789abcdef"
SLOT = 8192  # slot of a 5000-byte page


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[fake.FakeMount]:
    fake_mount = fake.mount(tmp_path / "3fs")
    yield fake_mount
    fake.unmount(fake_mount)


def open_usrbio(mount: fake.FakeMount, **kwargs: object) -> UsrbioEngine:
    options: dict[str, object] = {"bounce_bytes": 4 * SLOT, "timeout_s": 10.0}
    options.update(kwargs)
    return UsrbioEngine(root=Path(mount.root), binding=FAKE, **options)  # type: ignore[arg-type]


@pytest.fixture
def usrbio(mount: fake.FakeMount) -> Iterator[UsrbioEngine]:
    engine = open_usrbio(mount)
    yield engine
    engine.close()


@pytest.fixture
def file(mount: fake.FakeMount) -> Iterator[PageFile]:
    with PageFile.create(Path(mount.root), NS, 0, 5000, 16 * SLOT) as page_file:
        yield page_file


def pages_of(n: int) -> list[bytes]:
    return [os.urandom(5000) for _ in range(n)]


# --- the fake keeps the binding's semantics ------------------------------------------


def test_fake_refuses_io_on_an_unregistered_fd(mount: fake.FakeMount, file: PageFile) -> None:
    shm = SharedMemory(size=SLOT, create=True)
    iov = fake.make_iovec(shm, mount.root)
    shm.unlink()  # allowed right after make_iovec: the daemon mapped it
    ring = fake.make_ioring(mount.root, 4, True)
    with pytest.raises(OSError) as refused:
        ring.prepare(iov[:4096], True, file.fd, 0)
    assert refused.value.errno == errno.EBADF
    del iov
    shm.close()


def test_fake_ring_refuses_prepare_beyond_its_entries_until_reaped(
    mount: fake.FakeMount, file: PageFile
) -> None:
    shm = SharedMemory(size=4 * SLOT, create=True)
    iov = fake.make_iovec(shm, mount.root)
    ring = fake.make_ioring(mount.root, 2, False)
    fake.register_fd(file.fd)
    try:
        ring.prepare(iov[:SLOT], False, file.fd, 0)
        ring.prepare(iov[SLOT : 2 * SLOT], False, file.fd, SLOT)
        with pytest.raises(OSError) as full:
            ring.prepare(iov[2 * SLOT : 3 * SLOT], False, file.fd, 2 * SLOT)
        assert full.value.errno == errno.EAGAIN
        done = ring.submit().wait(min_results=2, timeout=timedelta(seconds=10))
        assert sorted(c.result for c in done) == [SLOT, SLOT]
        ring.prepare(iov[2 * SLOT : 3 * SLOT], False, file.fd, 2 * SLOT)  # slots came back
    finally:
        fake.deregister_fd(file.fd)
        del iov
        shm.close()
        shm.unlink()


def test_fake_reads_past_eof_short_and_a_wait_can_time_out_empty(
    mount: fake.FakeMount, tmp_path: Path
) -> None:
    path = Path(mount.root) / "small"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    shm = SharedMemory(size=SLOT, create=True)
    iov = fake.make_iovec(shm, mount.root)
    fake.register_fd(fd)
    try:
        ring = fake.make_ioring(mount.root, 4, True)
        ring.prepare(iov[:4096], True, fd, 0, userdata="a")
        (done,) = ring.submit().wait(min_results=1, timeout=timedelta(seconds=10))
        assert (done.result, done.userdata, bytes(shm.buf[:1000])) == (1000, "a", b"x" * 1000)
        # A positive io_depth issues only full batches: one I/O never runs.
        batching = fake.make_ioring(mount.root, 4, True, 4)
        batching.prepare(iov[:4096], True, fd, 0)
        assert batching.submit().wait(min_results=1, timeout=timedelta(seconds=0.2)) == []
    finally:
        fake.deregister_fd(fd)
        os.close(fd)
        del iov
        shm.close()
        shm.unlink()


# --- the engine: data paths ----------------------------------------------------------


def test_round_trip_through_rounds_of_the_bounce_iov(usrbio: UsrbioEngine, file: PageFile) -> None:
    pages = [0, 5, 6, 7, 9, 11]  # more pages than the 4-slot bounce iov holds
    data = pages_of(len(pages))
    written = usrbio.write_pages(file, pages, data)
    out = [bytearray(5000) for _ in pages]
    read = usrbio.read_pages(file, pages, out, expected=[w.checksum for w in written])
    assert all(r.ok for r in written + read)
    assert [bytes(b) for b in out] == data
    assert usrbio.counters()["copied_pages"] == 2 * len(pages)


def test_gathered_pages_go_through_the_bounce_iov_piece_by_piece(
    usrbio: UsrbioEngine, file: PageFile
) -> None:
    data = pages_of(6)  # more than the bounce iov holds: two rounds
    pieces = [[memoryview(p)[:1], memoryview(p)[1:4096], memoryview(p)[4096:]] for p in data]
    written = usrbio.write_pages_gathered(file, list(range(6)), pieces)
    assert [w.checksum for w in written] == [checksum(p, "xxh3") for p in data]
    back = [bytearray(5000) for _ in data]
    results = usrbio.read_pages(file, list(range(6)), back, expected=[w.checksum for w in written])
    assert all(r.ok for r in results) and back == data


def test_iov_backed_staging_rows_move_without_a_copy(usrbio: UsrbioEngine, file: PageFile) -> None:
    pool = StagingPool(1 << 20, pin=False, host_memory=engine_host_memory(usrbio))
    data = np.frombuffer(b"".join(pages_of(6)), dtype=np.uint8).reshape(6, 5000)
    with pool.acquire(6, 5000) as src, pool.acquire(6, 5000) as dst:
        assert src is not None and dst is not None
        src.tensor.numpy()[:] = data
        written = usrbio.write_pages(file, list(range(6)), src.rows())
        read = usrbio.read_pages(
            file, list(range(6)), dst.rows(), expected=[w.checksum for w in written]
        )
        assert all(r.ok for r in written + read)
        assert np.array_equal(dst.tensor.numpy(), data)
    counts = usrbio.counters()
    assert (counts["direct_pages"], counts["copied_pages"]) == (12, 0)
    assert pool.counters()["shared_allocations"] == 2


def test_a_pool_switched_to_iov_memory_drops_its_plain_buffers(
    usrbio: UsrbioEngine, file: PageFile
) -> None:
    pool = StagingPool(1 << 20, pin=False)
    plain = pool.acquire(2, 5000)
    assert plain is not None
    pool.use_host_memory(engine_host_memory(usrbio))
    plain.release()  # plain memory comes back: dropped, not cached for the next lease
    with pool.acquire(2, 5000) as rows:
        assert rows is not None
        assert all(r.ok for r in usrbio.write_pages(file, [0, 1], rows.rows()))
    assert usrbio.counters()["copied_pages"] == 0
    assert pool.counters()["held_bytes"] == pool.counters()["shared_allocations"] * 16384


def test_tier_save_then_load_is_byte_exact_with_one_copy(
    tmp_path: Path, mount: fake.FakeMount, usrbio: UsrbioEngine
) -> None:
    root = Path(mount.root)
    store = MetadataStore(
        tmp_path / "meta.db", policy=StorePolicy(storage_root=str(root), capacity="100%")
    )
    store.set_capacity(64 * PAGE_BYTES)
    ns, files = register_growable(store, root)
    pool = StagingPool(1 << 20, pin=False)
    try:
        tier = Tier(ns, 0, files[0], usrbio, lambda fn: fn(store), pool)
        assert pool.one_copy  # the tier put the pool in the engine's iov
        chain = keys(5)
        data = np.frombuffer(os.urandom(5 * PAGE_BYTES), dtype=np.uint8).reshape(5, -1)
        with tier.lease(5) as out_rows:
            assert out_rows is not None
            out_rows.tensor.numpy()[:] = data
            assert tier.save(chain, out_rows.rows()).kinds == [SAVED] * 5
        with tier.lease(5) as in_rows:
            assert in_rows is not None
            assert tier.load(chain, StagingRows(in_rows.rows())).kinds == [LOADED] * 5
            assert np.array_equal(in_rows.tensor.numpy(), data)
        assert usrbio.counters()["copied_pages"] == 0
        # Pieces of a host KV cache are not iov memory: one counted copy each.
        pieces = np.zeros((5, 2, PAGE_BYTES // 2), dtype=np.uint8)
        target = PagePieces([[p[0], p[1]] for p in pieces])
        assert tier.load(chain, target).kinds == [LOADED] * 5
        assert np.array_equal(pieces.reshape(5, -1), data)
        assert usrbio.counters()["copied_pages"] == 5
    finally:
        files[0].close()
        store.close()


def test_partial_waits_are_waited_out(
    mount: fake.FakeMount, usrbio: UsrbioEngine, file: PageFile
) -> None:
    mount.max_results_per_wait = 1  # completions trickle in one per wait
    data = pages_of(8)
    written = usrbio.write_pages(file, list(range(8)), data)
    out = [bytearray(5000) for _ in data]
    read = usrbio.read_pages(file, list(range(8)), out)
    assert all(r.ok for r in written + read)
    assert [bytes(b) for b in out] == data


def test_an_errno_fails_only_its_page(
    mount: fake.FakeMount, usrbio: UsrbioEngine, file: PageFile
) -> None:
    data = pages_of(4)
    written = usrbio.write_pages(file, [0, 1, 2, 3], data)
    mount.fail(file.path, file.offset(2), errno.EIO)
    out = [bytearray(5000) for _ in data]
    read = usrbio.read_pages(file, [0, 1, 2, 3], out, expected=[w.checksum for w in written])
    assert [r.ok for r in read] == [True, True, False, True]
    assert read[2].error == "io" and "Input/output error" in (read[2].detail or "")
    assert bytes(out[3]) == data[3]


def test_ring_full_is_back_pressure_not_an_error(mount: fake.FakeMount, file: PageFile) -> None:
    engine = open_usrbio(mount, ring_entries=2, bounce_bytes=16 * SLOT)
    try:
        data = pages_of(7)
        written = engine.write_pages(file, list(range(7)), data)
        out = [bytearray(5000) for _ in data]
        read = engine.read_pages(file, list(range(7)), out)
        assert all(r.ok for r in written + read)
        assert [bytes(b) for b in out] == data
        assert engine.counters()["ring_full"] > 0
        assert mount.peak_in_flight == 2
    finally:
        engine.close()


def test_a_file_off_the_mount_is_a_per_page_error(tmp_path: Path, usrbio: UsrbioEngine) -> None:
    with PageFile.create(tmp_path, NS, 1, 5000, 4 * SLOT) as elsewhere:
        results = usrbio.write_pages(elsewhere, [0, 1], pages_of(2))
    assert [(r.ok, r.error) for r in results] == [(False, "io"), (False, "io")]
    assert "register_fd" in (results[0].detail or "")


def test_a_hung_daemon_is_a_timeout_then_a_fresh_ring(
    mount: fake.FakeMount, file: PageFile
) -> None:
    engine = open_usrbio(mount, timeout_s=0.5)
    pages = list(range(6))  # two rounds of the 4-slot bounce iov
    try:
        data = pages_of(6)
        assert all(r.ok for r in engine.write_pages(file, pages, data))
        mount.stall()
        started = time.monotonic()
        stuck = engine.read_pages(file, pages, [bytearray(5000) for _ in data])
        assert time.monotonic() - started < 10.0  # bounded by the 0.5 s timeout
        assert all(r.error == "io" and "timed out" in (r.detail or "") for r in stuck)
        mount.resume()
        out = [bytearray(5000) for _ in data]
        assert all(r.ok for r in engine.read_pages(file, pages, out))
        assert [bytes(b) for b in out] == data
        assert engine.counters()["timeouts"] == 1
    finally:
        mount.resume()
        engine.close()


def test_a_reused_fd_number_is_registered_for_its_new_file(
    mount: fake.FakeMount, usrbio: UsrbioEngine
) -> None:
    root = Path(mount.root)
    with PageFile.create(root, NS, 0, 5000, 4 * SLOT) as first:
        assert usrbio.write_pages(first, [0], pages_of(1))[0].ok
        number = first.fd
    data = pages_of(1)
    with PageFile.create(root, NS, 1, 5000, 4 * SLOT) as second:
        if second.fd != number:
            os.dup2(second.fd, number)  # make the numbers collide, as a reopen can
            os.close(second.fd)
            second.fd = number  # type: ignore[misc]
        assert usrbio.write_pages(second, [0], data)[0].ok
        assert os.pread(number, 5000, 0) == data[0]


def test_close_deregisters_descriptors(mount: fake.FakeMount, file: PageFile) -> None:
    engine = open_usrbio(mount)
    assert engine.write_pages(file, [0], pages_of(1))[0].ok
    assert file.fd in fake._REGISTERED
    engine.close()
    assert file.fd not in fake._REGISTERED


# --- choosing the engine -------------------------------------------------------------


def mounts_claiming_3fs(mount: fake.FakeMount) -> str:
    return f"/dev/root / ext4 rw 0 0\nhf3fs {mount.root} fuse.hf3fs rw 0 0\n"


def test_auto_picks_usrbio_on_a_3fs_mount_and_says_one_copy(
    mount: fake.FakeMount, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hf3fsctl.storage.factory")
    engine = open_engine(
        "auto", root=mount.root, binding=FAKE, mounts_text=mounts_claiming_3fs(mount)
    )
    try:
        assert isinstance(engine, UsrbioEngine)
        assert engine_host_memory(engine) is not None
        assert "I/O engine: usrbio" in caplog.text and "one copy" in caplog.text
    finally:
        engine.close()


def test_auto_on_3fs_without_the_binding_is_posix_and_says_why(mount: fake.FakeMount) -> None:
    choice = describe_engine_choice(
        "auto", mount.root, binding="no_such_binding", mounts_text=mounts_claiming_3fs(mount)
    )
    assert (choice["engine"], choice["on_3fs"], choice["one_copy"]) == ("posix", True, False)
    assert "no USRBIO binding" in choice["reason"]


def test_usrbio_requested_without_a_binding_fails_fast_with_the_key_and_fix(
    mount: fake.FakeMount,
) -> None:
    with pytest.raises(StorageError) as failed:
        open_engine(
            "usrbio",
            root=mount.root,
            binding="no_such_binding",
            mounts_text=mounts_claiming_3fs(mount),
        )
    assert failed.value.message.startswith("storage.engine: usrbio requested but unavailable")
    assert "storage.engine" in failed.value.hint


def test_usrbio_that_does_not_start_fails_when_asked_for_and_warns_under_auto(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "not-a-fake-mount"  # /proc/mounts says 3FS, the binding finds none
    root.mkdir()
    claim = f"hf3fs {root} fuse.hf3fs rw 0 0\n"
    with pytest.raises(StorageError, match=r"^storage\.engine: usrbio requested but it did not"):
        open_engine("usrbio", root=root, binding=FAKE, mounts_text=claim)
    engine = open_engine("auto", root=root, binding=FAKE, mounts_text=claim)
    try:
        assert isinstance(engine, PosixEngine)
        assert "USRBIO did not start" in caplog.text
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("engine", "expected"),
    [("posix", ("ok", "off: preadv/pwritev")), ("usrbio", ("skip", "no I/O engine"))],
    ids=["posix-is-not-one-copy", "usrbio-that-cannot-open-is-skipped"],
)
def test_doctor_says_whether_staging_is_one_copy(
    tmp_path: Path, engine: str, expected: tuple[str, str]
) -> None:
    from hf3fsctl.cli.checks import Report
    from hf3fsctl.cli.doctor import check_storage
    from hf3fsctl.config import load_config

    config = load_config(overrides={"storage.path": str(tmp_path), "storage.engine": engine})
    report = Report()
    check_storage(report, config)
    (line,) = [c for c in report.checks if c.name == "storage.one_copy"]
    assert (line.status, line.detail[: len(expected[1])]) == expected


def test_a_connector_asked_for_usrbio_off_3fs_is_disabled_with_the_fix(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from helpers.connector_harness import make_harness, make_kv_caches
    from hf3fsctl_connector.namespace import load_settings
    from hf3fsctl_connector.stats import StatsRecorder
    from hf3fsctl_connector.worker import WorkerSide

    from hf3fsctl.config import build_config

    harness = make_harness(tiny_model_dir, tmp_path / "store")
    storage = tmp_path / "kv"
    storage.mkdir()
    config = build_config(
        [
            ("base", load_settings(harness.vllm_config).to_dict()),
            ("test", {"storage.path": str(storage), "storage.engine": "usrbio"}),
        ]
    )
    worker = WorkerSide(config, harness.worker.manifest, harness.kv_cache_config, StatsRecorder())
    try:
        worker.register_kv_caches(make_kv_caches(harness.kv_cache_config)[1])  # no raise
        assert (worker.disabled or "").startswith("storage unusable: storage.engine: usrbio")
        assert "set storage.engine to auto or posix" in worker.health.snapshot().fix
    finally:
        worker.shutdown()
        harness.close()

"""Page-file layout: slot math, paths that stay under the root, create/open, manifests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.meta_builders import make_manifest

from hf3fsctl.errors import InvalidRequest, NamespaceConflict, NotFound, StorageError
from hf3fsctl.keys import NamespaceManifest
from hf3fsctl.storage import layout
from hf3fsctl.storage.layout import (
    PageFile,
    manifest_file_name,
    rank_file_name,
    read_manifest,
    resolve_under,
    slot_bytes,
    write_manifest,
)

NS = "0123456789abcdef"


def _manifest(**changes: object) -> NamespaceManifest:
    defaults: dict[str, object] = {"revision": "local-0000", "page_bytes": 2 * 2 * 16 * 2 * 64 * 2}
    return make_manifest(**(defaults | changes))


@pytest.mark.parametrize(
    ("page_bytes", "expected"),
    [(1, 4096), (4095, 4096), (4096, 4096), (4097, 8192), (3 * 4096, 3 * 4096)],
    ids=["one-byte", "just-under", "exact", "just-over", "multiple"],
)
def test_slot_is_page_rounded_up_to_4096(page_bytes: int, expected: int) -> None:
    assert slot_bytes(page_bytes) == expected


@pytest.mark.parametrize(
    "page_bytes", [0, -4096, 1.5, True], ids=["zero", "negative", "float", "bool"]
)
def test_slot_rejects_non_positive_integers(page_bytes: object) -> None:
    with pytest.raises(InvalidRequest):
        slot_bytes(page_bytes)  # type: ignore[arg-type]


def test_rank_and_manifest_names_are_relative_under_the_namespace() -> None:
    assert rank_file_name(NS, 3) == f"{NS}/rank-0003.pages"
    assert manifest_file_name(NS) == f"{NS}/manifest.json"


@pytest.mark.parametrize(
    "namespace",
    ["../etc", "/abs/ns", "0123456789ABCDEF", "short"],
    ids=["dotdot", "absolute", "upper-case", "too-short"],
)
def test_rank_file_name_rejects_malformed_namespace(namespace: str) -> None:
    with pytest.raises(InvalidRequest):
        rank_file_name(namespace, 0)


@pytest.mark.parametrize(
    "relpath",
    ["../outside.pages", f"{NS}/../../outside.pages", "/etc/passwd", "", "a\\..\\b"],
    ids=["parent", "nested-parent", "absolute", "empty", "backslash"],
)
def test_paths_outside_the_root_are_rejected(tmp_path: Path, relpath: str) -> None:
    with pytest.raises(InvalidRequest):
        resolve_under(tmp_path, relpath)


def test_symlink_escaping_the_root_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "evil").symlink_to(tmp_path)
    with pytest.raises(InvalidRequest):
        resolve_under(root, "evil/x.pages")


def test_open_rejects_traversal_before_touching_the_file(tmp_path: Path) -> None:
    (tmp_path / "outside.pages").write_bytes(bytes(8192))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(InvalidRequest):
        PageFile.open(root, "../outside.pages", 4096, 1)


def test_create_gives_size_and_geometry(tmp_path: Path) -> None:
    with PageFile.create(tmp_path, NS, 0, 5000, 10 * 8192 + 100) as file:
        assert file.path == tmp_path.resolve() / NS / "rank-0000.pages"
        assert (file.slot_bytes, file.num_pages) == (8192, 10)
        assert file.path.stat().st_size == 10 * 8192 + 100


@pytest.mark.parametrize("preallocate", [True, False], ids=["fallocate", "sparse"])
def test_create_is_idempotent_and_keeps_written_bytes(tmp_path: Path, preallocate: bool) -> None:
    with PageFile.create(tmp_path, NS, 1, 4096, 1 << 20, preallocate=preallocate) as file:
        os.pwrite(file.fd, b"kept", file.offset(3))
    with PageFile.create(tmp_path, NS, 1, 4096, 1 << 20, preallocate=preallocate) as again:
        assert os.pread(again.fd, 4, again.offset(3)) == b"kept"


def test_create_with_a_different_size_is_a_conflict(tmp_path: Path) -> None:
    PageFile.create(tmp_path, NS, 0, 4096, 1 << 20).close()
    with pytest.raises(NamespaceConflict, match="1048576 bytes"):
        PageFile.create(tmp_path, NS, 0, 4096, 2 << 20)


def test_create_rejects_a_file_too_small_for_one_page(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        PageFile.create(tmp_path, NS, 0, 8192, 4096)


def test_preallocation_reports_progress_up_to_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layout, "PREALLOCATE_CHUNK", 1 << 20)
    calls: list[tuple[int, int]] = []
    PageFile.create(
        tmp_path, NS, 0, 4096, (5 << 20) + 4096, progress=lambda d, t: calls.append((d, t))
    ).close()
    done = [d for d, _ in calls]
    assert len(calls) >= 6
    assert done == sorted(done)
    assert calls[-1] == ((5 << 20) + 4096, (5 << 20) + 4096)


def test_interrupted_create_resumes_from_partial_file(tmp_path: Path) -> None:
    partial = tmp_path / NS / "rank-0000.pages.partial"
    partial.parent.mkdir()
    partial.write_bytes(b"x" * 4096)
    with PageFile.create(tmp_path, NS, 0, 4096, 1 << 20) as file:
        assert file.path.stat().st_size == 1 << 20
    assert not partial.exists()


def test_open_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        PageFile.open(tmp_path, rank_file_name(NS, 0), 4096, 1)


def test_open_file_smaller_than_the_pages_asked_for_fails(tmp_path: Path) -> None:
    PageFile.create(tmp_path, NS, 0, 4096, 4 * 4096).close()
    with pytest.raises(StorageError, match="too small"):
        PageFile.open(tmp_path, rank_file_name(NS, 0), 4096, 5)


@pytest.mark.parametrize("page", [-1, 4, True, 1.0], ids=["negative", "past-end", "bool", "float"])
def test_offset_out_of_range_is_invalid(tmp_path: Path, page: object) -> None:
    with PageFile.create(tmp_path, NS, 0, 100, 4 * 4096) as file, pytest.raises(InvalidRequest):
        file.offset(page)  # type: ignore[arg-type]


def test_offset_is_page_times_slot(tmp_path: Path) -> None:
    with PageFile.create(tmp_path, NS, 0, 100, 4 * 4096) as file:
        assert [file.offset(p) for p in range(4)] == [0, 4096, 8192, 12288]


def test_close_releases_the_descriptor_and_is_idempotent(tmp_path: Path) -> None:
    file = PageFile.create(tmp_path, NS, 0, 4096, 4096)
    fd = file.fd
    file.close()
    file.close()
    assert file.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)


def test_manifest_round_trips(tmp_path: Path) -> None:
    manifest = _manifest(extra={"note": "x"})
    path = write_manifest(tmp_path, manifest)
    assert path == tmp_path.resolve() / manifest.namespace_id / "manifest.json"
    assert read_manifest(tmp_path, manifest.namespace_id) == manifest


def test_rewriting_an_identical_manifest_is_a_no_op(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, _manifest())
    before = path.stat().st_mtime_ns, path.stat().st_ino
    write_manifest(tmp_path, _manifest())
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]


def test_a_different_manifest_for_the_same_namespace_is_a_conflict(tmp_path: Path) -> None:
    manifest = _manifest()
    path = write_manifest(tmp_path, manifest)
    data = json.loads(path.read_text())
    data["kv_dtype"] = "bfloat16"  # stored manifest no longer matches its namespace id
    path.write_text(json.dumps(data))
    with pytest.raises(NamespaceConflict, match="kv_dtype"):
        write_manifest(tmp_path, manifest)


def test_reading_a_missing_manifest_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        read_manifest(tmp_path, NS)


@pytest.mark.parametrize(
    "content",
    ["{not json", "[1, 2]", '{"model": "x"}'],
    ids=["not-json", "not-object", "incomplete"],
)
def test_a_corrupt_manifest_is_a_storage_error(tmp_path: Path, content: str) -> None:
    (tmp_path / NS).mkdir()
    (tmp_path / NS / "manifest.json").write_text(content)
    with pytest.raises(StorageError):
        read_manifest(tmp_path, NS)


def test_a_manifest_in_the_wrong_directory_is_a_storage_error(tmp_path: Path) -> None:
    manifest = _manifest()
    path = write_manifest(tmp_path, manifest)
    (tmp_path / NS).mkdir()
    (tmp_path / NS / "manifest.json").write_bytes(path.read_bytes())
    with pytest.raises(StorageError, match="wrong directory"):
        read_manifest(tmp_path, NS)


def test_opening_an_existing_file_still_reports_progress_complete(tmp_path: Path) -> None:
    PageFile.create(tmp_path, NS, 0, 4096, 1 << 20).close()
    calls: list[tuple[int, int]] = []
    PageFile.create(
        tmp_path, NS, 0, 4096, 1 << 20, progress=lambda d, t: calls.append((d, t))
    ).close()
    assert calls == [(1 << 20, 1 << 20)]


def test_a_page_file_knows_when_its_path_no_longer_names_it(tmp_path: Path) -> None:
    file = PageFile.create_growable(tmp_path, NS, 0, 4096)
    try:
        assert not file.removed
        file.path.unlink()  # its namespace removed while it is open
        assert file.removed
        PageFile.create_growable(tmp_path, NS, 0, 4096).close()  # another in its place
        assert file.removed
    finally:
        file.close()

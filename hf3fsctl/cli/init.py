"""`hf3fsctl init`: create a store — storage root, metadata DB, capacity, config, page files.

Steps, each reported: create the storage root and prove it is writable (a file is
written, synced and removed); for a `sqlite:///` metadata URL create the database and
its schema (for `http://`, check the service answers and warn if not: it may not be
started yet); record the store's capacity (`--capacity`, else `storage.capacity`: a
share of the file system's free space by default; a store that has one keeps it unless
`--capacity` is given); with `--write-config` write a config file pointing at all this
(refusing to overwrite one without `--force`); with `--namespace-manifest FILE` write
that namespace's manifest and register it with its per-rank page files — growing on
demand, or with `--preallocate` fallocated at `--file-size` up front, with a progress bar.
"""

from __future__ import annotations

import json as jsonlib
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt, JsonOpt
from hf3fsctl.errors import InvalidRequest, MetadataUnavailable, StorageError

if TYPE_CHECKING:
    from hf3fsctl.config import Config
    from hf3fsctl.keys import NamespaceManifest
    from hf3fsctl.meta.client import MetadataClient


def check_writable(root: Path) -> None:
    """Write, sync and remove a probe file under `root`.

    Raises:
        StorageError: naming the directory and the OS error.
    """
    probe = root / f".hf3fsctl-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"hf3fsctl")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise StorageError(f"storage path {str(root)!r} is not writable: {exc.strerror}") from None


def read_manifest_file(path: Path) -> NamespaceManifest:
    """A namespace manifest from a JSON file.

    Raises:
        InvalidRequest: the file is missing, not JSON, or not a complete manifest.
    """
    from hf3fsctl.keys import NamespaceManifest

    try:
        data = jsonlib.loads(path.read_text())
    except OSError as exc:
        raise InvalidRequest(f"cannot read manifest {str(path)!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidRequest(f"manifest {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"manifest {str(path)!r} must hold a JSON object")
    return NamespaceManifest.from_dict(data)


def register_namespace_files(
    config: Config,
    client: MetadataClient,
    manifest: NamespaceManifest,
    ranks: int,
    *,
    show_progress: bool,
) -> dict[str, Any]:
    """Write the manifest, register the namespace and its first `ranks` page files.

    The files grow on demand unless `storage.preallocate` is set, in which case each is
    fallocated at `storage.file_size` (resumable, with a progress bar) and registered as
    preallocated: it holds its whole size of the store's capacity from now on.
    """
    from hf3fsctl.meta.models import RankFile
    from hf3fsctl.storage.layout import PageFile, slot_bytes, write_manifest

    root = Path(config.storage.path)
    ns = manifest.namespace_id
    preallocated = config.storage.preallocate
    write_manifest(root, manifest)
    client.register_namespace(ns, manifest.to_dict())
    files = []
    with output.progress(show_progress and preallocated, in_bytes=True) as bar:
        for rank in range(ranks):
            if preallocated:
                task = bar.add_task(f"rank {rank}", total=config.storage.file_size)

                def advance(done: int, total: int, task: Any = task) -> None:
                    bar.update(task, completed=done, total=total)

                page_file = PageFile.create(
                    root,
                    ns,
                    rank,
                    manifest.page_bytes,
                    config.storage.file_size,
                    progress=advance,
                )
            else:
                page_file = PageFile.create_growable(root, ns, rank, manifest.page_bytes)
            with page_file:
                client.register_rank(
                    ns,
                    RankFile(
                        rank=rank,
                        path=page_file.relpath,
                        page_bytes=page_file.page_bytes,
                        slot_bytes=page_file.slot_bytes,
                        num_pages=page_file.num_pages,
                        preallocated=preallocated,
                    ),
                )
                files.append(
                    {
                        "rank": rank,
                        "path": str(page_file.path),
                        "num_pages": page_file.num_pages,
                        "preallocated": preallocated,
                    }
                )
    return {
        "namespace": ns,
        "slot_bytes": slot_bytes(manifest.page_bytes),
        "rank_files": files,
    }


def record_capacity(config: Config, client: MetadataClient, explicit: bool) -> dict[str, Any]:
    """Record the store's capacity: `storage.capacity` resolved on this file system.

    A store that already has a capacity keeps it unless `explicit` (`--capacity`).

    Raises:
        InvalidRequest: the capacity is smaller than one page's worth, or a share
            resolves to nothing (a full file system).
    """
    from hf3fsctl.config import format_size, parse_amount
    from hf3fsctl.meta.policy import file_system_room, resolve_capacity

    current = client.capacity()
    if current.capacity_bytes is not None and not explicit:
        return current.model_dump()
    root = config.storage.path
    amount = parse_amount(config.storage.capacity, "storage.capacity")
    value = resolve_capacity(amount, root, current.bytes_used)
    room = file_system_room(root) + current.bytes_used
    if value < 4096:
        raise InvalidRequest(
            f"storage.capacity {config.storage.capacity} is {value} bytes here: too small "
            "to hold a page",
            hint=f"free space on {root} ({format_size(room)} available) or pass a larger "
            "--capacity",
        )
    if value > room:
        output.warning(
            f"capacity {format_size(value)} is more than the file system can give the store "
            f"({format_size(room)}): writes will fail with no space before eviction starts"
        )
    return client.set_capacity(value).model_dump()


def _check_metadata(config: Config, report: dict[str, Any]) -> None:
    """Create the SQLite schema (embedded) or check the service answers (HTTP)."""
    db = context.sqlite_path(config.metadata_target)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    try:
        with context.open_client(config, create=True) as client:
            client.health()
        report["metadata"] = {"url": config.metadata_target.url, "reachable": True}
    except MetadataUnavailable as exc:
        if db is not None:
            raise
        report["metadata"] = {"url": config.metadata_target.url, "reachable": False}
        output.warning(f"{exc.message}; start it with `hf3fsctl serve` before using the store")


def init(
    ctx: typer.Context,
    storage_path: Annotated[
        Path,
        typer.Option("--storage-path", help="Storage root (on 3FS: a directory under the mount)."),
    ],
    config: ConfigOpt = None,
    metadata_url: Annotated[
        str | None,
        typer.Option(
            "--metadata-url",
            help="sqlite:///PATH or http://HOST:PORT (default: <storage-path>/metadata.db).",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="Bearer token file for an http:// metadata URL (metadata.token_file).",
        ),
    ] = None,
    capacity: Annotated[
        str | None,
        typer.Option(
            "--capacity",
            metavar="SIZE|SHARE",
            help="Bytes the whole store may hold (2TiB), or a share of the file system's "
            "free space (50%); default storage.capacity (80%).",
        ),
    ] = None,
    preallocate_files: Annotated[
        bool,
        typer.Option(
            "--preallocate",
            help="Fallocate the --namespace-manifest's page files at --file-size now "
            "(default: they grow on demand).",
        ),
    ] = False,
    file_size: Annotated[
        str | None,
        typer.Option(
            "--file-size", metavar="SIZE", help="Bytes of one preallocated page file (64GiB)."
        ),
    ] = None,
    write_config: Annotated[
        Path | None,
        typer.Option("--write-config", metavar="PATH", help="Write a config file for this store."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite the file given to --write-config.")
    ] = False,
    namespace_manifest: Annotated[
        Path | None,
        typer.Option(
            "--namespace-manifest",
            metavar="FILE",
            help="Register this namespace (a manifest JSON file) and its page files now.",
        ),
    ] = None,
    ranks: Annotated[
        int | None,
        typer.Option("--ranks", min=1, help="How many ranks to register (default: TP x PP)."),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Create the store: storage root, metadata DB, config file, page files."""
    from hf3fsctl.config import dump_config, format_size

    if write_config is not None and write_config.exists() and not force:
        raise InvalidRequest(
            f"config file {str(write_config)!r} exists", hint="pass --force to overwrite it"
        )
    if ranks is not None and namespace_manifest is None:
        raise InvalidRequest("--ranks needs --namespace-manifest")
    if preallocate_files and namespace_manifest is None:
        raise InvalidRequest(
            "--preallocate needs --namespace-manifest (the files of which namespace?)"
        )
    manifest = read_manifest_file(namespace_manifest) if namespace_manifest else None
    if manifest is not None and ranks is not None and ranks > manifest.num_ranks:
        raise InvalidRequest(
            f"--ranks {ranks} is more than the manifest's {manifest.num_ranks} ranks (TP x PP)"
        )
    root = storage_path.expanduser().resolve()
    cfg = context.load(
        ctx,
        config,
        {
            "storage.path": str(root),
            "metadata.url": metadata_url,
            "metadata.token_file": str(token_file.expanduser().resolve()) if token_file else None,
            "storage.file_size": file_size,
            "storage.capacity": capacity,
            "storage.preallocate": True if preallocate_files else None,
        },
        missing_ok=True,  # init writes the config: a named file need not exist yet
    )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create storage path {str(root)!r}: {exc.strerror}") from None
    check_writable(root)
    report: dict[str, Any] = {"storage_path": str(root)}
    if not json:
        output.line(f"storage root {root} is writable")
    _check_metadata(cfg, report)
    if not json:
        state = "ready" if report["metadata"]["reachable"] else "not reachable yet"
        output.line(f"metadata {cfg.metadata_target.url} {state}")
    if report["metadata"]["reachable"]:
        with context.open_client(cfg) as client:
            report["capacity"] = record_capacity(cfg, client, explicit=capacity is not None)
        if not json:
            cap = report["capacity"]
            output.line(
                f"capacity {format_size(cap['capacity_bytes'])} for every model and rank "
                f"({format_size(cap['bytes_used'])} held)"
            )
    if write_config is not None:
        write_config.parent.mkdir(parents=True, exist_ok=True)
        write_config.write_text(dump_config(cfg))
        report["config_file"] = str(write_config.resolve())
        if not json:
            output.line(f"wrote config {write_config}")
    if manifest is not None:
        with context.open_client(cfg) as client:
            report["namespace"] = register_namespace_files(
                cfg, client, manifest, ranks or manifest.num_ranks, show_progress=not json
            )
        if not json:
            ns = report["namespace"]
            size = (
                f"of {format_size(cfg.storage.file_size)}, preallocated"
                if cfg.storage.preallocate
                else "growing on demand"
            )
            output.line(f"namespace {ns['namespace']}: {len(ns['rank_files'])} page files {size}")
    if json:
        output.print_json(report)
        return
    config_flag = f" --config {write_config}" if write_config else ""
    output.line("next:", style="bold")
    if cfg.metadata_target.scheme in ("http", "https"):
        output.line(f"  hf3fsctl{config_flag} serve            # on the metadata host")
    output.line(f"  hf3fsctl{config_flag} doctor")
    output.line(
        f"  hf3fsctl{config_flag} vllm-config --compact  # for vllm serve --kv-transfer-config"
    )

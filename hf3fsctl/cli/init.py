"""`hf3fsctl init`: create a store — storage root, metadata DB, config, page files.

Steps, each reported: create the storage root and prove it is writable (a file is
written, synced and removed); for a `sqlite:///` metadata URL create the database and
its schema (for `http://`, check the service answers and warn if not: it may not be
started yet); with `--write-config` write a config file pointing at all this (refusing
to overwrite one without `--force`); with `--namespace-manifest FILE` write that
namespace's manifest, register it, and preallocate its per-rank page files with a
progress bar, reserving the capacity up front.
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


def preallocate(
    config: Config,
    client: MetadataClient,
    manifest: NamespaceManifest,
    ranks: int,
    *,
    show_progress: bool,
) -> dict[str, Any]:
    """Write the manifest, register the namespace and create its first `ranks` page files."""
    from hf3fsctl.meta.models import RankFile
    from hf3fsctl.storage.layout import PageFile, slot_bytes, write_manifest

    root = Path(config.storage.path)
    ns = manifest.namespace_id
    write_manifest(root, manifest)
    client.register_namespace(ns, manifest.to_dict())
    files = []
    with output.progress(show_progress, in_bytes=True) as bar:
        for rank in range(ranks):
            task = bar.add_task(f"rank {rank}", total=config.storage.file_size)

            def advance(done: int, total: int, task: Any = task) -> None:
                bar.update(task, completed=done, total=total)

            with PageFile.create(
                root,
                ns,
                rank,
                manifest.page_bytes,
                config.storage.file_size,
                preallocate=config.storage.preallocate,
                progress=advance,
            ) as page_file:
                client.register_rank(
                    ns,
                    RankFile(
                        rank=rank,
                        path=page_file.relpath,
                        page_bytes=page_file.page_bytes,
                        slot_bytes=page_file.slot_bytes,
                        num_pages=page_file.num_pages,
                    ),
                )
                files.append(
                    {"rank": rank, "path": str(page_file.path), "num_pages": page_file.num_pages}
                )
    return {
        "namespace": ns,
        "slot_bytes": slot_bytes(manifest.page_bytes),
        "rank_files": files,
    }


def _check_metadata(config: Config, report: dict[str, Any]) -> None:
    """Create the SQLite schema (embedded) or check the service answers (HTTP)."""
    db = context.sqlite_path(config.metadata_url)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    try:
        with context.open_client(config, create=True) as client:
            client.health()
        report["metadata"] = {"url": config.metadata_url, "reachable": True}
    except MetadataUnavailable as exc:
        if db is not None:
            raise
        report["metadata"] = {"url": config.metadata_url, "reachable": False}
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
    file_size: Annotated[
        str | None,
        typer.Option("--file-size", metavar="SIZE", help="Bytes of one page file (64GiB, 512MiB)."),
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
            help="Preallocate the page files of this namespace (a manifest JSON file).",
        ),
    ] = None,
    ranks: Annotated[
        int | None,
        typer.Option("--ranks", min=1, help="How many ranks to preallocate (default: TP x PP)."),
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
        },
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
        output.line(f"metadata {cfg.metadata_url} {state}")
    if write_config is not None:
        write_config.parent.mkdir(parents=True, exist_ok=True)
        write_config.write_text(dump_config(cfg))
        report["config_file"] = str(write_config.resolve())
        if not json:
            output.line(f"wrote config {write_config}")
    if manifest is not None:
        with context.open_client(cfg) as client:
            report["namespace"] = preallocate(
                cfg, client, manifest, ranks or manifest.num_ranks, show_progress=not json
            )
        if not json:
            ns = report["namespace"]
            output.line(
                f"namespace {ns['namespace']}: {len(ns['rank_files'])} page files of "
                f"{format_size(cfg.storage.file_size)} ({ns['rank_files'][0]['num_pages']} pages each)"
            )
    if json:
        output.print_json(report)
        return
    config_flag = f" --config {write_config}" if write_config else ""
    output.line("next:", style="bold")
    if not cfg.metadata_url.startswith("sqlite:"):
        output.line(f"  hf3fsctl{config_flag} serve            # on the metadata host")
    output.line(f"  hf3fsctl{config_flag} doctor")
    output.line(
        f"  hf3fsctl{config_flag} vllm-config --compact  # for vllm serve --kv-transfer-config"
    )
